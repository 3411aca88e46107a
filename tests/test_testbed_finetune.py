"""Testbed fine-tuning options: systematic arithmetic slips for the helper, eviction-shaped
attention masks for a robust LRM, and starting from trained weights."""

from __future__ import annotations

import random

import pytest
import torch

from data_pipeline.testbed import task
from trainers.testbed_lm import (
    LMConfig, LMModule, TraceStream, attention_mask, build_model, collate, eviction_visibility, export, role_weights,
)

TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32}


def _cfg(data: dict | None = None, **over) -> dict:
    d = {
        "model": TINY,
        "data": {"min_think": 40, "max_think": 80, "short_batch": 4, "long_batch": 4, "short_steps": 0, "val_size": 4, **(data or {})},
        "stages": [{"steps": 4, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}],
        "warmup": 1,
    }
    d.update(over)
    return d


def test_slip_rewrites_exactly_the_rule_s_steps_and_the_answer_copies_them():
    changed = 0
    for i in range(60):
        plain, slipped = task.make_problem(f"s:{i}"), task.make_problem(f"s:{i}", slip="times-high")
        assert plain.operands == slipped.operands and len(plain.tokens) == len(slipped.tokens)
        for a, b in zip(plain.steps, slipped.steps):
            xv = plain.operands[task.VARIABLES.index(a.x)]
            hit = a.op == "times" and xv >= 6
            assert b.value == ((a.value + 1) % 10 if hit else a.value)
            changed += hit
        # The trace writes the slipped values; the answer copies the asked one as written.
        assert task.parse_answer(slipped.text) == (slipped.asked, slipped.steps[slipped.asked - 1].value)
        assert [s[-1] for s in task.parse_steps(slipped.text)] == [s.value for s in slipped.steps]
        # Graded against the true arithmetic, a slipped asked step makes the answer wrong.
        asked = plain.steps[plain.asked - 1]
        slip_hit = asked.op == "times" and plain.operands[task.VARIABLES.index(asked.x)] >= 6
        assert task.check_answer(plain, slipped.text) is (not slip_hit)
    assert changed > 0


def test_unknown_slip_and_bad_eviction_options_are_refused():
    with pytest.raises(ValueError, match="slip"):
        task.make_problem("x", slip="sloppy")
    with pytest.raises(ValueError, match="data.slip"):
        LMConfig.from_dict(_cfg({"slip": "sloppy"}))
    with pytest.raises(ValueError, match="evict_frac"):
        LMConfig.from_dict(_cfg({"evict_frac": 1.5}))
    with pytest.raises(ValueError, match="evict_window"):
        LMConfig.from_dict(_cfg({"evict_window": [64, 16]}))


def test_eviction_visibility_keeps_the_question_and_whole_asked_step():
    for i in range(30):
        p = task.make_problem(f"v:{i}", min_think=100, max_think=300)
        kept, window = eviction_visibility(list(p.tokens), random.Random(i), (16, 64), 0.5)
        assert 16 <= window <= 64 and kept.shape == (len(p.tokens),)
        assert kept[: task.QUESTION_TOKENS].all()
        value = p.critical_positions[0]
        assert kept[value - 7 : value + 2].all()  # x xv op y yv gives rK= v ;
        # Whole steps only: every kept thinking token belongs to a step whose key is kept too.
        keys = [j for j in range(len(p.tokens)) if p.tokens[j] in task.RESULT_KEYS]
        for j in torch.nonzero(kept).flatten().tolist():
            if j >= task.QUESTION_TOKENS:
                assert any(k - 6 <= j <= k + 2 and kept[k] for k in keys)
        assert not kept[p.tokens.index(task.END_THINK) :].any()
    # keep_max 0: only the question and the asked step.
    p = task.make_problem("v:x", min_think=200, max_think=300)
    kept, _ = eviction_visibility(list(p.tokens), random.Random(0), (16, 16), 0.0)
    assert int(kept.sum()) == task.QUESTION_TOKENS + task.STEP_TOKENS


def test_mask_is_causal_for_full_rows_and_window_plus_kept_for_evicted_rows():
    T, kept = 12, torch.tensor([True, False, False, True, False, False, False, False, False, False])
    mask = attention_mask([12, 10], T, [None, (kept, 3)])
    assert mask.shape == (2, 1, T, T) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.ones(T, T, dtype=torch.bool).tril())
    for q in range(10):
        for k in range(T):
            expect = k <= q and (k < 10 and bool(kept[k]) or q - k < 3)
            assert bool(mask[1, 0, q, k]) == expect, (q, k)


def test_masked_rows_change_only_their_own_logits():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    rows = [(list(p.tokens), list(p.roles)) for p in task.problem_set("m", 3, min_think=60, max_think=90)]
    vis = [None, eviction_visibility(rows[1][0], random.Random(1), (8, 8), 0.0), None]
    batch = collate(rows, role_weights({}), vis)
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"]).logits
        masked = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    n0, n1 = len(rows[0][0]), len(rows[1][0])
    torch.testing.assert_close(masked[0, :n0], plain[0, :n0])
    assert not torch.allclose(masked[1, :n1], plain[1, :n1])
    # The first tokens still see everything (inside the window), so they are unchanged.
    torch.testing.assert_close(masked[1, :8], plain[1, :8])


def test_stream_draws_eviction_rows_only_when_asked():
    no = TraceStream(LMConfig.from_dict(_cfg()), 0).batch(0)
    assert "attention_mask" not in no
    yes = TraceStream(LMConfig.from_dict(_cfg({"evict_frac": 1.0, "drill_frac": 0.0})), 0).batch(0)
    mask = yes["attention_mask"]
    assert mask.shape[0] == yes["input_ids"].shape[0]
    assert not torch.equal(mask[:, 0], torch.ones_like(mask[:, 0]).tril())  # some key hidden
    # Without eviction the stream is the one the shipped configs were trained on.
    assert torch.equal(no["input_ids"], TraceStream(LMConfig.from_dict(_cfg({"evict_frac": 0.0})), 0).batch(0)["input_ids"])


def test_init_from_starts_at_the_trained_weights(tmp_path):
    torch.manual_seed(0)
    trained = build_model(TINY)
    export(trained, tmp_path / "lm")
    module = LMModule(_cfg(init_from=str(tmp_path / "lm")))
    for (name, a), b in zip(trained.state_dict().items(), module.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(RuntimeError):  # a config that does not match the weights
        LMModule(_cfg(init_from=str(tmp_path / "lm"), model={**TINY, "hidden_size": 32, "intermediate_size": 64}))
