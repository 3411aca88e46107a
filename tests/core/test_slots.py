"""The core's per-request and per-slot objects on their own: :class:`SlotTable`, :class:`RequestBudget`,
:func:`build_token_info`, :func:`check_scored`, :class:`SlotTracker` (record, evict, compact, release) and
:func:`copy_plan`."""

from __future__ import annotations

import random

import pytest
import torch

from dynts.core import (EvictionPolicy, EvictionSettings, Forward, RequestBudget, SlotTable, SlotTracker,
                        build_token_info, check_scored, copy_plan)
from dynts.core.slots import EvictorCall, select_kept
from dynts.evictors.base import Segment

CPU = torch.device("cpu")
Q, T, A, PAD = (int(s) for s in (Segment.QUESTION, Segment.THINKING, Segment.ANSWER, Segment.PAD))


def window(budget: int = 32, local: int = 8) -> EvictionSettings:
    return EvictionSettings("window", budget, local)


def as_long(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.long)


# ---------------------------------------------------------------------------------------------- SlotTable
def test_slot_table_rows_are_recycled_and_grow_by_doubling_keeping_their_contents():
    table = SlotTable(CPU, rows=2, width=4)
    a, b = table.acquire_row(), table.acquire_row()
    assert {a, b} == {0, 1}
    table.write(as_long([a, a, b]), as_long([0, 1, 0]), as_long([10, 11, 20]), as_long([Q, T, Q]), as_long([5, 6, 7]))
    c = table.acquire_row()  # no free row: doubles
    assert table.rows == 4 and c not in (a, b)
    table.ensure_width(9)  # doubles (at least what is needed)
    assert table.width == 9 and table.positions.shape == (4, 9)
    assert table.positions[a, :2].tolist() == [10, 11] and table.token_ids[b, 0].item() == 7
    assert table.segments[a, 2:].eq(PAD).all() and table.scores[a, :2].isnan().all()
    table.release_row(b)
    assert table.acquire_row() == b  # a released row is the next one handed out
    assert sorted(table.free_rows + [a, b, c]) == list(range(4))


def test_slot_table_compact_gathers_the_kept_columns_of_the_given_rows_only():
    table = SlotTable(CPU, rows=3, width=8)
    rows = [table.acquire_row() for _ in range(3)]
    for r in rows:
        table.write(as_long([r] * 8), as_long(range(8)), as_long(range(100 * r, 100 * r + 8)), as_long([T] * 8),
                    as_long(range(8)))
        table.scores[r] = torch.arange(8.0)
    before = table.positions.clone()
    kept = torch.tensor([[0, 2, 5], [1, 6, 7]])
    table.compact(torch.tensor([rows[0], rows[2]]), kept)
    assert table.positions[rows[0], :3].tolist() == [0, 2, 5]
    assert table.positions[rows[2], :3].tolist() == [201, 206, 207]
    assert table.scores[rows[2], :3].tolist() == [1.0, 6.0, 7.0] and table.token_ids[rows[0], :3].tolist() == [0, 2, 5]
    assert torch.equal(table.positions[rows[1]], before[rows[1]])  # an untouched row stays


def test_relabel_answer_marks_only_matching_thinking_pieces_before_the_end():
    table = SlotTable(CPU, rows=1, width=8)
    row = table.acquire_row()
    table.write(as_long([row] * 5), as_long(range(5)), as_long(range(5)), as_long([Q, T, T, T, T]),
                as_long([1, 7, 3, 7, 8]))
    table.relabel_answer(row, 5, [7, 8])
    assert table.segments[row, :5].tolist() == [Q, T, T, A, A]
    table.relabel_answer(row, 3, [9, 3])  # 9 is not there (lost to an eviction): only the 3 matches
    assert table.segments[row, :5].tolist() == [Q, T, A, A, A]
    table.relabel_answer(row, 1, [1])  # a question slot is never relabelled
    assert table.segments[row, 0].item() == Q


# --------------------------------------------------------------------------- build_token_info, check_scored
def test_build_token_info_views_the_first_slots_of_the_chosen_rows():
    table = SlotTable(CPU, rows=3, width=6)
    for r in range(3):
        table.write(as_long([r] * 6), as_long(range(6)), as_long(range(10 * r, 10 * r + 6)), as_long([Q] + [T] * 5),
                    as_long(range(6)))
    info = build_token_info(table, 4, 3, 1, 1, rows=torch.tensor([2, 0]))
    assert info.positions.tolist() == [[20, 21, 22, 23], [0, 1, 2, 3]]
    assert info.n_keep == 3 and info.local_window == 1 and info.question_length == 1
    assert info.attention is None and info.window_attention is None and info.scores.shape == (2, 4)
    assert torch.equal(table.token_info(torch.tensor([2, 0]), 4, 3, 1, 1).positions, info.positions)


def test_check_scored_refuses_an_unscored_thinking_slot_for_a_scoring_method_only():
    table = SlotTable(CPU, rows=1, width=4)
    table.write(as_long([0] * 3), as_long(range(3)), as_long(range(3)), as_long([Q, T, A]), as_long(range(3)))
    info = build_token_info(table, 3, 2, 0, 1)
    dynts_method = EvictionSettings("dynts", 64, 8, predictor="unused").evictor
    with pytest.raises(RuntimeError, match="needs predictor scores"):
        check_scored(info, dynts_method)
    check_scored(info, window().evictor)  # a method without scores never looks
    table.scores[0, 1] = 0.5  # the thinking slot scored; question / answer slots may stay NaN
    check_scored(build_token_info(table, 3, 2, 0, 1), dynts_method)


# ------------------------------------------------------------------------------------------ RequestBudget
def test_request_slots_due_evicted_and_stats():
    settings = window(32, 8)
    entry = RequestBudget(settings, 6, settings.n_keep(6))
    assert entry.n_keep == settings.bounds.n_keep(6) < 32
    assert not entry.due(31) and entry.due(32) and entry.due(31, incoming=2)
    entry.evicted(32)
    assert entry.shift == 32 - entry.n_keep and entry.evictions == 1 and entry.evicted_tokens == entry.shift
    assert entry.stats()["evictions"] == 1
    assert not RequestBudget(settings, 6, None).due(10_000)  # no budget: never due
    assert not RequestBudget(settings, 6, settings.n_keep(6), may_evict=False).due(10_000)


# ------------------------------------------------------------------------------------------- SlotTracker
def decode(tracker: SlotTracker, policy: EvictionPolicy, rid: str, tokens, reference) -> None:
    """Decode ``tokens`` one per forward for ``rid``, through the policy's events and the tracker's
    evictions; ``reference`` is the host list of ``(position, token id)`` the row must hold."""
    entry, budget = tracker.slots[rid], policy.get(rid)
    for tok in tokens:
        stored = len(reference)
        event = policy.event(rid, budget, stored)
        if event is not None:
            (group,) = tracker.evict([(entry, stored, event.n_keep)])
            assert group.entries == [entry] and group.stored == stored == event.stored
            kept = group.kept[0].tolist()
            assert kept == sorted(kept) and len(kept) == budget.n_keep
            reference[:] = [reference[j] for j in kept]
        start = reference[-1][0] + 1
        tracker.record([Forward(entry, start, len(reference), [tok])])
        assert start == len(reference) + budget.shift  # absolute position = stored index + shift
        reference.append((start, tok))
        n = len(reference)
        assert tracker.table.positions[entry.row, :n].tolist() == [p for p, _ in reference]
        assert tracker.table.token_ids[entry.row, :n].tolist() == [t for _, t in reference]
        assert n <= entry.settings.bounds.budget


def test_tracker_round_trip_record_evict_compact_release():
    settings = EvictionSettings("window", 32, 8, method_options={"keep_question": True})
    policy = EvictionPolicy(4)
    tracker = SlotTracker(settings, CPU, think_end=(9,))
    prompt = list(range(1, 7))
    budget = policy.open("r", settings, len(prompt), 100)
    entry = tracker.open("r", len(prompt), settings)
    tracker.record([Forward(entry, 0, 0, prompt)])
    reference = list(enumerate(prompt))
    generated = [3, 4, 5, 9] + [6] * 60
    decode(tracker, policy, "r", generated, reference)
    assert budget.evictions == settings.bounds.events(len(prompt), len(generated))
    segments = tracker.table.segments[entry.row, : len(reference)].tolist()
    assert segments[:6] == [Q] * 6  # keep_question: the prompt survives every event
    assert segments[-8:] == [A] * 8  # the local window, after the delimiter
    row = entry.row
    tracker.release("r")
    assert entry.row == -1 and "r" not in tracker.slots
    assert tracker.table.acquire_row() == row


def test_tracker_groups_requests_by_stored_count_and_batches_a_group():
    settings = window(16, 4)
    tracker = SlotTracker(settings, CPU, think_end=None)
    entries = {rid: tracker.open(rid, 4) for rid in "abc"}
    for rid, n in zip("abc", (16, 16, 15)):
        tracker.record([Forward(entries[rid], 0, 0, list(range(n)))])
    n_keep = settings.n_keep(4)
    groups = tracker.evict([(entries["a"], 16, n_keep), (entries["b"], 16, n_keep), (entries["c"], 15, n_keep)])
    assert [(len(g.entries), g.stored) for g in groups] == [(2, 16), (1, 15)]
    for g in groups:
        assert g.kept.shape == (len(g.entries), g.n_keep)
        for e, kept in zip(g.entries, g.kept.tolist()):
            assert tracker.table.positions[e.row, : g.n_keep].tolist() == kept  # positions were 0 .. n-1


def test_select_kept_calls_the_evictor_once_per_group_of_equal_calls():
    table = SlotTable(CPU, rows=4, width=8)
    for row in range(4):
        table.write(as_long([row] * 8), as_long(range(8)), as_long(range(8)), as_long([Q, Q] + [T] * 6), as_long(range(8)))
    evictor = window().evictor
    calls = []

    def counting(info):
        calls.append(info.shape)
        return evictor(info)

    spy = type("Spy", (), {"requires": (), "name": "window", "__call__": staticmethod(counting)})()
    due = [("a", 3, EvictorCall(spy, 2, 2, 8, 5)), ("b", 1, EvictorCall(spy, 2, 2, 6, 4)),
           ("c", 0, EvictorCall(spy, 2, 2, 8, 5))]
    selections = select_kept(table, due)
    assert calls == [(2, 8), (1, 6)]
    assert [(s.members, s.rows.tolist(), s.kept.shape) for s in selections] == [
        (["a", "c"], [3, 0], (2, 5)), (["b"], [1], (1, 4))]
    assert selections[0].kept.tolist() == [[3, 4, 5, 6, 7]] * 2  # window: the most recent n_keep


def test_write_scores_scores_exactly_the_recorded_tokens():
    settings = window(16, 4)
    tracker = SlotTracker(settings, CPU, think_end=None)
    a, b = tracker.open("a", 2), tracker.open("b", 1)
    tracker.record([Forward(a, 0, 0, [1, 2, 3]), Forward(b, 0, 0, [4])], score=True)
    hidden = torch.arange(6.0).unsqueeze(1)  # 4 recorded rows + 2 of padding
    tracker.write_scores(hidden, lambda h: h[:, 0] * 10)
    assert tracker.table.scores[a.row, :3].tolist() == [0.0, 10.0, 20.0] and tracker.table.scores[b.row, 0] == 30.0
    assert tracker.pending_scores is None
    with pytest.raises(RuntimeError, match="rows for"):
        tracker.record([Forward(a, 3, 3, [5, 6])], score=True)
        tracker.write_scores(torch.zeros(1, 1), lambda h: h[:, 0])


# ------------------------------------------------------------------------------------------------ copy_plan
def paged(rng: random.Random, g: int, stored: int, block: int, spare: int) -> torch.Tensor:
    """``[g, stored]`` physical rows of every logical slot: each request its own shuffled blocks."""
    per = -(-stored // block)
    blocks = rng.sample(range(g * per + spare), g * per)
    return torch.tensor([[blocks[i * per + j // block] * block + j % block for j in range(stored)]
                         for i in range(g)])


@pytest.mark.parametrize("seed", range(30))
def test_copy_plan_never_overwrites_a_row_it_still_has_to_read(seed):
    rng = random.Random(seed)
    g, block = rng.randint(1, 4), rng.choice([1, 2, 4, 16])
    stored = rng.randint(2, 40)
    k = rng.randint(1, stored - 1)
    physical = paged(rng, g, stored, block, spare=rng.randint(0, 3))
    kept = torch.tensor([sorted(rng.sample(range(stored), k)) for _ in range(g)])
    src, dst = copy_plan(kept, physical)
    assert src.shape == dst.shape and bool((src != dst).all())  # identity moves dropped
    written = set()
    for s, d in zip(src.tolist(), dst.tolist()):
        assert s not in written, "a row is read after it was overwritten"
        written.add(d)
    # done in chunks of any size in this order (each chunk reads, then writes), the cache ends compacted
    cache = torch.arange(int(physical.max()) + 1) * 1000
    original = cache.clone()
    i = 0
    while i < len(src):
        n = rng.randint(1, 8)
        cache[dst[i : i + n]] = cache[src[i : i + n]].clone()
        i += n
    for r in range(g):
        assert cache[physical[r, :k]].tolist() == original[physical[r].gather(0, kept[r])].tolist()
