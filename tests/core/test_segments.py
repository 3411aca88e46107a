"""The labelling rule's two implementations agree: :func:`dynts.core.segments.label_rows` (device, a batch
of rows) and :func:`dynts.core.segments.label_request` (host, one request, as :class:`dynts.core.SlotTracker`
runs it) give every stored slot the same segment on the same token streams, delimiters split across
forwards and pieces lost to evictions included."""

from __future__ import annotations

import random

import pytest
import torch

from dynts.core import SlotTable, segments as seg
from dynts.core.segments import AnswerState
from dynts.evictors.base import Segment
from dynts.thinking import DelimiterMatcher

VOCAB = 12  # small, so delimiter ids and their near-misses occur often


class DeviceRows:
    """The dense cache's way: a ``[b, n]`` table of stored slots, new tokens labelled by ``label_rows``."""

    def __init__(self, delimiter: DelimiterMatcher | None, prompts: list[list[int]]):
        self.delimiter = delimiter
        self.stored = [[(t, int(Segment.QUESTION)) for t in p] for p in prompts]
        b = len(prompts)
        self.in_answer = torch.zeros(b, dtype=torch.bool)
        self.think_match = torch.zeros(b, dtype=torch.long)

    def forward(self, new: list[list[int]]) -> None:
        """One forward; rows with fewer tokens are padded on the left (``valid`` False there)."""
        q = max(len(n) for n in new)
        ids = torch.zeros(len(new), q, dtype=torch.long)
        valid = torch.zeros(len(new), q, dtype=torch.bool)
        for r, n in enumerate(new):
            if n:
                ids[r, q - len(n):] = torch.tensor(n)
                valid[r, q - len(n):] = True
        width = max(len(s) for s in self.stored)
        stored_ids = torch.zeros(len(new), width, dtype=torch.long)
        stored_seg = torch.full((len(new), width), int(Segment.PAD), dtype=torch.long)
        for r, s in enumerate(self.stored):  # right-aligned, PAD fillers in front
            if s:
                stored_ids[r, width - len(s):] = torch.tensor([t for t, _ in s])
                stored_seg[r, width - len(s):] = torch.tensor([g for _, g in s])
        labels, self.think_match = seg.label_rows(self.delimiter, ids, valid, self.in_answer, self.think_match,
                                                  stored_seg, stored_ids)
        for r, n in enumerate(new):
            relabelled = stored_seg[r, width - len(self.stored[r]):].tolist()
            self.stored[r] = [(t, g) for (t, _), g in zip(self.stored[r], relabelled)]
            self.stored[r] += list(zip(n, labels[r, q - len(n):].tolist()))
            assert all(g == int(Segment.PAD) for g in labels[r, : q - len(n)].tolist())

    def keep(self, row: int, kept: list[int]) -> None:
        self.stored[row] = [self.stored[row][j] for j in kept]

    def segments(self, row: int) -> list[int]:
        return [g for _, g in self.stored[row]]


class HostRequests:
    """The paged engines' way: one :class:`SlotTable` row per request, new tokens labelled by
    ``label_request``, the delimiter's stored pieces relabelled by :meth:`SlotTable.relabel_answer`."""

    def __init__(self, delimiter: DelimiterMatcher | None, prompts: list[list[int]]):
        self.delimiter = delimiter
        self.table = SlotTable(torch.device("cpu"), rows=2, width=4)
        self.rows = [self.table.acquire_row() for _ in prompts]
        self.state = [AnswerState() for _ in prompts]
        self.question = [len(p) for p in prompts]
        self.seen = [0] * len(prompts)
        self.length = [0] * len(prompts)
        for r, p in enumerate(prompts):
            self.forward_one(r, p)

    def forward_one(self, r: int, new: list[int]) -> None:
        row, stored = self.rows[r], self.length[r]
        labels = seg.label_request(self.delimiter, self.state[r], new, self.seen[r], self.question[r],
                                   lambda pieces: self.table.relabel_answer(row, stored, pieces))
        n = len(new)
        self.table.ensure_width(stored + n)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        self.table.write(as_long([row] * n), as_long(range(stored, stored + n)),
                         as_long(range(self.seen[r], self.seen[r] + n)), as_long(labels), as_long(new))
        self.seen[r] += n
        self.length[r] += n

    def keep(self, r: int, kept: list[int]) -> None:
        self.table.compact(torch.tensor([self.rows[r]]), torch.tensor([kept]))
        self.length[r] = len(kept)

    def segments(self, r: int) -> list[int]:
        return self.table.segments[self.rows[r], : self.length[r]].tolist()


def run_streams(delimiter_ids, streams, prompts, chunks, evictions) -> None:
    """Feed every row's stream in the given chunks through both paths, evicting the same slots, and
    compare every stored segment after every forward."""
    delimiter = DelimiterMatcher(delimiter_ids) if delimiter_ids is not None else None
    device, host = DeviceRows(delimiter, prompts), HostRequests(delimiter, prompts)
    done = [0] * len(streams)
    for step, sizes in enumerate(chunks):
        new = [s[d : d + n] for s, d, n in zip(streams, done, sizes)]
        device.forward(new)
        for r, n in enumerate(new):
            host.forward_one(r, n)
            done[r] += len(n)
        for r in range(len(streams)):
            assert device.segments(r) == host.segments(r), f"row {r} after forward {step}"
        for r, kept in evictions.get(step, {}).items():
            device.keep(r, kept)
            host.keep(r, kept)


def test_a_three_token_delimiter_split_across_forwards():
    d = (7, 8, 9)
    prompt = [1, 2, 3]
    stream = [4, 7, 8, 5, 7, 7, 8, 9, 4, 5, 6]  # a near miss, then 7 | 7 8 | 9 split over three forwards
    run_streams(d, [stream], [prompt], [[2], [2], [1], [2], [1], [3]], {})
    host = HostRequests(DelimiterMatcher(d), [prompt])
    host.forward_one(0, stream[:5])
    host.forward_one(0, stream[5:7])
    assert host.segments(0)[-2:] == [int(Segment.THINKING)] * 2  # 7 8: the delimiter not yet closed
    host.forward_one(0, stream[7:8])
    A, T, Q = int(Segment.ANSWER), int(Segment.THINKING), int(Segment.QUESTION)
    assert host.segments(0) == [Q] * 3 + [T] * 5 + [A] * 3  # the pieces stored by earlier forwards relabelled


def test_a_delimiter_piece_lost_to_an_eviction_is_not_found_on_either_path():
    d = (7, 8, 9)
    prompt = [1, 2]
    stream = [3, 7, 8, 9, 4]
    # after forward 1 (prompt 2 + 3, 7 stored): evict the 7 so only 9 of the delimiter is near the close
    run_streams(d, [stream], [prompt], [[2], [1], [1], [1]], {0: {0: [0, 1, 2]}})


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_agree(seed):
    rng = random.Random(seed)
    m = rng.choice([1, 2, 3, 4])
    delimiter = tuple(rng.choice([7, 8, 9]) for _ in range(m)) if rng.random() > 0.1 else None
    b = rng.randint(1, 4)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))] for _ in range(b)]
    streams = []
    for _ in range(b):
        s = [rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 30))]
        if delimiter is not None and rng.random() < 0.8:  # plant the delimiter somewhere
            at = rng.randrange(len(s))
            s[at:at] = list(delimiter)
        streams.append(s)
    chunks, evictions, done, lengths = [], {}, [0] * b, [len(p) for p in prompts]
    step = 0
    while any(d < len(s) for d, s in zip(done, streams)):
        sizes = [min(rng.choice([1, 1, 1, 2, 3]), len(s) - d) for d, s in zip(done, streams)]
        chunks.append(sizes)
        for r, n in enumerate(sizes):
            done[r] += n
            lengths[r] += n
        if rng.random() < 0.3:
            r = rng.randrange(b)
            k = rng.randint(1, lengths[r])
            evictions[step] = {r: sorted(rng.sample(range(lengths[r]), k))}
            lengths[r] = k
        step += 1
    run_streams(delimiter, streams, prompts, chunks, evictions)
