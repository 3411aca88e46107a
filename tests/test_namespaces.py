"""The testbed's problem namespaces: ``confirm`` and ``sealed`` are read by the final tables only (and
every read is logged in the final-set ledger), ``gate`` serves the PRM gates and AUROC tools, all give
other problems for other length ranges, and ``dev``/``test`` still generate the problems the
committed numbers were measured on."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from data_pipeline.testbed import task

ROOT = Path(__file__).resolve().parents[1]
# the commands that produce final tables: the only modules that may name a final-only set, each through
# eval.harness.ledger.final_run, the only module that enters task.final_tables()
FINAL_TABLE_COMMANDS = {"eval/harness/cli.py", "eval/harness/demo.py", "eval/rescue/cli.py", "eval/analyses/cli.py"}
LEDGER_MODULE = "eval/harness/ledger.py"
SCANNED = ("dynts", "trainers", "eval", "data_pipeline", "scripts")


@pytest.mark.parametrize("space", task.FINAL_ONLY)
def test_final_only_sets_are_refused_outside_the_final_tables(space):
    with pytest.raises(ValueError, match=r"set=dev.*--final"):
        task.problem_set(space, 3)
    with pytest.raises(ValueError, match=space):
        task.problem_set(f"{space}:chain", 3, family="chain")
    with task.final_tables() as reads:
        assert len(task.problem_set(space, 2, family="chain")) == 2
    assert reads == [{"set": space, "n": 2, "family": "chain", "min_think": 150, "max_think": 900}]
    with pytest.raises(ValueError):
        task.problem_set(space, 3)


def test_sealed_is_fresh():
    """``sealed`` draws its own seeds, so it shares a question with another set only by chance (the same
    five operands and asked key): measured at the planned sizes (copy 200, chain 500) against 200
    problems of ``confirm``, ``dev``, ``test`` and ``gate`` (150-900 and 60-700), one chain problem of 500
    repeats a ``gate`` question (gate serves the PRM tools, not the LRM's choices); docs/evaluation.md
    states it."""
    for family, n, expected in (("copy", 200, {}), ("chain", 500, {"gate": ["sealed:150-900:28"]})):
        with task.final_tables():
            sealed = task.problem_set("sealed", n, family=family)
            confirm = task.problem_set("confirm", 200, family=family)
        others = {"confirm": confirm, "dev": task.problem_set("dev", 200, family=family),
                  "test": task.problem_set("test", 200, family=family),
                  "gate": task.problem_set("gate", 200, family=family) + task.problem_set("gate", 200, 60, 700, family=family)}
        shared = {name: task.shared_questions(sealed, ps) for name, ps in others.items()}
        assert {k: v for k, v in shared.items() if v} == expected, family


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


def test_eval_and_demo_opt_in_with_final(monkeypatch, tmp_path, final_ledger):
    """``dynts eval --final`` / ``dynts demo --final`` run inside final_tables(); without it a run
    on set=confirm is refused before anything is generated; the final run writes one ledger line."""
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
    assert not final_ledger.exists()  # nothing read, nothing logged
    assert cli.main(argv + ["--final"]) == 0 and seen == [2]
    from eval.harness.ledger import read_ledger, revision

    (line,) = read_ledger()
    assert line["command"].startswith("dynts eval --model testbed --benchmark testbed:n=2,set=confirm") and line["command"].endswith("--final")
    assert line["sets"] == [{"set": "confirm", "n": 2, "family": "copy", "min_think": 150, "max_think": 900}]
    assert line["status"] == "finished" and line["git"] == revision()[0] and line["utc"].endswith("Z")
    assert line["out"] == str(tmp_path / "run") and line["cells"] == []


def test_ledger_logs_failed_final_runs_and_nothing_else(final_ledger):
    from eval.harness.ledger import final_run, read_ledger

    with final_run("dynts eval", ["--final"], enabled=False) as entry:
        with pytest.raises(ValueError):
            task.problem_set("sealed", 1)
    with final_run("dynts eval", ["--final"], enabled=True):
        task.problem_set("dev", 1)  # no final set read: no line
    assert read_ledger() == []
    with pytest.raises(RuntimeError):
        with final_run("dynts eval", ["--final", "--benchmark", "testbed:set=sealed"], enabled=True, out="runs/x") as entry:
            task.problem_set("sealed", 3, family="chain")
            entry["cells"].append("cell-a")
            raise RuntimeError("killed")
    with final_run("dynts demo", ["--final"], enabled=True) as entry:
        task.problem_set("confirm", 1)
    first, second = read_ledger()
    assert first["status"] == "failed" and first["cells"] == ["cell-a"] and first["sets"][0]["set"] == "sealed"
    assert first["command"] == "dynts eval --final --benchmark testbed:set=sealed" and second["command"] == "dynts demo --final"
    assert final_ledger.read_text().count("\n") == 2


def test_ledger_logs_a_final_run_stopped_by_sigterm(final_ledger):
    """``kill`` (SIGTERM) during a final run still writes its line, marked failed; the handler is restored."""
    import os
    import signal

    from eval.harness.ledger import final_run, read_ledger

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        with final_run("dynts eval", ["--final"], enabled=True, out="runs/x") as entry:
            task.problem_set("sealed", 2)
            entry["cells"].append("cell-a")
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM
    (line,) = read_ledger()
    assert line["status"] == "failed" and line["cells"] == ["cell-a"] and line["sets"][0]["set"] == "sealed"
    assert signal.getsignal(signal.SIGTERM) == before


def test_ledger_keeps_the_revision_the_run_started_from(final_ledger, monkeypatch):
    """A commit made while a final run reads (hours, on CPU) does not move the line's ``git``/``dirty``."""
    from eval.harness import ledger

    monkeypatch.setattr(ledger, "revision", lambda: ("start", False))
    with ledger.final_run("dynts eval", ["--final"], enabled=True):
        task.problem_set("sealed", 1)
        monkeypatch.setattr(ledger, "revision", lambda: ("later", True))
    (line,) = ledger.read_ledger()
    assert (line["git"], line["dirty"]) == ("start", False)


def test_every_final_command_goes_through_the_ledger():
    """Each final-table command names ``final_run`` (so its ``--final`` work is logged); the committed
    ledger parses."""
    from eval.harness.ledger import LEDGER, read_ledger

    for rel in sorted(FINAL_TABLE_COMMANDS):
        assert "final_run(" in (ROOT / rel).read_text(), rel
    for line in read_ledger(LEDGER):
        assert {"utc", "command", "git", "sets", "cells", "status"} <= set(line)


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
                if set(task.FINAL_ONLY) & set(words) and rel not in FINAL_TABLE_COMMANDS:
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif name in ("CONFIRM", "SEALED", "FINAL_ONLY") or (name == "final_tables" and rel != LEDGER_MODULE):
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
    from eval.harness.ledger import read_ledger

    (line,) = read_ledger()  # the final run's ledger line
    assert line["command"].startswith("dynts rescue bench --benchmark testbed:n=2,set=confirm") and line["status"] == "finished"
    assert line["sets"][0]["set"] == "confirm" and line["out"] == str(tmp_path / "run")


def test_analysis_traces_opt_in_with_final(tmp_path):
    """``dynts analyze traces --final`` (the Pareto table's traces) may read set=confirm; without it the
    command refuses before loading anything, and the traces carry their family for the grader."""
    from eval.analyses import cli
    from eval.analyses.traces import load_traces

    argv = ["traces", "--source", "testbed", "--reference", "--family", "chain", "--set", "confirm", "--n", "2",
            "--min-think", "60", "--max-think", "200", "--out", str(tmp_path / "traces")]
    assert cli.main(argv) == 2 and not (tmp_path / "traces").exists()
    assert cli.main(argv + ["--final"]) == 0
    from eval.harness.ledger import read_ledger

    (line,) = read_ledger()
    assert line["command"].startswith("dynts analyze traces --source testbed") and line["sets"][0]["family"] == "chain"
    traces = load_traces(str(tmp_path / "traces"))
    assert len(traces) == 2 and set(traces["family"]) == {"chain"}
