"""The testbed report's kept-set shape check: the three oracles of a dynts eval run, per budget."""

from __future__ import annotations

import json

import pytest

from trainers.testbed_report import oracle_shapes, table, update_oracle_shapes


def _cell(label, budget, acc, se=0.02):
    return {"method": {"label": label}, "budget": budget, "benchmark": "testbed:n=200", "local_window": 32,
            "questions": 200, "pass@1": acc, "pass@1_se": se, "mean_generated_tokens": 400.0, "loop_rate": 0.1,
            "truncated_rate": 0.0}


def test_oracle_shapes_reads_an_eval_run_and_states_the_gap(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cells = [_cell("full", None, 0.98), _cell("oracle-step", 96, 0.95), _cell("oracle-value", 96, 0.81),
             _cell("oracle-token", 96, 0.235), _cell("oracle-step", 128, 0.945), _cell("oracle-value", 128, 0.93)]
    (run / "results.json").write_text(json.dumps(cells))
    out = oracle_shapes(run)
    assert out["local_window"] == 32 and out["questions"] == 200 and set(out["budgets"]) == {"96", "128"}
    assert out["budgets"]["96"]["trails_step_points"] == pytest.approx({"oracle-value": 14.0, "oracle-token": 71.5})
    assert out["budgets"]["128"]["trails_step_points"] == pytest.approx({"oracle-value": 1.5})
    report = tmp_path / "testbed.json"
    report.write_text(json.dumps({"n_problems": 200, "sampling": {}, "accuracy": {}}))
    result = update_oracle_shapes(run, "lrm-mix", report)
    assert json.loads(report.read_text())["oracle_shapes"]["lrm-mix"]["budgets"]["96"]["oracle-step"]["pass@1"] == 0.95
    (run / "results.json").write_text(json.dumps(cells[:1]))
    with pytest.raises(ValueError, match="no oracle cells"):
        oracle_shapes(run)
    result.update({"accuracy": {"lrm_full": _row(), "helper_full": _row()}, "attention": {"top20_fraction": 0, "first_fraction": 0, "n": 0},
                   "prm": {"auroc": 0.5, "steps": 0}, "checkpoints": {}})
    assert "oracles by kept-set shape (lrm-mix), B=96 W_l=32: oracle-step 0.950 oracle-value 0.810" in table(result)


def _row():
    return {"accuracy": 1.0, "parse_rate": 1.0, "mean_thinking_tokens": 400, "retrieval": 1.0, "operand_copy": 1.0, "step_arithmetic": 1.0}
