"""The testbed's problem namespaces: ``confirm`` and ``final`` are read by the final tables only, through
the final-set ledger alone (every read is logged, ``final`` is read once), ``sealed`` is retired,
``gate`` serves the PRM gates and AUROC tools, all give other problems for other length ranges, and
``dev``/``test`` still generate the problems the committed numbers were measured on."""
from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import pytest

from data_pipeline.testbed import task
from eval.harness.ledger import final_run, read_ledger

ROOT = Path(__file__).resolve().parents[1]
# the commands that produce final tables: the only modules that may name a final-only set, each through
# eval.harness.ledger.final_run, the only module that enters task.final_tables() (with the handle only it creates)
FINAL_TABLE_COMMANDS = {"eval/harness/cli.py", "eval/harness/demo.py", "eval/rescue/cli.py", "eval/analyses/cli.py"}
LEDGER_MODULE = "eval/harness/ledger.py"
SCANNED = ("dynts", "trainers", "eval", "data_pipeline", "scripts")


# Where the fresh ``final`` set shares a question with another set (test_final_is_fresh): (family, n, overlaps).
FINAL_SHARED = (("copy", 200, {}), ("chain", 500, {}))
# sha256 over (name, operands, asked, steps, tokens, roles, critical_positions) of the first 20 ``final``
# problems of each family (150-900 thinking tokens), pinned when the namespace was made: the set read
# once must not move under a generator change before it is read.
FINAL_DIGEST = "7a5d7f0b4810b3c3d36c5daf8b89e1e7e8cc92f69f61c220768aaa5f91d5b613"


def final_sets(*argv: str, methods=("m",), **kw):
    """The tests' one way into the final-only sets: a final run that logs to the test's own ledger
    (conftest's ``final_ledger`` patches ``ledger_path`` to a tmp file, in-process)."""
    return final_run("pytest", list(argv), enabled=True, methods=methods, **kw)


@pytest.mark.parametrize("space", task.FINAL_ONLY)
def test_final_only_sets_are_refused_outside_the_final_tables(space):
    with pytest.raises(ValueError, match=r"set=dev.*--final"):
        task.problem_set(space, 3)
    with pytest.raises(ValueError, match=space):
        task.problem_set(f"{space}:chain", 3, family="chain")
    with final_sets():
        assert len(task.problem_set(space, 2, family="chain")) == 2
    (line,) = read_ledger()
    assert line["sets"] == [{"set": space, "n": 2, "family": "chain", "min_think": 150, "max_think": 900}]
    with pytest.raises(ValueError):
        task.problem_set(space, 3)


def _sealed(n: int, family: str) -> list[task.Problem]:
    """The retired ``sealed`` set's problems, drawn from their seeds (``problem_set`` refuses the namespace)."""
    return [task.make_problem(f"sealed:150-900:{i}", name=f"sealed:150-900:{i}", family=family) for i in range(n)]


def test_final_is_fresh():
    """``final`` draws its own seeds, so it shares a question with another set only by chance (the same
    five operands and asked key): measured at the planned sizes (copy 200, chain 500) against 200
    problems of ``confirm``, ``dev``, ``test``, ``val``, ``ptest`` and ``gate`` (150-900 and 60-700), and
    the retired ``sealed`` set at its read sizes; docs/evaluation.md states the result."""
    for family, n, expected in FINAL_SHARED:
        with final_sets():
            final = task.problem_set("final", n, family=family)
            confirm = task.problem_set("confirm", 200, family=family)
        others = {"confirm": confirm, "sealed": _sealed(n, family),
                  **{name: task.problem_set(name, 200, family=family) for name in ("dev", "test", "val", "ptest")},
                  "gate": task.problem_set("gate", 200, family=family) + task.problem_set("gate", 200, 60, 700, family=family)}
        shared = {name: task.shared_questions(final, ps) for name, ps in others.items()}
        assert {k: v for k, v in shared.items() if v} == expected, family
        texts = {p.text for p in final}
        assert all(not texts & {p.text for p in ps} for ps in others.values()), family  # no problem repeats


def test_final_problems_are_pinned():
    h = hashlib.sha256()
    with final_sets():
        problems = task.problem_set("final", 20) + task.problem_set("final", 20, family="chain")
    for p in problems:
        h.update(repr((p.name, p.operands, p.asked, p.steps, p.tokens, p.roles, p.critical_positions)).encode())
    assert h.hexdigest() == FINAL_DIGEST
    assert [p.name for p in problems[:2]] == ["final:150-900:0", "final:150-900:1"]
    assert {p.family for p in problems[20:]} == {"chain"} and problems[0].question != problems[20].question


def test_sealed_is_retired_and_says_why():
    """``sealed`` is refused everywhere, inside a final run too, with the reason and the namespace
    that replaces it; the committed ledger holds its retirement line (written by ``ledger.retire``)."""
    from eval.harness.benchmarks import load_benchmark
    from eval.harness.ledger import LEDGER

    for call in (lambda: task.problem_set("sealed", 1), lambda: task.problem_set("sealed:x", 1, family="chain"),
                 lambda: load_benchmark("testbed:n=2,set=sealed")):
        with pytest.raises(task.FinalSetError, match=r"retired.*untuned, token-level baselines.*one seed.*'final'"):
            call()
    with final_sets():
        with pytest.raises(task.FinalSetError, match="retired"):
            task.problem_set("sealed", 1)
    assert read_ledger() == []  # refused before anything was read: no line
    for space in task.RETIRED:
        lines = [line for line in read_ledger(LEDGER) if line.get("status") == "retired" and line.get("namespace") == space]
        assert len(lines) == 1, space
        assert lines[0]["replaced_by"] == task.FINAL and "untuned" in lines[0]["why"] and "seed" in lines[0]["why"]


def test_retire_writes_one_line(final_ledger):
    from eval.harness import ledger

    assert ledger.main(["retire", "sealed", "--why", "baselines untuned", "--replaced-by", "final"]) == 0
    (line,) = read_ledger()
    assert (line["status"], line["namespace"], line["why"], line["replaced_by"]) == ("retired", "sealed", "baselines untuned", "final")
    assert line["command"].startswith("python -m eval.harness.ledger retire sealed") and line["sets"] == []
    assert ledger.main(["retire", "sealed", "--why", "again"]) == 2  # one line per namespace
    assert ledger.main(["retire", "confirm", "--why", "x"]) == 2  # not retired in task.RETIRED
    with pytest.raises(ValueError, match="why"):
        ledger.retire("sealed", "  ", "final", path=final_ledger.with_name("other.jsonl"))
    assert len(read_ledger()) == 1
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "eval.harness.ledger", "retire", "sealed", "--why", "again"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # the module as __main__ defines its handle
    assert run.returncode == 2 and "already has its retirement line" in run.stderr, run.stderr


def test_final_tables_cannot_be_entered_without_the_ledger():
    """The ledger is the only door: ``final_tables`` wants the handle only ``final_run`` creates (and
    that handle writes the line); a handle class defined elsewhere is refused when it is defined."""
    for handle in ((), (None,), (object(),)):
        with pytest.raises(task.FinalSetError, match=r"final_tables\(\) refused.*eval\.harness\.ledger\.final_run"):
            with task.final_tables(*handle):
                pass
    with pytest.raises(TypeError, match="final_run creates"):
        task.LedgerHandle()
    with pytest.raises(TypeError, match="only eval.harness.ledger"):
        type("Fake", (task.LedgerHandle,), {"admit": lambda self, read: None})
    with pytest.raises(task.FinalSetError, match="final tables"):
        task.problem_set("final", 1)
    assert read_ledger() == []


def test_the_line_is_written_at_the_first_read(final_ledger):
    """A final run's line exists from its first read on (``running``), so a run killed without a
    chance to clean up (SIGKILL) still leaves it; the exit makes it ``finished``."""
    with final_sets(out="runs/x") as run:
        assert read_ledger() == []
        task.problem_set("final", 2, family="chain")
        (line,) = read_ledger()
        assert line["status"] == "running" and line["sets"][0]["set"] == "final"
        run.finished_cell("cell-a", "m")
    (line,) = read_ledger()
    assert line["status"] == "finished" and line["cells"] == ["cell-a"] and line["out"] == "runs/x"


def test_final_is_read_once(final_ledger):
    """A second final run over a ``final`` cell (set, family, length range; any n, since problem ``i`` is
    the same whatever ``n`` is) is refused before a problem is drawn unless it says why; the reason and
    the earlier runs go to its line. Other cells, reads within one run and ``confirm`` are not refused."""
    with final_sets():
        first = task.problem_set("final", 3, family="chain")
        assert task.problem_set("final", 3, family="chain") == first  # the same run may draw it again
        task.problem_set("confirm", 2)
    for n in (3, 1, 10):
        with pytest.raises(task.FinalSetError, match=r"read once.*--reread WHY"):
            with final_sets("--again"):
                task.problem_set("final", n, family="chain")
    assert len(read_ledger()) == 1  # refused reads write nothing
    with final_sets():  # another family, another length range, confirm again: new cells
        task.problem_set("final", 3)
        task.problem_set("final", 3, 60, 400, family="chain")
        task.problem_set("confirm", 2)
    with final_sets("--reread", "the first run's records were lost", reread="the first run's records were lost"):
        assert task.problem_set("final", 3, family="chain") == first
    lines = read_ledger()
    assert len(lines) == 3 and "reread" not in lines[1]
    assert lines[2]["reread"] == "the first run's records were lost" and lines[2]["reread_of"] == [lines[0]["run"]]
    with pytest.raises(ValueError, match="reason"):
        with final_sets(reread=" "):
            pass
    with pytest.raises(ValueError, match="--final"):
        with final_run("pytest", [], enabled=False, reread="why"):
            pass


def test_reread_through_the_commands(monkeypatch, tmp_path):
    """``dynts eval --final --reread WHY``: the flag reaches the ledger; without it the second read is refused."""
    from eval.harness import benchmarks, cli, runner

    def fake_run(config, **kw):
        benchmarks.load_benchmark(config.benchmarks[0])  # the read the ledger admits or refuses
        return []

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr("eval.harness.report.markdown_table", lambda results, *a, **k: "")
    argv = ["--model", "testbed", "--benchmark", "testbed:n=2,family=chain,set=final", "--method", "full", "--k", "1",
            "--run-dir", str(tmp_path / "run"), "--no-progress", "--final"]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 2  # read once
    assert cli.main(argv[:-1] + ["--reread", "why"]) == 2  # --reread without --final
    assert cli.main(argv + ["--reread", "a second look"]) == 0
    first, second = read_ledger()
    assert second["reread"] == "a second look" and second["reread_of"] == [first["run"]]


def test_confirm_is_refused_outside_the_final_tables():
    with pytest.raises(ValueError, match=r"set=dev.*--final"):
        task.problem_set("confirm", 3)
    with pytest.raises(ValueError, match="confirm"):
        task.problem_set("confirm:chain", 3)  # the whole namespace
    with final_sets():
        problems = task.problem_set("confirm", 3)
    assert len(problems) == 3
    with pytest.raises(ValueError):  # the permission ends with the block
        task.problem_set("confirm", 3)


def test_confirm_through_the_benchmark_loader():
    from eval.harness.benchmarks import load_benchmark

    with pytest.raises(ValueError, match="final"):
        load_benchmark("testbed:n=2,set=confirm")
    with final_sets():
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
    from eval.harness.ledger import revision

    (line,) = read_ledger()
    assert line["command"].startswith("dynts eval --model testbed --benchmark testbed:n=2,set=confirm") and line["command"].endswith("--final")
    assert line["sets"] == [{"set": "confirm", "n": 2, "family": "copy", "min_think": 150, "max_think": 900}]
    assert line["status"] == "finished" and line["git"] == revision()[0] and line["utc"].endswith("Z")
    assert line["out"] == str(tmp_path / "run") and line["cells"] == []


def test_ledger_logs_failed_final_runs_and_nothing_else(final_ledger):
    with final_run("dynts eval", ["--final"], enabled=False) as run:
        with pytest.raises(ValueError):
            task.problem_set("final", 1)
        run.finished_cell("cell-x", "anything")  # records nothing
    with final_run("dynts eval", ["--final"], enabled=True, methods=["m"]):
        task.problem_set("dev", 1)  # no final set read: no line
    assert read_ledger() == []
    with pytest.raises(RuntimeError):
        with final_run("dynts eval", ["--final", "--benchmark", "testbed:set=final"], enabled=True, out="runs/x",
                       methods=["m"]) as run:
            task.problem_set("final", 3, family="chain")
            run.finished_cell("cell-a", "m")
            raise RuntimeError("killed")
    with final_run("dynts demo", ["--final"], enabled=True, methods=["m"]):
        task.problem_set("confirm", 1)
    first, second = read_ledger()
    assert first["status"] == "failed" and first["cells"] == ["cell-a"] and first["sets"][0]["set"] == "final"
    assert first["command"] == "dynts eval --final --benchmark testbed:set=final" and second["command"] == "dynts demo --final"
    assert final_ledger.read_text().count("\n") == 2


def test_ledger_logs_a_final_run_stopped_by_sigterm(final_ledger):
    """``kill`` (SIGTERM) during a final run still writes its line, marked failed; the handler is restored."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        with final_run("dynts eval", ["--final"], enabled=True, out="runs/x", methods=["m"]) as run:
            task.problem_set("final", 2)
            run.finished_cell("cell-a", "m")
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM
    (line,) = read_ledger()
    assert line["status"] == "failed" and line["cells"] == ["cell-a"] and line["sets"][0]["set"] == "final"
    assert signal.getsignal(signal.SIGTERM) == before


def test_ledger_keeps_the_revision_the_run_started_from(final_ledger, monkeypatch):
    """A commit made while a final run reads (hours, on CPU) does not move the line's ``git``/``dirty``."""
    from eval.harness import ledger

    monkeypatch.setattr(ledger, "revision", lambda: ("start", []))
    with ledger.final_run("dynts eval", ["--final"], enabled=True, methods=["m"]):
        task.problem_set("final", 1)
        monkeypatch.setattr(ledger, "revision", lambda: ("later", ["x.py"]))
    (line,) = ledger.read_ledger()
    assert (line["git"], line["dirty"]) == ("start", False)


def test_every_final_command_goes_through_the_ledger():
    """Each final-table command names ``final_run`` (so its ``--final`` work is logged); the committed
    ledger parses."""
    from eval.harness.ledger import LEDGER

    for rel in sorted(FINAL_TABLE_COMMANDS):
        assert "final_run(" in (ROOT / rel).read_text(), rel
        assert "reread=" in (ROOT / rel).read_text(), rel  # each passes --reread to the ledger
    for line in read_ledger(LEDGER):
        assert {"utc", "command", "git", "sets", "cells", "status"} <= set(line)


def test_new_namespaces_differ_across_lengths_and_from_the_old_sets():
    gate_long, gate_short = task.problem_set("gate", 200, 60, 700), task.problem_set("gate", 200, 60, 400)
    assert task.shared_questions(gate_long, gate_short) == []
    with final_sets():
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


# Final-only or retired namespaces that are also English words (``final``): a string names one only as a
# set reference (the whole string, ``final:...``, ``set=final``, ``--set final``, ``testbed:final:...``).
PROSE_NAMES = {task.FINAL}
# What only task.py and the ledger may name: the constants, the door and its key.
DOOR_NAMES = ("CONFIRM", "FINAL", "SEALED", "FINAL_ONLY", "READ_ONCE", "RETIRED", "final_tables", "LedgerHandle", "_FINAL_DOOR",
              "_make_problem")


def names_a_final_set(text: str) -> bool:
    words = set(text.replace(",", " ").replace(":", " ").replace("=", " ").split())
    if ((set(task.FINAL_ONLY) | set(task.RETIRED)) - PROSE_NAMES) & words:
        return True
    return any(re.search(rf"^\s*{n}\s*(:|$)|\bset\s*=\s*{n}\b|--set[\s=]+{n}\b|\btestbed:{n}\b", text)
               for n in PROSE_NAMES)


def test_the_scan_tells_a_set_from_prose():
    for text in ("confirm", "set=confirm", "sealed", "final", "final:chain", "testbed:n=2,set=final", "--set final",
                 "testbed:final:100:chain", " set = final"):
        assert names_a_final_set(text), text
    for text in ("the final answer", "--final", "final hidden states", "this run produces a final table", "finally"):
        assert not names_a_final_set(text), text


def test_no_training_gate_or_tuning_path_reads_confirm():
    """Static walk: outside the final-table commands no module names a final-only or retired namespace
    (as a string or through ``task.CONFIRM`` / ``task.FINAL`` ...), and outside the ledger none names
    ``final_tables`` or its key ``LedgerHandle``; so at run time every other path that reaches
    ``problem_set('confirm', ...)`` or ``problem_set('final', ...)`` raises (tested above)."""
    offenders = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "data_pipeline/testbed/task.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.name if isinstance(node, ast.alias) else None)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if names_a_final_set(node.value) and rel not in FINAL_TABLE_COMMANDS | {LEDGER_MODULE}:
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif name in DOOR_NAMES and rel != LEDGER_MODULE:
                offenders.append(f"{rel}:{node.lineno}: {name}")
    assert offenders == [], "the final-only sets are for the final tables only: " + "; ".join(offenders)


def test_rescue_bench_opts_in_with_final(monkeypatch, tmp_path):
    """``dynts rescue bench --final`` runs inside final_tables(); without it set=confirm is refused."""
    from eval.harness import benchmarks
    from eval.rescue import cli

    seen = []

    def fake_evaluate(config, after_cell=None):
        seen.append(len(benchmarks.load_benchmark(config.benchmark).examples))
        after_cell("evict-window-0123456789", "evict-window")
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
    assert line["program"] == "dynts rescue" and "evict-window" in line["methods"]
    assert line["cells"] == ["evict-window-0123456789"]


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
