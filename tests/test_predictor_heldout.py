"""Held-out predictor metrics with CIs and the on-policy retention measure
(:mod:`eval.analyses.predictor_heldout`), on a few ``ptest`` problems."""
from __future__ import annotations

import json

import pytest

from data_pipeline.testbed import task
from eval.analyses import predictor_heldout as ph

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reads_of_a_reference_chain_trace_by_hand():
    p = task.problem_set("dev", 1, family="chain")[0]  # a 7 b 2 c 2 d 6 e 4 find r4; d 6 plus d 6 gives r1= 2 ; ...
    w = task.words(p.text)
    r = ph.reads(w, "chain")
    assert r[0] == ("step reads a question variable", 29, [8])  # the first step's d reads the question's 6 (position 8)
    assert r[2] == ("step reads a result", 74, [35])  # r1 times r1: the value written after r1= at 35
    assert w[34:36] == ["r1=", "2"] and w[74] == "2"
    kind, pos, sources = r[-1]
    assert kind == "answer reads the asked result" and w[pos - 2:pos] == [task.END_THINK, f"r{p.asked}="]
    assert all(w[s - 1] == f"r{p.asked}=" for s in sources)


def test_retention_full_keeps_every_read_and_a_window_loses_some():
    from trainers.testbed_eval import load_testbed

    model, tok = load_testbed("testbed-chain")
    problems = task.problem_set(task.PREDICTOR_TEST, 2, family="chain")
    out = ph.retention(model, tok, problems, ["full,window"], budget=40, local_window=8, max_new_tokens=120)
    full, window = out["methods"]["full"]["retained"], out["methods"]["window"]["retained"]
    for kind in ph.READ_KINDS:
        if full[kind]["n"]:
            assert full[kind]["mean"] == 1.0 and full[kind]["pooled"][0] == full[kind]["pooled"][1]
    lost = window["step reads a question variable"]  # no question protection, 8 recent tokens: the question is gone
    assert lost["n"] and lost["mean"] < 0.5 and lost["ci"][0] <= lost["mean"] <= lost["ci"][1]


def test_metrics_on_ptest_with_cis(tmp_path):
    out = tmp_path / "chain.json"
    assert ph.main(["--family", "chain", "--n", "3", "--methods", "full,dynts", "--budget", "64", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["set"] == "ptest" and result["metrics"]["traces"] >= 1
    tau = result["metrics"]["kendall"]
    assert -1 <= tau["ci"][0] <= tau["mean"] <= tau["ci"][1] <= 1
    assert set(result["retention"]["methods"]) == {"full", "dynts"}
    table = out.with_suffix(".md").read_text()
    assert table == ph.markdown(result) and f"Kendall tau-b {tau['mean']:.3f}" in table and "| dynts |" in table
    assert ph.main(["--set", "confirm", "--n", "2"]) == 2  # a final-only set is refused
