"""Paired statistics over per-question results (the tables of :mod:`eval.harness.compare` and
:mod:`eval.rescue.table`): percentile bootstrap CIs, McNemar's exact test and the sign test.

Every function takes per-question values in the same question order for both arms; bootstraps
resample questions (with their ``k`` samples), seeded, so a table recomputes to the same digits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from scipy.stats import binomtest

__all__ = ["RESAMPLES", "bootstrap_ci", "mcnemar_exact", "paired_difference", "ratio_ci", "sign_test"]

RESAMPLES = 10_000


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    if n < 1:
        raise ValueError("no questions to resample; give at least one per-question value")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_ci(values: Sequence[float], resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap ``level`` CI of the mean of ``values`` (one value per question)."""
    x = np.asarray(values, dtype=float)
    means = x[_indices(len(x), resamples, seed)].mean(axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def ratio_ci(columns: Sequence[Sequence[float]], statistic: Callable[..., np.ndarray], resamples: int = RESAMPLES,
             seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap CI of ``statistic(*column_means)`` (vectorised over resamples), the
    questions resampled jointly for all columns; resamples where it is undefined (NaN/inf) are
    dropped, None when all are (e.g. the recovered fraction ``(kvr - bon) / (full - bon)``)."""
    cols = [np.asarray(c, dtype=float) for c in columns]
    if len({len(c) for c in cols}) != 1:
        raise ValueError(f"columns have {[len(c) for c in cols]} questions; pair them question by question")
    idx = _indices(len(cols[0]), resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = statistic(*(c[idx].mean(axis=1) for c in cols))
    stat = stat[np.isfinite(stat)]
    if stat.size == 0:
        return None
    tail = 100 * (1 - level) / 2
    return float(np.percentile(stat, tail)), float(np.percentile(stat, 100 - tail))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float | int]:
    """McNemar's exact test on paired outcomes: ``only_a`` pairs right under ``a`` alone, ``only_b``
    under ``b`` alone; two-sided binomial p of ``only_a`` among the discordant pairs at 1/2 (1.0
    when there are none)."""
    if len(a) != len(b):
        raise ValueError(f"got {len(a)} and {len(b)} outcomes; pair them question (and sample) by question")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {"only_a": only_a, "only_b": only_b, "p": float(p)}


def sign_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int]:
    """Sign test of per-question scores: questions where ``a`` scores higher / lower (ties
    dropped), two-sided binomial p at 1/2. With one sample per question it is McNemar's exact test."""
    if len(a) != len(b):
        raise ValueError(f"got {len(a)} and {len(b)} per-question scores; pair them question by question")
    plus = sum(1 for x, y in zip(a, b) if x > y)
    minus = sum(1 for x, y in zip(a, b) if x < y)
    p = binomtest(plus, plus + minus, 0.5).pvalue if plus + minus else 1.0
    return {"plus": plus, "minus": minus, "p": float(p)}


def paired_difference(a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES, seed: int = 0,
                      level: float = 0.95) -> dict[str, float]:
    """``mean(a) - mean(b)`` over paired per-question scores and its paired bootstrap CI."""
    if len(a) != len(b):
        raise ValueError(f"got {len(a)} and {len(b)} per-question scores; pair them question by question")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    lo, hi = bootstrap_ci(d, resamples, seed, level)
    return {"diff": float(d.mean()), "lo": lo, "hi": hi}
