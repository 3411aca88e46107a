"""Resume points: a Lightning checkpoint carried as safetensors + JSON round-trips exactly and resumes a training."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
import yaml
from safetensors.torch import load_file

from trainers import resume_point


def _same(a, b, where="checkpoint"):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where  # keys, their types and their order
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def _checkpoint() -> dict:
    emb = torch.randn(5, 3)
    return {
        "global_step": 7,
        "state_dict": OrderedDict([("embed.weight", emb), ("head.weight", emb), ("norm", torch.ones(3, dtype=torch.bfloat16))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(5, 3)}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98), "foreach": None, "params": [0]}]}],
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf")), "best_model_score": None}},
        "lr_schedulers": [{"last_epoch": 7, "_is_initial": False, "lr_lambdas": [None], "score": float("nan")}],
        "hyper_parameters": {"cfg": {"name": "tiny", "stages": [{"steps": 3, "lr": 1.0e-3}]}},
    }


def _run_with(tmp_path, state: dict):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    torch.save(state, run / "ckpt" / "last.ckpt")
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_0" / "metrics.csv").write_text("epoch,step,train_loss\n0,0,2.5\n")
    return run


def test_round_trip_is_exact_and_carries_the_logs(tmp_path):
    state = _checkpoint()
    run = _run_with(tmp_path, state)
    point = resume_point.save(run, tmp_path / "point")
    assert resume_point.saved_step(point) == 7
    assert set(load_file(str(point / "resume.safetensors"))) == {f"t{i}" for i in range(6)}  # tied weights: two copies
    restored = resume_point.restore(point, tmp_path / "fresh")
    _same(state, torch.load(restored, weights_only=True))
    assert (tmp_path / "fresh" / "logs" / "version_0" / "metrics.csv").read_text().endswith("0,0,2.5\n")


def test_restore_refuses_a_tampered_or_foreign_point_and_an_existing_checkpoint(tmp_path):
    run = _run_with(tmp_path, _checkpoint())
    point = resume_point.save(run, tmp_path / "point")
    with pytest.raises(FileExistsError, match="--force"):
        resume_point.restore(point, run)
    resume_point.restore(point, run, force=True)
    manifest = json.loads((point / "resume.json").read_text())
    (point / "resume.json").write_text(json.dumps({**manifest, "tensors_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="SHA-256"):
        resume_point.restore(point, tmp_path / "other")
    (point / "resume.json").write_text(json.dumps({**manifest, "format": "pickle"}))
    with pytest.raises(ValueError, match="format"):
        resume_point.restore(point, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="save one first"):
        resume_point.restore(tmp_path / "nowhere", tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="--run-dir"):
        resume_point.save(tmp_path / "no-run", tmp_path / "p2")


def test_save_names_what_has_no_plain_form(tmp_path):
    run = _run_with(tmp_path, {"global_step": 1, "loops": {"fit": {"when": torch.device("cpu")}}})
    with pytest.raises(TypeError, match=r"checkpoint/loops/fit/when holds a device"):
        resume_point.save(run, tmp_path / "point")


@pytest.mark.slow
def test_a_training_killed_then_resumed_from_a_carried_point_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    import shutil

    import lightning as L

    from trainers.testbed import train

    cfg = {
        "kind": "lm", "name": "tiny", "seed": 0, "run_dir": str(tmp_path / "run"), "export_dir": str(tmp_path / "straight"),
        "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32},
        "data": {"min_think": 40, "max_think": 60, "short_batch": 4, "long_batch": 2, "short_steps": 1, "val_size": 2},
        "stages": [{"steps": 3, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 0.5}, {"steps": 2, "lr": 5e-4, "lr_end": 1e-5, "long_frac": 1.0}],
        "warmup": 1, "val_every": 100, "ckpt_every": 1, "gate_size": 1, "gate_max_new_tokens": 4,
    }
    straight = tmp_path / "straight.yaml"
    straight.write_text(yaml.safe_dump(cfg))
    train(straight)
    shutil.rmtree(tmp_path / "run")
    carried = tmp_path / "carried.yaml"
    carried.write_text(yaml.safe_dump({**cfg, "export_dir": str(tmp_path / "carried")}))

    # Session 1: the same config, stopped after step 3 (as a kill after that step's checkpoint); its resume point is
    # saved and the run dir lost with the machine.
    trainer = L.Trainer
    monkeypatch.setattr(L, "Trainer", lambda *a, **k: trainer(*a, **{**k, "max_steps": 3}))
    train(carried)
    monkeypatch.setattr(L, "Trainer", trainer)
    point = resume_point.save(tmp_path / "run", tmp_path / "point")
    assert resume_point.saved_step(point) == 3
    shutil.rmtree(tmp_path / "run")
    # Session 2: restore, resume, finish.
    resume_point.restore(point, tmp_path / "run")
    result = train(carried, resume=True)
    assert result["global_step"] == 5
    assert result["total_fit_seconds"] > result["fit_seconds"] > 0  # session 1's seconds came with the point
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "carried" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise the uninterrupted run


def test_the_command_saves_and_restores(tmp_path, capsys):
    from trainers import testbed_cli

    run = _run_with(tmp_path, _checkpoint())
    assert testbed_cli.main(["resume-point", "save", "--run-dir", str(run), "--dir", str(tmp_path / "point")]) == 0
    assert "saved step 7" in capsys.readouterr().out
    assert testbed_cli.main(["resume-point", "restore", "--run-dir", str(tmp_path / "new"), "--dir", str(tmp_path / "point")]) == 0
    assert "(step 7)" in capsys.readouterr().out and (tmp_path / "new" / "ckpt" / "last.ckpt").is_file()
    assert resume_point.default_dir("runs/testbed-chain-lrm-fair-s1").as_posix() == "checkpoints/resume/testbed-chain-lrm-fair-s1"
