"""The oracle choice between the evicted base and the full-context helper (KV-Rescue paper, Fig. 1a).

Per problem, an oracle keeps whichever of two answers is right: the evicted base's (one sample,
the ``evict`` cell) or the helper's (one sample with its full cache, the ``helper`` cell). The share
of the eviction loss it wins back,

    recovered = (A_oracle - A_evict) / (A_full - A_evict),     A_oracle = mean(base_ok or helper_ok),

bounds what any per-problem selector between the two can reach; the paper measures 79% (the
helper's errors are of capability, the base's of lost context, so they rarely coincide). The
counts say where the recovery comes from: problems only the helper solves, only the base, both,
neither. Standard errors are binomial, ``sqrt(p (1 - p) / n)``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

__all__ = ["oracle_choice", "oracle_choice_table", "plot_oracle_choice"]


def _binomial_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def _accuracy(records: Sequence[dict[str, Any]]) -> tuple[float, float]:
    p = sum(bool(r["correct"]) for r in records) / len(records)
    return p, _binomial_se(p, len(records))


def oracle_choice(full: Sequence[dict[str, Any]], evict: Sequence[dict[str, Any]], helper: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The oracle-choice numbers from three cells' per-problem ``records`` (``id``, ``correct``).

    Raises ``ValueError`` when the cells do not cover the same problems.
    """
    ids = [r["id"] for r in evict]
    if sorted(ids) != sorted(r["id"] for r in helper) or sorted(ids) != sorted(r["id"] for r in full):
        raise ValueError("full, evict and helper cells must hold the same problems (rerun them on one benchmark)")
    ok_helper = {r["id"]: bool(r["correct"]) for r in helper}
    base_ok = [bool(r["correct"]) for r in evict]
    helper_ok = [ok_helper[i] for i in ids]
    either = [{"correct": b or h} for b, h in zip(base_ok, helper_ok)]
    (a_full, se_full), (a_evict, se_evict), (a_helper, se_helper), (a_oracle, se_oracle) = (
        _accuracy(full), _accuracy(evict), _accuracy(helper), _accuracy(either))
    gap = a_full - a_evict
    return {
        "problems": len(ids),
        "A_full": a_full, "A_evict": a_evict, "A_helper": a_helper, "A_oracle": a_oracle,
        "se": {"A_full": se_full, "A_evict": se_evict, "A_helper": se_helper, "A_oracle": se_oracle},
        "recovered_fraction": (a_oracle - a_evict) / gap if gap > 0 else None,
        "only_helper": sum(h and not b for b, h in zip(base_ok, helper_ok)),
        "only_base": sum(b and not h for b, h in zip(base_ok, helper_ok)),
        "both": sum(b and h for b, h in zip(base_ok, helper_ok)),
        "neither": sum(not (b or h) for b, h in zip(base_ok, helper_ok)),
    }


def oracle_choice_table(rows: dict[str, dict[str, Any]]) -> str:
    """Markdown, one row per base method (accuracies in %, with one standard error)."""
    pct = lambda r, k: f"{100 * r[k]:.1f} ± {100 * r['se'][k]:.1f}"  # noqa: E731
    lines = ["| base method | A_full % | A_evict % | A_helper % | A_oracle choice % | recovered | only helper | only base | both | neither |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, r in rows.items():
        rec = r["recovered_fraction"]
        lines.append(f"| {method} | {pct(r, 'A_full')} | {pct(r, 'A_evict')} | {pct(r, 'A_helper')} | {pct(r, 'A_oracle')} | "
                     f"{'–' if rec is None else f'{rec:.2f}'} | {r['only_helper']} | {r['only_base']} | {r['both']} | {r['neither']} |")
    return "\n".join(lines) + "\n"


def plot_oracle_choice(rows: dict[str, dict[str, Any]], path: str | Path, kvr: dict[str, float] | None = None) -> Path:
    """Grouped bars per base method: evicted base, helper, oracle choice, KV-Rescue (if given) and
    full cache, with one standard error; the recovered fraction above each group."""
    from eval.harness.figures import new_figure, save_png

    keys = [("A_evict", "evicted base"), ("A_helper", "helper (full cache)"), ("A_oracle", "oracle choice"), ("A_full", "full cache")]
    fig, ax = new_figure(1.9 + 2.2 * len(rows), 3.6)
    width = 0.8 / (len(keys) + (kvr is not None))
    colors = {label: f"C{i}" for i, label in enumerate(["evicted base", "helper (full cache)", "oracle choice", "KV-Rescue",
                                                        "full cache"])}  # one color per bar kind in every group
    named: set[str] = set()
    for g, (method, r) in enumerate(rows.items()):
        bars = [(label, r[k], r["se"][k]) for k, label in keys]
        if kvr is not None and method in kvr:
            bars.insert(3, ("KV-Rescue", kvr[method], _binomial_se(kvr[method], r["problems"])))
        for j, (label, value, se) in enumerate(bars):
            ax.bar(g + (j - (len(bars) - 1) / 2) * width, 100 * value, width, yerr=100 * se, capsize=2,
                   color=colors[label], label=None if label in named else label)
            named.add(label)
        if r["recovered_fraction"] is not None:
            ax.text(g, 103, f"recovered {r['recovered_fraction']:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"base: {m}" for m in rows])
    ax.set_ylim(0, 112)
    ax.set_ylabel("pass@1 (%)")
    ax.set_title("Oracle choice between the evicted base and the helper (KV-Rescue Fig. 1a)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    return save_png(fig, path, dpi=130)
