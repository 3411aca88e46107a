"""Testbed training pieces: batch stream, loss weights, schedule, PRM corruption, resumable fit."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from data_pipeline.testbed import task
from trainers.testbed_lm import TOKEN_ID, LMConfig, TraceStream, lr_at, role_weights
from trainers.testbed_prm import IGNORE, auroc, corrupt


def _cfg(**over) -> LMConfig:
    d = {
        "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32},
        "data": {"min_think": 40, "max_think": 80, "short_batch": 4, "long_batch": 2, "short_steps": 2, "val_size": 4},
        "stages": [{"steps": 4, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 0.5}, {"steps": 2, "lr": 5e-4, "lr_end": 1e-5, "long_frac": 1.0}],
        "warmup": 1,
    }
    d.update(over)
    return LMConfig.from_dict(d)


def test_stream_is_a_function_of_the_step():
    cfg = _cfg()
    a, b = TraceStream(cfg, 0), TraceStream(cfg, 3)
    first = next(iter(b))
    assert torch.equal(first["input_ids"], a.batch(3)["input_ids"])
    assert not torch.equal(a.batch(3)["input_ids"][:1, :20], a.batch(4)["input_ids"][:1, :20])
    # Short-only warmup, then the stage's mix.
    assert a.long_frac(0) == 0.0 and a.long_frac(2) == 0.5 and a.long_frac(5) == 1.0


def test_a_stage_can_train_longer_traces_without_changing_earlier_batches():
    base = _cfg()
    stages = [dict(s) for s in (
        {"steps": 4, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 0.5},
        {"steps": 2, "lr": 5e-4, "lr_end": 1e-5, "long_frac": 1.0, "max_think": 400})]
    longer = _cfg(stages=stages)
    a, b = TraceStream(base, 0), TraceStream(longer, 0)
    for step in range(4):  # the first stage draws the same batches
        assert torch.equal(a.batch(step)["input_ids"], b.batch(step)["input_ids"])
    widths = [b.batch(step)["input_ids"].shape[1] for step in range(4, 6)]
    assert max(widths) > max(a.batch(step)["input_ids"].shape[1] for step in range(4, 6))
    assert (base.longest_think, longer.longest_think) == (80, 400)  # the gate reads up to the longest


def test_weights_follow_roles():
    cfg = _cfg()
    batch = TraceStream(cfg, 0).batch(0)
    ids, w, probe = batch["input_ids"], batch["weights"], batch["probe_pos"]
    rows = torch.arange(len(ids))
    # The probe points at the answer key; its target (the answer value) carries weight 10.
    assert torch.all(w[rows, probe] == 10.0)
    assert all(task.VOCAB[int(t)] in task.RESULT_KEYS for t in ids[rows, probe])
    assert torch.all(w[ids == TOKEN_ID[task.PAD]] == 0)  # padding never trains
    assert set(role_weights({}).values()) == {0.5, 1.0, 2.0, 3.0, 10.0}


def test_lr_schedule():
    cfg = _cfg()
    assert lr_at(cfg, 0) == pytest.approx(1e-3)
    assert lr_at(cfg, 4) == pytest.approx(5e-4)  # second stage restarts its cosine
    assert lr_at(cfg, 100) == pytest.approx(1e-5)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(0, 3))


def test_prm_corruption_labels():
    rng = random.Random(0)
    for seed in range(30):
        p = task.make_problem(seed, max_think=300)
        toks, labels = corrupt(p, rng, 0.5)
        assert len(toks) == len(labels) and toks[-1] != task.END_THINK
        sep = [i for i, t in enumerate(toks) if t == task.SEP]
        assert [i for i, y in enumerate(labels) if y != IGNORE] == sep
        for i in sep:
            x, xv, op, y, yv, _g, _k, v = toks[i - 8 : i]
            true_x, true_y = p.operands[task.VARIABLES.index(x)], p.operands[task.VARIABLES.index(y)]
            ok = int(xv) == true_x and int(yv) == true_y and int(v) == task.OPS[op](true_x, true_y)
            assert labels[i] == int(ok)


def test_prm_digit_labels_check_each_digit_locally():
    rng = random.Random(1)
    for seed in range(30):
        p = task.make_problem(seed, max_think=300)
        toks, labels = corrupt(p, rng, 0.5, digit_labels=True)
        for i in (i for i, t in enumerate(toks) if t == task.SEP):
            x, xv, op, y, yv, _g, _k, v = toks[i - 8 : i]
            assert labels[i - 7] == int(int(xv) == p.operands[task.VARIABLES.index(x)])
            assert labels[i - 4] == int(int(yv) == p.operands[task.VARIABLES.index(y)])
            assert labels[i - 1] == int(int(v) == task.OPS[op](int(xv), int(yv)))
            assert labels[i] == int(labels[i - 7] == labels[i - 4] == labels[i - 1] == 1 and int(v) == task.OPS[op](
                p.operands[task.VARIABLES.index(x)], p.operands[task.VARIABLES.index(y)]))


def test_prm_recipe_freezes_the_lm_and_targets_its_expectation(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainers.testbed_lm import build_model
    from trainers.testbed_prm import CorruptStream, PRMModule

    tiny = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32}
    build_model(tiny).save_pretrained(tmp_path / "lm")
    cfg = {"kind": "prm", "model": tiny, "init_from": str(tmp_path / "lm"), "extra_layers": 1, "freeze_backbone": True,
           "expect_weight": 1.0, "digit_labels": True, "prm_short_steps": 1,
           "data": {"short_min": 10, "short_max": 20, "short_batch": 3, "min_think": 40, "max_think": 60, "long_batch": 2},
           "stages": [{"steps": 2, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}]}
    module = PRMModule(cfg)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    assert torch.equal(module.model.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm.", "score.")) for n in trainable)
    stream = CorruptStream(module.cfg, 0)
    short, long = stream.batch(0), stream.batch(1)
    assert short["input_ids"].shape[0] == 3 and long["input_ids"].shape[0] == 2  # warm-up on short traces
    _, seen = module._layer_outputs(short["input_ids"])
    with torch.no_grad():  # the target is the frozen LM's own next-token distribution
        expected = lm(input_ids=short["input_ids"]).logits
        got = module.lm_norm(seen[0]) @ module.model.model.embed_tokens.weight.T
    assert torch.allclose(got, expected, atol=1e-5)
    module.train()
    loss, _ = module._loss(short)
    loss.backward()
    assert module.expect_probe.weight.grad is not None and module.model.model.layers[0].mlp.up_proj.weight.grad is None
    with pytest.raises(ValueError, match="expect_weight"):
        PRMModule({**cfg, "freeze_backbone": False})


def test_prm_answer_labels():
    from trainers.testbed_prm import with_answer

    rng = random.Random(2)
    seen = set()
    for seed in range(40):
        p = task.make_problem(seed, max_think=300)
        toks, labels = with_answer(p, *corrupt(p, rng, 0.0), rng, 0.5, digit_labels=True)
        assert toks[-4] == task.END_THINK and toks[-1] == task.SEP
        key, value = toks[-3], toks[-2]
        right = key == f"r{p.asked}=" and int(value) == p.steps[p.asked - 1].value
        assert labels[-1] == int(right) and labels[-3] == int(key == f"r{p.asked}=")
        written = {toks[i - 2]: toks[i - 1] for i, t in enumerate(toks[:-4]) if t == task.SEP}
        assert labels[-2] == int(written[key] == value)
        seen.add((labels[-3], labels[-2]))
    assert {(1, 1), (1, 0), (0, 1)} <= seen  # right, wrong value, wrong key (with its own value)


def test_auroc():
    assert auroc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auroc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auroc([0.5, 0.5], [0, 1]) == 0.5


@pytest.mark.slow
def test_training_resumes_from_last_checkpoint(tmp_path):
    from trainers.testbed import train

    cfg = {
        "kind": "lm", "name": "tiny", "seed": 0, "run_dir": str(tmp_path / "run"), "export_dir": str(tmp_path / "export"),
        "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32},
        "data": {"min_think": 40, "max_think": 60, "short_batch": 4, "long_batch": 2, "short_steps": 1, "val_size": 2},
        "stages": [{"steps": 3, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 0.5}],
        "warmup": 1, "val_every": 2, "ckpt_every": 1, "gate_size": 2, "gate_max_new_tokens": 8,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    first = train(path)
    assert first["global_step"] == 3 and (tmp_path / "run" / "ckpt" / "last.ckpt").is_file()
    cfg["stages"][0]["steps"] = 5
    path.write_text(yaml.safe_dump(cfg))
    second = train(path, resume=True)
    assert second["global_step"] == 5  # continued from step 3, not from scratch
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "train_result.json").read_text())["global_step"] == 5
