"""Paired statistics of a Pareto retention run (:func:`eval.analyses.pareto.pareto_curve`).

Every condition (strategy, percent) answers the same traces the same number of times, so the
conditions pair trace by trace: a trace's score under a condition is its share of correct answers
over the runs. The table gives each accuracy with a bootstrap 95 % CI over traces, and per percent
``top - random`` and ``top - bottom`` as paired bootstrap differences with the sign test
(:mod:`eval.harness.stats`).

The compact records (``records.json``: per condition, the correct answers per trace) are what
``reports/`` keeps; the table recomputes from them::

    python -m eval.analyses.pareto_stats RUN_DIR [--write]     # RUN_DIR: pareto_records.jsonl or records.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from dynts.io import write_atomic
from eval.harness.stats import MARGIN, bootstrap_ci, paired_test, table_verdicts

__all__ = ["compact_records", "load_compact", "paired_rows", "markdown", "write_tables", "main"]

FULL = "full@100"


def _cell(strategy: str, percent: float) -> str:
    return f"{strategy}@{percent:g}"


def compact_records(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``{"traces": [...], "runs": R, "cells": {"top@30": [correct answers per trace], ...}}`` from
    the per-answer records; every condition must cover every trace with ``R`` answers."""
    counts: dict[str, dict[str, int]] = {}
    answers: dict[tuple[str, str], int] = {}
    for r in records:
        trace, cell = f"{r['question_id']}/{r['sample_id']}", _cell(r["strategy"], float(r["percent"]))
        counts.setdefault(cell, {}).setdefault(trace, 0)
        counts[cell][trace] += bool(r["correct"])
        answers[(cell, trace)] = answers.get((cell, trace), 0) + 1
    if not counts:
        raise ValueError("no Pareto records: run dynts analyze pareto first")
    traces = sorted({t for per in counts.values() for t in per})
    runs = set(answers.values())
    if len(runs) != 1 or len(answers) != len(traces) * len(counts):
        raise ValueError("the records are incomplete (a condition lacks a trace or an answer); rerun dynts analyze pareto, which resumes")
    return {"traces": traces, "runs": runs.pop(), "cells": {c: [per[t] for t in traces] for c, per in sorted(counts.items())}}


def load_compact(run_dir: str | Path) -> dict[str, Any]:
    """The compact records of a run directory: ``records.json``, else built from ``pareto_records.jsonl``."""
    run_dir = Path(run_dir)
    if (run_dir / "records.json").is_file():
        return json.loads((run_dir / "records.json").read_text())
    path = run_dir / "pareto_records.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has neither records.json nor pareto_records.jsonl; pass a dynts analyze pareto --out directory")
    return compact_records(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def paired_rows(compact: dict[str, Any], against: Sequence[str] = ("random", "bottom"), lead: str = "top",
                margin: float = MARGIN) -> list[dict[str, Any]]:
    """One row per percent: every strategy's accuracy and CI, and ``lead`` minus each of ``against``
    (paired bootstrap difference in points, its CI, the test's p and the Holm-adjusted verdict over
    every difference of the table)."""
    runs, cells = compact["runs"], compact["cells"]
    score = {c: [k / runs for k in v] for c, v in cells.items()}
    percents = sorted({float(c.split("@")[1]) for c in cells if c != FULL})
    present = {c.split("@")[0] for c in cells if c != FULL}
    strategies = [s for s in (lead, *against) if s in present] + sorted(present - {lead, *against})
    rows, where, tests = [], [], []
    for p in percents:
        row: dict[str, Any] = {"percent": p}
        for s in strategies:
            if _cell(s, p) in score:
                x = score[_cell(s, p)]
                row[s] = (sum(x) / len(x), *bootstrap_ci(x))
        for other in against:
            a, b = score.get(_cell(lead, p)), score.get(_cell(other, p))
            if a is not None and b is not None:
                where.append((len(rows), f"{lead}-{other}"))
                tests.append(paired_test(a, b, runs, margin=margin))
        rows.append(row)
    for (i, name), t in zip(where, table_verdicts(tests)):
        rows[i][name] = (100 * t["diff"], 100 * t["lo"], 100 * t["hi"], t["p"], t["p_holm"], t["verdict"])
    return rows


def markdown(compact: dict[str, Any], against: Sequence[str] = ("random", "bottom"), lead: str = "top") -> str:
    """The paired table as Markdown (accuracies in %, differences in points)."""
    rows = paired_rows(compact, against, lead)
    strategies = [k for k in rows[0] if k != "percent" and "-" not in k] if rows else []
    diffs = [k for k in rows[0] if "-" in k] if rows else []
    full = compact["cells"].get(FULL)
    n, runs = len(compact["traces"]), compact["runs"]
    head = f"{n} traces x {runs} answers per condition"
    if full is not None:
        x = [k / runs for k in full]
        lo, hi = bootstrap_ci(x)
        head += f"; full thinking {100 * sum(x) / n:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]"
    lines = [head, "", "| p (%) | " + " | ".join(f"{s} %" for s in strategies) + " | "
             + " | ".join(f"{d} (pts, p, Holm p, verdict)" for d in diffs) + " |", "|---" * (1 + len(strategies) + len(diffs)) + "|"]
    for r in rows:
        accs = [f"{100 * r[s][0]:.1f} [{100 * r[s][1]:.1f}, {100 * r[s][2]:.1f}]" for s in strategies]
        ds = [f"{r[d][0]:+.1f} [{r[d][1]:+.1f}, {r[d][2]:+.1f}], p {r[d][3]:.2g}, Holm {r[d][4]:.2g}, {r[d][5]}" for d in diffs]
        lines.append(f"| {r['percent']:g} | " + " | ".join(accs + ds) + " |")
    return "\n".join(lines) + "\n"


def write_tables(run_dir: str | Path, compact: dict[str, Any]) -> str:
    """Write ``records.json`` and ``table.md`` (:func:`markdown`) into ``run_dir``; return the table."""
    table = markdown(compact)
    write_atomic(Path(run_dir) / "records.json", json.dumps(compact, separators=(",", ":")))
    write_atomic(Path(run_dir) / "table.md", table)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a dynts analyze pareto --out directory (or a reports/ copy holding records.json)")
    p.add_argument("--write", action="store_true", help="also write records.json and table.md into RUN_DIR")
    args = p.parse_args(argv)
    try:
        compact = load_compact(args.run_dir)
    except ValueError as err:
        print(f"pareto_stats: {err}")
        return 2
    print(write_tables(args.run_dir, compact) if args.write else markdown(compact), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
