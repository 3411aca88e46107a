"""``dynts vllm-check MODEL``: is this vLLM / device / backend combination exact with the plugin?

Runs a few greedy requests through vLLM with the plugin at the engine's defaults (async scheduling, the
platform's attention backend, CUDA graphs on a GPU), each twice: evicting (``dynts`` with a predictor, else
``streamingllm``) and not evicting (per-request ``full``, the control). Every request is compared token by token
with the masked reference, :func:`dynts.generate` on transformers with the same method and budget (the control
with plain decoding). Prints the engine it ran (vLLM version, model runner, attention backend, async scheduling,
CUDA-graph mode; the CUDA-graph replays while the requests ran) and one line per request: exact, or the first
divergence.

Exit status: 0 every request exact; 1 a mismatch (an evicting request diverges where its control agrees); 2 a
bad argument; 3 the engine did not start; 4 inconclusive (vLLM without eviction already diverges from
transformers: the numerics of this dtype/backend; rerun with ``--dtype float32`` where the backend takes it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["CheckSettings", "compare", "counting_graph_replays", "drive", "engine_info", "main", "reference_tokens",
           "run_check"]

PROMPTS = ["What is 17 * 23? Think step by step.", "List the first ten prime numbers and explain how you found them.",
           "A train travels 120 km in 1.5 hours. What is its average speed?",
           "Write a short proof that the square root of 2 is irrational."]
TESTBED_PROMPTS = ["a 5 b 1 c 2 d 1 e 0 find r3", "a 5 b 3 c 7 d 6 e 0 find r3", "a 7 b 0 c 0 d 9 e 8 find r3",
                   "a 0 b 1 c 9 d 7 e 1 find r2"]  # the bundled testbed LRM's question format
EXACT, MISMATCH, NO_ENGINE, INCONCLUSIVE = 0, 1, 3, 4


@dataclass
class CheckSettings:
    """What one self-check runs. ``budget=None`` picks one that evicts several times per request; ``engine``:
    extra ``vllm.LLM`` keyword arguments (``attention_config``, ``compilation_config``, ``async_scheduling``...)."""

    model: str
    method: str | None = None
    predictor: str | None = None
    budget: int | None = None
    local_window: int = 16
    requests: int = 4
    max_tokens: int = 160
    dtype: str = "float32"
    prompts: list[str] | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "dynts" if self.predictor else "streamingllm"
        if self.method == "dynts" and not self.predictor:
            raise ValueError("method='dynts' needs predictor=DIR (--predictor); or pick a budget-only method "
                             "such as --method streamingllm")
        if self.predictor and not Path(self.predictor).is_dir():
            raise ValueError(f"predictor={self.predictor!r} is not a directory; pass a DynTS predictor directory")
        if not 1 <= self.requests <= 64:
            raise ValueError(f"requests={self.requests}: pass 1..64")


def reference_tokens(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int, **method: Any) -> list[int]:
    """:func:`dynts.generate` on one prompt alone, greedy, up to EOS (included) or ``max_tokens``."""
    from ..generate import generate

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = generate(model, tokenizer, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                   max_new_tokens=max_tokens, **method)
    seq = out.sequences[0].tolist()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ends = [i for i, t in enumerate(seq) if t in eos]
    return seq[: ends[0] + 1] if ends else seq


def drive(llm: Any, requests: list[dict], after_step: Callable[[], None] | None = None) -> dict[str, dict]:
    """Run ``requests`` (``prompt_token_ids``, ``max_tokens``, ``extra_args``, ``arrive_at_step``, ``ignore_eos``)
    greedily through ``llm``'s engine, each added at its step (later ones join while others decode). Returns per
    request id (its index) ``{"token_ids", "finish_reason", "kv_transfer_params"}`` or ``{"error"}`` when vLLM
    refused it."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    engine = llm.llm_engine
    pending = sorted(enumerate(requests), key=lambda p: p[1].get("arrive_at_step", 0))
    outputs: dict[str, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].get("arrive_at_step", 0) <= step:
            i, r = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], extra_args=r.get("extra_args"),
                                    ignore_eos=r.get("ignore_eos", False))
            try:
                engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params)
            except (ValueError, VLLMValidationError) as err:  # what the server answers with HTTP 400
                outputs[str(i)] = {"error": f"{type(err).__name__}: {err}"}
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = {"token_ids": list(out.outputs[0].token_ids),
                                           "finish_reason": out.outputs[0].finish_reason,
                                           "kv_transfer_params": out.kv_transfer_params}
        if after_step is not None:
            after_step()
        step += 1
    return outputs


@contextmanager
def counting_graph_replays() -> Iterator[list[int]]:
    """Count ``torch.cuda.CUDAGraph.replay`` calls while inside (vLLM's FULL and PIECEWISE graphs both replay through
    it): a check that ran with graphs on shows its decode steps replayed them."""
    count = [0]
    original = torch.cuda.CUDAGraph.replay

    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield count
    finally:
        torch.cuda.CUDAGraph.replay = original


def model_runner(llm: Any) -> Any:
    """The model runner of an in-process engine with one worker (``None`` otherwise)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    return getattr(worker, "model_runner", None)


def engine_info(llm: Any) -> dict[str, Any]:
    """What the engine runs: vLLM version, runner class, attention backends, async scheduling, graph mode."""
    import vllm

    config = llm.llm_engine.vllm_config
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    runner = model_runner(llm)
    backends = sorted({g.backend.get_name() for groups in getattr(runner, "attn_groups", []) for g in groups})
    attention = getattr(config, "attention_config", None)
    compilation = config.compilation_config
    return {
        "vllm": vllm.__version__,
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}" if runner is not None else None,
        "v2_runner": runner is not None and any(c.__module__ == "vllm.v1.worker.gpu.model_runner"
                                                for c in type(runner).__mro__),
        "scheduler": type(core.scheduler).__name__ if core is not None else None,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "batch_queue": getattr(core, "batch_queue", None) is not None,
        "attention_backends": backends or [str(getattr(attention, "backend", None))],
        "flash_attn_version": getattr(attention, "flash_attn_version", None),
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "cudagraph_capture_sizes": len(compilation.cudagraph_capture_sizes or []),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "dtype": str(config.model_config.dtype),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def first_divergence(got: list[int] | None, want: list[int]) -> int | None:
    """The first index where ``got`` and ``want`` differ (``None`` when equal)."""
    if got is None:
        return 0
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def compare(evicted: list[int] | None, control: list[int] | None, want_evicted: list[int],
            want_control: list[int]) -> dict[str, Any]:
    """One prompt's verdict: ``exact``; ``mismatch`` (the evicting request diverges where the control agrees);
    ``inconclusive`` (the control diverged first: numerics, not eviction)."""
    e, c = first_divergence(evicted, want_evicted), first_divergence(control, want_control)
    verdict = "exact" if e is None and c is None else "mismatch" if c is None or (e is not None and e < c) \
        else "inconclusive"
    return {"verdict": verdict, "evicted_divergence": e, "control_divergence": c}


def default_budget(prompts: list[list[int]], local_window: int, max_tokens: int) -> int:
    """A budget every prompt fits (``prompt <= B - W_l - 1``) that evicts several times within ``max_tokens``."""
    floor = max(map(len, prompts)) + local_window + 1
    return max(64, 16 * -(-(floor + min(32, max_tokens // 4)) // 16))


def encode(settings: CheckSettings, tokenizer: Any) -> list[list[int]]:
    from ..prompts import encode_prompt

    texts = settings.prompts or (TESTBED_PROMPTS if Path(settings.model).name in ("testbed", "testbed-lrm") else PROMPTS)
    texts = [texts[i % len(texts)] for i in range(settings.requests)]
    chat = getattr(tokenizer, "chat_template", None) is not None
    return [encode_prompt(tokenizer, [{"role": "user", "content": t}] if chat else t) for t in texts]


def references(settings: CheckSettings, path: Path, prompts: list[list[int]], method: dict) -> list[tuple]:
    """(evicted, control) reference tokens per prompt, on the GPU when there is one; the model is freed after."""
    from ..models import load, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load(str(path), dtype=settings.dtype, device=device)
    tokenizer = load_tokenizer(str(path))
    out = [(reference_tokens(model, tokenizer, p, settings.max_tokens, **method),
            reference_tokens(model, tokenizer, p, settings.max_tokens, method="full")) for p in prompts]
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def not_runnable() -> str | None:
    """Why no engine with the plugin can start here (``None``: it can)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment: pip install 'dynts-lrm[vllm]'"
    from .compat import unsupported_reason

    return unsupported_reason()


def run_check(settings: CheckSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the self-check; returns ``{"status", "engine", "settings", "requests": [...], "seconds"}``."""
    from ..models import load_tokenizer, resolve_path
    from .metrics import request_stats

    start = time.perf_counter()
    reason = not_runnable()
    if reason is not None:
        log(f"dynts vllm-check: {reason}")
        return {"status": NO_ENGINE, "error": reason, "seconds": 0.0}
    path = resolve_path(settings.model)
    prompts = encode(settings, load_tokenizer(str(path)))
    budget = settings.budget or default_budget(prompts, settings.local_window, settings.max_tokens)
    method = {"method": settings.method, "budget": budget, "local_window": settings.local_window}
    if settings.predictor:
        method["predictor"] = str(Path(settings.predictor).resolve())
    log(f"dynts vllm-check: {settings.requests} requests x {settings.max_tokens} tokens, {settings.method} at "
        f"B = {budget}, W_l = {settings.local_window}, each beside a control without eviction")
    wanted = references(settings, path, prompts, method)
    log(f"  reference (dynts.generate on transformers): {time.perf_counter() - start:.0f} s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: readable
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default claims most of the RAM
    from vllm import LLM

    engine = dict(dtype=settings.dtype, seed=0, max_num_seqs=2 * settings.requests,
                  max_model_len=max(map(len, prompts)) + settings.max_tokens + 16, additional_config={"dynts": method})
    engine.update(settings.engine)
    try:
        llm = LLM(model=str(path), **engine)
    except (ValueError, ImportError, NotImplementedError, RuntimeError) as err:
        log(f"dynts vllm-check: the engine did not start: {type(err).__name__}: {err}")
        return {"status": NO_ENGINE, "error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}
    info = engine_info(llm)
    log("  engine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    requests = []
    for i, prompt in enumerate(prompts):  # evicting and control side by side, arriving while others decode
        for extra in ({}, {"dynts": {"method": "full"}}):
            requests.append({"prompt_token_ids": prompt, "max_tokens": settings.max_tokens, "extra_args": extra or None,
                             "arrive_at_step": 3 * i})
    with counting_graph_replays() as replays:
        got = drive(llm, requests)
    info["graph_replays"] = replays[0]
    log(f"  CUDA-graph replays while the requests ran: {replays[0]}")
    rows = []
    for i, (want_evicted, want_control) in enumerate(wanted):
        evicted, control = got.get(str(2 * i), {}), got.get(str(2 * i + 1), {})
        row = compare(evicted.get("token_ids"), control.get("token_ids"), want_evicted, want_control)
        stats = request_stats(evicted.get("kv_transfer_params")) or [{}]
        row.update(tokens=len(want_evicted), evictions=stats[0].get("evictions", 0),
                   error=evicted.get("error") or control.get("error"))
        rows.append(row)
        where = {"exact": "exact", "mismatch": f"MISMATCH at token {row['evicted_divergence']}",
                 "inconclusive": f"inconclusive: without eviction vLLM already diverges at token "
                                 f"{row['control_divergence']}"}[row["verdict"]]
        log(f"  request {i}: {row['tokens']} tokens, {row['evictions']} eviction events: {where}"
            + (f" ({row['error']})" if row["error"] else ""))
    verdicts = {r["verdict"] for r in rows}
    status = MISMATCH if "mismatch" in verdicts else INCONCLUSIVE if "inconclusive" in verdicts else EXACT
    seconds = time.perf_counter() - start
    summary = {EXACT: "EXACT: every request token-identical to dynts.generate",
               MISMATCH: "MISMATCH: eviction inside vLLM diverges from the masked reference (report it, with "
                         "the engine line above)",
               INCONCLUSIVE: "INCONCLUSIVE: vLLM without eviction differs from transformers here; rerun with "
                             "--dtype float32 (a backend that takes it) to test the plugin"}[status]
    if status == EXACT and not all(r["evictions"] for r in rows):
        summary += " (some requests never evicted: raise --max-tokens or lower --budget)"
    log(f"dynts vllm-check: {summary} [{seconds:.0f} s]")
    return {"status": status, "engine": info, "settings": {**method, "requests": settings.requests,
                                                            "max_tokens": settings.max_tokens},
            "requests": rows, "seconds": seconds}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments the command-line flags ask for (nothing: vLLM's defaults)."""
    engine: dict[str, Any] = {}
    attention = {k: v for k, v in (("backend", args.attention_backend), ("flash_attn_version", args.flash_attn_version))
                 if v is not None}
    if attention:
        engine["attention_config"] = attention
    if args.cudagraph_mode:
        engine["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    if args.enforce_eager:
        engine["enforce_eager"] = True
    if args.no_async_scheduling:
        engine["async_scheduling"] = False
    for key in ("block_size", "gpu_memory_utilization"):
        if getattr(args, key) is not None:
            engine[key] = getattr(args, key)
    return engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dynts vllm-check", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a bundled name (testbed), a local directory or a cached hub id")
    p.add_argument("--method", default=None, help="default: dynts with --predictor, else streamingllm")
    p.add_argument("--predictor", default=None, help="a DynTS predictor directory trained on MODEL")
    p.add_argument("--budget", type=int, default=None, help="default: a budget that evicts several times")
    p.add_argument("--local-window", type=int, default=16)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--dtype", default="float32", help="float32 (default: the decisive check), bfloat16, float16")
    p.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable); default: built in")
    p.add_argument("--attention-backend", default=None, help="vLLM's attention backend (default: vLLM's choice)")
    p.add_argument("--flash-attn-version", type=int, choices=[2, 3, 4], default=None)
    p.add_argument("--cudagraph-mode", default=None, help="e.g. FULL_AND_PIECEWISE (default: vLLM's)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    try:
        settings = CheckSettings(args.model, args.method, args.predictor, args.budget, args.local_window, args.requests,
                                 args.max_tokens, args.dtype, args.prompt, engine_options(args))
    except ValueError as err:
        print(f"dynts vllm-check: {err}", file=sys.stderr)
        return 2
    result = run_check(settings)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return int(result["status"])
