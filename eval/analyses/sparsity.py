"""Sparsity of thinking-token importance (DynTS paper 3.1, Fig. 2; appendix B.3, Fig. 10/11).

The paper's headline number: only 21.1% of thinking tokens score above the mean importance of the
thinking tokens, while question tokens score densely. :func:`sparsity_table` computes that per
trace, :func:`importance_over_steps` gives the thinking importance as a function of the decoding
step (the curves of Fig. 10/11, and the rows of the heat strips in :mod:`eval.analyses.plots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .traces import IMPORTANCE, check_traces

__all__ = ["SparsitySummary", "importance_over_steps", "sparsity_summary", "sparsity_table", "trace_sparsity"]


def trace_sparsity(importance: Any, question_len: int, answer_start: int) -> dict[str, float]:
    """Per-trace statistics.

    Returns ``thinking_tokens``; ``above_mean_fraction`` (thinking tokens above the mean thinking
    importance); ``top10_mass`` (share of the thinking importance held by its top 10% tokens);
    ``question_mean`` / ``thinking_mean`` (mean importance per token of each segment) and
    ``question_above_thinking_mean`` (question tokens above the mean thinking importance).
    """
    scores = np.asarray(importance, dtype=np.float64)
    thinking = scores[question_len:answer_start]
    question = scores[:question_len]
    if thinking.size == 0:
        raise ValueError("a trace has no thinking tokens (question_len == answer_start)")
    mean = thinking.mean()
    top = np.sort(thinking)[::-1][: max(1, int(np.ceil(0.1 * thinking.size)))]
    total = thinking.sum()
    return {
        "thinking_tokens": int(thinking.size),
        "above_mean_fraction": float((thinking > mean).mean()),
        "top10_mass": float(top.sum() / total) if total > 0 else float("nan"),
        "question_mean": float(question.mean()) if question.size else float("nan"),
        "thinking_mean": float(mean),
        "question_above_thinking_mean": float((question > mean).mean()) if question.size else float("nan"),
    }


def sparsity_table(traces: Any) -> list[dict[str, Any]]:
    """:func:`trace_sparsity` for every trace, with its ``question_id`` / ``sample_id``."""
    check_traces(traces, importance=True)
    return [
        {"question_id": r["question_id"], "sample_id": r["sample_id"],
         **trace_sparsity(r[IMPORTANCE], int(r["question_len"]), int(r["answer_start"]))}
        for r in traces
    ]


@dataclass
class SparsitySummary:
    """Means over traces of :func:`trace_sparsity` (``traces`` = how many)."""

    traces: int
    above_mean_fraction: float
    top10_mass: float
    question_to_thinking_mean: float  # mean question importance / mean thinking importance

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def sparsity_summary(table: list[dict[str, Any]]) -> SparsitySummary:
    """Aggregate a :func:`sparsity_table` (mean of per-trace values)."""
    if not table:
        raise ValueError("the sparsity table is empty")
    ratio = [r["question_mean"] / r["thinking_mean"] for r in table if r["thinking_mean"] > 0]
    return SparsitySummary(
        traces=len(table),
        above_mean_fraction=float(np.mean([r["above_mean_fraction"] for r in table])),
        top10_mass=float(np.nanmean([r["top10_mass"] for r in table])),
        question_to_thinking_mean=float(np.mean(ratio)) if ratio else float("nan"),
    )


def importance_over_steps(
    trace: dict, bins: int | None = None, normalize: bool = True, pool: str = "max"
) -> np.ndarray:
    """Importance of each thinking token against its decoding step (step 0 = first thinking token).

    Args:
        trace: one trace row with ``importance``.
        bins: resample to this many equal-width bins, so traces of different lengths stack into a
            heat-strip matrix; ``None`` keeps one value per step.
        pool: ``"max"`` (keeps isolated spikes visible) or ``"mean"`` per bin.
        normalize: divide by the trace's maximum thinking importance (values in ``[0, 1]``).

    Returns ``[steps]`` or ``[bins]`` float64.
    """
    if IMPORTANCE not in trace:
        raise ValueError("trace has no 'importance'; compute it with eval.analyses.traces.add_importance")
    q, a = int(trace["question_len"]), int(trace["answer_start"])
    values = np.asarray(trace[IMPORTANCE][q:a], dtype=np.float64)
    if values.size == 0:
        raise ValueError("trace has no thinking tokens")
    if normalize and values.max() > 0:
        values = values / values.max()
    if bins is None:
        return values
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins={bins!r} must be a positive int or None")
    if pool not in ("max", "mean"):
        raise ValueError(f"pool={pool!r} must be 'max' or 'mean'")
    reduce = np.max if pool == "max" else np.mean
    edges = np.linspace(0, values.size, bins + 1)
    out = np.empty(bins)
    for i in range(bins):
        lo, hi = int(edges[i]), max(int(edges[i]) + 1, int(np.ceil(edges[i + 1])))
        out[i] = reduce(values[lo:hi])
    return out
