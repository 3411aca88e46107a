"""The testbed report: the kept-set shape check (the oracles of a dynts eval run, per budget) and the
per-family report (copy, chain: models, problems, oracles, critical positions, PRM config, CLI)."""

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


def test_the_chain_report_records_the_chain_oracle_presets(tmp_path):
    from trainers.testbed_report import CHAIN_SHAPE_ORACLES

    run = tmp_path / "run"
    run.mkdir()
    cells = [_cell("oracle-step", 96, 0.9), _cell("chain-oracle-step", 96, 0.7), _cell("chain-oracle-value", 96, 0.6)]
    (run / "results.json").write_text(json.dumps(cells))
    report = tmp_path / "testbed-chain.json"
    report.write_text(json.dumps({"family": "chain", "n_problems": 200}))
    shapes = update_oracle_shapes(run, "chain-lrm", report, family="chain")["oracle_shapes"]["chain-lrm"]["budgets"]["96"]
    assert list(shapes) == [*CHAIN_SHAPE_ORACLES, "trails_step_points"]
    assert shapes["trails_step_points"] == pytest.approx({"chain-oracle-value": 10.0})


def _row():
    return {"accuracy": 1.0, "parse_rate": 1.0, "mean_thinking_tokens": 400, "retrieval": 1.0, "operand_copy": 1.0, "step_arithmetic": 1.0}


# --- per-family report: the family table, the chain path, the CLI ---------------------------------

def test_the_family_table_names_bundled_models_and_each_prm_config_carries_its_family():
    import yaml

    from data_pipeline.testbed import task
    from dynts.models import TESTBED, configs_dir
    from trainers.testbed_prm import PRMConfig
    from trainers.testbed_report import FAMILY_MODELS, require_checkpoint

    assert set(FAMILY_MODELS) == set(task.FAMILIES)
    for family, fm in FAMILY_MODELS.items():
        assert all(name in TESTBED for name in fm.models)
        for name in (fm.lrm, fm.helper):  # the PRM of a family may still be training
            assert (require_checkpoint(family, name) / "model.safetensors").is_file()
        cfg = PRMConfig.from_dict(yaml.safe_load((configs_dir() / fm.prm_config.removeprefix("configs/")).read_text()))
        assert cfg.data.family == family and cfg.name == fm.prm
    assert FAMILY_MODELS["copy"].models == ("testbed", "testbed-helper", "testbed-prm")
    assert FAMILY_MODELS["chain"].models == ("testbed-chain", "testbed-chain-helper", "testbed-chain-prm")
    assert (FAMILY_MODELS["copy"].out, FAMILY_MODELS["chain"].out) == ("reports/testbed.json", "reports/testbed-chain.json")


def test_copy_policies_are_unchanged_and_each_family_runs_the_eval_oracle_presets():
    import dynts
    import data_pipeline.testbed.oracle  # noqa: F401
    from eval.harness import methods
    from trainers.testbed_report import FAMILY_MODELS, POLICIES

    assert FAMILY_MODELS["copy"].policies == POLICIES == (
        ("question+recent", "window", {"keep_question": True}),
        ("oracle", "testbed-oracle", None),
        ("oracle(step)", "testbed-oracle", {"keep_step": True}),
        ("oracle(token)", "testbed-oracle", {"keep_key": False}),
    )
    presets = {"copy": {"oracle": "oracle-value", "oracle(step)": "oracle-step", "oracle(token)": "oracle-token"},
               "chain": {"oracle": "chain-oracle-value", "oracle(step)": "chain-oracle-step"}}
    for family, fm in FAMILY_MODELS.items():
        oracles = {label: (method, options or {}) for label, method, options in fm.policies if method == "testbed-oracle"}
        assert set(oracles) == set(presets[family])  # chain: no token oracle (copy-only)
        for label, preset in presets[family].items():
            spec = methods.parse_method(preset)
            assert oracles[label] == (spec.name, dict(spec.options))
            assert dynts.make_evictor(spec.name, **dict(spec.options)).family == family
    assert FAMILY_MODELS["copy"].shape_oracles == tuple(methods.ORACLES)
    assert FAMILY_MODELS["chain"].shape_oracles == tuple(methods.CHAIN_ORACLES)


def test_attention_ranks_reads_the_family_critical_positions():
    """A model whose answer rows attend only to a value of the asked result's closure (not the asked
    value): first for the chain problem, not first when the same trace is read as copy."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from data_pipeline.testbed import task
    from trainers.testbed_report import attention_ranks

    p = task.problem_set("test", 1, family="chain")[0]
    closure_only = min(set(p.critical_positions) - set(task.find_critical_positions(p.tokens, p.asked)))

    def model(input_ids, output_attentions):
        att = torch.zeros(1, 1, input_ids.shape[1], input_ids.shape[1])
        att[..., closure_only] = 1.0
        return SimpleNamespace(attentions=(att,))

    text = " ".join(p.tokens[task.QUESTION_TOKENS :])
    chain = attention_ranks(model, None, [p], [text])
    assert chain["n"] == 1 and chain["first_fraction"] == 1.0
    copy = attention_ranks(model, None, [dataclasses.replace(p, family="copy")], [text])
    assert copy["n"] == 1 and copy["first_fraction"] == 0.0


def test_chain_report_runs_the_chain_models_problems_and_oracles(tmp_path, monkeypatch):
    """The whole report path for chain on 2 problems with 40 generated tokens (real generation)."""
    import functools

    from data_pipeline.testbed import task
    from trainers import testbed_report as tr

    calls = []

    def short(model, tokenizer, problems, method, options=None, **kw):
        calls.append((tuple(p.name for p in problems), {p.family for p in problems}, method, options))
        return real(model, tokenizer, problems, method, options, **kw)

    real = functools.partial(tr.run_policy, max_new_tokens=40)
    monkeypatch.setattr(tr, "run_policy", short)
    out = tmp_path / "testbed-chain.json"
    result = tr.report(n=2, budget=40, out=out, family="chain", skip_prm=True)
    assert json.loads(out.read_text())["family"] == result["family"] == "chain" and result["problem_set"] == "test"
    assert list(result["checkpoints"]) == ["testbed-chain", "testbed-chain-helper"] and "prm" not in result
    assert {c[0] for c in calls} == {tuple(p.name for p in task.problem_set("test", 2, family="chain"))}
    assert {f for c in calls for f in c[1]} == {"chain"}
    assert list(result["eviction"]["policies"]) == ["full", "question+recent", "oracle", "oracle(step)"]
    assert result["eviction"]["policies"]["oracle"]["options"] == {"family": "chain"}
    assert result["eviction"]["local_window"] == 40 - task.QUESTION_TOKENS - 8
    for row in [result["accuracy"]["lrm_full"], *result["eviction"]["policies"].values()]:  # the per-problem bits
        rec = row["records"]
        assert rec["problems"] == [p.name for p in task.problem_set("test", 2, family="chain")]
        assert rec["correct"].count("1") / 2 == row["accuracy"] and rec["parsed"].count("1") / 2 == row["parse_rate"]
        assert sum(rec["thinking_tokens"]) / 2 == row["mean_thinking_tokens"]
    text = tr.table(result)
    assert "chain family" in text and "--family chain --prm-only" in text and "lrm oracle(step) B=40" in text
    with pytest.raises(ValueError, match="'chain' family's report, not 'copy'"):
        tr.update_prm(out, family="copy")


def test_a_missing_prm_checkpoint_names_its_config_before_any_generation(tmp_path, monkeypatch):
    from dynts import models
    from trainers import testbed_report as tr

    monkeypatch.setitem(models.TESTBED, "testbed-chain-prm", "no-such-checkpoint")
    monkeypatch.setattr(tr, "run_policy", lambda *a, **k: pytest.fail("generated before checking the checkpoints"))
    with pytest.raises(ValueError, match=r"dynts testbed train --config configs/testbed/chain-prm\.yaml.*--skip-prm"):
        tr.report(n=2, out=tmp_path / "r.json", family="chain")


def test_the_chain_prm_auroc_uses_the_chain_config(tmp_path, monkeypatch):
    """``--prm-only --family chain`` scores held-out traces of the chain PRM config; the copy PRM's
    weights stand in for the chain PRM's here, so only the traces' family and lengths are checked."""
    from dynts import models
    from trainers import testbed_report as tr

    monkeypatch.setitem(models.TESTBED, "testbed-chain-prm", models.TESTBED["testbed-prm"])
    out = tmp_path / "testbed-chain.json"
    out.write_text(json.dumps({"family": "chain", "n_problems": 2, "checkpoints": {}}))
    prm = tr.update_prm(out, n=2, family="chain")["prm"]
    assert prm["family"] == "chain" and prm["think_range"] == [60, 700] and prm["traces"] == 2 and prm["steps"] > 0
    assert list(json.loads(out.read_text())["checkpoints"]) == ["testbed-chain-prm"]


def test_the_cli_takes_a_family_and_its_default_report_path(monkeypatch, capsys):
    from trainers import testbed_cli
    from trainers import testbed_report as tr

    with pytest.raises(SystemExit) as stop:
        testbed_cli.main(["report", "--family", "nope"])
    assert stop.value.code == 2 and "--family" in capsys.readouterr().err
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return {"family": kw["family"], "n_problems": kw["n"], "sampling": {}, "accuracy": {"lrm_full": _row(), "helper_full": _row()},
                "attention": {"top20_fraction": 0, "first_fraction": 0, "n": 0}, "checkpoints": {}}

    monkeypatch.setattr(tr, "report", fake)
    assert testbed_cli.main(["report", "--family", "chain", "--n", "3", "--skip-prm"]) == 0
    assert (seen["family"], seen["out"], seen["skip_prm"]) == ("chain", "reports/testbed-chain.json", True)
    assert "wrote reports/testbed-chain.json" in capsys.readouterr().out
    assert testbed_cli.main(["report", "--n", "3"]) == 0
    assert (seen["family"], seen["out"], seen["skip_prm"]) == ("copy", "reports/testbed.json", False)


def test_run_policy_draws_k_samples_per_problem_with_recorded_streams():
    """k = 3: texts problem-major, records hold every sample with its (batch seed, row) stream, all
    distinct; accuracy is the mean of the per-problem means; k = 1 seeds batches as before."""
    from data_pipeline.testbed import task
    from trainers import testbed_report as tr
    from trainers.testbed_eval import load_testbed

    model, tok = load_testbed("testbed")
    problems = task.problem_set("test", 2)
    texts, result = tr.run_policy(model, tok, problems, "full", k=3, batch_size=4, max_new_tokens=30)
    rec = result["records"]
    assert len(texts) == 6 and result["k"] == rec["k"] == 3 and result["n_problems"] == 2
    assert rec["problems"] == ["test:0", "test:1"] and len(rec["correct"]) == 6
    assert list(zip(rec["seeds"], rec["rows"])) == [(0, 0), (0, 1), (0, 2), (0, 3), (4, 0), (4, 1)]
    per_problem = [rec["correct"][i * 3:(i + 1) * 3].count("1") / 3 for i in range(2)]
    assert result["accuracy"] == pytest.approx(sum(per_problem) / 2)
    _, one = tr.run_policy(model, tok, problems, "full", k=1, batch_size=1, max_new_tokens=5)
    assert one["records"]["seeds"] == [0, 1] and one["k"] == 1
    with pytest.raises(ValueError, match="k=0"):
        tr.run_policy(model, tok, problems, "full", k=0)
