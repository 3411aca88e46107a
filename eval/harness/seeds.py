"""DynTS against the best baseline, one row per training seed and budget (docs/testbed.md "Seeds").

``python -m eval.harness.seeds DIR [DIR ...] [--names s1,s2,s3]`` reads the per-problem records
(``records/*.json``) of one dev table per seed (a ``dynts eval`` run or report directory; each seed's
LRM with its own predictor and budgets) and prints, per seed and budget: the full cache, DynTS, the
best baseline there (the highest pass@1 among the baselines the table ran: every bounded method but
DynTS, the ``random`` control and the oracles, which read the answer), and DynTS minus it in points
with its paired 95 % CI over problems and the table's Holm-adjusted verdict
(:func:`eval.harness.compare.paired_tests`, the same tests as the table's ``compare.md``). Choosing the
best baseline after seeing the table favours the baselines, not DynTS. The last line says whether
DynTS leads it at every budget of every seed.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from .compare import cells_from_records, paired_tests
from .records import read_records

__all__ = ["NOT_BASELINES", "best_baseline_rows", "main", "seed_table"]

NOT_BASELINES = ("dynts", "random")  # evictor names that are not baselines; every "*oracle*" name neither


def _is_baseline(cell: dict[str, Any]) -> bool:
    name = cell["method"]["name"]
    return cell.get("budget") is not None and name not in NOT_BASELINES and "oracle" not in name


def best_baseline_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per budget of one seed's table: ``budget``, ``full`` (pass@1 or None), ``dynts`` and
    its label, ``best`` (label) and ``best_pass``, and the paired test ``diff`` / ``lo`` / ``hi`` /
    ``verdict``. Raises ``ValueError`` without exactly one DynTS method or without a baseline."""
    cells = cells_from_records(records)
    ours = sorted({c["method"]["label"] for c in cells if c["method"]["name"] == "dynts"})
    if len(ours) != 1:
        raise ValueError(f"a seed's table needs exactly one DynTS method, found {ours or 'none'}; give one dev table per seed")
    against = ours[0]
    tests = paired_tests(cells, against, {r["key"]: r for r in records})
    full = next((c["pass@1"] for c in cells if c.get("budget") is None and c["method"]["name"] == "full"), None)
    rows = []
    for budget in sorted({c["budget"] for c in cells if c.get("budget") is not None}):
        mine = next((c for c in cells if c.get("budget") == budget and c["method"]["label"] == against), None)
        rivals = [c for c in cells if c.get("budget") == budget and _is_baseline(c)]
        if mine is None or not rivals:
            raise ValueError(f"budget {budget}: the table needs {against} and at least one baseline there")
        best = max(rivals, key=lambda c: c["pass@1"])  # ties: the first in the table's order
        test = tests[(best["method"]["label"], budget)]
        rows.append({"budget": budget, "full": full, "against": against, "dynts": mine["pass@1"], "best": best["method"]["label"],
                     "best_pass": best["pass@1"], "diff": test["diff"], "lo": test["lo"], "hi": test["hi"], "verdict": test["verdict"]})
    return rows


def seed_table(runs: Sequence[Sequence[dict[str, Any]]], names: Sequence[str]) -> str:
    """The markdown table of :func:`best_baseline_rows` for each seed's records, and the verdict line."""
    if len(runs) != len(names):
        raise ValueError(f"{len(runs)} tables and {len(names)} names: give one name per table")
    lines = ["| seed | B | full cache % | DynTS % | best baseline | its % | DynTS - best, points [95 % CI] | verdict (Holm) |",
             "|---|---|---|---|---|---|---|---|"]
    leads = []
    for name, records in zip(names, runs):
        for r in best_baseline_rows(records):
            full = "–" if r["full"] is None else f"{100 * r['full']:.1f}"
            lines.append(f"| {name} | {r['budget']} | {full} | {100 * r['dynts']:.1f} | {r['best']} | {100 * r['best_pass']:.1f} | "
                         f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {r['verdict']} |")
            leads.append(r["verdict"] == "leads")
    holds = "yes" if all(leads) else f"no ({leads.count(False)} of {len(leads)} seed x budget cells without a lead)"
    lines += ["", f"DynTS leads the best baseline at every budget of every seed: {holds}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", metavar="DIR", nargs="+", help="one dev table per seed: a run or report directory with records/*.json")
    parser.add_argument("--names", help="the seeds' names, comma-separated (default: the directories' names)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.names.split(",")] if args.names else [d.rstrip("/").rsplit("/", 1)[-1] for d in args.tables]
    runs = []
    for d in args.tables:
        records = read_records(d)
        if not records:
            parser.error(f"{d}: no records/*.json; give a dynts eval --run-dir or a report directory holding records")
        runs.append(records)
    try:
        print(seed_table(runs, names))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
