"""Paired statistics over per-question results, the one implementation every table writer uses
(:mod:`eval.harness.compare`, :mod:`eval.analyses.pareto_stats`, :mod:`eval.rescue.table`):
percentile bootstrap CIs, McNemar's exact test, the sign test, Holm's adjustment, TOST equivalence
and the verdict of a table cell.

Every function takes per-question values in the same question order for both arms; bootstraps
resample questions (with their ``k`` samples), seeded, so a table recomputes to the same digits.

**A table's verdicts** (:func:`table_verdicts`): each cell compares two arms on the same problems,
on per-problem scores (the mean over a problem's ``k`` samples). Its test is the sign test over
problems (ties dropped); with ``k = 1`` that is McNemar's exact test, the only place McNemar is
used (over (problem, sample) pairs with ``k > 1`` it would count correlated samples as independent).
Equivalence is TOST (two one-sided paired t-tests on the per-problem differences, margin ``m``,
default :data:`MARGIN` = 3 points). The tests' p-values are Holm-adjusted over the table (the
difference tests as one family, the TOST tests as another), and the verdict is

- ``leads`` / ``trails``: the Holm-adjusted test p < ``alpha`` (0.05), by the sign of the difference;
- ``equivalent within ±m``: otherwise, when the Holm-adjusted TOST p < ``alpha``;
- ``inconclusive``: neither.

The bootstrap CI of the difference is printed beside the verdict but does not decide it (a
percentile CI over 4-vs-0 discordances excludes 0 where the exact test gives p = 0.125).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from scipy.stats import binomtest, ttest_1samp

__all__ = ["ALPHA", "MARGIN", "RESAMPLES", "VERDICTS", "bootstrap_ci", "holm", "mcnemar_exact", "paired_difference",
           "paired_test", "ratio_ci", "sign_test", "table_verdicts", "tost", "verdict_word"]

RESAMPLES = 10_000
ALPHA = 0.05
MARGIN = 0.03  # the equivalence margin of a verdict: +-3 points of pass@1
VERDICTS = ("leads", "trails", "equivalent within ±m", "inconclusive")


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


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given): sort ascending, multiply the i-th
    smallest (0-based) by ``n - i``, take the running maximum, cap at 1."""
    p = [float(x) for x in pvalues]
    order = sorted(range(len(p)), key=lambda i: p[i])
    out = [1.0] * len(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def tost(a: Sequence[float], b: Sequence[float], margin: float = MARGIN) -> dict[str, float]:
    """Paired TOST equivalence test of ``mean(a - b)`` within ``(-margin, +margin)``: two one-sided
    one-sample t-tests on the per-question differences (``scipy.stats.ttest_1samp``: mean > -margin,
    mean < +margin); ``p`` is the larger of the two.

    Differences without spread have no t statistic. Every difference 0 (two arms that agree on every
    problem, e.g. bit-identical cells): ``p = (1 - margin) ** n``, exact for scores in [0, 1] (if the
    true mean difference were at least ``margin``, a problem would differ with probability at least
    ``margin``, so seeing none in ``n`` has probability at most that): 0.0023 at n = 200, 0.91 at
    n = 3. Every difference the same nonzero value: ``p`` 1 (no equivalence claimed)."""
    if len(a) != len(b):
        raise ValueError(f"got {len(a)} and {len(b)} per-question scores; pair them question by question")
    if not margin > 0:
        raise ValueError(f"margin={margin!r} must be > 0 (a share: 0.03 = 3 points)")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.size < 2 or np.all(d == d[0]):
        p = float((1 - margin) ** d.size) if d.size and d[0] == 0 else 1.0
        return {"p_lower": p, "p_upper": p, "p": p, "margin": margin}
    lower = float(ttest_1samp(d, -margin, alternative="greater").pvalue)
    upper = float(ttest_1samp(d, margin, alternative="less").pvalue)
    return {"p_lower": lower, "p_upper": upper, "p": max(lower, upper), "margin": margin}


def paired_test(a: Sequence[float], b: Sequence[float], k: int = 1, bits: tuple[Sequence[bool], Sequence[bool]] | None = None,
                margin: float = MARGIN, resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Everything one table cell needs about ``a - b`` (per-problem scores, each the mean of ``k``
    samples): the difference and its paired bootstrap 95 % CI, the sign test over problems, McNemar's
    exact test over the 0/1 outcomes where ``k == 1`` (``bits``, else the scores themselves; None when
    ``k > 1``), TOST within ``margin``, and ``p``: the cell's test (McNemar at ``k = 1``, which equals
    the sign test there; the sign test otherwise)."""
    if k < 1:
        raise ValueError(f"k={k!r}: samples per problem must be >= 1")
    out: dict[str, Any] = {**paired_difference(a, b, resamples, seed), "k": k, "sign": sign_test(a, b), "tost": tost(a, b, margin)}
    out["mcnemar"] = mcnemar_exact(*(bits or ([x >= 0.5 for x in a], [x >= 0.5 for x in b]))) if k == 1 else None
    out["p"] = out["mcnemar"]["p"] if k == 1 else out["sign"]["p"]
    return out


def verdict_word(test: dict[str, Any], alpha: float = ALPHA) -> str:
    """The verdict of a Holm-adjusted cell (:func:`table_verdicts`): ``leads``, ``trails``,
    ``equivalent within ±m`` (m in points) or ``inconclusive``."""
    if test["p_holm"] < alpha and test["diff"] != 0:
        return "leads" if test["diff"] > 0 else "trails"
    if test["tost_p_holm"] < alpha:
        return f"equivalent within ±{100 * test['tost']['margin']:g}"
    return "inconclusive"


def table_verdicts(tests: Sequence[dict[str, Any]], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Holm over one table: each :func:`paired_test` result gains ``p_holm`` (the difference tests
    adjusted together), ``tost_p_holm`` (the TOST tests adjusted together) and ``verdict``
    (:func:`verdict_word`). Returns new dicts in the given order."""
    p_holm = holm([t["p"] for t in tests])
    tost_holm = holm([t["tost"]["p"] for t in tests])
    out = []
    for t, ph, th in zip(tests, p_holm, tost_holm):
        cell = {**t, "p_holm": ph, "tost_p_holm": th}
        cell["verdict"] = verdict_word(cell, alpha)
        out.append(cell)
    return out
