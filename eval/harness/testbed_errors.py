"""Why testbed answers are wrong: a breakdown of the wrong samples of a ``dynts eval`` run on the
testbed benchmark (``docs/evaluation.md``'s error table comes from here).

Each wrong sample falls in exactly one class, checked in this order:

- ``unparsed``: no ``</think> rK= v`` answer could be read (the thinking never closed, or junk);
- ``wrong key``: the answer names another key than the one asked;
- ``asked step never written``: the trace's thinking holds no step for the asked key;
- ``step's own value wrong``: the answer copies a value the trace wrote for the asked key, but that
  step's arithmetic was wrong (the answer is checked against the true value of the step);
- ``retrieval wrong``: the trace wrote the asked step, yet the answer carries a value the trace
  never wrote for it (the lookup failed).

A coarser view, :func:`degeneration_class`, says what an evicted model *does* when it fails
(KV-Rescue's degeneration question), checked in this order:

- ``loops``: the thinking writes a step key it already wrote (it restarted or repeats itself);
- ``stops early``: it answers the asked key, but its thinking closed before writing that step;
- ``wrong value``: it wrote the asked step, and the answer carries a wrong value (a failed lookup or
  a slip in the step itself);
- ``incoherent``: no readable answer, or an answer to another key.

:func:`length_table` splits pass@1 by the problems' thinking length (``--by-length 700``: up to 700 and
above), read from the cells' committed per-problem records: where a model's accuracy falls off with length.

Run: ``python -m eval.harness.testbed_errors RUN_DIR [--degeneration | --by-length EDGE ...]`` (a markdown
table, one row per cell).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from data_pipeline.testbed import task

from .loops import testbed_loops

__all__ = ["DEGENERATION_CLASSES", "ERROR_CLASSES", "classify_error", "count_errors", "degeneration_class", "error_table",
           "length_table", "main"]

ERROR_CLASSES = ("wrong key", "unparsed", "asked step never written", "step's own value wrong", "retrieval wrong")
DEGENERATION_CLASSES = ("stops early", "wrong value", "loops", "incoherent")
_COARSE = {"wrong key": "incoherent", "unparsed": "incoherent", "asked step never written": "stops early",
           "step's own value wrong": "wrong value", "retrieval wrong": "wrong value"}


def classify_error(problem: task.Problem, text: str) -> str | None:
    """The class of a generated ``text`` for ``problem`` (see the module docstring); ``None`` when
    the answer is correct."""
    if task.check_answer(problem, text):
        return None
    parsed = task.parse_answer(text)
    if parsed is None:
        return "unparsed"
    key, value = parsed
    if key != problem.asked:
        return "wrong key"
    written = [v for *_, k, v in task.parse_steps(text, problem.family) if k == problem.asked]
    if not written:
        return "asked step never written"
    return "step's own value wrong" if value in written else "retrieval wrong"


def degeneration_class(problem: task.Problem, text: str) -> str | None:
    """What the model did when ``text`` is wrong (see the module docstring); ``None`` when right."""
    kind = classify_error(problem, text)
    if kind is None:
        return None
    return "loops" if testbed_loops(text, problem.family) else _COARSE[kind]


def count_errors(problems: dict[str, task.Problem], records: Sequence[dict[str, Any]], degeneration: bool = False) -> dict[str, int]:
    """Counts per class (and ``wrong``) over ``records`` (``id``, ``text``; ``problems`` by id):
    :func:`classify_error`'s classes, or with ``degeneration`` :func:`degeneration_class`'s."""
    classify, classes = (degeneration_class, DEGENERATION_CLASSES) if degeneration else (classify_error, ERROR_CLASSES)
    counts = {"wrong": 0, **{c: 0 for c in classes}}
    for record in records:
        kind = classify(problems[record["id"]], record["text"])
        if kind is not None:
            counts["wrong"] += 1
            counts[kind] += 1
    return counts


def cell_errors(run_dir: Path, cell: dict[str, Any], degeneration: bool = False) -> dict[str, int]:
    """:func:`count_errors` over the samples of one finished cell of ``run_dir``."""
    from .benchmarks import load_benchmark

    problems = {ex.id: ex.answer for ex in load_benchmark(cell["benchmark"]).examples}
    lines = (run_dir / "samples" / f"{cell['key']}.jsonl").read_text().splitlines()
    return count_errors(problems, [json.loads(line) for line in lines], degeneration)


def error_table(run_dir: str | Path, cells: Sequence[dict[str, Any]] | None = None, degeneration: bool = False) -> str:
    """Markdown table of the wrong samples of every testbed cell in ``run_dir``'s ``results.json``,
    one row per cell with its budget (``degeneration``: the coarse classes)."""
    run_dir = Path(run_dir)
    cells = cells if cells is not None else json.loads((run_dir / "results.json").read_text())
    classes = DEGENERATION_CLASSES if degeneration else ERROR_CLASSES
    header = ["method", "budget", "samples", "wrong", *classes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in cells:
        if not cell["benchmark"].startswith("testbed"):
            continue
        counts = cell_errors(run_dir, cell, degeneration)
        first = [cell["method"]["label"], str(cell.get("budget") or "–"), str(cell.get("samples", "–"))]
        lines.append("| " + " | ".join(first + [str(counts[h]) for h in header[len(first):]]) + " |")
    return "\n".join(lines)


def length_table(run_dir: str | Path, edges: Sequence[int]) -> str:
    """Markdown table of pass@1 % per band of the problems' thinking length (bands split at ``edges``),
    one row per testbed cell of ``run_dir``'s per-problem records (``n``: problems in the band)."""
    from .benchmarks import load_benchmark
    from .records import per_question, read_records

    if not edges or list(edges) != sorted(set(edges)):
        raise ValueError(f"--by-length {list(edges)}: give increasing thinking lengths, e.g. --by-length 700")
    bounds = [0, *edges, None]
    bands = [f"{lo}-{hi}" if hi is not None else f">= {lo}" for lo, hi in zip(bounds, bounds[1:])]
    lines = ["| method | budget | " + " | ".join(f"{b} pass@1 % (n)" for b in bands) + " |", "|" + "---|" * (2 + len(bands))]
    lengths: dict[str, dict[str, int]] = {}  # per benchmark: each problem's thinking length (built once)
    for record in read_records(run_dir):
        cell = record["cell"]
        if not cell["benchmark"].startswith("testbed"):
            continue
        if cell["benchmark"] not in lengths:
            lengths[cell["benchmark"]] = {ex.id: ex.answer.thinking_length for ex in load_benchmark(cell["benchmark"]).examples}
        length = lengths[cell["benchmark"]]
        scores = dict(zip(record["ids"], per_question(record)))
        row = [cell["method"]["label"], str(cell.get("budget") or "–")]
        for lo, hi in zip(bounds, bounds[1:]):
            band = [v for q, v in scores.items() if length[q] >= lo and (hi is None or length[q] < hi)]
            row.append(f"{100 * sum(band) / len(band):.1f} ({len(band)})" if band else "– (0)")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.testbed_errors", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a dynts eval run directory on the testbed benchmark")
    parser.add_argument("--degeneration", action="store_true",
                        help="coarse classes (stops early / wrong value / loops / incoherent) per method and budget")
    parser.add_argument("--by-length", type=int, nargs="+", metavar="EDGE",
                        help="pass@1 per band of the problems' thinking length, split at these lengths")
    args = parser.parse_args(argv)
    if args.by_length:
        print(length_table(args.run_dir, args.by_length))
        return 0
    print(error_table(args.run_dir, degeneration=args.degeneration))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
