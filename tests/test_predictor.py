"""ImportancePredictor: shape contract, safetensors round trip, clear errors on bad files."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.predictor import WEIGHTS_NAME


def test_architecture_and_roundtrip(tmp_path):
    torch.manual_seed(0)
    p = dynts.ImportancePredictor(48, activation="softplus", backbone="tiny")
    shapes = [tuple(m.weight.shape) for m in p.mlp if isinstance(m, torch.nn.Linear)]
    assert shapes == [(96, 48), (24, 96), (1, 24)]  # d -> 2d -> d/2 -> 1
    h = torch.randn(2, 5, 48)
    assert p(h).shape == (2, 5)
    p.save_pretrained(tmp_path)
    q = dynts.ImportancePredictor.from_pretrained(tmp_path)
    assert q.config.backbone == "tiny"
    torch.testing.assert_close(p(h), q(h))


def test_corrupted_and_missing_files(tmp_path):
    dynts.ImportancePredictor(16).save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupted"):
        dynts.ImportancePredictor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="predictor_config.json"):
        dynts.ImportancePredictor.from_pretrained(tmp_path / "missing")


def test_bad_config():
    with pytest.raises(ValueError, match="activation"):
        dynts.ImportancePredictor(16, activation="swishy")
    with pytest.raises(ValueError, match="hidden_size"):
        dynts.ImportancePredictor(0)


def test_scores_come_from_the_same_forward(qwen2):
    """Each new token is scored once, from the final hidden state of the forward that produced it."""
    calls = []
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size)
    predictor.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    ids = torch.randint(3, 100, (1, 7))
    result = dynts.generate(
        qwen2, input_ids=ids, method="dynts", budget=200, local_window=4, predictor=predictor,
        max_new_tokens=5, pad_token_id=0, eos_token_id=None,
    )
    # prefill scored at once; the 4 decode steps' hidden states kept and scored in ONE batched call
    # (defer_scores, the default of build_cache); no second model forward
    assert calls == [7, 4]
    cache = result.cache
    assert not cache.scores[0, : cache.length].isnan().any()


def test_deferred_scores_equal_per_step_scores(qwen2):
    """Scoring decode steps in one batched call at the event gives the per-step scores and kept sets."""
    from conftest import decode_with_cache, padded_batch

    torch.manual_seed(0)
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size).eval()
    ids, mask = padded_batch([12, 9], seed=5)
    runs = [decode_with_cache(qwen2, ids, mask, "dynts", 24, 30, predictor, defer_scores=d) for d in (False, True)]
    (seq_a, _, visible_a, _, cache_a), (seq_b, _, visible_b, _, cache_b) = runs
    assert cache_a.stats.evictions >= 2 and torch.equal(seq_a, seq_b) and visible_a == visible_b
    n = cache_a.length
    torch.testing.assert_close(cache_b.scores[:, :n], cache_a.scores[:, :n], equal_nan=True)


def test_deep_copied_model_scores_through_its_own_slot(qwen2):
    """The predictor hook stays on the model after a call; a deep copy scores for its own caches."""
    import copy

    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, method="dynts", budget=24, local_window=4, predictor=predictor, max_new_tokens=30,
              pad_token_id=0, eos_token_id=None)
    first = dynts.generate(qwen2, **kw)
    twin = copy.deepcopy(qwen2)
    second = dynts.generate(twin, **kw)
    assert first.stats["evictions"] >= 2 and torch.equal(first.sequences, second.sequences)
