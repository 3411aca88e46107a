"""The testbed error breakdown (``python -m eval.harness.testbed_errors``): each wrong answer gets one class."""

from __future__ import annotations

import json
import re

import pytest

from data_pipeline.testbed import task
from eval.harness.testbed_errors import classify_error, error_table


def variants() -> tuple[task.Problem, dict[str, str]]:
    """A reference trace and one edited copy per error class."""
    problem = task.problem_set("errors", 1)[0]
    text = problem.text.split("<think>", 1)[1]
    asked, value = f"r{problem.asked}=", problem.answer
    step = re.search(rf"\S+ \d \S+ \S+ \d gives {asked} (\d) ;", text)
    wrong = (value + 1) % 10
    other = f"r{problem.asked % 3 + 1 if problem.asked > 3 else problem.asked + 1}="
    answer = f"</think> {asked} {value}"
    return problem, {
        "correct": text,
        "unparsed": text.split("</think>")[0],
        "wrong key": text.replace(answer, f"</think> {other} {value}"),
        "asked step never written": text.replace(step.group(0), ""),
        "step's own value wrong": text.replace(step.group(0), step.group(0).replace(f"{asked} {value} ;", f"{asked} {wrong} ;"))
        .replace(answer, f"</think> {asked} {wrong}"),
        "retrieval wrong": text.replace(answer, f"</think> {asked} {wrong}"),
    }


def test_each_error_class():
    problem, texts = variants()
    for kind, text in texts.items():
        assert classify_error(problem, text) == (None if kind == "correct" else kind), kind


def test_error_table_from_a_run_dir(tmp_path):
    problem, texts = variants()
    cell = {"key": "c1", "benchmark": "testbed:n=1,set=errors", "method": {"label": "window"}}
    (tmp_path / "samples").mkdir()
    records = [{"id": problem.name, "text": t} for t in texts.values()]
    (tmp_path / "samples" / "c1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "results.json").write_text(json.dumps([cell]))
    table = error_table(tmp_path).splitlines()
    assert table[0].startswith("| method | budget | samples | wrong | wrong key | unparsed")
    assert table[2] == "| window | – | – | 5 | 1 | 1 | 1 | 1 | 1 |"


def test_degeneration_classes():
    from eval.harness.testbed_errors import degeneration_class

    problem, texts = variants()
    expect = {"correct": None, "unparsed": "incoherent", "wrong key": "incoherent", "asked step never written": "stops early",
              "step's own value wrong": "wrong value", "retrieval wrong": "wrong value"}
    for kind, text in texts.items():
        assert degeneration_class(problem, text) == expect[kind], kind
    # A trace that writes a step key a second time loops, whatever its answer.
    text = texts["retrieval wrong"]
    first = re.search(r"\S+ \d \S+ \S+ \d gives r1= \d ;", text).group(0)
    looping = text.replace("</think>", f"{first} </think>")
    assert degeneration_class(problem, looping) == "loops"
    assert degeneration_class(problem, texts["correct"].replace("</think>", f"{first} </think>")) is None  # right is right


def test_degeneration_table_has_budget_and_samples(tmp_path):
    problem, texts = variants()
    cell = {"key": "c1", "benchmark": "testbed:n=1,set=errors", "method": {"label": "window"}, "budget": 64, "samples": 6}
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "c1.jsonl").write_text("".join(json.dumps({"id": problem.name, "text": t}) + "\n" for t in texts.values()))
    (tmp_path / "results.json").write_text(json.dumps([cell]))
    table = error_table(tmp_path, degeneration=True).splitlines()
    assert table[0] == "| method | budget | samples | wrong | stops early | wrong value | loops | incoherent |"
    assert table[2] == "| window | 64 | 6 | 5 | 1 | 2 | 0 | 2 |"


def test_length_table_splits_pass_at_1_by_thinking_length(tmp_path):
    from eval.harness.records import eval_record, write_record
    from eval.harness.testbed_errors import length_table

    benchmark = "testbed:n=6,set=errors"
    problems = task.problem_set("errors", 6)
    lengths = sorted(p.thinking_length for p in problems)
    edge = lengths[3]  # three problems below, three at or above
    correct = {p.name: p.thinking_length < edge for p in problems}  # right below the edge only
    ids = [p.name for p in problems]
    samples = [{"question": i, "sample": s, "correct": correct[q], "answered": True, "tokens": 10}
               for i, q in enumerate(ids) for s in range(2)]
    cell = {"benchmark": benchmark, "method": {"name": "full", "options": {}, "label": "full"}, "budget": None}
    write_record(tmp_path, eval_record("c1", cell, ids, 2, samples))
    table = length_table(tmp_path, [edge]).splitlines()
    assert table[0] == f"| method | budget | 0-{edge} pass@1 % (n) | >= {edge} pass@1 % (n) |"
    assert table[2] == "| full | – | 100.0 (3) | 0.0 (3) |"
    with pytest.raises(ValueError, match="--by-length"):
        length_table(tmp_path, [900, 700])
