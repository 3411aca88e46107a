"""eval.rescue.step_errors: a rescue run's committed steps checked one by one by the testbed's exact step check,
counted by who wrote them."""

from __future__ import annotations

import json

import pytest

from data_pipeline.testbed import task
from eval.harness.benchmarks import load_benchmark
from eval.rescue.step_errors import committed_steps, main, step_errors, step_errors_table

SPEC = "testbed:n=2,family=chain,set=dev"


def write_run(tmp_path, records):
    run = tmp_path / "run"
    (run / "cells").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"config": {"benchmark": SPEC}}))
    (run / "cells" / "kvr-dynts-0.json").write_text(json.dumps({"setting": "kvr", "method": "dynts", "records": records}))
    (run / "cells" / "full-0.json").write_text(json.dumps({"setting": "full", "method": None, "records": [
        {"id": r["id"], "text": r["text"]} for r in records]}))  # no step search: no sources, not counted
    return run


def test_committed_steps_split_as_the_search_commits():
    assert committed_steps("a b ; c d ; </think> r2= 5 <eos>") == ["a b ;", "c d ;", "</think> r2= 5"]
    assert committed_steps("a b ; c d") == ["a b ;", "c d"]  # a step cut by the token limit
    assert committed_steps("a ; </think> r1= x ; </think> r1= 2") == ["a ;", "</think> r1= x ;", "</think> r1= 2"]


def test_reference_traces_are_right_and_a_corrupted_base_step_is_counted(tmp_path):
    problems = [ex.answer for ex in load_benchmark(SPEC).examples]
    records = []
    for p in problems:
        text = " ".join(p.tokens[task.QUESTION_TOKENS:])
        steps = committed_steps(text)
        records.append({"id": p.name, "text": text, "sources": "hb" * (len(steps) // 2) + "h" * (len(steps) % 2)})
    # the first problem's second step (written by the base) miscomputed: it and the steps that read it go wrong
    steps = committed_steps(records[0]["text"])
    words = steps[1].split()
    value = words.index(task.SEP) - 1
    words[value] = str((int(words[value]) + 3) % 10)
    steps[1] = " ".join(words)
    records[0] = {**records[0], "text": " ".join(steps)}
    (row,) = step_errors(write_run(tmp_path, records))
    assert row["cell"] == "kvr (dynts)"
    total = sum(len(committed_steps(r["text"])) for r in records)
    assert row["base"]["steps"] + row["helper"]["steps"] == total
    assert row["base"]["first_wrong"] == 1 and row["helper"]["first_wrong"] == 0
    assert row["base"]["wrong"] >= 1
    table = step_errors_table([row])
    assert table.splitlines()[2].startswith("| kvr (dynts) | ") and " / 0 |" in table


def test_bad_runs_are_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ValueError, match="holds no results.json"):
        step_errors(tmp_path)
    problems = [ex.answer for ex in load_benchmark(SPEC).examples]
    text = " ".join(problems[0].tokens[task.QUESTION_TOKENS:])
    run = write_run(tmp_path, [{"id": problems[0].name, "text": text, "sources": "b"}])
    with pytest.raises(ValueError, match=r"1 sources for \d+ committed steps"):
        step_errors(run)
    with pytest.raises(SystemExit):
        main([])
