"""Budgets the KV-Rescue paper's way (Appendix C): B score-selected entries kept at every event plus a
headroom buffer w, so at most B + w are held; the base absorbs a committed helper step, then evicts."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.core.budget import Budget
from dynts.core import EvictionSettings
from dynts.rescue import RescueConfig, load_prm, rescue_generate
from dynts.rescue.engine import StepDecoder
from conftest import tiny_model
from rescue_tiny import DELIMITER, step_model, tiny_prm, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_from_paper_keeps_b_and_holds_b_plus_headroom():
    b = Budget.from_paper(score_selected=64, headroom=128, local_window=16)
    assert (b.budget, b.n_keep(20), b.eviction_volume(20), b.sizing) == (192, 64, 128, "headroom")
    with pytest.raises(ValueError, match="score_selected"):
        Budget.from_paper(score_selected=0)
    with pytest.raises(ValueError, match="headroom"):
        Budget.from_paper(score_selected=64, headroom=0)
    with pytest.raises(ValueError, match="raise score_selected to at least 77"):
        b.check_question(60)
    with pytest.raises(ValueError, match="keep="):
        Budget(100, 16, keep=50)  # keep belongs to the headroom sizing


def test_the_base_absorbs_a_helper_step_then_evicts_to_b():
    policy = StepDecoder(tiny_model("qwen2"), EvictionSettings("window", Budget.from_paper(10, headroom=4, local_window=3)))
    state = policy.prefill([5, 6, 7, 8])
    state = policy.append([state], [list(range(20, 32))])[0]  # a 12-token helper step: 16 > B' = 14
    assert state.cache.rows[state.row].real == 10 and state.cache.rows[state.row].evictions == 1
    state = policy.append([state], [[40, 41, 42]])[0]  # 13 <= 14: no event
    assert state.cache.rows[state.row].real == 13


def test_rescue_generate_with_the_paper_budget():
    tok = word_tokenizer()
    prm = load_prm((tiny_prm(), tok), kind="token", separator=DELIMITER)
    paper = Budget.from_paper(12, headroom=4, local_window=4)
    config = RescueConfig(n_base=2, n_helper=2, step_delimiter=DELIMITER, detector=None, seed=0, max_steps=5,
                          max_step_tokens=8, max_tokens=30)
    kw = dict(method="window", think_end=None, config=config)
    out = rescue_generate(step_model(0), step_model(1), prm, tok, ["<bos> w5 w9 w20 w33"], budget=paper, **kw)
    same = rescue_generate(step_model(0), step_model(1), prm, tok, ["<bos> w5 w9 w20 w33"], budget=16, local_window=4, **kw)
    settings = EvictionSettings("window", paper, think_end=None)  # the settings object instead of its keywords
    given = rescue_generate(step_model(0), step_model(1), prm, tok, ["<bos> w5 w9 w20 w33"], eviction=settings, config=config)
    assert [s.tokens for s in given.problems[0].steps] == [s.tokens for s in out.problems[0].steps]
    assert out.stats["budget"] == 16 and out.stats["n_keep_sizing"] == "headroom"
    assert out.problems[0].steps and same.stats["n_keep_sizing"] == "paper"
