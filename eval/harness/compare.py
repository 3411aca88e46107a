"""One method against the others, budget by budget: the tables ``docs/evaluation.md`` prints.

``python -m eval.harness.compare RUN_DIR [--against dynts] [--write]`` reads every finished cell of a run
(``cells/*.json``, whichever command wrote them) and prints

1. pass@1 % +- one standard error, one row per method, one column per budget (the full cache first);
2. for each other method and budget, ``against - method`` in points and the standard error of that
   difference, ``sqrt(se_a^2 + se_b^2)`` (conservative: it ignores that both ran on the same
   questions), with a verdict: ``leads`` (difference >= 2 SE), ``trails`` (<= -2 SE) or ``within 2 SE``.

``--write`` also renders those cells as the run's ``results.{json,csv,md}`` and plots (runs filled by
several ``dynts eval`` commands, e.g. one per budget, get one table).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Sequence

__all__ = ["compare", "finished_cells", "main", "pivot"]


def finished_cells(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every finished cell of a run directory, the full cache first, then by method and budget."""
    cells = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "cells").glob("*.json"))]
    order = {m: i for i, m in enumerate(dict.fromkeys(c["method"]["label"] for c in cells))}
    return sorted(cells, key=lambda c: (c.get("budget") is not None, order[c["method"]["label"]], c.get("budget") or 0))


def _cells(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[int], dict[tuple[str, int | None], dict[str, Any]]]:
    methods = list(dict.fromkeys(r["method"]["label"] for r in results))
    budgets = sorted({r["budget"] for r in results if r.get("budget") is not None})
    return methods, budgets, {(r["method"]["label"], r.get("budget")): r for r in results}


def pivot(results: Sequence[dict[str, Any]]) -> str:
    """pass@1 % +- 1 SE per method (rows) and budget (columns); the full cache spans the row."""
    methods, budgets, cells = _cells(results)
    lines = ["| method | " + " | ".join(f"B = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in methods:
        if (m, None) in cells:
            r = cells[(m, None)]
            lines.append(f"| {m} (no eviction) | {100 * r['pass@1']:.1f} ± {100 * r['pass@1_se']:.1f} |" + " |" * (len(budgets) - 1))
            continue
        row = [f"{100 * cells[(m, b)]['pass@1']:.1f} ± {100 * cells[(m, b)]['pass@1_se']:.1f}" if (m, b) in cells else "" for b in budgets]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def compare(results: Sequence[dict[str, Any]], against: str = "dynts") -> str:
    """``against`` minus every other bounded method, in points, with the SE of the difference."""
    methods, budgets, cells = _cells(results)
    if not any((against, b) in cells for b in budgets):
        raise ValueError(f"against={against!r} has no bounded cell in these results; methods: {methods}")
    lines = [f"| {against} minus | " + " | ".join(f"B = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in methods:
        if m == against or not any((m, b) in cells for b in budgets):
            continue
        row = []
        for b in budgets:
            if (m, b) not in cells or (against, b) not in cells:
                row.append("")
                continue
            a, o = cells[(against, b)], cells[(m, b)]
            diff = 100 * (a["pass@1"] - o["pass@1"])
            se = 100 * math.hypot(a["pass@1_se"], o["pass@1_se"])
            verdict = "leads" if diff >= 2 * se else "trails" if diff <= -2 * se else "within 2 SE"
            row.append(f"{diff:+.1f} ± {se:.1f} ({verdict})")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a dynts eval run directory (its results.json)")
    parser.add_argument("--against", default="dynts", help="the method every other one is compared with")
    parser.add_argument("--write", action="store_true", help="render all finished cells as results.{json,csv,md} and plots")
    args = parser.parse_args(argv)
    results = finished_cells(args.run_dir)
    if not results:
        parser.error(f"{args.run_dir} has no finished cells (cells/*.json); give the --run-dir of a dynts eval run")
    if args.write:
        from .report import write_reports

        write_reports(args.run_dir, results)
    print(pivot(results) + "\n\n" + compare(results, args.against))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
