"""Decode cost with a bounded cache vs the full cache: per-token latency by position, peak KV, FLOPs.

For every model and batch size, :func:`eval.perf.decode_bench.bench_positions` advances all lanes
(the full cache and each eviction method) together through the positions (default 1k / 4k / 8k / 16k
tokens seen) and times ``top`` / ``event`` / ``bottom`` decode steps of the sawtooth at each, next to
a full cache at length ``B`` (``full@B``, the bound); that module's docstring says what is measured and
how each figure is derived. A continuous decode of the small model traces the sawtooth of the paper's
Fig. 5. Writes ``bench_decode.json`` and ``decode_latency.png`` under ``--out``.

``--stats-before-after``: the per-step cost of the attention statistics (H2O, SnapKV, R-KV) over the
window method, with ``q k^T`` in the model's dtype (shipped, "after") and with the query and the whole
key cache cast to float32 first ("before"), alternating ``--ab-rounds`` times; pair it with
``--dtype bfloat16`` (in float32 the two are the same computation).

``--compile``: every lane uses a static-layout cache and decode steps run through
:func:`dynts.compiled.compiled_decode`; ``t_full(B)`` is then the compiled static full cache at
length ``B``.

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py            # ~10 min on 2 cores
    .venv/bin/python scripts/bench_decode.py --quick                               # tiny model, ~1 min
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py --models small --compile
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py --quick --dtype bfloat16 --stats-before-after
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

import dynts
import dynts.attention
from dynts.kernels import backend_for
from dynts.models import checkpoints_dir
from eval.perf.decode_bench import DecodeSettings, bench_positions, default_methods, sawtooth
from eval.perf.decode_report import plot, print_run, print_stats_before_after, write_json

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- models
def small_model() -> tuple[torch.nn.Module, str]:
    """The testbed LRM if it has been trained, else a random Qwen2 of the testbed's shape."""
    if (checkpoints_dir() / "testbed-lrm" / "config.json").is_file():
        model, _ = dynts.load("testbed")
        return model, "testbed-lrm"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval(), "random-qwen2-0.8M"


STATS_METHODS = ("h2o", "snapkv", "rkv")  # the methods whose statistics come from dynts.attention.attention_rows
SHIPPED_ATTENTION_ROWS = dynts.attention.attention_rows


def fp32_attention_rows(query, key, attention_mask, scaling):
    """The float32 variant of the statistics: query and the whole key cache cast to float32 before ``q k^T``."""
    return SHIPPED_ATTENTION_ROWS(query.float(), key.float(), attention_mask, scaling)


def stats_before_after(model, label: str, args, settings: DecodeSettings) -> dict:
    """``t_top`` of window and the statistics methods with float32-cast keys (before) and model-dtype
    ``q k^T`` (after), best of ``args.ab_rounds`` alternating runs; overhead = method - window."""
    methods = ["window", *STATS_METHODS]
    best: dict = {}
    for _ in range(args.ab_rounds):
        for variant, rows_fn in (("before", fp32_attention_rows), ("after", SHIPPED_ATTENTION_ROWS)):
            dynts.attention.attention_rows = rows_fn
            try:
                run = bench_positions(model, f"{label} [{variant}]", 1, methods, args.positions, settings)
            finally:
                dynts.attention.attention_rows = SHIPPED_ATTENTION_ROWS
            for row in run["rows"]:
                for name, r in row["methods"].items():
                    key = (row["position"], name, variant)
                    best[key] = min(best.get(key, float("inf")), r["t_top"])
    table = []
    for position in args.positions:
        for name in STATS_METHODS:
            before = best[(position, name, "before")] - best[(position, "window", "before")]
            after = best[(position, name, "after")] - best[(position, "window", "after")]
            table.append(dict(position=position, method=name, t_top_before=best[(position, name, "before")],
                              t_top_after=best[(position, name, "after")], overhead_before=before, overhead_after=after))
    print_stats_before_after(f"{label} {args.dtype}, B={args.budget}, best of {args.ab_rounds}", table)
    return dict(model=label, dtype=args.dtype, budget=args.budget, rounds=args.ab_rounds, rows=table)


def load_model(name: str) -> tuple[torch.nn.Module, str]:
    if name == "small":
        return small_model()
    model, _ = dynts.load(name)
    return model, name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model only, B=128, positions 128/512/1024")
    parser.add_argument("--models", nargs="+", default=None, help="smollm2-135m, small (testbed or random Qwen2), a dir")
    parser.add_argument("--methods", nargs="+", default=None, help="small model (default: every registered method)")
    parser.add_argument("--large-methods", nargs="+", default=["window", "streamingllm", "dynts"],
                        help="other models at batch 1 (each lane costs ~1 min of prefill per 16k tokens on SmolLM2)")
    parser.add_argument("--batch8-methods", nargs="+", default=["window", "dynts"], help="other models at batch 8")
    parser.add_argument("--positions", type=int, nargs="+", default=None, help="batch 1 (default 1024 4096 8192 16384)")
    parser.add_argument("--batch8-positions", type=int, nargs="+", default=None, help="batch 8 on SmolLM2 (default 2048)")
    parser.add_argument("--budget", type=int, default=None, help="B (default 1024; quick 128)")
    parser.add_argument("--local-window", type=int, default=None, help="W_l (default 128; quick 16)")
    parser.add_argument("--retention", type=float, default=DecodeSettings.retention)
    parser.add_argument("--prompt-tokens", type=int, default=DecodeSettings.prompt_tokens, help="M, the question window")
    parser.add_argument("--steps", type=int, default=None, help="N timed steps per phase (default 12; quick 6)")
    parser.add_argument("--full-chunk", type=int, default=DecodeSettings.full_chunk, help="prefill chunk of the full cache")
    parser.add_argument("--sawtooth-length", type=int, default=None, help="continuous trace length (small model)")
    parser.add_argument("--stat", choices=("median", "min"), default=DecodeSettings.stat,
                        help="per-phase statistic of step times (min resists a shared machine's noise)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], choices=[1, 8],
                        help="batch sizes to run (batch 8 uses the --batch8-* settings on large models)")
    parser.add_argument("--compile", action="store_true",
                        help="static-layout caches and torch.compile'd decode steps (see the module docstring)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    parser.add_argument("--stats-before-after", action="store_true",
                        help="only the attention-statistics cost, float32-cast keys vs model-dtype q k^T (docstring)")
    parser.add_argument("--ab-rounds", type=int, default=2, help="alternating rounds of --stats-before-after")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=DecodeSettings.seed)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_decode")
    args = parser.parse_args(argv)
    q = args.quick
    args.models = args.models or (["small"] if q else ["smollm2-135m", "small"])
    args.positions = args.positions or ([128, 512, 1024] if q else [1024, 4096, 8192, 16384])
    args.batch8_positions = args.batch8_positions or ([128, 512] if q else [2048])
    args.budget = args.budget or (128 if q else DecodeSettings.budget)
    args.local_window = args.local_window if args.local_window is not None else (16 if q else DecodeSettings.local_window)
    args.steps = args.steps or (6 if q else DecodeSettings.steps)
    args.sawtooth_length = args.sawtooth_length if args.sawtooth_length is not None else (600 if q else 2600)
    if q:
        args.full_chunk = min(args.full_chunk, 128)
    return args


def decode_settings(args: argparse.Namespace) -> DecodeSettings:
    """The measurement's settings out of the parsed flags."""
    return DecodeSettings(**{f.name: getattr(args, f.name) for f in fields(DecodeSettings)})


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def main(argv=None) -> int:
    if argv is None and any(k not in os.environ for k in MALLOC_ENV):
        # glibc reads these at start-up: without them CPU decode churns pages (batch 8: 70 ms/step, with them 26)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**MALLOC_ENV, **os.environ})
    args = parse_args(argv)
    settings = decode_settings(args)
    torch.set_num_threads(args.threads)
    methods = args.methods or default_methods()
    results = dict(
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        machine=dict(platform=platform.platform(), threads=torch.get_num_threads(), torch=torch.__version__,
                     kernels=backend_for(torch.zeros(1)),
                     malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_")),
        runs=[],
    )
    started = time.perf_counter()
    for name in args.models:
        model, label = load_model(name)
        model = model.to(getattr(torch, args.dtype))
        if args.stats_before_after:
            results["stats_before_after"] = stats_before_after(model, label, args, settings)
            write_json(results, args.out / "bench_decode.json")
            continue
        small = name == "small"
        for batch in args.batches:
            batch_methods = methods if small else (args.large_methods if batch == 1 else args.batch8_methods)
            positions = args.positions if batch == 1 or small else args.batch8_positions
            print(f"{label}: batch {batch}, methods {batch_methods}, positions {positions}", flush=True)
            run = bench_positions(model, label, batch, batch_methods, positions, settings)
            print_run(run)
            results["runs"].append(run)
            write_json(results, args.out / "bench_decode.json")
        if small and args.sawtooth_length:
            trace_methods = [m for m in ("window", "dynts") if m in methods]
            print(f"{label}: sawtooth trace to {args.sawtooth_length} tokens ({['full'] + trace_methods})", flush=True)
            lanes = sawtooth(model, label, trace_methods, args.sawtooth_length, settings)
            results["sawtooth"] = dict(model=label, prompt_tokens=args.prompt_tokens, lanes=lanes)
            for lane, trace in lanes.items():
                s = trace["seconds"]
                print(f"  {lane:<8} first 100 steps {1e3 * statistics.median(s[:100]):.2f} ms, last 100 "
                      f"{1e3 * statistics.median(s[-100:]):.2f} ms, events at {trace['events'][:6]}")
        del model
    results["seconds"] = time.perf_counter() - started
    write_json(results, args.out / "bench_decode.json")
    if args.stats_before_after:
        return 0
    plot(results, args.out / "decode_latency.png")
    print(f"\nwrote {args.out / 'bench_decode.json'} and {args.out / 'decode_latency.png'} "
          f"({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
