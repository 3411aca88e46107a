"""Peak memory of the importance labels vs a plain forward.

Each variant runs in its own subprocess on the same random model and input; the peak resident
memory (``VmHWM``, reset through ``/proc/self/clear_refs`` right before the forward) minus the
resident memory just before it is the variant's extra memory:

- ``plain``: one no-grad forward of the decoder (SDPA), what any prefill costs;
- ``rows``: :func:`dynts.importance.answer_importance` (same forward + the answer rows only);
- ``future`` / ``golden``: :func:`dynts.importance.future_importance` / ``golden_importance`` (same forward +
  every row, ``chunk_rows`` at a time; golden at 25 % of the tokens);
- ``eager``: the brute force, eager attention with ``output_attentions=True`` (``T x T`` per layer);
  opt-in with ``--eager`` because it needs gigabytes at 8k tokens.

Usage::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        flock /tmp/dynts-cpu.lock python scripts/bench_importance.py --tokens 8192 --answer 64 [--labels] [--eager]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _model(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if args.model != "random":
        import dynts

        model, _ = dynts.load(args.model)
        return model
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.tokens + 16,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from dynts.importance import FutureSettings, GoldenSettings, answer_importance, future_importance, golden_importance

    model = _model(args)
    ids = torch.randint(3, min(1000, model.config.vocab_size), (1, args.tokens))
    start = args.tokens - args.answer
    with torch.no_grad():  # warm up kernels on a short input so one-time allocations are not counted
        answer_importance(model, ids[:, :64], [32])
        model.model(input_ids=ids[:, :64])
    if args.variant == "eager":
        model.set_attn_implementation("eager")
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.variant == "plain":
            model.model(input_ids=ids, use_cache=False)
        elif args.variant == "rows":
            answer_importance(model, ids, [start])
        elif args.variant == "future":
            future_importance(model, ids, [start], settings=FutureSettings(chunk_rows=args.chunk_rows))
        elif args.variant == "golden":
            settings = GoldenSettings(future=FutureSettings(chunk_rows=args.chunk_rows))
            golden_importance(model, ids, [start], [16], settings=settings)
        else:
            out = model.model(input_ids=ids, use_cache=False, output_attentions=True)
            scores = torch.stack(out.attentions)[:, :, :, start:, :].sum(dim=(0, 2, 3))
            del out, scores
    seconds = time.perf_counter() - t0
    return {"variant": args.variant, "extra_bytes": _status("VmHWM") - before, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--answer", type=int, default=64, help="answer rows (tokens after the delimiter)")
    parser.add_argument("--model", default="random", help="'random' (a Qwen2 of --hidden/--layers/--heads) or a dynts.load name")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="also run the brute-force eager output_attentions")
    parser.add_argument("--chunk-rows", type=int, default=64, help="attention rows at a time (future, golden)")
    parser.add_argument("--labels", action="store_true", help="also the future and golden labels (every row)")
    parser.add_argument("--variant", choices=["plain", "rows", "future", "golden", "eager"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    variants = ["plain", "rows"] + (["future", "golden"] if args.labels else []) + (["eager"] if args.eager else [])
    results = {}
    for variant in variants:
        cmd = [sys.executable, __file__, "--variant", variant] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-2000:]}")
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"importance extraction, {args.tokens} tokens, {args.answer} answer rows, model={args.model}"
          + (f" (hidden {args.hidden}, {args.layers} layers, {args.heads} heads)" if args.model == "random" else ""))
    print(f"{'variant':<8} {'extra peak MiB':>15} {'seconds':>8}")
    for name, r in results.items():
        print(f"{name:<8} {r['extra_bytes'] / mib:>15.1f} {r['seconds']:>8.2f}")
    plain = max(results["plain"]["extra_bytes"], 1)
    print(f"rows / plain peak: {results['rows']['extra_bytes'] / plain:.2f}x (target < 2x)")
    for name in ("future", "golden"):
        if name in results:
            print(f"{name} / plain peak: {results[name]['extra_bytes'] / plain:.2f}x")
    if "eager" in results:
        print(f"eager / plain peak: {results['eager']['extra_bytes'] / plain:.2f}x")


if __name__ == "__main__":
    main()
