"""The engine-neutral core of per-request eviction in a paged KV cache.

Both serving engines (transformers' continuous batching, :mod:`dynts.serving`, and vLLM,
:mod:`dynts.vllm`) run the same per-request logic through one :class:`SlotTracker`:

1. ``open`` a request when it is first scheduled: its row of the :class:`~dynts.paged.slots.SlotTable`,
   its ``n_keep`` (:meth:`dynts.Budget.n_keep`) and its statistics;
2. ``record`` the tokens of every forward: absolute positions, token ids and segments (question, then
   thinking until the whole thinking delimiter was emitted, then answer -- the rule of
   :class:`dynts.BoundedCache`), and ``write_scores`` from the final-norm hidden states (DynTS);
3. ``due`` says whether a request's next forward would overflow its budget
   (``stored + new > B`` and ``stored > n_keep``, the event rule of :class:`dynts.BoundedCache`);
4. ``evict`` runs the one :class:`~dynts.evictors.Evictor` contract for every request due this round
   (batched per group of equal settings, prompt length and stored count), compacts the table rows and
   returns the kept logical slots; :func:`copy_plan` turns them into the physical ``src -> dst`` rows
   that actually move (identity moves dropped).

An engine adapter only maps logical slots to its physical rows (its block table), moves K/V in its own
layout, returns tail blocks to its pool and shifts RoPE positions by ``RequestSlots.shift``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..evictors.base import Segment
from ..thinking import DelimiterMatcher
from .settings import EvictionSettings
from .slots import RequestSlots, SlotTable

__all__ = ["EvictionGroup", "Forward", "SlotTracker", "copy_plan"]


@dataclass
class Forward:
    """The tokens one request computes in one forward.

    Attributes:
        entry: the request's :class:`RequestSlots`.
        start: absolute index (RoPE position) of the first new token.
        stored: slots the request stores before this forward (the first new token's slot).
        token_ids: the new tokens' ids (``q`` of them).
    """

    entry: RequestSlots
    start: int
    stored: int
    token_ids: Sequence[int]


@dataclass
class EvictionGroup:
    """Requests that evicted together: same settings, prompt length and stored count.

    Attributes:
        entries: the requests, in the order of ``kept``'s rows.
        stored: slots each stored before the event.
        n_keep: slots each keeps.
        kept: ``[g, n_keep]`` ascending logical slots kept (they move to slots ``0 .. n_keep - 1``).
    """

    entries: list[RequestSlots]
    stored: int
    n_keep: int
    kept: torch.Tensor


def copy_plan(kept: torch.Tensor, physical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical rows to move for one group: ``kept`` ``[g, k]`` logical slots, ``physical`` ``[g, stored]``
    the physical row of every logical slot. Returns ``(src, dst)`` 1-D, only rows whose source differs
    from their destination, ordered request by request with ascending destinations (so a copy done in
    chunks in this order never overwrites a row it still has to read: ``kept[i] >= i``)."""
    k = kept.shape[1]
    src = physical.gather(1, kept.to(physical.device))
    dst = physical[:, :k]
    moved = src != dst
    return src[moved], dst[moved]


class SlotTracker:
    """Per-request slot metadata, event rule, evictor calls and statistics of one engine.

    Args:
        settings: the engine's default :class:`EvictionSettings` (a request may bring its own, see :meth:`open`).
        device: where the slot table (and the evictor's inputs) live: the model's device.
        think_end: the thinking delimiter's token ids (:func:`dynts.thinking.think_end_ids`); ``None``:
            every generated token is thinking.
    """

    def __init__(self, settings: EvictionSettings, device: torch.device | str,
                 think_end: Sequence[int] | None) -> None:
        self.settings = settings
        self.delimiter = DelimiterMatcher(think_end) if think_end is not None else None
        self.table = SlotTable(torch.device(device), width=max(256, settings.budget or 0))
        self.slots: dict[str, RequestSlots] = {}
        self.finished: dict[str, dict[str, int]] = {}
        self.pending_scores: tuple[torch.Tensor, torch.Tensor, int] | None = None

    # ------------------------------------------------------------------ requests
    def open(self, rid: str, question_length: int, reserved_blocks: int = 0,
             settings: EvictionSettings | None = None) -> RequestSlots:
        """The request's entry, created on first use with its own ``settings`` (default: the engine's)."""
        entry = self.slots.get(rid)
        if entry is None:
            settings = settings or self.settings
            bounds = settings.bounds
            entry = RequestSlots(
                row=self.table.acquire_row(),
                question_length=question_length,
                n_keep=bounds.n_keep(question_length) if bounds is not None else None,
                reserved_blocks=reserved_blocks,
                settings=settings,
            )
            self.slots[rid] = entry
        return entry

    def release(self, rid: str) -> dict[str, int]:
        """Forget a request; its final statistics stay readable in :attr:`finished`."""
        entry = self.slots.pop(rid)
        stats = entry.stats()
        self.finished[rid] = stats
        self.table.release_row(entry.row)
        return stats

    def stats(self, rid: str) -> dict[str, int]:
        """Statistics of a request in flight or finished (empty if unknown)."""
        entry = self.slots.get(rid)
        return entry.stats() if entry is not None else dict(self.finished.get(rid, {}))

    # ------------------------------------------------------------------ forwards
    def record(self, forwards: Sequence[Forward], score: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the metadata of one forward's new tokens, request by request in batch order.

        Returns the ``(rows, slots)`` ``[T]`` index pairs of the ``T`` tokens; with ``score`` they are kept
        for :meth:`write_scores` (the next final-norm output scores exactly these tokens)."""
        rows: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        tokens: list[int] = []
        for f in forwards:
            q = len(f.token_ids)
            entry = f.entry
            segments += self.segments(entry, f.token_ids, f.start, f.stored)
            rows += [entry.row] * q
            slots += range(f.stored, f.stored + q)
            positions += range(f.start, f.start + q)
            tokens += f.token_ids
            entry.peak_slots = max(entry.peak_slots, f.stored + q)
        device = self.table.device
        if slots:
            self.table.ensure_width(max(slots) + 1)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        row_t, slot_t = as_long(rows), as_long(slots)
        self.table.write(row_t, slot_t, as_long(positions), as_long(segments), as_long(tokens))
        self.pending_scores = (row_t, slot_t, len(rows)) if score and rows else None
        return row_t, slot_t

    def segments(self, entry: RequestSlots, new: Sequence[int], start: int, stored: int) -> list[int]:
        """Segments of a forward's ``new`` tokens (absolute index ``start`` on): thinking until the request
        has emitted the whole delimiter; the delimiter (all its tokens, also those stored by earlier
        forwards, relabelled in the table) and everything after it are answer. The matcher state is one
        host integer per request, so labelling reads nothing back from the device."""
        seg: list[int] = []
        generated = 0
        for i, tok in enumerate(new):
            if start + i < entry.question_length:
                seg.append(int(Segment.QUESTION))
                continue
            generated += 1
            if self.delimiter is not None and not entry.in_answer:
                closes, entry.think_match = self.delimiter.step(entry.think_match, tok)
                if closes:
                    entry.in_answer = True
                    m = self.delimiter.length
                    here = min(m, generated)  # the delimiter's last tokens, in this forward
                    seg[len(seg) - (here - 1):] = [int(Segment.ANSWER)] * (here - 1)
                    if here < m:  # its first tokens were stored by earlier forwards
                        self.table.relabel_answer(entry.row, stored, self.delimiter.ids[: m - here])
            seg.append(int(Segment.ANSWER if entry.in_answer else Segment.THINKING))
        return seg

    def write_scores(self, hidden: torch.Tensor, predictor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score the recorded tokens from the forward's final-norm output ``[T', h]`` (``T' >= T``; rows
        past the recorded ``T`` are padding, e.g. of a CUDA graph)."""
        if self.pending_scores is None:
            return
        rows, slots, total = self.pending_scores
        self.pending_scores = None
        if hidden.dim() == 3:
            hidden = hidden[0]
        if hidden.shape[0] < total:
            raise RuntimeError(f"final-norm output has {hidden.shape[0]} rows for {total} recorded tokens")
        self.table.scores[rows, slots] = predictor(hidden[:total]).float().to(self.table.device)

    # ------------------------------------------------------------------ events
    @staticmethod
    def due(entry: RequestSlots, stored: int, new_tokens: int = 1) -> bool:
        """True when the next forward (``new_tokens``) would overflow the request's budget."""
        if entry.n_keep is None:
            return False
        return stored + new_tokens > entry.settings.bounds.budget and stored > entry.n_keep

    def evict(self, requests: Sequence[tuple[RequestSlots, int]]) -> list[EvictionGroup]:
        """Select the kept slots of every ``(entry, stored)`` due this round and compact their table rows.

        One evictor call per group of requests with the same settings, prompt length and stored count.
        Updates each entry's ``shift`` and statistics (``freed_blocks`` is the adapter's to count)."""
        groups: dict[tuple[int, int, int], list[RequestSlots]] = defaultdict(list)
        for entry, stored in requests:
            groups[(id(entry.settings), entry.question_length, stored)].append(entry)
        out = []
        for (_, question_length, stored), members in groups.items():
            settings, n_keep = members[0].settings, members[0].n_keep
            rows = torch.tensor([e.row for e in members], dtype=torch.long, device=self.table.device)
            info = self.table.token_info(rows, stored, n_keep, settings.bounds.local_window, question_length)
            if settings.needs_scores:
                stale = info.scores.isnan() & (info.segments == Segment.THINKING)
                if bool(stale.any()):
                    raise RuntimeError(f"method={settings.evictor.name!r}: thinking tokens without predictor scores")
            kept = settings.evictor(info)  # [g, n_keep]
            self.table.compact(rows, kept)
            for entry in members:
                entry.shift += stored - n_keep
                entry.evictions += 1
                entry.evicted_tokens += stored - n_keep
            out.append(EvictionGroup(members, stored, n_keep, kept))
        return out
