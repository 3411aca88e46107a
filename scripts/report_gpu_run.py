"""The markdown tables docs/performance.md and docs/vllm.md show of one GPU run of ``scripts/gpu_check.py``.

    python scripts/report_gpu_run.py reports/gpu-runs/2026-12-04

Reads ``gpu_check.json`` in the run's folder (and ``combos.json`` beside it: decode combinations run afterwards with
the script's own ``run_combo``, if present) and prints: the machine and versions, the Triton kernels against torch,
the decode table (per lane, batch, budget and context length: the full cache at ``L`` and at ``B``, DynTS, its
speedup and ``t / t_full(B)``), the vLLM worker hooks and slot copy, and the serving runs. Keys a run does not
have are left out, so older and newer runs both print.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def kernels(run: dict) -> list[str]:
    k = run.get("kernels") or {}
    if "compact_ms" not in k:
        return []
    return ["| kernel, K/V " + "x".join(map(str, k["layout"])) + f" {k['dtype'].split('.')[-1]} | Triton ms | torch ms | "
            "x torch | bitwise equal |", "|---|---|---|---|---|",
            f"| compaction | {k['compact_ms']:.3f} | {k['compact_torch_ms']:.3f} | {k['compact_torch_ms'] / k['compact_ms']:.2f} "
            f"| {k['compact_equal']} |",
            *([f"| compaction, per-head indices | {k['compact_per_head_ms']:.3f} | {k['compact_per_head_torch_ms']:.3f} | "
               f"{k['compact_per_head_torch_ms'] / k['compact_per_head_ms']:.2f} | {k['per_head_equal']} |"]
              if "compact_per_head_ms" in k else []),
            f"| keep-top selection | {k['select_ms']:.3f} | {k['select_torch_ms']:.3f} | "
            f"{k['select_torch_ms'] / k['select_ms']:.2f} | {k['select_equal']} |"]


def decode(combos: list[dict]) -> list[str]:
    lines = ["| lane | batch | B | L | t_full(L) ms | t_full(B) ms | DynTS ms | speedup | t / t_full(B) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(combos, key=lambda c: (c["compile"], c["batch"], c["budget"])):
        for row in c["rows"]:
            m = row["methods"].get("dynts")
            if m is None:
                continue
            lines.append(f"| {'compiled' if c['compile'] else 'eager'} | {c['batch']} | {c['budget']} | {row['position']} | "
                         f"{_ms(row['t_full_L_ms'])} | {_ms(row['t_full_B_ms'])} | {_ms(m['t_ms'])} | {m['speedup']:.2f} | "
                         f"{m['t_over_t_full_B']:.3f} |")
    return lines if len(lines) > 2 else []


def vllm(run: dict) -> list[str]:
    v = run.get("vllm") or {}
    lines = []
    hooks = {name: v[name] for name in ("hooks", "hooks_v2") if isinstance(v.get(name), dict)}
    if hooks:
        lines += ["| hooks (runner) | rows | plain step: host us | done us | syncs | eviction round: host us | done us | syncs |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, h in hooks.items():
            plain, event = h["plain"]["step"], h["event"]["step"]
            lines.append(f"| {h.get('runner', 'v1')} | {h['rows']} | {plain['host_us']:.0f} | {plain['done_us']:.0f} | "
                         f"{h['syncs_per_plain_step']:g} | {event['host_us']:.0f} | {event['done_us']:.0f} | "
                         f"{h['syncs_per_event_round']:g} |")
    if "copy_ms" in v:
        lines += ["", f"slot copy of one round: {v['requests']} requests, B = {v['budget']}, n_keep = {v['n_keep']}, "
                      f"{v['layers']} layers, {v['moved_slots']} moved slots"]
        for layout, c in v["copy_ms_by_layout"].items():
            rate = f", {c['gb_per_s']:.0f} GB/s ({c.get('backend', 'torch index_put')})" if "gb_per_s" in c else ""
            lines.append(f"- {layout}: {c['median_ms']:.2f} ms, exact {c['exact']}{rate}")
    return lines


def serve(run: dict) -> list[str]:
    s = run.get("serve") or {}
    if "runs" not in s:
        return []
    lines = [f"{s['requests']} requests x ({s['prompt']} + {s['generate']}) tokens, pool of {s['pool_blocks']} blocks",
             "", "| run | tokens/s | in flight (max / mean) | preemptions | evictions |", "|---|---|---|---|---|"]
    for r in s["runs"]:
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['in_flight_max']} / {r['in_flight_mean']:.2f} | "
                     f"{r['preemptions']} | {r['evictions']} |")
    return lines


def report(folder: Path) -> str:
    run = json.loads((folder / "gpu_check.json").read_text())
    combos = list(run.get("bench") or [])
    extra = folder / "combos.json"
    if extra.exists():
        combos += json.loads(extra.read_text())
    versions = run.get("versions", {}).get("found", {})
    out = [f"GPU run `{folder}`: {', '.join(run.get('gpus') or ['?'])}; "
           + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; {run.get('seconds', 0):.0f} s"]
    for title, lines in (("Kernels", kernels(run)), ("Decode (R1-Distill-Qwen-7B shape, bf16)", decode(combos)),
                         ("vLLM worker side", vllm(run)), ("Continuous batching", serve(run))):
        if lines:
            out += ["", f"### {title}", "", *lines]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder with gpu_check.json (e.g. reports/gpu-runs/2026-12-04)")
    args = parser.parse_args(argv)
    if not (args.folder / "gpu_check.json").exists():
        print(f"no gpu_check.json in {args.folder}: pass the folder gpu_check.py --out wrote", file=sys.stderr)
        return 2
    print(report(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
