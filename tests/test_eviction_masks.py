"""Kept-set shapes for training the testbed LRM under eviction (trainers/eviction_masks.py): the
mixture follows its config, every drawn shape keeps the question and the asked value, the attention shape
ranks by the model's own attention, and configs without a mixture reproduce their old batches."""

from __future__ import annotations

import collections
import hashlib
import random
from pathlib import Path

import pytest
import torch
import yaml

from data_pipeline.testbed import task
from trainers.eviction_masks import FORCED_SHAPES, add_attention_ranked, check_shapes, draw_kept_set, draw_shape
from trainers.testbed_lm import LMConfig, TraceStream, build_model

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32}


def test_shape_proportions_match_the_config():
    shapes = yaml.safe_load((ROOT / "configs/testbed/lrm-mix.yaml").read_text())["data"]["evict_shapes"]
    rng = random.Random(0)
    counts = collections.Counter(draw_shape(shapes, rng) for _ in range(20000))
    total = sum(shapes.values())
    for shape, weight in shapes.items():
        assert abs(counts[shape] / 20000 - weight / total) < 0.015, (shape, counts)
    assert set(counts) == {s for s, w in shapes.items() if w > 0}


def test_a_single_shape_draws_no_random_number():
    rng = random.Random(5)
    state = rng.getstate()
    assert draw_shape({"steps": 1.0}, rng) == "steps" and rng.getstate() == state


@pytest.mark.parametrize("shape", FORCED_SHAPES)
def test_every_shape_keeps_the_question_and_the_asked_value(shape):
    for i in range(20):
        p = task.make_problem(f"mask:{i}", min_think=120, max_think=200)
        tokens = list(p.tokens)
        kept, window, share = draw_kept_set(tokens, random.Random(i), (16, 64), 0.6, shape)
        assert kept[: task.QUESTION_TOKENS].all() and 16 <= window <= 64 and 0 <= share <= 0.6
        c = p.critical_positions[0]
        assert kept[c - 1] and kept[c]  # the asked key and its value
        end = tokens.index(task.END_THINK)
        assert not kept[end:].any()  # nothing of the answer is a kept key


def test_shapes_differ_in_what_they_keep():
    p = task.make_problem("mask:shape", min_think=300, max_think=300)
    tokens = list(p.tokens)
    kept = {s: draw_kept_set(tokens, random.Random(1), (16, 16), 0.6, s)[0] for s in ("steps", "tokens", "values")}
    steps = [i for i, t in enumerate(tokens) if t in task.RESULT_KEYS]
    # values: only result keys and the token after them; steps: whole 9-token steps.
    values = kept["values"].nonzero().flatten().tolist()
    assert all(i < task.QUESTION_TOKENS or tokens[i] in task.RESULT_KEYS or tokens[i - 1] in task.RESULT_KEYS for i in values)
    assert any(kept["steps"][k - 6 : k + 3].all() for k in steps)
    assert not torch.equal(kept["tokens"], kept["steps"])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown shapes"):
        check_shapes({"sentences": 1.0})
    with pytest.raises(ValueError, match="non-negative"):
        check_shapes({"steps": -1.0})
    with pytest.raises(ValueError, match="evict_shapes"):
        LMConfig.from_dict({"model": TINY, "data": {"evict_shapes": {"steps": 0}}, "stages": []})


def test_attention_shape_adds_the_most_attended_candidates():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    cfg = LMConfig.from_dict({
        "model": TINY, "seed": 1, "stages": [{"steps": 4, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}],
        "data": {"min_think": 40, "max_think": 80, "long_batch": 8, "short_steps": 0, "drill_frac": 0.0,
                 "evict_frac": 1.0, "evict_shapes": {"attention": 1.0}, "evict_keep": 0.5, "evict_window": [1, 1]},
    })
    batch = TraceStream(cfg, 0).batch(0)
    assert batch["rank_rows"].tolist() == list(range(8))
    before = batch["attention_mask"].clone()
    add_attention_ranked(model, batch)
    after = batch["attention_mask"]
    assert model.config._attn_implementation == "sdpa"  # restored
    model.set_attn_implementation("eager")
    with torch.no_grad():
        real = torch.arange(after.shape[-1])[None] < batch["lengths"][:, None]
        attentions = model(input_ids=batch["input_ids"], attention_mask=real.long(), output_attentions=True).attentions
    received = (sum(a.sum(1) for a in attentions) * real[:, :, None]).sum(1)  # [B, T]
    causal = torch.ones(after.shape[-1], after.shape[-1], dtype=torch.bool).tril()
    for r in range(8):
        candidates = batch["rank_candidates"][r]
        added = (after[r, 0] & ~before[r, 0]).any(0)
        assert added.sum() == int(torch.tensor(float(batch["rank_keep"][r]) * int(candidates.sum())).ceil())
        assert (added <= candidates).all()
        assert received[r][added].min() >= received[r][candidates & ~added].max()  # the most attended ones
        assert (after[r, 0] <= causal).all() and (after[r, 0] >= before[r, 0]).all()  # causal, only widened


def test_configs_without_a_mixture_reproduce_their_batches():
    cfg = LMConfig.from_dict(yaml.safe_load((ROOT / "configs/testbed/lrm-robust.yaml").read_text()))
    stream = TraceStream(cfg, 0)
    h = hashlib.sha256()
    for step in (0, 1, 7, 123):
        batch = stream.batch(step)
        h.update(batch["input_ids"].numpy().tobytes())
        h.update(batch["attention_mask"].numpy().tobytes())
    # The digest of these batches before kept-set shapes existed (the shipped robust LRM's stream).
    assert h.hexdigest() == "eb43b4cccf4a8332afe742e4075e2a71cacf670b2d741f9d0b8cb094ab70253f"
