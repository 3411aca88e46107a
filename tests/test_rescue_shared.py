"""Shared-prefix forks of the full-context helper: every fork of a problem references ONE copy of its
committed K/V (data_ptr), decodes logit for logit like a plain full cache, and never changes the
state it was forked from; committed tails extend the prefix in place (copy on write if needed)."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.rescue.engine import StepDecoder
from dynts.rescue.shared import ForkCache
from conftest import tiny_model
from rescue_tiny import decode_ragged

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_logits(model, tokens: list[int], prompt_len: int) -> list[torch.Tensor]:
    """Logits after the prompt and after each later token, one token at a time in a full cache."""
    cache = dynts.build_cache(model, dynts.make_evictor("full"), None)
    out = []
    with torch.no_grad(), dynts.attach(model, cache):
        out.append(model(input_ids=torch.tensor([tokens[:prompt_len]]), cache=cache).logits[0, -1])
        for t in tokens[prompt_len:]:
            out.append(model(input_ids=torch.tensor([[t]]), cache=cache).logits[0, -1])
    return out


def committed_states(policy, g):
    rand = lambda n: torch.randint(4, 128, (n,), generator=g).tolist()  # noqa: E731
    prompts, histories = [rand(5), rand(3)], [rand(9), rand(4)]
    states = []
    for prompt, history in zip(prompts, histories):
        state = policy.prefill(prompt)
        state = policy.append([state], [history[:2]])[0]  # a multi-token append
        for t in history[2:]:
            state = policy.append([state], [[t]])[0]
        states.append(state)
    return prompts, histories, states, rand


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_forks_share_the_prefix_and_match_plain_decoding(family):
    model = tiny_model(family)
    policy = StepDecoder(model)
    prompts, histories, states, rand = committed_states(policy, torch.Generator().manual_seed(0))
    cache, logits = policy.fork(states, 2)  # rows: A, A, B, B
    assert isinstance(cache, ForkCache)
    prefixes = [cache.refs[r][0] for r in range(4)]
    assert prefixes[0] is prefixes[1] and prefixes[2] is prefixes[3] and prefixes[0] is not prefixes[2]
    for layer in range(model.config.num_hidden_layers):  # one copy per problem: the state's own storage
        for r, s in enumerate(states):
            own = s.cache.commit(s.row)[0]
            assert prefixes[2 * r].keys[layer].data_ptr() == prefixes[2 * r + 1].keys[layer].data_ptr() == own.keys[layer].data_ptr()
    frozen = [(p.length, [k[:, :, : p.length].clone() for k in p.keys]) for p in (prefixes[0], prefixes[2])]

    steps = 7
    continuations = [rand(steps), rand(steps), rand(2), rand(steps)]  # row 2 finishes early and rides along padded
    got = decode_ragged(policy, cache, continuations, logits)
    for r, (owner, cont) in enumerate(zip([0, 0, 1, 1], continuations)):
        tokens = prompts[owner] + histories[owner] + cont
        expected = plain_logits(model, tokens, len(prompts[owner]))[len(histories[owner]):]
        assert len(got[r]) == len(expected)
        torch.testing.assert_close(torch.stack(got[r]), torch.stack(expected), atol=1e-5, rtol=1e-5)
    for p, (length, keys) in zip((prefixes[0], prefixes[2]), frozen):  # decoding forks never writes the prefix
        assert p.length == length
        for a, b in zip(p.keys, keys):
            torch.testing.assert_close(a[:, :, :length], b, rtol=0, atol=0)

    # committing a winner extends the prefix in place; a sibling committed later gets its own copy
    prefix, length = cache.commit(3)
    assert prefix is prefixes[3] and length == frozen[1][0] + steps
    other, other_length = cache.commit(2)
    assert other is not prefix and other_length == frozen[1][0] + 2
    fork, _ = policy.fork([dynts.rescue.engine.State(cache, 3, got[3][-1])], 3)
    assert {id(fork.refs[i][0]) for i in range(3)} == {id(prefix)}


def test_memory_per_problem_does_not_grow_with_n():
    model = tiny_model("qwen2")
    policy = StepDecoder(model)
    _, _, states, _ = committed_states(policy, torch.Generator().manual_seed(1))
    shared = {n: policy.fork(states, n)[0].shared_bytes() for n in (1, 2, 8)}
    assert shared[1] == shared[2] == shared[8] == sum(s.cache.commit(s.row)[0].bytes for s in states)
