"""Microseconds per step of dynts' vLLM worker hooks, per plain decode step and per eviction round, on a stand-in
for vLLM's model runner (:mod:`eval.perf.vllm_hooks_bench`; no vLLM needed), with the host syncs they make:

* ``--runner v1`` (default): vLLM 0.32's V1 runner, :class:`dynts.vllm.worker.WorkerHooks` (``before_step`` +
  ``after_prepare_inputs`` + ``after_forward``);
* ``--runner v2``: vLLM 0.34's V2 runner (persistent input buffers, device slot mappings; the hooks bound by the
  plugin's own binder), :class:`dynts.vllm.worker_v2.RunnerV2Hooks` (``before_step`` + ``before_attention`` +
  ``after_execute`` + ``after_sample``), async scheduling (``--sync-scheduling``: ids with their own round).

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_vllm_hooks.py --rows 256 --dtype float32
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_vllm_hooks.py --runner v2 --rows 256 --dtype float32
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


def compare_table(named: list[tuple[str, dict]]) -> str:
    """Markdown rows of several saved results side by side (``--compare``): per plain step the host time of the
    hooks that record and point attention (all but the last, which runs the predictor) and of the predictor's hook,
    per eviction round the host time of the whole round, the syncs of each, and the slots moved per ms of the
    round's ``before_step``."""
    lines = ["| run | runner | method | rows | plain: recording hooks us | plain: predictor hook us | plain: the "
             "runner's own step us | plain syncs | round: host ms | round syncs | moved slots / ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in named:
        hooks = r["hooks"]
        plain = r["plain"]
        recording = sum(plain[h]["host_us"] for h in hooks[:-1])
        runner_step = plain.get("runner_step", {}).get("host_us")
        event = r["event"]
        lines.append(f"| {name} | {r['runner']} | {r.get('method', 'dynts')} | {r['rows']} | {recording:.0f} | "
                     f"{plain[hooks[-1]]['host_us']:.0f} | {'' if runner_step is None else f'{runner_step:.0f}'} | "
                     f"{r['syncs_per_plain_step']:g} | {event['step']['host_us'] / 1e3 if event else float('nan'):.1f} | "
                     f"{r['syncs_per_event_round']:g} | {r['moved_slots_per_ms'] or float('nan'):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", type=Path, nargs="+", default=None,
                        help="print saved --json results side by side (markdown) instead of running")
    parser.add_argument("--runner", default="v1", choices=["v1", "v2"],
                        help="the stand-in model runner: v1 (vLLM 0.32) or v2 (vLLM 0.34)")
    parser.add_argument("--sync-scheduling", action="store_true", help="v2: token ids ship with their own round")
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
    if args.compare:
        print(compare_table([(path.stem, json.loads(path.read_text())) for path in args.compare]))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.shape or ("r1-7b" if torch.device(args.device).type == "cuda" else "small")
    result = run_hooks_bench(HooksBenchSettings(
        rows=args.rows, shape=shape, runner=args.runner, dtype=args.dtype, device=args.device, method=args.method,
        reps=args.reps, warmup=args.warmup, plain_steps=args.plain_steps, layout=args.layout, verify=args.verify,
        async_scheduling=not args.sync_scheduling))
    result["shape_name"] = shape
    result["torch"] = torch.__version__
    result["threads"] = torch.get_num_threads()
    print(format_table(result))
    syncs = result["syncs"] or {}
    print(f"syncs counted by: {result['syncs_counter']} (uploads per plain step {syncs.get('uploads_per_plain_step')}, "
          f"per eviction round {syncs.get('uploads_per_event_round')}); {result['moved_slots_per_round']:.0f} slots moved "
          f"per round, {result['moved_slots_per_ms']:.0f} per ms of its before_step; {result['seconds']:.1f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
