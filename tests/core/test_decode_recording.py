"""A decode step's recording in :class:`SlotTracker`: :meth:`~SlotTracker.place_decode` and
:meth:`~SlotTracker.record_decode` (immediate, or with places made a step before and the labels deferred to the next
table operation, as vLLM's V2 hooks under async scheduling run it) leave the same table as labelling every token by
the one rule; :meth:`SlotTable.put` writes what :meth:`SlotTable.write` writes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dynts.core import EvictionSettings, Forward, SlotTable, SlotTracker
from dynts.core.segments import AnswerState, label_request
from dynts.evictors.base import Segment
from dynts.thinking import DelimiterMatcher

CPU = torch.device("cpu")
DELIMITER = (7, 8)
COLUMNS = ("positions", "segments", "token_ids", "scores")


def _tracker() -> SlotTracker:
    return SlotTracker(EvictionSettings("window", 64, 8), CPU, think_end=DELIMITER)


def _streams(seed: int, requests: int = 5, steps: int = 24) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and decoded ids; some streams close the delimiter, one in pieces a few steps apart."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 50) for _ in range(rng.randint(1, 6))] for _ in range(requests)]
    streams = [[rng.randrange(10, 50) for _ in range(steps)] for _ in range(requests)]
    for s in streams[:3]:
        at = rng.randrange(steps - 3)
        s[at : at + 2] = list(DELIMITER)
    streams[3][5], streams[3][6] = DELIMITER[0], 11  # a near miss
    return prompts, streams


def _prefilled(prompts: list[list[int]]) -> tuple[SlotTracker, list]:
    tracker = _tracker()
    entries = [tracker.open(f"r{i}", len(p)) for i, p in enumerate(prompts)]
    tracker.record([Forward(e, 0, 0, p) for e, p in zip(entries, prompts)])
    return tracker, entries


def _hidden(step: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).unsqueeze(1) + 100.0 * step


def _score(h: torch.Tensor) -> torch.Tensor:
    return h[:, 0]


def _decode(prompts: list[list[int]], streams: list[list[int]], late: bool) -> SlotTracker:
    """Every stream decoded one token per step: recorded at once, or (``late``) placed and scored first and labelled a
    step later with the next step's places (V2's order: label, place, score)."""
    tracker, entries = _prefilled(prompts)
    rows = np.array([e.row for e in entries])
    waiting = None
    for step in range(len(streams[0])):
        starts = np.array([len(p) + step for p in prompts])
        tokens = [s[step] for s in streams]
        if not late:
            tracker.record_decode(entries, starts, starts, tokens, score=True)
        else:
            if waiting is not None:
                tracker.record_decode(entries, *waiting, keep_scores=True, rows=rows, places=places, defer=True)
            places = tracker.place_decode(rows, starts, starts, score=True)
            waiting = (starts, starts, tokens)
        tracker.write_scores(_hidden(step, len(entries)), _score)
    if late:
        tracker.record_decode(entries, *waiting, keep_scores=True, rows=rows, places=places, defer=True)
        tracker.write_scores(_hidden(0, 0), _score)  # any table operation writes the deferred labels first
    return tracker


def _reference(prompts: list[list[int]], streams: list[list[int]]) -> list[list[int]]:
    """Every request's segments by the one rule, token by token (the delimiter's stored pieces relabelled)."""
    out = []
    for prompt, stream in zip(prompts, streams):
        state, segments = AnswerState(), []

        def relabel(pieces, segments=segments):
            for j in range(len(segments) - len(pieces), len(segments)):
                if segments[j] == Segment.THINKING:
                    segments[j] = int(Segment.ANSWER)

        for i, token in enumerate(prompt + stream):
            segments += label_request(DelimiterMatcher(DELIMITER), state, [token], i, len(prompt), relabel)
        out.append(segments)
    return out


def _stored(tracker: SlotTracker, prompts: list[list[int]], steps: int) -> dict[str, list]:
    out = {}
    for name in COLUMNS:
        column = getattr(tracker.table, name).nan_to_num(-1.0)  # (NaN: not scored)
        out[name] = [column[tracker.slots[f"r{i}"].row, : len(p) + steps].tolist() for i, p in enumerate(prompts)]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_recorded_now_or_late_leave_the_same_table(seed):
    prompts, streams = _streams(seed)
    now, late = _decode(prompts, streams, late=False), _decode(prompts, streams, late=True)
    steps = len(streams[0])
    got, want = _stored(late, prompts, steps), _stored(now, prompts, steps)
    assert got == want
    assert want["segments"] == _reference(prompts, streams)
    assert want["positions"] == [list(range(len(p) + steps)) for p in prompts]
    assert want["token_ids"] == [p + s for p, s in zip(prompts, streams)]
    assert [row[len(p):] for row, p in zip(want["scores"], prompts)] == [
        [i + 100.0 * step for step in range(steps)] for i in range(len(prompts))]  # each token's own hidden row


def _deferred_one_step() -> tuple[SlotTracker, list, np.ndarray]:
    """A tracker holding one decode step's deferred labels (ids 31 at slot 3 of every row)."""
    tracker, entries = _prefilled([[11, 12, 13], [14, 15, 16]])
    rows = np.array([e.row for e in entries])
    starts = np.array([3, 3])
    places = tracker.place_decode(rows, starts, starts)
    tracker.record_decode(entries, starts, starts, [31, 31], keep_scores=True, rows=rows, places=places, defer=True)
    return tracker, entries, rows


@pytest.mark.parametrize("operation", ["record", "record_decode", "place_decode", "evict", "release", "write_scores"])
def test_deferred_labels_are_written_before_the_next_table_operation(operation):
    tracker, entries, rows = _deferred_one_step()
    assert tracker.table.token_ids[rows, 3].tolist() == [0, 0]  # deferred
    if operation == "record":
        tracker.record([Forward(entries[0], 4, 4, [32, 33])])
    elif operation == "record_decode":
        tracker.record_decode(entries, [4, 4], [4, 4], [32, 32])
    elif operation == "place_decode":
        tracker.place_decode(rows, np.array([4, 4]), np.array([4, 4]))
    elif operation == "evict":
        tracker.evict([(entries[0], 4, 4)])
    elif operation == "release":
        tracker.release("r1")
    else:
        tracker.write_scores(torch.zeros(0, 1), _score)
    assert tracker.table.token_ids[rows, 3].tolist() == [31, 31]
    assert tracker.table.positions[rows, 3].tolist() == [3, 3]
    assert tracker.table.segments[rows, 3].tolist() == [int(Segment.THINKING)] * 2


def test_places_made_before_the_table_widened_are_not_used():
    tracker, entries = _prefilled([[11, 12]])
    rows = np.array([entries[0].row])
    places = tracker.place_decode(rows, np.array([2]), np.array([2]))
    tracker.table.ensure_width(2 * tracker.table.width)  # flat indices of the old width point elsewhere now
    tracker.record_decode(entries, [2], [2], [40], keep_scores=True, rows=rows, places=places, defer=True)
    assert tracker.table.token_ids[rows[0], :3].tolist() == [11, 12, 40]


def test_put_writes_what_write_writes():
    rng = torch.Generator().manual_seed(0)
    a, b = SlotTable(CPU, rows=4, width=16), SlotTable(CPU, rows=4, width=16)
    rows, slots = torch.randint(0, 4, (12,), generator=rng), torch.randperm(16, generator=rng)[:12]
    values = [torch.randint(0, 99, (12,), generator=rng) for _ in range(3)]
    for keep_scores in (True, False):
        a.scores.fill_(1.0)
        b.scores.fill_(1.0)
        a.write(rows, slots, *values, keep_scores=keep_scores)
        b.put(rows * b.width + slots, *values, keep_scores=keep_scores)
        for (name, x), (_, y) in zip(a.columns(), b.columns()):
            assert torch.equal(x.nan_to_num(-1), y.nan_to_num(-1)), name
