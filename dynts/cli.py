"""The ``dynts`` command. Subcommands live in their own modules and are imported lazily, so that
the library never imports ``trainers``/``eval``/``data_pipeline`` at import time."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help). Each function takes argv (list[str]) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("eval.harness.demo:main", "every eviction method at one tight budget on 100 testbed problems"),
    "demo-smollm2": ("dynts.demo:main", "compare eviction methods on SmolLM2-135M (mechanics, untrained predictor)"),
    "generate": ("dynts.generate_cli:main", "generate with a bounded cache from the command line"),
    "testbed": ("trainers.testbed_cli:main", "train / sample / report the embedded testbed models"),
    "analyze": ("eval.analyses.cli:main", "Pareto retention, sparsity and POS-by-importance analyses (paper 3.1-3.2, B.2)"),
    "cost": ("dynts.cost_cli:main", "decode FLOPs / KV bytes / break-even eviction volume for a model config (paper 5, KV-Rescue D)"),
    "train-predictor": ("trainers.predictor_cli:main", "train the DynTS importance predictor (LightningCLI: fit / validate)"),
    "pipeline": ("trainers.pipeline:main", "traces -> importance -> predictor training -> export, resumable"),
    "eval": ("eval.harness.cli:main", "pass@1 / tokens/s / peak KV of methods x budgets x benchmarks, ablations, resumable"),
    "serve": ("dynts.serving.server:main", "OpenAI-compatible server, a bounded KV cache per request (--engine vllm: vLLM's)"),
    "vllm-check": ("dynts.vllm.selfcheck:main", "is vLLM + the plugin exact here? a few requests vs dynts.generate, a verdict"),
    "rescue": ("eval.rescue.cli:main", "KV-Rescue: evicted base + full-context helper + PRM; generate, or bench vs best-of-N"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dynts <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `dynts <command> --help` for the options of a command."]
    return "\n".join(lines)


def engine_of(argv: list[str]) -> str:
    """The ``--engine`` of ``dynts serve`` (``transformers`` unless ``--engine vllm`` / ``--engine=vllm``)."""
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1]
    return "transformers"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dynts: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    if name == "serve" and engine_of(rest) == "vllm":
        target = "dynts.vllm.serve:main"  # vLLM's own server with the plugin (another venv: transformers<5.20)
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
