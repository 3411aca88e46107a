"""The queues' ``carry`` steps: what a started job has done is copied where a commit keeps it.

Each script runs in a scratch copy of the repository's layout (its scripts and configs, this venv), so the
real ``runs/`` and ``checkpoints/`` are never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # this venv, where the scripts look for it
    return tmp_path


def _bash(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", *args], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _eval_run(run: Path) -> None:
    for sub in ("cells", "records"):
        (run / sub).mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "cells" / "done.json").write_text('{"pass@1": 0.5}')
    (run / "records" / "done.json").write_text("{}")
    (run / "cells" / "open.partial.jsonl").write_text('{"batch": 0}\n')


def test_fair_seeds_carry_saves_unexported_trainings_and_unfinished_dev_tables(scratch):
    ckpt = scratch / "runs" / "testbed-chain-lrm-fair-s2" / "ckpt"
    ckpt.mkdir(parents=True)
    torch.save({"global_step": 12, "state_dict": {"w": torch.ones(2)}}, ckpt / "last.ckpt")
    _eval_run(scratch / "runs" / "copy-dev-fair-scratch-s1")
    _eval_run(scratch / "runs" / "chain-dev-fair-s1")
    (scratch / "reports" / "chain-dev-fair-s1").mkdir(parents=True)
    (scratch / "reports" / "chain-dev-fair-s1" / "results.json").write_text("[]")  # written: nothing to carry

    out = _bash(scratch, "scripts/run_fair_seeds.sh", "carry")
    log = (scratch / "runs" / "fair-seeds.log").read_text()
    assert out.returncode == 0, log
    point = scratch / "checkpoints" / "resume" / "testbed-chain-lrm-fair-s2"
    assert (point / "resume.json").is_file() and (point / "resume.safetensors").is_file()
    assert "saved step 12" in log
    carried = scratch / "reports" / "copy-dev-fair-scratch-s1" / "carried"
    assert sorted(p.relative_to(carried).as_posix() for p in carried.rglob("*") if p.is_file()) == [
        "cells/done.json", "records/done.json", "run.json"]  # finished cells only
    assert not (scratch / "reports" / "chain-dev-fair-s1" / "carried").exists()


def test_fair_seeds_carry_fails_loudly_when_a_point_cannot_be_saved(scratch):
    ckpt = scratch / "runs" / "testbed-lrm-fair-scratch-s3" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "last.ckpt").write_bytes(b"not a checkpoint")
    assert _bash(scratch, "scripts/run_fair_seeds.sh", "carry").returncode != 0
    log = (scratch / "runs" / "fair-seeds.log").read_text()
    assert "carry runs/testbed-lrm-fair-scratch-s3 FAILED" in log and "finished: carry" not in log


def test_final_tables_carry_copies_an_unfinished_tables_cells(scratch):
    _eval_run(scratch / "runs" / "final-chain")
    out = _bash(scratch, "scripts/run_final_tables.sh", "carry")
    assert out.returncode == 0, out.stderr
    carried = scratch / "reports" / "final-chain" / "carried"
    assert (carried / "cells" / "done.json").is_file() and not (carried / "cells" / "open.partial.jsonl").exists()
    assert "1 finished cells" in out.stdout and not (scratch / "reports" / "final-copy").exists()


def test_final_tables_continue_a_started_run_with_reread_even_before_its_first_cell(scratch):
    """A run dir holding ``run.json`` was started by a run that read ``final`` (its ledger line), finished cells or
    not: the table continues it with ``--reread`` saying so; a table never started reads without it."""
    family = "chain"
    need = [f"reports/tuning/{family}-fair/choices.json", f"reports/tuning/{family}-fair-sepllm/choices.json",
            f"reports/{family}-dev-fair-s1/results.json"]
    for path in need:
        (scratch / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, scratch / path)
    for name in (f"testbed-{family}-fair-s1-lrm", f"testbed-{family}-fair-s1-predictor"):
        shutil.copytree(ROOT / "checkpoints" / name, scratch / "checkpoints" / name)
    git = lambda *a: subprocess.run(["git", *a], cwd=scratch, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("add", "reports", "checkpoints")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "choices")

    fresh = _bash(scratch, "scripts/run_final_tables.sh", "--dry-run", family)
    assert fresh.returncode == 0, fresh.stderr
    assert "--final --benchmark" in fresh.stdout and "--reread" not in fresh.stdout
    (scratch / "runs" / f"final-{family}").mkdir(parents=True)
    (scratch / "runs" / f"final-{family}" / "run.json").write_text("{}")  # started, stopped before any cell
    started = _bash(scratch, "scripts/run_final_tables.sh", "--dry-run", family)
    assert started.returncode == 0, started.stderr
    assert "--final --reread resume\\ runs/final-chain" in started.stdout
    assert "--workers 1 " in started.stdout
    two = _bash(scratch, "scripts/run_final_tables.sh", "--dry-run", "--workers", "2", family)
    assert two.returncode == 0 and "--workers 2 " in two.stdout, two.stderr
    bad = _bash(scratch, "scripts/run_final_tables.sh", "--dry-run", "--workers", family)
    assert bad.returncode == 2 and "--workers takes a count >= 1" in bad.stderr


def test_a_carried_run_refills_only_an_unstarted_run_dir(tmp_path):
    from eval.harness import carried

    _eval_run(tmp_path / "run")
    assert carried.save(tmp_path / "run", tmp_path / "carried") == 1
    assert carried.restore(tmp_path / "carried", tmp_path / "fresh")
    assert sorted(p.relative_to(tmp_path / "fresh").as_posix() for p in (tmp_path / "fresh").rglob("*") if p.is_file()) == [
        "cells/done.json", "records/done.json", "run.json"]
    (tmp_path / "run" / "cells" / "later.json").write_text("{}")
    assert not carried.restore(tmp_path / "carried", tmp_path / "run")  # started: left as it is
    assert (tmp_path / "run" / "cells" / "later.json").is_file()
    with pytest.raises(FileNotFoundError, match="run.json"):
        carried.save(tmp_path / "nowhere", tmp_path / "c2")


def test_final_tables_refuse_dry_in_the_environment(scratch):
    """``DRY=1`` is not the dry-run flag: the script stops before it reads anything, and says to pass ``--dry-run``
    (each run reads the final set once, a ledger line)."""
    env_dry = subprocess.run(["bash", "scripts/run_final_tables.sh", "copy"], cwd=scratch, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), "DRY": "1"})
    assert env_dry.returncode == 2 and "pass --dry-run" in env_dry.stderr
    assert not (scratch / "runs").exists() and not (scratch / "reports").exists()


def test_verdicts_write_each_family_whose_three_tables_exist(scratch):
    """``verdicts`` writes a family's per-seed verdicts once its three dev tables are written and marks the other one
    pending (it is rerun when that family's last table lands)."""
    for seed, source in (("s1", "s1"), ("s2", "s2"), ("s3", "s2")):  # the copy family: three written tables
        shutil.copytree(ROOT / "reports" / f"copy-dev-fair-scratch-{source}", scratch / "reports" / f"copy-dev-fair-scratch-{seed}")
    shutil.copytree(ROOT / "reports" / "chain-dev-fair-s1", scratch / "reports" / "chain-dev-fair-s1")  # chain: one of three
    out = _bash(scratch, "scripts/run_fair_seeds.sh", "verdicts")
    log = (scratch / "runs" / "fair-seeds.log").read_text()
    assert out.returncode == 0, log
    text = (scratch / "reports" / "seed-verdicts.md").read_text()
    assert "### chain-dev-fair: pending (no reports/chain-dev-fair-s2 reports/chain-dev-fair-s3 yet)" in text
    copy = text.split("### copy-dev-fair-scratch (", 1)[1]
    assert "| s3 |" in copy and "DynTS leads the best baseline at every budget of every seed:" in copy
    assert "1 of 2 families complete" in log


def test_a_dev_table_waits_for_a_core_while_two_heavy_jobs_run(scratch):
    """A dev table starts beside one other heavy job (the final tables, or a training), not beside two: the 2 cores
    hold one job each."""
    busy = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "dynts.cli eval"]) for _ in range(2)]
    try:
        out = _bash(scratch, "scripts/run_fair_seeds.sh", "--dry-run", "dev-chain-s1")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert "dry-run: would wait for a core (" in out.stdout, out.stdout + out.stderr
