"""The testbed's problem namespaces: ``confirm`` is read by the final tables only, ``gate`` serves the
PRM gates and AUROC tools, both give other problems for other length ranges, and ``dev``/``test``
still generate the problems the committed numbers were measured on."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from data_pipeline.testbed import task

ROOT = Path(__file__).resolve().parents[1]
# the only modules that may enter task.final_tables(): the commands that produce final tables
FINAL_TABLE_COMMANDS = {"eval/harness/cli.py", "eval/harness/demo.py", "eval/rescue/cli.py", "eval/analyses/cli.py"}
SCANNED = ("dynts", "trainers", "eval", "data_pipeline", "scripts")


def test_confirm_is_refused_outside_the_final_tables():
    with pytest.raises(ValueError, match=r"set=dev.*--final"):
        task.problem_set("confirm", 3)
    with pytest.raises(ValueError, match="confirm"):
        task.problem_set("confirm:chain", 3)  # the whole namespace
    with task.final_tables():
        problems = task.problem_set("confirm", 3)
    assert len(problems) == 3
    with pytest.raises(ValueError):  # the permission ends with the block
        task.problem_set("confirm", 3)


def test_confirm_through_the_benchmark_loader():
    from eval.harness.benchmarks import load_benchmark

    with pytest.raises(ValueError, match="final"):
        load_benchmark("testbed:n=2,set=confirm")
    with task.final_tables():
        assert len(load_benchmark("testbed:n=2,set=confirm").examples) == 2


def test_eval_and_demo_opt_in_with_final(monkeypatch, tmp_path):
    """``dynts eval --final`` / ``dynts demo --final`` run inside final_tables(); without it a run
    on set=confirm is refused before anything is generated."""
    from eval.harness import benchmarks, cli, runner

    seen = []

    def fake_run(config, **kw):
        seen.append(len(benchmarks.load_benchmark(config.benchmarks[0]).examples))
        return []

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr("eval.harness.report.markdown_table", lambda results, *a, **k: "")
    argv = ["--model", "testbed", "--benchmark", "testbed:n=2,set=confirm", "--method", "full", "--k", "1",
            "--run-dir", str(tmp_path / "run"), "--no-progress"]
    assert cli.main(argv) == 2 and not seen  # refused: names the fix
    assert cli.main(argv + ["--final"]) == 0 and seen == [2]


def test_new_namespaces_differ_across_lengths_and_from_the_old_sets():
    gate_long, gate_short = task.problem_set("gate", 200, 60, 700), task.problem_set("gate", 200, 60, 400)
    assert task.shared_questions(gate_long, gate_short) == []
    with task.final_tables():
        confirm = task.problem_set("confirm", 200)
    test_sets = task.problem_set("test", 200) + task.problem_set("test", 200, 60, 700) + task.problem_set("dev", 200)
    assert task.shared_questions(confirm, test_sets + gate_long + gate_short) == []
    assert task.shared_questions(gate_long + gate_short, task.problem_set("test", 200)) == []
    assert len({p.name for p in gate_long + gate_short}) == 400  # names say the length range


def test_old_sets_are_unchanged_and_their_overlap_is_as_documented():
    """``dev``/``test`` problems are what the committed numbers used; docs/evaluation.md states the
    overlap of the eval/rescue problems with the former PRM gate set (same seeds, 60-700 tokens)."""
    first = task.problem_set("test", 1)[0]
    assert (first.name, first.question, first.answer, first.thinking_length, len(first.steps)) == (
        "test:0", "a 8 b 4 c 6 d 5 e 1 find r2", 3, 467, 13)
    rescue, evals = task.problem_set("test", 100), task.problem_set("test", 200)
    old_gate = task.problem_set("test", 200, 60, 700)
    assert len(task.shared_questions(rescue, old_gate)) == 79
    assert len(task.shared_questions(evals, old_gate)) == 148
    assert len(task.shared_questions(evals, old_gate + task.problem_set("test", 200, 60, 400))) == 157


def test_gate_and_auroc_tools_read_the_gate_namespace(monkeypatch):
    """Every PRM gate / AUROC entry point draws its problems from ``gate`` (monkeypatched recorder)."""
    from trainers import testbed_prm, testbed_prm_order

    spaces = []
    real = task.problem_set

    def recording(name, n, *a, **kw):
        spaces.append(task.namespace(name))
        return real(name, n, *a, **kw)

    monkeypatch.setattr(task, "problem_set", recording)
    from data_pipeline.testbed.tokenizer import build_tokenizer
    from dynts.rescue import CallablePRM
    from eval.rescue.verifiers import testbed_step_verifier

    result = testbed_prm.scorer_gate(CallablePRM(testbed_step_verifier), 3, build_tokenizer())
    assert result["gate_steps"] > 0
    source = (ROOT / "trainers/testbed_prm.py").read_text() + (ROOT / "trainers/testbed_report.py").read_text()
    assert 'heldout("test"' not in source and "heldout(task.GATE" in source
    testbed_prm_order.order_heldout(task.GATE, 2, "repeat")
    assert spaces and set(spaces) == {task.GATE}


def _python_files():
    for package in SCANNED:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_training_gate_or_tuning_path_reads_confirm():
    """Static walk: outside the final-table commands no module names the ``confirm`` namespace (as a
    string or through ``task.CONFIRM``) or enters ``final_tables``; so at run time every other path
    that reaches ``problem_set('confirm', ...)`` raises (tested above)."""
    offenders = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "data_pipeline/testbed/task.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.name if isinstance(node, ast.alias) else None)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words = node.value.replace(",", " ").replace(":", " ").replace("=", " ").split()
                if task.CONFIRM in words and rel not in FINAL_TABLE_COMMANDS:
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif name in ("CONFIRM", "FINAL_ONLY") or (name == "final_tables" and rel not in FINAL_TABLE_COMMANDS):
                offenders.append(f"{rel}:{node.lineno}: {name}")
    assert offenders == [], "the confirm namespace is for the final tables only: " + "; ".join(offenders)


def test_rescue_bench_opts_in_with_final(monkeypatch, tmp_path):
    """``dynts rescue bench --final`` runs inside final_tables(); without it set=confirm is refused."""
    from eval.harness import benchmarks
    from eval.rescue import cli

    seen = []

    def fake_evaluate(config):
        seen.append(len(benchmarks.load_benchmark(config.benchmark).examples))
        return {}

    monkeypatch.setattr(cli, "evaluate", fake_evaluate)
    monkeypatch.setattr(cli, "summary_table", lambda summary: "")
    argv = ["bench", "--benchmark", "testbed:n=2,set=confirm", "--method", "window", "--out", str(tmp_path / "run")]
    with pytest.raises(ValueError, match="final"):
        cli.main(argv)
    assert not seen
    assert cli.main(argv + ["--final"]) == 0 and seen == [2]


def test_analysis_traces_opt_in_with_final(tmp_path):
    """``dynts analyze traces --final`` (the Pareto table's traces) may read set=confirm; without it the
    command refuses before loading anything, and the traces carry their family for the grader."""
    from eval.analyses import cli
    from eval.analyses.traces import load_traces

    argv = ["traces", "--source", "testbed", "--reference", "--family", "chain", "--set", "confirm", "--n", "2",
            "--min-think", "60", "--max-think", "200", "--out", str(tmp_path / "traces")]
    assert cli.main(argv) == 2 and not (tmp_path / "traces").exists()
    assert cli.main(argv + ["--final"]) == 0
    traces = load_traces(str(tmp_path / "traces"))
    assert len(traces) == 2 and set(traces["family"]) == {"chain"}
