"""Answer-to-thinking importance from answer rows only equals the brute-force eager computation."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from dynts.attention import recording_attention
from dynts.importance import answer_importance, sequence_importance

pytestmark = pytest.mark.usefixtures("one_thread")


def eager_attention(model, ids: torch.Tensor) -> torch.Tensor:
    """``[layers, b, heads, T, T]`` float32 from eager ``output_attentions`` (the full, unchunked matrices)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return torch.stack(out.attentions).float()


def brute_force(model, ids: torch.Tensor, answer_start: int) -> torch.Tensor:
    """Eager attention with ``output_attentions``: the full ``T x T`` matrices, summed over layers,
    heads and the answer rows; answer columns zeroed."""
    scores = eager_attention(model, ids)[:, :, :, answer_start:, :].sum(dim=(0, 2, 3))
    scores[:, answer_start:] = 0
    return scores


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_matches_eager_output_attentions_512(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 512), generator=torch.Generator().manual_seed(1))
    start = 470
    got = answer_importance(model, ids, [start], return_hidden_states=True)
    expected = brute_force(model, ids, start)
    assert got.scores.shape == (1, 512)
    assert (got.scores - expected).abs().max().item() < 1e-5
    assert torch.all(got.scores[:, start:] == 0) and got.scores[:, :start].sum() > 0
    # total mass: each of the 42 answer rows sums to 1 per layer and head, minus what answer columns got
    assert got.scores.sum() <= 2 * 4 * (512 - start) + 1e-3
    with torch.no_grad():
        reference = model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got.hidden_states, reference, atol=1e-5, rtol=1e-5)


def test_only_answer_rows_are_computed():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (2, 40))
    shapes = []
    with torch.no_grad(), recording_attention(model, lambda module, probs: shapes.append(tuple(probs.shape)), last_rows=5):
        model(input_ids=ids)
    assert shapes == [(2, 4, 5, 40)] * 2  # [b, heads, answer rows, T] per layer, never T x T


def test_padded_batch_equals_one_by_one():
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 75, 52)]
    starts = [20, 70, 40]
    batched = sequence_importance(model, seqs, starts, max_batch_tokens=10_000, return_hidden_states=True)
    for seq, start, got in zip(seqs, starts, batched):
        single = answer_importance(model, torch.tensor([seq]), [start], return_hidden_states=True)
        assert got.scores.shape == (len(seq),)
        assert (got.scores - single.scores[0]).abs().max().item() < 1e-5
        torch.testing.assert_close(got.hidden_states, single.hidden_states[0], atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_clear_errors():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 16))
    with pytest.raises(ValueError, match="answer_start"):
        answer_importance(model, ids, [16])
    with pytest.raises(ValueError, match="answer_start"):
        answer_importance(model, ids, [0])
    with pytest.raises(ValueError, match="one per row"):
        answer_importance(model, ids, [3, 4])
    right_padded = torch.ones(1, 16, dtype=torch.long)
    right_padded[0, -2:] = 0
    with pytest.raises(ValueError, match="LEFT-padded"):
        answer_importance(model, ids, [8], right_padded)
    with pytest.raises(ValueError, match="2 answer_starts"):
        sequence_importance(model, [[3, 4, 5]], [1, 2])


@pytest.mark.slow
def test_smollm2_matches_eager_short(smollm2):
    model, tokenizer = smollm2
    text = "Question: what is 2 + 3? Let me think. Two plus three is five. </think> The answer is 5."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    start = ids.shape[1] - 7
    got = answer_importance(model, ids, [start])
    expected = brute_force(model, ids, start)
    # Scores are sums of 30 layers x 9 heads x 7 rows = 1890 probabilities (the sink token gets ~765),
    # so float32 summation order alone moves them by ~1e-4: compare in probability units (the mean
    # attention an answer row pays a token), as the tiny-model test does implicitly.
    rows = 30 * 9 * (ids.shape[1] - start)
    assert ((got.scores - expected).abs().max() / rows).item() < 1e-5
    torch.testing.assert_close(got.scores, expected, rtol=1e-5, atol=1e-4)
