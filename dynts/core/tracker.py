"""The worker side of per-request eviction in a paged KV cache: slot metadata, scores, evictor calls.

Both paged engines (transformers' continuous batching, :mod:`dynts.serving`, and vLLM,
:mod:`dynts.vllm`) run the same worker-side logic through one :class:`SlotTracker`:

1. ``open`` a request when it is first scheduled: its :class:`~dynts.core.slots.RequestRow` and row of the
   :class:`~dynts.core.slots.SlotTable`;
2. ``record`` the tokens of every forward: absolute positions, token ids and segments
   (:mod:`dynts.core.segments`), and ``write_scores`` from the final-norm hidden states (DynTS);
3. ``evict`` runs the one :class:`~dynts.evictors.Evictor` contract for every request the scheduler side
   found due (:meth:`dynts.core.policy.EvictionPolicy.event`, the event rule :meth:`dynts.Budget.due`),
   batched per group of equal settings, prompt length and stored count, compacts the table rows and
   returns the kept logical slots; :func:`copy_plan` turns them into the physical ``src -> dst`` rows
   that actually move (identity moves dropped).

An engine adapter only maps logical slots to its physical rows (its block table), moves K/V in its own
layout, returns tail blocks to its pool and shifts RoPE positions by ``RequestBudget.shift``.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..evictors.base import Segment
from ..thinking import DelimiterMatcher
from .settings import EvictionSettings
from .segments import label_request
from .slots import EvictorCall, RequestRow, SlotTable, select_kept
from .upload import HostStaging

__all__ = ["DecodePlaces", "EvictionGroup", "Forward", "SlotTracker", "copy_plan"]

_ROW = attrgetter("row")
_PAST_PROMPT = np.array([int(Segment.THINKING), int(Segment.ANSWER)])  # a token after the prompt, by ``in_answer``


@dataclass
class Forward:
    """The tokens one request computes in one forward.

    Attributes:
        entry: the request's :class:`RequestRow`.
        start: absolute index (RoPE position) of the first new token.
        stored: slots the request stores before this forward (the first new token's slot).
        token_ids: the new tokens' ids (``q`` of them).
    """

    entry: RequestRow
    start: int
    stored: int
    token_ids: Sequence[int]


class DecodePlaces(NamedTuple):
    """Where a decode step's tokens go in the table, on the device (``[n]`` each; :meth:`SlotTracker.place_decode`):
    rows, slots, flat indices ``row * width + slot`` (at the table's ``width`` then) and absolute positions."""

    rows: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor
    width: int


class _Labels(NamedTuple):
    """A decode step's tokens to label (:meth:`SlotTracker.record_decode`'s arguments) and their places (``None``: the
    places :meth:`SlotTracker.place_decode` is making)."""

    entries: Sequence[RequestRow]
    rows: np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    tokens: Sequence[int]
    places: DecodePlaces | None
    keep_scores: bool


@dataclass
class EvictionGroup:
    """Requests that evicted together: same settings, prompt length and stored count.

    Attributes:
        entries: the requests, in the order of ``kept``'s rows.
        stored: slots each stored before the event.
        n_keep: slots each keeps.
        kept: ``[g, n_keep]`` ascending logical slots kept (they move to slots ``0 .. n_keep - 1``).
        stale: ``[g]`` device flags, a request ranked a thinking token without a score (``evict(defer_stale=True)``
            with a scoring method; else ``None``).
    """

    entries: list[RequestRow]
    stored: int
    n_keep: int
    kept: torch.Tensor
    stale: torch.Tensor | None = None


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
    """Per-request slot metadata, scores and evictor calls of one engine's worker.

    Args:
        settings: the engine's default :class:`EvictionSettings` (a request may bring its own, see :meth:`open`).
        device: where the slot table (and the evictor's inputs) live: the model's device.
        think_end: the thinking delimiter's token ids (:func:`dynts.thinking.think_end_ids`); ``None``:
            every generated token is thinking.
        table: the :class:`SlotTable` to use (an engine that sizes it up front, e.g. vLLM at worker init);
            default one that grows by doubling.
    """

    def __init__(self, settings: EvictionSettings, device: torch.device | str,
                 think_end: Sequence[int] | None, table: SlotTable | None = None) -> None:
        self.settings = settings
        self.delimiter = DelimiterMatcher(think_end) if think_end is not None else None
        self.delimiter_ids = np.asarray(self.delimiter.ids if self.delimiter is not None else (), dtype=np.int64)
        self.table = table if table is not None else SlotTable(torch.device(device), width=max(256, settings.bounds.budget if settings.bounds else 0))
        self.staging = HostStaging(self.table.device)  # every upload of this worker: pinned, never waited on
        # the delimiter's ids on the device, uploaded once: a relabelling compares stored ids with its first pieces
        self.delimiter_on_device = self.staging.upload(self.delimiter_ids) if len(self.delimiter_ids) else None
        self.slots: dict[str, RequestRow] = {}
        self.pending_scores: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._scratch_row: int | None = None
        # per table row, a host mirror of what a decode step's labelling reads: prompt length, in answer, the
        # delimiter's partial match (kept in step with each request's AnswerState by open() and segments())
        self.row_state = np.zeros((3, self.table.rows), dtype=np.int64)

    _deferred: _Labels | None = None  # a decode step's labels waiting for the next table operation (record_decode)
    generation: int = 0  # counts every open and release: records looked up before are still the records while it holds

    @property
    def scratch_row(self) -> int:
        """A table row no request holds: the scores of a forward's tokens that belong to no recorded request (a
        failed or skipped one) are written there, so every hidden-state row is scored into its own token's slot
        (:meth:`expect_scores`). Taken from the table on first use (an engine takes it at start-up)."""
        if self._scratch_row is None:
            self._scratch_row = self.table.acquire_row()
        return self._scratch_row

    # ------------------------------------------------------------------ requests
    def open(self, rid: str, question_length: int, settings: EvictionSettings | None = None) -> RequestRow:
        """The request's record, created on first use with its own ``settings`` (default: the engine's) and a
        table row."""
        entry = self.slots.get(rid)
        if entry is None:
            entry = RequestRow(settings or self.settings, question_length, self.table.acquire_row())
            self.slots[rid] = entry
            self.generation += 1
            if entry.row >= self.row_state.shape[1]:  # the table grew
                self.row_state = np.pad(self.row_state, ((0, 0), (0, self.table.rows - self.row_state.shape[1])))
            self.row_state[:, entry.row] = (question_length, entry.answer.in_answer, entry.answer.think_match)
        return entry

    def release(self, rid: str) -> None:
        """Forget a request and free its table row."""
        self._write_deferred()
        entry = self.slots.pop(rid)
        self.generation += 1
        self.table.release_row(entry.row)
        entry.row = -1

    # ------------------------------------------------------------------ forwards
    def record(self, forwards: Sequence[Forward], score: bool = False,
               keep_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the metadata of one forward's new tokens, request by request in batch order.

        Returns the ``(rows, slots)`` ``[T]`` index pairs of the ``T`` tokens; with ``score`` they are kept
        for :meth:`write_scores` (the next final-norm output scores exactly these tokens). ``keep_scores``: the
        tokens were scored already (ids that arrive after their forward), their scores stay."""
        self._write_deferred()
        if forwards and all(len(f.token_ids) == 1 for f in forwards):  # a decode step: the vectorised path
            return self.record_decode([f.entry for f in forwards], [f.start for f in forwards],
                                      [f.stored for f in forwards], [f.token_ids[0] for f in forwards], score,
                                      keep_scores)
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
        if slots:
            self.table.ensure_width(max(slots) + 1)
        row_t, slot_t, *columns = self.staging.columns((rows, slots, positions, segments, tokens))
        self.table.write(row_t, slot_t, *columns, keep_scores=keep_scores)
        self.pending_scores = (row_t, slot_t, len(rows)) if score and rows else None
        return row_t, slot_t

    def place_decode(self, rows: np.ndarray, slots: np.ndarray, starts: np.ndarray,
                     score: bool = False) -> DecodePlaces:
        """Where a decode step's tokens go (one per request: table row ``rows[i]``, slot ``slots[i]``, absolute index
        ``starts[i]``), on the device in one upload, the table widened first; with ``score`` the next final-norm
        output scores exactly these tokens (:meth:`write_scores`). Their labels follow with :meth:`record_decode`;
        labels it deferred (as many tokens) go up in the same upload."""
        n = len(rows)
        needed = int(slots.max()) + 1
        deferred, self._deferred = self._deferred, None
        if deferred is not None and deferred.places is not None and (len(deferred.rows) != n
                                                                     or needed > self.table.width):
            self._write(deferred)  # at the places (and width) they were given
            deferred = None
        self.table.ensure_width(needed)
        width = self.table.width
        staged = np.empty((4 if deferred is None else 6, n), dtype=np.int64)  # rows, slots, flat index, positions
        row, slot, index, start = staged[:4]
        row[:], slot[:], start[:] = rows, slots, starts
        np.multiply(row, width, out=index)
        index += slot
        if deferred is not None:
            self._labels(deferred, staged[4:])  # ids, segments
        row_t, slot_t, index_t, start_t, *labels = self.staging.upload(staged).unbind(0)
        places = DecodePlaces(row_t, slot_t, index_t, start_t, width)
        if deferred is not None:
            at = deferred.places or places
            self.table.put(at.index, at.positions, labels[1], labels[0], keep_scores=deferred.keep_scores)
        self.pending_scores = (row_t, slot_t, n) if score else None
        return places

    def record_decode(self, entries: Sequence[RequestRow], starts: Sequence[int], stored: Sequence[int],
                      tokens: Sequence[int], score: bool = False, keep_scores: bool = False,
                      rows: np.ndarray | None = None, places: DecodePlaces | None = None, defer: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`record` for a decode step: one token per request (``entries[i]`` computes ``tokens[i]`` at absolute
        index ``starts[i]`` into slot ``stored[i]``; ``rows``: their table rows, when the caller has them), placed and
        labelled in one upload, one ``put_`` per column (:meth:`SlotTable.put`). ``places``: where
        :meth:`place_decode` put these tokens already (scored before their ids arrived): only the ids and segments
        go up. ``defer`` (with ``places``): the labelling and its writes wait for the tracker's next operation on the
        table, which runs them first (:meth:`place_decode` in its own upload), so whatever goes through the tracker
        finds the table as if they ran now."""
        self._write_deferred()
        if not entries:
            return self.record([], score, keep_scores)
        if rows is None:
            rows = np.fromiter(map(_ROW, entries), dtype=np.int64, count=len(entries))
        labels = _Labels(entries, rows, np.asarray(starts), np.asarray(stored), tokens, None, keep_scores)
        if places is None or places.width != self.table.width:  # (or the table widened since they were placed)
            self._deferred = labels  # labelled at the places made now, in their upload
            places = self.place_decode(rows, labels.slots, labels.starts, score)
            return places.rows, places.slots
        self.pending_scores = (places.rows, places.slots, len(rows)) if score else None
        labels = labels._replace(places=places)
        if defer:
            self._deferred = labels
        else:
            self._write(labels)
        return places.rows, places.slots

    def _labels(self, labels: _Labels, out: np.ndarray) -> None:
        """``out`` ``[2, n]``: the ids and segments of a decode step's tokens."""
        out[0] = labels.tokens
        out[1] = self._decode_segments(labels.entries, labels.rows, labels.starts, labels.slots, out[0])

    def _write(self, labels: _Labels) -> None:
        """A decode step's labels into the table at their places: one upload, one ``put_`` per column."""
        staged = np.empty((2, len(labels.rows)), dtype=np.int64)
        self._labels(labels, staged)
        ids, segments = self.staging.upload(staged).unbind(0)
        self.table.put(labels.places.index, labels.places.positions, segments, ids, keep_scores=labels.keep_scores)

    def _write_deferred(self) -> None:
        """The labels :meth:`record_decode` deferred, written now (before anything else touches the table)."""
        if self._deferred is not None:
            labels, self._deferred = self._deferred, None
            self._write(labels)

    def _decode_segments(self, entries: Sequence[RequestRow], rows: np.ndarray, start: np.ndarray, slot: np.ndarray,
                         token: np.ndarray) -> np.ndarray:
        """Segments of a decode step's tokens. The labelling rule runs one request at a time only where the delimiter
        can change something (a partial match, or a delimiter id); every other token is question, thinking or answer
        by its request's state alone (:attr:`row_state`)."""
        question_length, answering, match = self.row_state.take(rows, axis=1)
        segments = _PAST_PROMPT.take(answering)
        asked = start < question_length
        if asked.any():
            segments[asked] = int(Segment.QUESTION)
        if self.delimiter is None or not (match.any() or not set(self.delimiter.ids).isdisjoint(token.tolist())):
            return segments
        for i in np.flatnonzero(match | (token[:, None] == self.delimiter_ids).any(1)).tolist():
            if segments[i] == Segment.THINKING:  # a thinking row whose delimiter match could move: the rule
                segments[i] = self.segments(entries[i], (int(token[i]),), int(start[i]), int(slot[i]))[0]
        return segments

    def segments(self, entry: RequestRow, new: Sequence[int], start: int, stored: int) -> list[int]:
        """Segments of a forward's ``new`` tokens (absolute index ``start`` on; ``stored`` slots before them),
        by the one rule (:func:`dynts.core.segments.label_request`); delimiter pieces stored by earlier
        forwards are relabelled in the table."""
        on_device = self.delimiter_on_device
        out = label_request(self.delimiter, entry.answer, new, start, entry.question_length,
                            lambda pieces: self.table.relabel_answer(
                                entry.row, stored, pieces if on_device is None else on_device[: len(pieces)]))
        if 0 <= entry.row < self.row_state.shape[1]:
            self.row_state[1:, entry.row] = (entry.answer.in_answer, entry.answer.think_match)
        return out

    def expect_scores(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """The next forward's final-norm output scores ``T`` tokens into ``(rows[i], slots[i])`` (``[T]`` each, one
        per hidden-state row in batch order; a token of no recorded request points at :attr:`scratch_row`)."""
        staged = np.empty((2, len(rows)), dtype=np.int64)
        staged[0], staged[1] = rows, slots
        row_t, slot_t = self.staging.upload(staged).unbind(0)
        self.pending_scores = (row_t, slot_t, len(rows))

    def write_scores(self, hidden: torch.Tensor, predictor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score the recorded tokens from the forward's final-norm output ``[T', h]`` (``T' >= T``; rows
        past the recorded ``T`` are padding, e.g. of a CUDA graph)."""
        self._write_deferred()
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
    def evict(self, requests: Sequence[tuple[RequestRow, int, int]], defer_stale: bool = False) -> list[EvictionGroup]:
        """Select the kept slots of every ``(entry, stored, n_keep)`` due this round (the scheduler's events) and
        compact their table rows.

        One evictor call per group of requests with the same settings, prompt length and stored count
        (:func:`~dynts.core.slots.select_kept`). The shift and counters are the scheduler side's
        (:meth:`RequestBudget.evicted`). A request whose evictor would rank a thinking token without a score raises
        here (one host read per round), or with ``defer_stale`` nothing is read: each group's ``stale`` holds the
        device flags of its requests for the caller to read later (:class:`dynts.core.readback.HostReadback`)."""
        self._write_deferred()
        due = [(entry, entry.row, EvictorCall(entry.settings.evictor, entry.settings.bounds.local_window,
                                              entry.question_length, stored, n_keep, owner=entry.settings))
               for entry, stored, n_keep in requests]
        out = []
        for sel in select_kept(self.table, due, check="defer" if defer_stale else True):
            self.table.compact(sel.rows, sel.kept)
            out.append(EvictionGroup(sel.members, sel.call.stored, sel.call.n_keep, sel.kept, sel.stale))
        return out
