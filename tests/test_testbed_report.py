"""The testbed report's kept-set shape check: three oracles at equal budgets, with their gap."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_pipeline.testbed import task
from pipeline_utils import tiny_eval_testbed
from trainers.testbed_report import SHAPE_ORACLES, oracle_shapes, table

pytestmark = pytest.mark.usefixtures("one_thread")


def test_oracle_shapes_reports_every_shape_at_every_budget(tmp_path, monkeypatch):
    tiny_eval_testbed(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    calls = []
    import trainers.testbed_report as report

    real = report.run_policy

    def counted(*args, **kwargs):
        calls.append((args[3], args[4], kwargs["budget"], kwargs["local_window"]))
        return real(*args, **{**kwargs, "max_new_tokens": 24})

    monkeypatch.setattr(report, "run_policy", counted)
    problems = task.problem_set("test", 2)
    out = oracle_shapes(model, tok, problems, seed=0, budgets=(40, 48), local_window=8)
    assert set(out["budgets"]) == {"40", "48"} and out["local_window"] == 8
    assert [(m, o, b) for m, o, b, _ in calls] == [("testbed-oracle", opts, b) for b in (40, 48) for _, opts in SHAPE_ORACLES]
    for cells in out["budgets"].values():
        accs = [cells[name]["accuracy"] for name, _ in SHAPE_ORACLES]
        assert cells["gap_points"] == pytest.approx(100 * (max(accs) - min(accs)))
    result = {"n_problems": 2, "sampling": {}, "accuracy": {"lrm_full": cells["step"], "helper_full": cells["step"]},
              "oracle_shapes": out, "attention": {"top20_fraction": 0, "first_fraction": 0, "n": 0},
              "prm": {"auroc": 0.5, "steps": 0}, "checkpoints": {}}
    assert "oracles by kept-set shape, B=48 W_l=8: step" in table(result)
