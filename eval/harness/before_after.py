"""Two models on the same problems, method by method: the before/after tables of docs/testbed.md.

``python -m eval.harness.before_after BEFORE AFTER [--names favouring,fair]`` reads the per-problem
records (``records/*.json``) of two ``dynts eval`` runs or report directories that ran the same
methods on the same problems with the same ``k`` (two LRMs, each with its own predictor), and prints
one row per method: pass@1 % before, after, and ``after - before`` in points with its paired
bootstrap 95 % CI over problems (per-problem scores: the mean over their ``k`` samples;
:func:`eval.harness.stats.paired_difference`).

Budgets pair by rank: the i-th smallest budget of one run with the i-th of the other. Runs sized by
``--budget-fraction`` give each LRM the same shares of its own mean full sequence, so the token
budgets differ; the column head names both (``B = 59 / 72``).
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from .compare import cells_from_records
from .records import per_question, read_records
from .stats import paired_difference

__all__ = ["before_after", "main"]


Cell = tuple[dict[str, Any], dict[str, Any]]  # a cell's result (pass@1 recomputed from its record) and its record


def _by_method(records: Sequence[dict[str, Any]]) -> tuple[list[int], dict[tuple[str, int | None], Cell]]:
    """The run's budgets (ascending) and its cells by ``(method, budget rank)`` (rank None: the full cache)."""
    cells = cells_from_records(records)
    budgets = sorted({c["budget"] for c in cells if c.get("budget") is not None})
    rank = {b: i for i, b in enumerate(budgets)}
    by_key = {r["key"]: r for r in records}
    return budgets, {(c["method"]["label"], rank.get(c.get("budget"))): (c, by_key[c["key"]]) for c in cells}


def before_after(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]],
                 names: tuple[str, str] = ("before", "after")) -> str:
    """The markdown table of two runs' records (see the module docstring). Raises ``ValueError`` when
    the runs ran other problems, another ``k`` or another number of budgets."""
    budgets_b, cells_b = _by_method(before)
    budgets_a, cells_a = _by_method(after)
    if len(budgets_b) != len(budgets_a):
        raise ValueError(f"{names[0]} has budgets {budgets_b} and {names[1]} {budgets_a}: budgets pair by rank, "
                         "so give runs with as many budgets (the same --budget-fraction)")
    pairs = [key for key in cells_b if key in cells_a]
    if not pairs:
        raise ValueError(f"{names[0]} and {names[1]} share no (method, budget) cell; give runs of the same methods")
    for key in pairs:
        (_, rb), (_, ra) = cells_b[key], cells_a[key]
        if rb["ids"] != ra["ids"] or rb["k"] != ra["k"]:
            raise ValueError(f"cell {key[0]}: {names[0]} and {names[1]} ran other problems or another k; "
                             "compare runs of one benchmark (same n, family, set, seed) and --k")
    methods = list(dict.fromkeys(m for m, _ in pairs))
    ranks = range(len(budgets_b))
    head = ["method"]
    for i in ranks:
        b = f"B = {budgets_b[i]}" if budgets_b[i] == budgets_a[i] else f"B = {budgets_b[i]} / {budgets_a[i]}"
        head += [f"{b} {names[0]}", f"{b} {names[1]}", f"{b} change [95 % CI]"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m in methods:
        row = [m]
        for i in ([None] if (m, None) in cells_b else ranks):
            if (m, i) not in cells_b or (m, i) not in cells_a:
                row += ["", "", ""]
                continue
            (cb, rb), (ca, ra) = cells_b[(m, i)], cells_a[(m, i)]
            d = paired_difference(per_question(ra), per_question(rb))
            row += [f"{100 * cb['pass@1']:.1f}", f"{100 * ca['pass@1']:.1f}",
                    f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"]
        row += [""] * (len(head) - len(row))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.before_after", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", metavar="BEFORE", help="run or report directory with records/*.json")
    parser.add_argument("after", metavar="AFTER", help="run or report directory with records/*.json")
    parser.add_argument("--names", default="before,after", help="the two column names, comma-separated")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.names.split(",")]
    if len(names) != 2 or not all(names):
        parser.error(f"--names {args.names!r}: give two names, e.g. --names favouring,fair")
    runs = []
    for d in (args.before, args.after):
        records = read_records(d)
        if not records:
            parser.error(f"{d}: no records/*.json; give a dynts eval --run-dir or a report directory holding records")
        runs.append(records)
    try:
        print(before_after(runs[0], runs[1], (names[0], names[1])))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
