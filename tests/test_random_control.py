"""The ``random`` control: question + local window protected, the rest a seeded uniform sample that
does not depend on batch composition, padding or engine."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.evictors import Segment, TokenInfo, make_evictor
from dynts.core.settings import serving_methods


def _info(rows: list[list[int]], q: int, n_keep: int, local: int = 4, pad: list[int] | None = None) -> TokenInfo:
    """Left-padded rows of token ids whose first ``q`` tokens are the question."""
    pad = pad or [0] * len(rows)
    n = max(len(r) + p for r, p in zip(rows, pad))
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    seg = torch.full((len(rows), n), int(Segment.PAD))
    for b, (r, p) in enumerate(zip(rows, pad)):
        off = n - len(r)
        ids[b, off:] = torch.tensor(r)
        seg[b, off : off + q] = int(Segment.QUESTION)
        seg[b, off + q :] = int(Segment.THINKING)
    pos = torch.arange(n).expand(len(rows), n).clone()
    return TokenInfo(positions=pos, segments=seg, token_ids=ids, n_keep=n_keep, local_window=local, question_length=n - min(len(r) for r in rows) + q)


def _kept_tokens(info: TokenInfo, kept: torch.Tensor, b: int) -> list[int]:
    """Kept slots of row ``b`` as offsets from its first real token."""
    first = int(info.valid[b].long().argmax())
    return [k - first for k in kept[b].tolist() if info.valid[b, k]]


def test_keeps_question_and_local_window_and_fills_the_budget_at_random():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 50, (60,), generator=g).tolist() for _ in range(3)]
    info = _info(rows, q=6, n_keep=20, local=5)
    kept = make_evictor("random")(info)
    assert kept.shape == (3, 20)
    for b in range(3):
        k = set(kept[b].tolist())
        assert set(range(6)) <= k and set(range(55, 60)) <= k  # question, local window
        assert torch.equal(kept[b], kept[b].sort().values)
    assert not torch.equal(kept[0], kept[1])  # different rows draw differently
    assert make_evictor("random").protected_prefix(6) == 6
    assert "random" in serving_methods()  # a budget-only method: every engine serves it


def test_same_seed_same_kept_set_whatever_the_batch_and_padding():
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(1, 50, (n,), generator=g).tolist() for n in (50, 40, 70))
    alone = _info([a], q=6, n_keep=18)
    batched = _info([c, a, b], q=6, n_keep=18)  # row `a` now left-padded by 20 slots
    ev = make_evictor("random", seed=3)
    assert _kept_tokens(alone, ev(alone), 0) == _kept_tokens(batched, ev(batched), 1)
    assert _kept_tokens(alone, make_evictor("random", seed=4)(alone), 0) != _kept_tokens(alone, ev(alone), 0)


def test_each_thinking_token_is_kept_with_the_same_chance():
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, 50, (80,), generator=g).tolist() for _ in range(400)]
    info = _info(rows, q=4, n_keep=4 + 4 + 24)
    kept = make_evictor("random")(info)
    counts = torch.zeros(80)
    for b in range(len(rows)):
        counts[kept[b]] += 1
    share = counts[4:76] / len(rows)  # the 72 candidates between the windows; 24 kept each time
    assert abs(share.mean().item() - 24 / 72) < 1e-6
    assert share.min() > 0.2 and share.max() < 0.47  # binomial spread around 1/3 (sd ~0.024)


def test_bad_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        make_evictor("random", seed=-1)


def test_generate_with_random_holds_the_budget(qwen2):
    from conftest import padded_batch

    ids, mask = padded_batch([7, 12, 5])
    out = dynts.generate(qwen2, input_ids=ids, attention_mask=mask, method="random", budget=24, local_window=4,
                         max_new_tokens=40, do_sample=False)
    assert out.stats["evictions"] > 0 and out.stats["peak_cache_tokens"] <= 24
