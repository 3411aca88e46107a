"""``dynts cost``: print the decode cost model of :mod:`dynts.cost` for a model config."""

from __future__ import annotations

import argparse
import json

from .core.budget import Budget
from .cost import (
    ModelShape,
    break_even_volume,
    crossover_length,
    decode_flops,
    dynts_decode_flops,
    effective_length,
    helper_fraction,
    predictor_flops,
)

__all__ = ["cost_report", "main"]


def cost_report(
    shape: ModelShape,
    *,
    budget: int = 1024,
    local_window: int = 128,
    retention: float = 0.4,
    prefill: int = 32,
    positions: tuple[int, ...] = (1024, 4096, 8192, 16384),
    alpha: float = 2.9,
    buffer: int = 128,
    helper: ModelShape | None = None,
) -> dict:
    """Everything ``dynts cost`` prints, as a dict (FLOPs per token, bytes per sequence)."""
    bounds = Budget(budget, local_window, retention)
    volume = bounds.eviction_volume(prefill)
    rows = []
    for position in positions:
        step = position - prefill
        if step < 1:
            raise ValueError(f"position {position} must exceed prefill={prefill}")
        full, ours = decode_flops(shape, position), dynts_decode_flops(shape, step, prefill, budget, volume)
        length = effective_length(step, prefill, budget, volume)
        rows.append(
            dict(
                position=position,
                full_flops=full,
                dynts_flops=ours,
                flops_ratio=ours / full,
                dynts_length=length,
                full_kv_bytes=shape.kv_bytes(position),
                dynts_kv_bytes=shape.kv_bytes(min(position, budget)),
                kv_ratio=min(position, budget) / position,
            )
        )
    last = positions[-1] - prefill
    cumulative_full = sum(decode_flops(shape, prefill + i) for i in range(1, last + 1))
    cumulative_ours = sum(dynts_decode_flops(shape, i, prefill, budget, volume) for i in range(1, last + 1))
    report = dict(
        model=shape.to_dict(),
        dense_flops=shape.dense_flops,
        attention_flops_per_cached_token=shape.attention_flops(1),
        predictor_flops=predictor_flops(shape.hidden_size),
        budget=dict(budget=budget, local_window=local_window, retention=retention, prefill=prefill,
                    n_keep=bounds.n_keep(prefill), eviction_volume=volume),
        break_even_volume=break_even_volume(shape),
        break_even_satisfied=volume >= break_even_volume(shape),
        positions=rows,
        cumulative_flops_ratio=cumulative_ours / cumulative_full,
        kvrescue=dict(alpha=alpha, physical_budget=budget + buffer,
                      crossover_length=crossover_length(budget + buffer, alpha)),
    )
    if helper is not None:
        report["kvrescue"]["helper"] = helper.name
        report["kvrescue"]["helper_fraction"] = {
            str(p): helper_fraction(helper, shape, p, budget + buffer, alpha) for p in positions
        }
    return report


def _format(report: dict) -> str:
    m, b = report["model"], report["budget"]
    kib = m["kv_bytes_per_token"] / 1024
    lines = [
        f"model {m['name']}: L={m['num_layers']} d={m['hidden_size']} heads={m['num_heads']}/{m['num_kv_heads']} "
        f"d_h={m['head_dim']} P={m['parameters'] / 1e6:.1f}M, KV {kib:g} KiB/token ({m['bytes_per_element']} B/elem)",
        f"dense 2P = {report['dense_flops'] / 1e9:.3f} GFLOP/token; attention 4*L*d = "
        f"{report['attention_flops_per_cached_token'] / 1e3:.1f} kFLOP per cached token; predictor 6d^2+d = "
        f"{report['predictor_flops'] / 1e6:.2f} MFLOP/token ({100 * report['predictor_flops'] / report['dense_flops']:.2f}% of dense)",
        f"budget B={b['budget']} (prefill {b['prefill']}, local window {b['local_window']}, retention {b['retention']}): "
        f"n_keep={b['n_keep']}, eviction volume K={b['eviction_volume']}",
        f"break-even (DynTS Cor. 5.2): K >= 1.5d/(n_i L) = {report['break_even_volume']:.1f} at n_i=1 -> "
        + ("satisfied" if report["break_even_satisfied"] else "NOT satisfied: eviction costs more than it saves"),
        f"KV-Rescue crossover (Eq. 14): l* = (1+alpha) B' = {report['kvrescue']['crossover_length']:.0f} "
        f"(alpha={report['kvrescue']['alpha']}, B'={report['kvrescue']['physical_budget']})",
        "",
        f"{'position':>8} {'full GFLOP':>10} {'DynTS GFLOP':>11} {'ratio':>6} {'cache':>6} {'full KV MiB':>11} {'DynTS KV MiB':>12} {'KV ratio':>8}",
    ]
    for r in report["positions"]:
        lines.append(
            f"{r['position']:>8} {r['full_flops'] / 1e9:>10.3f} {r['dynts_flops'] / 1e9:>11.3f} {r['flops_ratio']:>6.3f} "
            f"{r['dynts_length']:>6} {r['full_kv_bytes'] / 2**20:>11.1f} {r['dynts_kv_bytes'] / 2**20:>12.1f} {r['kv_ratio']:>8.3f}"
        )
    lines.append(f"cumulative FLOPs over the whole decode, DynTS / full: {report['cumulative_flops_ratio']:.3f}")
    if "helper_fraction" in report["kvrescue"]:
        fr = ", ".join(f"{p}: {100 * v:.1f}%" for p, v in report["kvrescue"]["helper_fraction"].items())
        lines.append(f"helper {report['kvrescue']['helper']} cost fraction rho (Eq. 15): {fr}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynts cost", description=__doc__)
    parser.add_argument("model", help="config.json, a directory with one, or a bundled name (smollm2-135m, testbed)")
    parser.add_argument("--budget", type=int, default=1024, help="B, KV entries held")
    parser.add_argument("--local-window", type=int, default=128, help="W_l")
    parser.add_argument("--retention", type=float, default=0.4, help="fraction of the selection window kept")
    parser.add_argument("--prefill", type=int, default=32, help="M, prompt tokens (the question window)")
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--bytes", type=int, default=None, help="bytes per KV element (default: the config's dtype)")
    parser.add_argument("--params", type=float, default=None, help="P, parameter count (default: from the shapes)")
    parser.add_argument("--alpha", type=float, default=2.9, help="KV-Rescue re-scoring factor (1.5-3)")
    parser.add_argument("--buffer", type=int, default=128, help="KV-Rescue eviction buffer w (B' = B + w)")
    parser.add_argument("--helper", default=None, help="a full-context helper model for KV-Rescue's rho (Eq. 15)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    overrides = {}
    if args.bytes is not None:
        overrides["bytes_per_element"] = args.bytes
    if args.params is not None:
        overrides["num_parameters"] = int(args.params)
    try:
        shape = ModelShape.load(args.model, **overrides)
        helper = ModelShape.load(args.helper, **({"bytes_per_element": args.bytes} if args.bytes else {})) if args.helper else None
        report = cost_report(
            shape, budget=args.budget, local_window=args.local_window, retention=args.retention, prefill=args.prefill,
            positions=tuple(args.positions), alpha=args.alpha, buffer=args.buffer, helper=helper,
        )
    except ValueError as err:
        parser.error(str(err))
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0
