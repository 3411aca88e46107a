"""Ragged rows: forks of different problems decoded in one batch evict and attend exactly as each
would alone in a plain batch-1 BoundedCache, and never touch the state they were forked from."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.rescue import RaggedCache
from dynts.core import EvictionSettings
from dynts.rescue.engine import StepDecoder
from conftest import tiny_model
from rescue_tiny import decode_ragged

BUDGET, WINDOW = 14, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_logits(model, method, predictor, tokens: list[int], prompt_len: int) -> list[torch.Tensor]:
    """Logits after each token past the prompt, decoding one token at a time in a plain cache."""
    cache = dynts.build_cache(model, dynts.make_evictor(method), dynts.Budget(BUDGET, WINDOW, 0.4))
    out = []
    with torch.no_grad(), dynts.attach(model, cache, predictor):
        out.append(model(input_ids=torch.tensor([tokens[:prompt_len]]), cache=cache).logits[0, -1])
        for t in tokens[prompt_len:]:
            out.append(model(input_ids=torch.tensor([[t]]), cache=cache).logits[0, -1])
    return out


def snapshot(cache: RaggedCache) -> list[torch.Tensor]:
    n = cache.length
    tensors = [cache.positions[:, :n], cache.segments[:, :n], cache.token_ids[:, :n], cache.scores[:, :n], torch.tensor([r.seen for r in cache.rows])]
    tensors += [t[:, :, :n] for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("method", ["window", "dynts", "streamingllm"])
def test_ragged_forks_match_plain_decoding(method):
    model = tiny_model("qwen2")
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    policy = StepDecoder(model, EvictionSettings(method, dynts.Budget(BUDGET, WINDOW, 0.4), predictor=predictor))
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(4, 128, (n,), generator=g).tolist()  # noqa: E731
    # two committed problems of different lengths (A has evicted already, B not yet)
    prompts, histories = [rand(5), rand(3)], [rand(15), rand(4)]
    committed = []
    for prompt, history in zip(prompts, histories):
        state = policy.prefill(prompt)
        for t in history:
            state = policy.append([state], [[t]])[0]
        committed.append(state)
    assert committed[0].cache.rows[0].evictions >= 1 and committed[1].cache.rows[0].evictions == 0
    before = [snapshot(s.cache) for s in committed]

    cache, logits = policy.fork(committed, 2)  # rows: A, A, B, B
    steps = 12
    continuations = [rand(steps), rand(steps), rand(3), rand(steps)]  # row 2 finishes early and rides along padded
    got = decode_ragged(policy, cache, continuations, logits)
    evictions = [r.evictions for r in cache.rows]  # each row evicts on its own schedule (counts include history)
    assert evictions[3] >= 1 and evictions[2] == 0 and evictions[0] > committed[0].cache.rows[0].evictions
    assert cache.real_counts().max() <= BUDGET
    assert cache.real_counts().tolist() == [r.real for r in cache.rows]  # the host counts follow the device

    for r, (owner, cont) in enumerate(zip([0, 0, 1, 1], continuations)):
        tokens = prompts[owner] + histories[owner] + cont
        expected = plain_logits(model, method, predictor, tokens, len(prompts[owner]))[len(histories[owner]):]
        assert len(got[r]) == len(expected)
        torch.testing.assert_close(torch.stack(got[r]), torch.stack(expected), atol=1e-5, rtol=1e-5)
    for state, snap in zip(committed, before):  # the forked-from states are untouched
        for a, b in zip(snapshot(state.cache), snap):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_stack_validates_rows():
    model = tiny_model("qwen2")
    policy = StepDecoder(model, EvictionSettings("window", dynts.Budget(BUDGET, WINDOW, 0.4)))
    state = policy.prefill([5, 6, 7])
    with pytest.raises(ValueError, match="out of range"):
        RaggedCache.stack([(state.cache, [1])])
    with pytest.raises(ValueError, match="at least one row"):
        RaggedCache.stack([(state.cache, [])])
    other = StepDecoder(model, EvictionSettings("streamingllm", dynts.Budget(BUDGET, WINDOW, 0.4))).prefill([5, 6, 7])
    with pytest.raises(ValueError, match="share one evictor"):
        RaggedCache.stack([(state.cache, [0]), (other.cache, [0])])


def test_evict_keeps_n_keep_in_every_row_over_it_as_the_dense_cache_does():
    """``evict()`` substitutes for the dense cache's: every row over its ``n_keep`` keeps exactly ``n_keep``
    real slots (the most recent under ``window``), a shorter row keeps all of its own."""
    model = tiny_model("qwen2")
    decoder = StepDecoder(model, EvictionSettings("window", dynts.Budget(BUDGET, WINDOW, 0.4)))
    first, second = decoder.prefill([5, 6, 7]), decoder.prefill([5, 6, 7])
    cache = RaggedCache.stack([(first.cache, [0]), (second.cache, [0])])
    ids = torch.tensor([list(range(8, 16)), [0] * 8])
    decoder.forward(cache, ids, torch.tensor([[True] * 8, [False] * 8]))  # 3 + 8 real tokens fit B = 14
    keep = cache.rows[0].keep
    assert cache.rows[0].real == 11 > keep and cache.rows[1].real == 3 <= keep
    cache.evict()
    assert [r.real for r in cache.rows] == [keep, 3] and cache.real_counts().tolist() == [keep, 3]
    assert [r.evictions for r in cache.rows] == [1, 0] and cache.stats.evictions == 1
    assert cache.positions[0, : cache.length].tolist() == list(range(11 - keep, 11))
