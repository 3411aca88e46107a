"""Output of :mod:`.decode_bench` (``scripts/bench_decode.py``): the per-position table, the latency plot and
the JSON file."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from dynts.io import write_atomic


def print_run(run: dict) -> None:
    ms = 1e3
    print(f"\n== {run['model']}  batch {run['batch']}  B={run['budget']} W_l={run['local_window']} "
          f"retention={run['retention']} prompt={run['prompt_tokens']}: n_keep={run['n_keep']} K={run['eviction_volume']}")
    print(f"{'L':>6} {'lane':<13} {'ms/token':>9} {'top':>7} {'bottom':>7} {'event':>7} {'speedup':>7} "
          f"{'top/tB':>7} {'t/tB':>6} {'peakKV MiB':>10} {'KV ratio':>8} {'GFLOP/tok':>9}")
    capacity = run["rows"][0].get("full_capacity") if run["rows"] else None
    if capacity:
        print(f"{'':>6} full: ONE static cache of {capacity} slots for every L (t_full(L) is the cost at the largest L)")
    for row in run["rows"]:
        print(f"{row['position']:>6} {'full':<13} {ms * row['t_full_L']:>9.2f} {'':>7} {'':>7} {'':>7} {'1.00':>7} "
              f"{row['t_full_L'] / row['t_full_B']:>7.3f} {'':>6} {row['full_peak_kv_bytes'] / 2**20:>10.1f} {'1.000':>8} "
              f"{row['full_flops'] / 1e9:>9.3f}")
        print(f"{'':>6} {'full@B':<13} {ms * row['t_full_B']:>9.2f}")
        for name, r in row["methods"].items():
            print(f"{'':>6} {name:<13} {ms * r['t_amortised']:>9.2f} {ms * r['t_top']:>7.2f} {ms * r['t_bottom']:>7.2f} "
                  f"{ms * r['t_event']:>7.2f} {r['speedup']:>7.2f} {r['top_over_full_B']:>7.3f} {r['amortised_over_full_B']:>6.3f} "
                  f"{r['peak_kv_bytes'] / 2**20:>10.1f} {r['kv_ratio']:>8.3f} {r['flops'] / 1e9:>9.3f}")
        if "dynts_vs_window" in row:
            v = row["dynts_vs_window"]
            print(f"{'':>6} dynts/window: top {v['top']:.3f}, amortised {v['amortised']:.3f}, "
                  f"event extra {v['event_extra_ms']:+.2f} ms")


def print_stats_before_after(title: str, table: list[dict]) -> None:
    """The ``--stats-before-after`` table: per-step time and overhead over window, before / after."""
    print(f"\n== attention statistics per decode step, {title}")
    print(f"{'L':>6} {'method':<7} {'before ms':>9} {'after ms':>9} {'after/before':>12} "
          f"{'overhead before':>15} {'overhead after':>14}")
    for r in table:
        print(f"{r['position']:>6} {r['method']:<7} {1e3 * r['t_top_before']:>9.3f} {1e3 * r['t_top_after']:>9.3f} "
              f"{r['t_top_after'] / r['t_top_before']:>12.3f} {1e3 * r['overhead_before']:>13.3f}ms "
              f"{1e3 * r['overhead_after']:>12.3f}ms")


def plot(results: dict, path: Path) -> None:
    """One panel per (model, batch): per-token latency vs position; plus the continuous sawtooth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    panels = len(runs) + (1 if results.get("sawtooth") else 0)
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    for ax, run in zip(axes, runs):
        xs = [row["position"] for row in run["rows"]]
        ax.plot(xs, [1e3 * row["t_full_L"] for row in run["rows"]], "o-", color="black", label="full t(L)")
        ax.plot(xs, [1e3 * row["t_full_B"] for row in run["rows"]], "x--", color="gray", label="full@B (the bound)")
        for name in run["rows"][0]["methods"]:
            ax.plot(xs, [1e3 * row["methods"][name]["t_amortised"] for row in run["rows"]], ".-", lw=1, label=name)
        ax.set_xlabel("position L (tokens seen)")
        ax.set_ylabel("ms / token (amortised over a sawtooth cycle)")
        ax.set_title(f"{run['model']} batch {run['batch']} (B={run['budget']}, K={run['eviction_volume']})", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    if results.get("sawtooth"):
        ax = axes[panels - 1]
        lengths_ax = ax.twinx()
        saw = results["sawtooth"]
        for color, (name, trace) in zip(("black", "tab:blue", "tab:orange"), saw["lanes"].items()):
            ys = trace["seconds"]
            window = 24  # running median: the sawtooth without the scheduler's noise
            smooth = [1e3 * statistics.median(ys[max(0, i - window) : i + 1]) for i in range(len(ys))]
            xs = range(saw["prompt_tokens"] + 1, saw["prompt_tokens"] + 1 + len(ys))
            ax.plot(xs, smooth, lw=1, color=color, label=f"{name} ms/step")
            lengths_ax.plot(xs, trace["lengths"], lw=0.8, ls=":", color=color)
        ax.set_xlabel("position (tokens seen)")
        ax.set_ylabel("ms / decode step (running median of 25)")
        lengths_ax.set_ylabel("cached entries (dotted)")
        ax.set_title(f"sawtooth: {saw['model']} batch 1, every step timed", fontsize=9)
        ax.set_ylim(bottom=0)
        lengths_ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(results: dict, path: Path) -> None:
    write_atomic(path, json.dumps(results, indent=1))


