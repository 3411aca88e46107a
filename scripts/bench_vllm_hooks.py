"""Microseconds per step of dynts' vLLM worker hooks (``before_step`` + ``after_prepare_inputs`` +
``after_forward``), per plain decode step and per eviction round, on a stand-in for vLLM's model runner
(:mod:`eval.perf.vllm_hooks_bench`; no vLLM needed), with the host syncs they make.

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_vllm_hooks.py --rows 256 --dtype float32
    python scripts/bench_vllm_hooks.py --device cuda --rows 256 --dtype bfloat16 --json hooks.json   # R1-7B shape

Defaults: ``--shape r1-7b`` on CUDA (hidden 3584, 28 layers, 4 KV heads, head 128, blocks of 16, B = 4096,
W_l = 512, 256-token prompts), ``--shape small`` elsewhere (hidden 512, 4 layers, 2 KV heads, head 64, B = 512,
W_l = 64, 64-token prompts); DynTS with a random-init predictor (float32, as ``load_predictor`` loads one).
``--verify`` also checks, after every round, that each row's stored K/V slots hold what the evictor kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.perf.vllm_hooks_bench import SHAPES, HooksBenchSettings, format_table, run_hooks_bench  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=256, help="requests decoding one token each")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: r1-7b on CUDA, small elsewhere")
    parser.add_argument("--method", default="dynts")
    parser.add_argument("--reps", type=int, default=5, help="timed cycles (one eviction round + plain steps each)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--plain-steps", type=int, default=8)
    parser.add_argument("--layout", default="LBNHC", help="vLLM KVCacheLayout of the FLASH_ATTN caches")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--verify", action="store_true", help="check every row's stored K/V after every round")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.shape or ("r1-7b" if torch.device(args.device).type == "cuda" else "small")
    result = run_hooks_bench(HooksBenchSettings(
        rows=args.rows, shape=shape, dtype=args.dtype, device=args.device, method=args.method, reps=args.reps,
        warmup=args.warmup, plain_steps=args.plain_steps, layout=args.layout, verify=args.verify))
    result["shape_name"] = shape
    result["torch"] = torch.__version__
    result["threads"] = torch.get_num_threads()
    print(format_table(result))
    print(f"syncs counted by: {result['syncs_counter']}; {result['seconds']:.1f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
