"""Eviction is real and correct: logits equal a plain forward with the equivalent 4-D mask."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.hf_compat import cache_keyword
from conftest import decode_with_cache, explicit_mask_logits, padded_batch


@pytest.mark.parametrize(
    "method",
    [
        "window", "streamingllm", "dynts", "h2o", "snapkv", "rkv",
        # SepLLM with every 4th id of the tiny vocabulary as a separator
        pytest.param(dynts.make_evictor("sepllm", separator_token_ids=tuple(range(3, 128, 4))), id="sepllm"),
    ],
)
@pytest.mark.parametrize("lengths", [[10], [10, 6]], ids=["batch1", "batch2-padded"])
def test_logits_match_explicit_mask(family_model, method, lengths):
    model = family_model
    ids, mask = padded_batch(lengths, seed=1)
    budget, steps = 22, 40
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    seq, logits, visible, sizes, cache = decode_with_cache(model, ids, mask, method, budget, steps, predictor)
    assert cache.stats.evictions >= 3
    assert max(sizes) <= budget  # the physical cache never holds more than B entries (decoded token included)

    ref = explicit_mask_logits(model, ids, mask, seq, visible)
    torch.testing.assert_close(logits[:, :-1], ref, atol=1e-5, rtol=1e-5)


def test_question_always_kept_and_budget_respected(qwen2):
    ids, mask = padded_batch([12, 7], seed=2)
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size)
    result = dynts.generate(
        qwen2, input_ids=ids, attention_mask=mask, method="dynts", budget=30, local_window=6,
        predictor=predictor, max_new_tokens=80, pad_token_id=0, eos_token_id=None,
    )
    cache = result.cache
    assert result.stats["peak_cache_tokens"] <= 30
    assert result.stats["evictions"] > 5
    for row, n in enumerate([12, 7]):
        kept = cache.kept_positions(row).tolist()
        question = list(range(12 - n, 12))
        assert set(question) <= set(kept)
        # the last sampled token is never fed back, so the cache has seen 12 + 79 tokens
        assert kept[-6:] == list(range(12 + 79 - 6, 12 + 79))  # local window: the most recent tokens


def test_window_keeps_most_recent(qwen2):
    ids, mask = padded_batch([8], seed=3)
    result = dynts.generate(
        qwen2, input_ids=ids, attention_mask=mask, method="window", budget=20, local_window=4,
        max_new_tokens=50, pad_token_id=0, eos_token_id=None,
    )
    kept = result.cache.kept_positions(0).tolist()
    assert kept == list(range(57 - len(kept), 57))


def test_streamingllm_keeps_sinks(qwen2):
    ids, mask = padded_batch([3, 9], seed=4)
    result = dynts.generate(
        qwen2, input_ids=ids, attention_mask=mask, method="streamingllm", budget=24, local_window=4,
        max_new_tokens=50, pad_token_id=0, eos_token_id=None, method_options={"sink_size": 2},
    )
    for row, n in enumerate([3, 9]):
        kept = result.cache.kept_positions(row).tolist()
        first = 9 - n
        assert kept[:2] == [first, first + 1]
        assert kept[2:] == list(range(58 - len(kept) + 2, 58))


def test_kv_buffers_are_preallocated(qwen2):
    """Decode steps write in place: the buffer storage never changes once the budget is allocated."""
    ids, mask = padded_batch([6], seed=5)
    evictor = dynts.make_evictor("window")
    cache = dynts.build_cache(qwen2, evictor, dynts.Budget(32, 4, 0.5))
    kw = {cache_keyword(qwen2): cache}  # generate's own keyword: `cache` on transformers 5.24, `past_key_values` before
    with torch.no_grad(), dynts.attach(qwen2, cache):
        qwen2.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kw)
        pointer = cache.layers[0].keys.data_ptr()
        qwen2.generate(
            input_ids=torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1), max_new_tokens=60,
            pad_token_id=0, eos_token_id=None, **kw,
        )
    assert cache.layers[0].keys.data_ptr() == pointer
    assert cache.stats.peak_cache_tokens <= 32
