"""What the final-set ledger enforces (eval/harness/ledger.py): its file is fixed to the checkout (no
environment variable moves it), a final read refuses an uncommitted tree and records the commit, the
methods of a namespace are frozen at its first read, each finished cell is on the line as it finishes
(a killed run's cells are on record), and final problems are drawn only through the ledger's handle."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.testbed import task
from eval.harness import ledger
from eval.harness.ledger import final_run, read_ledger
from eval.harness.ledger import ledger_path as real_ledger_path  # conftest patches the module's own per test
from eval.harness.ledger import revision as real_revision

ROOT = Path(__file__).resolve().parents[1]


def final_sets(*argv: str, methods=("m",), program: str = "pytest", **kw):
    return final_run(program, list(argv), enabled=True, methods=methods, **kw)


def test_no_environment_variable_moves_the_ledger(monkeypatch):
    monkeypatch.setenv("DYNTS_FINAL_LEDGER", "/tmp/elsewhere.jsonl")
    assert real_ledger_path() == ledger.LEDGER == ROOT / "reports" / "final-ledger.jsonl"
    for rel in ("eval/harness/ledger.py", "data_pipeline/testbed/task.py"):
        names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(ast.parse((ROOT / rel).read_text()))
                 if isinstance(n, (ast.Attribute, ast.Name))}
        assert not names & {"environ", "getenv", "putenv"}, rel


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_final_read_refuses_an_uncommitted_tree_and_records_the_commit(tmp_path, monkeypatch):
    """Tracked changes (staged or not) refuse the read, naming the files and the fix; the ledger file's own
    changes and untracked files do not; outside git the read is refused; a clean tree's line has its commit."""
    repo = tmp_path / "repo"
    (repo / "reports").mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    (repo / "b.py").write_text("y = 1\n")
    (repo / "reports" / "final-ledger.jsonl").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "start")
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 2\n")
    _git(repo, "add", "b.py")
    (repo / "reports" / "final-ledger.jsonl").write_text("{}\n")
    (repo / "scratch.py").write_text("untracked\n")
    head, changed = real_revision(repo)
    assert head == _git(repo, "rev-parse", "HEAD") and sorted(changed) == ["a.py", "b.py"]
    monkeypatch.setattr(ledger, "revision", lambda: real_revision(repo))
    with pytest.raises(task.FinalSetError, match=r"committed tree.*2 tracked file\(s\).*a\.py, b\.py.*Commit them first"):
        with final_sets():
            task.problem_set("final", 1)
    assert read_ledger() == []
    _git(repo, "commit", "-qam", "the change")
    with final_sets():
        task.problem_set("final", 1)
    (line,) = read_ledger()
    assert (line["git"], line["dirty"]) == (_git(repo, "rev-parse", "HEAD"), False)
    (tmp_path / "plain").mkdir()
    assert real_revision(tmp_path / "plain") == ("unknown", None)
    monkeypatch.setattr(ledger, "revision", lambda: real_revision(tmp_path / "plain"))
    with pytest.raises(task.FinalSetError, match="not a git checkout"):
        with final_sets():
            task.problem_set("confirm", 1)


def test_a_namespace_s_methods_are_frozen_at_its_first_read():
    """The first run of a program that reads a namespace in a family freezes its methods there: a later run
    (another range, ``--reread``) with a method outside the list is refused; another family, namespace or
    program has its own list."""
    with final_sets(methods=["a", "b"]):
        task.problem_set("final", 2, family="chain")
    with final_sets(methods=["b"]):  # a subset, another length range
        task.problem_set("final", 2, 60, 400, family="chain")
    for methods, kw in ((["a", "c"], {}), (["c"], {"reread": "again"})):
        with pytest.raises(task.FinalSetError, match=r"frozen at its first read.*adds 1: c.*dev/test"):
            with final_sets(methods=methods, **kw):
                task.problem_set("final", 2, 60, 700 if kw else 400, family="chain")
    assert len(read_ledger()) == 2  # refused reads write nothing
    with final_sets(methods=["c"]):
        task.problem_set("final", 2)  # the copy family: its own list
        task.problem_set("confirm", 2, family="chain")  # another namespace
    with final_sets(methods=["d"], program="dynts demo"):
        task.problem_set("final", 2, 60, 900, family="chain")
    lines = read_ledger()
    assert [line["methods"] for line in lines] == [["a", "b"], ["b"], ["c"], ["d"]]
    assert [line["program"] for line in lines] == ["pytest"] * 3 + ["dynts demo"]
    with pytest.raises(task.FinalSetError, match="adds 1: c"):
        with final_sets(methods=["c"]):
            task.problem_set("confirm", 1, 60, 400)  # copy's confirm, read by no line yet: passes ...
            task.problem_set("final", 1, 60, 500, family="chain")  # ... chain's final is ["a", "b"]


def test_lines_without_methods_freeze_nothing(final_ledger):
    """Lines written before the ledger recorded methods (the committed ``final`` reads) freeze no list: the
    next run's list is the frozen one."""
    ledger.append({"run": "old", "program": "pytest", "sets": [{"set": "final", "n": 2, "family": "copy",
                                                                  "min_think": 150, "max_think": 900}], "cells": []})
    with final_sets(methods=["x"]):
        task.problem_set("final", 1, 60, 400)
    with pytest.raises(task.FinalSetError, match="adds 1: y"):
        with final_sets(methods=["y"]):
            task.problem_set("final", 1, 60, 500)


def test_a_final_read_needs_declared_methods_and_cells_need_a_declared_method():
    with pytest.raises(task.FinalSetError, match=r"declared no method.*methods="):
        with final_sets(methods=()):
            task.problem_set("final", 1)
    with pytest.raises(ValueError, match=r"method 'z' is not among this final run's declared methods \(m\)"):
        with final_sets() as run:
            task.problem_set("final", 1)
            run.finished_cell("cell", "z")
    (line,) = read_ledger()
    assert line["status"] == "failed" and line["cells"] == []


def test_each_cell_is_on_the_line_as_it_finishes(monkeypatch, tmp_path):
    """``dynts eval --final``: a cell is on the ledger line the moment it finishes; a run that fails after two
    cells leaves both on its (failed) line."""
    from eval.harness import benchmarks, cli, runner

    seen = []

    def fake_run(config, after_cell=None, **kw):
        benchmarks.load_benchmark(config.benchmarks[0])
        for key in ("cell-1", "cell-2"):
            after_cell({"key": key, "method": {"name": "window", "options": {}, "label": "window"}})
            seen.append(read_ledger()[0]["cells"])
        raise RuntimeError("the machine went away")

    monkeypatch.setattr(runner, "run", fake_run)
    argv = ["--model", "testbed", "--benchmark", "testbed:n=2,family=chain,set=final", "--method", "full,window",
            "--budget", "64", "--k", "1", "--run-dir", str(tmp_path / "run"), "--no-progress", "--final"]
    with pytest.raises(RuntimeError):
        cli.main(argv)
    assert seen == [["cell-1"], ["cell-1", "cell-2"]]
    (line,) = read_ledger()
    assert line["status"] == "failed" and line["cells"] == ["cell-1", "cell-2"]
    assert line["program"] == "dynts eval" and line["methods"] == ["full", "window"]


KILLED = """
import sys, time
from pathlib import Path
from data_pipeline.testbed import task
from eval.harness import ledger
ledger.ledger_path = lambda: Path(sys.argv[1])  # in this process only, as the tests' fixture does
ledger.revision = lambda root=None: ("c0ffee", [])
with ledger.final_run("dynts eval", ["--final"], enabled=True, methods=["m"]) as run:
    task.problem_set("final", 2, family="chain")
    run.finished_cell("cell-1", "m")
    run.finished_cell("cell-2", "m")
    print("two cells", flush=True)
    time.sleep(120)
"""


def test_a_run_killed_by_sigkill_leaves_its_finished_cells(tmp_path):
    path = tmp_path / "ledger.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "two cells", proc.stderr.read()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    (line,) = read_ledger(path)
    assert line["status"] == "running" and line["cells"] == ["cell-1", "cell-2"] and line["git"] == "c0ffee"


@pytest.mark.parametrize("seed,family", [("final:150-900:0", "copy"), ("final:150-900:0", "chain"),
                                         ("confirm:60-400:3", "copy"), ("chain|final:150-900:0", "copy"),
                                         ("final", "copy")])
def test_final_problems_are_not_drawn_directly(seed, family):
    """``make_problem`` refuses a final-only namespace's seed (the copy family's or another family's stream),
    inside the final tables too: ``problem_set`` inside them, through the ledger's handle, is the only way."""
    with pytest.raises(task.FinalSetError, match="final-only namespace.*problem_set inside the final tables"):
        task.make_problem(seed, family=family)
    with final_sets():
        with pytest.raises(task.FinalSetError, match="final-only"):
            task.make_problem(seed, family=family)
        drawn = task.problem_set("final", 1, family="chain")[0]
    assert drawn.name == "final:150-900:0" and task.make_problem("finals:0").name == "finals:0"
