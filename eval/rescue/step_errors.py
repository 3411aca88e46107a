"""What a KV-Rescue run committed, step by step, on the testbed: every committed step of every cell checked by the
testbed's exact step check (:func:`data_pipeline.testbed.steps.check_step`: the next key, operands copied, the value
computed; an answer by the grader) given the steps committed before it, counted by who wrote it -- the evicted base
(``b``) or the helper (``h``), as the cell's ``sources`` record them.

The verifier picks one of ``N + N`` candidates per step, so its mistakes show here as wrong committed steps: a
verifier that lets the evicted base's lost-place steps through commits more wrong base steps than helper steps.
A step after a wrong one is checked against the wrong one (the check's "given the steps before it"), so a wrong
step early in a trajectory can make the next ones wrong too; ``first wrong`` counts, per trajectory, only the first.

    python -m eval.rescue.step_errors reports/rescue/dev-chain-fair-s1-B72-N4-step-prm

Reads ``results.json`` (the benchmark) and ``cells/*.json`` of a ``dynts rescue bench`` run on a testbed
benchmark that is not final-only (the problems are drawn again to read their questions).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from data_pipeline.testbed import task
from data_pipeline.testbed.steps import check_step
from eval.rescue.answers import split_steps

__all__ = ["committed_steps", "step_errors", "step_errors_table"]

SOURCES = {"b": "base", "h": "helper"}


def committed_steps(text: str) -> list[str]:
    """A trajectory's committed steps as the search committed them: the words up to and with each ``;``, then the words
    after the last ``;`` when there are any (the answer, ``</think> rK= v``, or a step cut by the token limit)."""
    words = [w for w in text.split() if w not in (task.EOS, task.PAD)]
    steps, tail = split_steps(words, task.SEP.__eq__)
    return [" ".join(step) for step in (steps + [tail] if tail else steps)]


def _cell_errors(question_of: dict[str, str], family: str, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counts = {name: {"steps": 0, "wrong": 0, "first_wrong": 0} for name in SOURCES.values()}
    for record in records:
        steps, sources = committed_steps(record["text"]), record["sources"]
        if len(sources) != len(steps):
            raise ValueError(f"problem {record['id']}: {len(sources)} sources for {len(steps)} committed steps")
        first = True
        for j, source in enumerate(sources):
            right = check_step(question_of[record["id"]], steps[: j + 1], family)
            count = counts[SOURCES[source]]
            count["steps"] += 1
            count["wrong"] += not right
            count["first_wrong"] += (not right) and first
            first = first and right
    return counts


def step_errors(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per cell of a rescue run (those whose trajectories are step searches: ``sources`` recorded), the committed
    steps by source with how many the exact check marks wrong."""
    from eval.harness.benchmarks import load_benchmark

    run = Path(run_dir)
    results = run / "results.json"
    if not results.is_file():
        raise ValueError(f"run_dir={str(run)!r} holds no results.json: give a `dynts rescue bench` run directory")
    spec = json.loads(results.read_text())["config"]["benchmark"]
    if not spec.startswith("testbed"):
        raise ValueError(f"{run}: benchmark {spec!r} is not the testbed: the exact step check needs testbed problems")
    bench = load_benchmark(spec)
    question_of = {ex.id: ex.question for ex in bench.examples}
    rows = []
    for path in sorted((run / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        records = cell.get("records") or []
        if not records or not all(r.get("sources") for r in records):
            continue
        label = cell["setting"] + (f" ({cell['method']})" if cell.get("method") else "")
        rows.append({"cell": label, "file": path.name, **_cell_errors(question_of, bench.grader.family, records)})
    return rows


def step_errors_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per cell, the committed steps of each source, the share the exact check marks wrong, and the
    trajectories' first wrong steps by source."""
    def share(count: dict[str, int]) -> str:
        return f"{count['wrong']} / {count['steps']} ({100 * count['wrong'] / count['steps']:.1f} %)" if count["steps"] else "–"

    lines = ["| cell | base steps wrong | helper steps wrong | first wrong step: base / helper |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['cell']} | {share(row['base'])} | {share(row['helper'])} | "
                     f"{row['base']['first_wrong']} / {row['helper']['first_wrong']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rescue.step_errors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="`dynts rescue bench` run directories on the testbed")
    args = p.parse_args(argv)
    for run in args.runs:
        print(f"\n{run}\n")
        print(step_errors_table(step_errors(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
