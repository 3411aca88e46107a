"""DynTS keeps the question window whatever the answer length; answers are protected up to
``answer_share`` of the selection capacity. Budget sizing (paper / official) and R-KV's attention
normalisation option (all keys / non-window keys)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import LogitsProcessor, LogitsProcessorList

import dynts
from conftest import padded_batch
from dynts.evictors import Segment, TokenInfo
from dynts.evictors.rkv import window_importance

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def events(draw):
    """A random eviction event: rows with left pads in the question, thinking then an answer of any
    length (possibly the whole generation), random scores, a budget that fires now."""
    b = draw(st.integers(1, 3))
    wq = draw(st.integers(1, 12))
    wl = draw(st.integers(0, 10))
    budget = dynts.Budget(draw(st.integers(wq + wl + 1, wq + wl + 60)), wl, draw(st.floats(0.05, 1.0)))
    n_keep = budget.n_keep(wq)
    n = draw(st.integers(n_keep + 1, budget.budget))
    segments = torch.full((b, n), int(Segment.THINKING))
    for r in range(b):
        pads = draw(st.integers(0, wq - 1))
        segments[r, :pads] = int(Segment.PAD)
        segments[r, pads:wq] = int(Segment.QUESTION)
        answer_from = draw(st.integers(wq, n))
        segments[r, answer_from:] = int(Segment.ANSWER)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scores = torch.rand(b, n, generator=g) * 10 - 5
    scores[segments == Segment.QUESTION] = float("nan")  # the predictor never scores the prompt
    info = TokenInfo(positions=torch.arange(n).expand(b, n), segments=segments, token_ids=torch.zeros(b, n, dtype=torch.long),
                     n_keep=n_keep, local_window=wl, question_length=wq, scores=scores)
    return info, draw(st.floats(0.0, 1.0)), draw(st.sampled_from(["top", "bottom", "random"]))


@settings(max_examples=300, deadline=None)
@given(events())
def test_question_survives_answers_of_any_length(event):
    info, share, selection = event
    evictor = dynts.make_evictor("dynts", answer_share=share, selection=selection)
    kept = evictor(info)
    b, n = info.shape
    keep = torch.zeros(b, n, dtype=torch.bool).scatter_(1, kept, True)
    assert bool(keep[info.segments == Segment.QUESTION].all())  # the question window, always
    assert bool(keep[:, n - info.local_window :].all())  # the local window, always
    # the most recent ``cap`` answer tokens before the local window are kept
    cap = math.floor(share * (info.n_keep - info.question_length - info.local_window))
    older = info.segments[:, : n - info.local_window] == Segment.ANSWER
    for r in range(b):
        idx = older[r].nonzero().flatten()
        assert bool(keep[r, idx[len(idx) - min(cap, len(idx)) :]].all())


def test_answer_beyond_share_competes_by_score():
    """Question 4, local 2, n_keep 12 -> capacity 6, share 0.5 -> 3 answer tokens protected; the
    other 3 kept slots go to the best scores among thinking and the older answer tokens."""
    n = 20
    segments = torch.tensor([[0] * 4 + [1] * 6 + [2] * 10])
    scores = torch.arange(n, dtype=torch.float).flip(0).unsqueeze(0)  # older = higher score
    info = TokenInfo(positions=torch.arange(n)[None], segments=segments, token_ids=torch.zeros(1, n, dtype=torch.long),
                     n_keep=12, local_window=2, question_length=4, scores=scores)
    kept = dynts.make_evictor("dynts").select(info)[0].tolist()
    assert kept == [0, 1, 2, 3, 4, 5, 6, 15, 16, 17, 18, 19]
    every_answer = dynts.make_evictor("dynts", answer_share=1.0).select(info)[0].tolist()
    assert every_answer == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True])
def test_answer_share_validated(bad):
    with pytest.raises(ValueError, match="answer_share"):
        dynts.make_evictor("dynts", answer_share=bad)


class ForceAt(LogitsProcessor):
    """Force ``token`` at generated step ``step`` (the think-end id, early)."""

    def __init__(self, prompt_length: int, step: int, token: int):
        self.prompt_length, self.step, self.token = prompt_length, step, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length == self.step:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.token] = 0.0
        return scores


def test_question_survives_a_long_answer_end_to_end(qwen2):
    ids, mask = padded_batch([10, 6], seed=5)
    think_end = 7
    result = dynts.generate(
        qwen2, input_ids=ids, attention_mask=mask, method="dynts", budget=28, local_window=4,
        predictor=dynts.ImportancePredictor(qwen2.config.hidden_size), max_new_tokens=90, think_end=think_end,
        logits_processor=LogitsProcessorList([ForceAt(ids.shape[1], 2, think_end)]), pad_token_id=0, eos_token_id=None,
    )
    cache = result.cache
    assert bool(cache.in_answer.all()) and result.stats["evictions"] > 5
    for row, length in enumerate([10, 6]):
        kept = set(cache.kept_positions(row).tolist())
        assert set(range(10 - length, 10)) <= kept


# ------------------------------------------------------------------ Budget sizing


def test_budget_sizing_formulas():
    paper = dynts.Budget(100, 20, 0.4)
    assert paper.n_keep(10) == 10 + math.floor(0.4 * 70) + 20 == 58
    official = dynts.Budget(100, 20, 0.4, sizing="official")
    assert official.n_keep(10) == int(0.4 * (100 - 20)) + 20 == 52
    assert official.eviction_volume(10) == 48
    assert dynts.Budget(100, 20, 1.0, sizing="official").n_keep(10) == 99  # at least one entry goes
    with pytest.raises(ValueError, match="sizing='official'.*fewer than the question"):
        official.n_keep(33)
    assert official.n_keep(32) == 52
    with pytest.raises(ValueError, match="sizing"):
        dynts.Budget(100, 20, 0.4, sizing="reference")


def test_generate_takes_an_official_budget(qwen2):
    ids, mask = padded_batch([6], seed=6)
    result = dynts.generate(qwen2, input_ids=ids, attention_mask=mask, method="window",
                            budget=dynts.Budget(30, 4, 0.5, sizing="official"), max_new_tokens=40,
                            pad_token_id=0, eos_token_id=None)
    assert result.stats["n_keep"] == int(0.5 * 26) + 4 and result.stats["budget"] == 30
    assert result.stats["peak_cache_tokens"] <= 30 and result.stats["evictions"] >= 2


# ------------------------------------------------------------------ R-KV normalisation


def test_window_importance_non_window_is_softmax_over_non_window_keys():
    g = torch.Generator().manual_seed(0)
    w, n = 4, 12
    logits = torch.randn(w, n, generator=g)
    causal = torch.ones(w, n, dtype=torch.bool).tril(n - w)  # query i sees slots <= n - w + i
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    got = window_importance(probs[None], exclude_recent=w)[0]
    expected = logits[:, : n - w].softmax(-1).mean(0)
    torch.testing.assert_close(got[: n - w], expected)
    assert bool((got[n - w :] == 0).all())
    torch.testing.assert_close(window_importance(probs[None])[0], probs.mean(0))


def test_rkv_normalize_option():
    with pytest.raises(ValueError, match="normalize"):
        dynts.make_evictor("rkv", normalize="window")
    g = torch.Generator().manual_seed(1)
    b, n, w = 1, 16, 8
    window = torch.rand(b, w, n, generator=g)
    info = TokenInfo(positions=torch.arange(n)[None], segments=torch.ones(b, n, dtype=torch.long),
                     token_ids=torch.zeros(b, n, dtype=torch.long), n_keep=8, local_window=2, question_length=0,
                     window_attention=window, keys=torch.randn(b, 2, n, 4, generator=g))
    every = dynts.make_evictor("rkv", mix_lambda=1.0, kernel_size=1).scores(info)
    official = dynts.make_evictor("rkv", mix_lambda=1.0, kernel_size=1, normalize="non_window").scores(info)
    rows = window[:, :, : n - w]
    torch.testing.assert_close(official[:, : n - w], (rows / rows.sum(-1, keepdim=True)).mean(1))
    assert not torch.allclose(every[:, : n - w], official[:, : n - w])
