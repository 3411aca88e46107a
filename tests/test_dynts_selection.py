"""Property tests of the DynTS dual-window rule (paper 4.2) on random caches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynts
from dynts.evictors import Segment, TokenInfo


@st.composite
def caches(draw):
    b = draw(st.integers(1, 3))
    q = draw(st.integers(1, 8))
    local = draw(st.integers(0, 6))
    budget = draw(st.integers(q + local + 2, q + local + 40))
    retention = draw(st.floats(0.05, 1.0))
    bounds = dynts.Budget(budget, local, retention)
    n_keep = bounds.n_keep(q)
    n = budget  # an event fires when the cache is full
    pads = [draw(st.integers(0, q - 1)) for _ in range(b)]
    scores = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, -1.0]), min_size=b * n, max_size=b * n))
    segments = torch.full((b, n), int(Segment.THINKING))
    segments[:, :q] = int(Segment.QUESTION)
    for row, p in enumerate(pads):
        segments[row, :p] = int(Segment.PAD)
    info = TokenInfo(
        positions=torch.arange(n).expand(b, n),
        segments=segments,
        token_ids=torch.zeros(b, n, dtype=torch.long),
        n_keep=n_keep,
        local_window=local,
        question_length=q,
        scores=torch.tensor(scores).view(b, n),
    )
    return info, pads


@settings(max_examples=200, deadline=None)
@given(caches())
def test_dynts_keeps_question_local_and_exact_topk(case):
    info, pads = case
    kept = dynts.make_evictor("dynts")(info)
    b, n = info.shape
    q, local = info.question_length, info.local_window
    assert torch.equal(kept, kept.sort(-1).values)
    for row in range(b):
        k = set(kept[row].tolist())
        assert len(k) == info.n_keep
        question = set(range(pads[row], q))
        recent = set(range(n - local, n))
        assert question <= k, "a question token was evicted"
        assert recent <= k, "a local-window token was evicted"
        # the rest of the kept set is exactly the top-scoring selection-window tokens
        selection = [j for j in range(q, n - local)]
        chosen = k - question - recent - set(range(pads[row]))
        slots = info.n_keep - len(question) - len(recent)
        # pads are evicted first, so they only survive when nothing else is left to evict
        assert len(chosen) == min(slots, len(selection))
        ranked = sorted(selection, key=lambda j: (-info.scores[row, j].item(), -j))
        assert chosen == set(ranked[: len(chosen)])


@settings(max_examples=50, deadline=None)
@given(caches())
def test_ablation_bottom_keeps_lowest(case):
    info, pads = case
    kept = dynts.make_evictor("dynts", selection="bottom")(info)
    q, local, n = info.question_length, info.local_window, info.shape[1]
    for row in range(info.shape[0]):
        chosen = [j for j in kept[row].tolist() if q <= j < n - local]
        dropped = [j for j in range(q, n - local) if j not in chosen]
        if chosen and dropped:
            assert max(info.scores[row, chosen]) <= min(info.scores[row, dropped])


def test_budget_arithmetic():
    bounds = dynts.Budget(100, 10, 0.4)
    assert bounds.selection_window(20) == 70
    assert bounds.n_keep(20) == 20 + 28 + 10
    assert bounds.eviction_volume(20) == 42
    assert dynts.Budget(100, 10, 1.0).eviction_volume(20) == 1  # retention 1 still bounds the cache
