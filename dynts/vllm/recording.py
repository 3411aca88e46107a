"""The decode step of the vLLM worker hooks, kept cheap on the host (:class:`DecodeRecording`, V1's; the rest both
runners share).

A plain decode step schedules the same requests as the step before, one token each. Every such step lowers
``seq_lens`` and the slot mapping's positions by each request's ``shift``; the shifts change only at eviction rounds
(and when the batch changes), so :class:`DeviceShifts` uploads them once and hands the same device tensors back while
they repeat: a plain step between two eviction rounds uploads nothing for them. :class:`DecodeBatch` keeps the batch's
records, table rows and shifts while nothing about them changed; :class:`LateBatch` is a decode step whose ids arrive
with the next plan (V2 under async scheduling).
"""

from __future__ import annotations

from functools import cached_property
from itertools import repeat
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core.tracker import DecodePlaces
from ..core.upload import HostStaging

__all__ = ["DecodeBatch", "DecodeRecording", "DecodeRequests", "DeviceShifts", "LateBatch"]

_ROW = attrgetter("row")


class LateBatch(NamedTuple):
    """A decode step's tokens, scored before their ids arrived (V2 under async scheduling): one per request ``rids[i]``
    (its record ``entries[i]``, table row ``rows[i]``) at absolute index ``positions[i]`` (also as the ints
    ``starts``, compared with the plan's shipment) into slot ``slots[i]``; ``places``: the same on the device
    (:meth:`~dynts.core.SlotTracker.place_decode`), which their labels reuse."""

    rids: list[str]
    entries: list[Any]
    rows: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    starts: tuple[int, ...]
    places: DecodePlaces


class DecodeRequests(NamedTuple):
    """A decode step's requests: their records, table rows and shifts (``[n]`` each, in batch order)."""

    entries: list[Any]
    rows: np.ndarray
    shifts: np.ndarray


class DecodeBatch:
    """The last decode step's :class:`DecodeRequests`, handed back while the batch's request ids, the tracker's records
    (:attr:`~dynts.core.SlotTracker.generation`) and the round's shifts (the same mapping) are unchanged: every plain
    step between two eviction rounds, which then looks nothing up per request. The arrays are only ever read."""

    def __init__(self) -> None:
        self._key: tuple[list[str], int, Any] | None = None
        self._requests: DecodeRequests | None = None

    def get(self, req_ids: list[str], generation: int, shifts: dict[str, int]) -> DecodeRequests | None:
        """The requests of ``req_ids`` as last kept, or ``None`` when anything changed."""
        key = self._key
        if key is None or key[1] != generation or key[2] is not shifts or key[0] != req_ids:
            return None
        return self._requests

    def put(self, req_ids: list[str], generation: int, shifts: dict[str, int], entries: list[Any]) -> DecodeRequests:
        """Keep the requests of ``req_ids`` (``entries``: their records, all present) under their shifts."""
        rows = np.fromiter(map(_ROW, entries), dtype=np.int64, count=len(entries))
        per_row = np.fromiter(map(shifts.get, req_ids, repeat(0)), dtype=np.int64, count=len(req_ids))
        self._key, self._requests = (list(req_ids), generation, shifts), DecodeRequests(entries, rows, per_row)
        return self._requests


class DeviceShifts:
    """The round's shifts on the device, per batch row (in the dtype of the runner's ``seq_lens``) and per token (in
    the dtype of its positions), and per batch row on the host (V1's CPU copy of ``seq_lens``): one upload through the
    worker's pinned ``staging`` (never waited on), reused while the rows' shifts, their scheduled tokens, the padded
    token count and the dtypes repeat. The tensors handed out are only ever read."""

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging
        self._key: tuple | None = None
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, per_row: np.ndarray, scheduled: np.ndarray, padded: int, row_dtype: torch.dtype,
                 token_dtype: torch.dtype, host_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``per_row`` ``[n]`` on the device as ``row_dtype``; per token (``scheduled[i]`` tokens of row ``i``, then
        zeros up to ``padded`` tokens) as ``token_dtype``; ``per_row`` on the host as ``host_dtype`` (``None``: not
        wanted)."""
        key = (per_row.tobytes(), scheduled.tobytes(), padded, row_dtype, token_dtype, host_dtype)
        if key != self._key:
            per_token = np.zeros(padded, dtype=np.int64)
            tokens = np.repeat(per_row, scheduled)
            per_token[: len(tokens)] = tokens
            shifts = self.staging.upload(np.concatenate([per_row, per_token]))  # one copy, never waited on
            n = len(per_row)
            host = None if host_dtype is None else torch.from_numpy(per_row.copy()).to(host_dtype)
            self._key, self._tensors = key, (shifts[:n].to(row_dtype), shifts[n:].to(token_dtype), host)
        return self._tensors


class DecodeRecording:
    """The decode step of :class:`~dynts.vllm.worker.WorkerHooks` (mixed in; V2's hooks inherit the shifts and the
    batch): every request's token recorded in one vectorised pass, and the guard that no request stores past its
    slot-table row. It reads the hooks' ``tracker``, ``staging``, ``shifts``, ``untracked``, ``failed``,
    ``predictor`` and ``scratch_row``, and calls their ``_fail`` and ``_drop_failed``."""

    @cached_property
    def device_shifts(self) -> DeviceShifts:
        """The round's shifts on the device, uploaded only when they change (:class:`DeviceShifts`)."""
        return DeviceShifts(self.staging)

    @cached_property
    def decode_batch(self) -> DecodeBatch:
        """The last decode step's records, table rows and shifts, kept while nothing about them changed
        (:class:`DecodeBatch`)."""
        return DecodeBatch()

    def _decode_requests(self, req_ids: list[str]) -> DecodeRequests | None:
        """The records, table rows and shifts of a decode step's requests (the last step's while nothing changed);
        ``None`` when one is not recorded."""
        known = self.decode_batch.get(req_ids, self.tracker.generation, self.shifts)
        if known is None:
            found = list(map(self.tracker.slots.get, req_ids))
            if not all(found):  # (``None in found`` would call each record's __eq__)
                return None
            known = self.decode_batch.put(req_ids, self.tracker.generation, self.shifts, found)
        return known

    def _fail_overflowing(self, req_ids: list[str], ends: np.ndarray) -> bool:
        """Fail every recorded request this step would store past the slot table's reserved width (``ends[i]``: the
        slots request ``req_ids[i]`` holds after the step, ``stored + scheduled``), before anything is recorded: a
        budget bounds what a request stores, so only a scheduler/worker disagreement (a stale evicted count) gets
        there, and it ends that request alone (:meth:`_fail`), never the engine. Their table rows go at once; their
        tokens' scores go to the scratch row. ``True`` when one failed (the step's records changed)."""
        table = self.tracker.table
        if not table.fixed or not len(ends) or int(ends.max()) <= table.width:
            return False
        slots, failed = self.tracker.slots, self.failed
        over = [i for i in np.flatnonzero(ends > table.width).tolist()
                if req_ids[i] in slots and req_ids[i] not in failed]
        for i in over:
            self._fail(req_ids[i], f"it would store {int(ends[i])} slots, past the {table.width} its slot-table row "
                                   "holds (max_budget): the scheduler's evicted count is out of step with the worker")
        if over:
            self._drop_failed()
        return bool(over)

    def _record_decode(self, batch: Any, requests: DecodeRequests) -> None:
        """Record a decode step (one token per request, every request recorded: ``requests``) through
        :meth:`SlotTracker.record_decode`."""
        num_reqs = len(requests.rows)
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        tokens = batch.token_ids_cpu[np.arange(num_reqs), computed]
        self.tracker.record_decode(requests.entries, computed, computed - requests.shifts, tokens,
                                   score=self.predictor is not None, rows=requests.rows)

    def _record_decode_partly(self, batch: Any, req_ids: list[str], shift_rows: np.ndarray) -> bool:
        """A decode step where some requests are not recorded (failed, or never evicting); ``False`` (nothing
        recorded) when one is seen first (opened by the general path)."""
        num_reqs = len(req_ids)
        found = list(map(self.tracker.slots.get, req_ids))
        if any(entry is None and rid not in self.untracked for entry, rid in zip(found, req_ids)):
            return False
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        stored = computed - shift_rows
        index = np.flatnonzero([entry is not None for entry in found])
        if len(index):
            self.tracker.record_decode([found[i] for i in index.tolist()], computed[index], stored[index],
                                       batch.token_ids_cpu[index, computed[index]])
        if self.predictor is not None:  # every token of the batch scored into its own slot, a skipped one to scratch
            rows = [None if entry is None else entry.row for entry in found]
            self._expect_scores(rows, stored, np.ones(num_reqs, dtype=np.int64))
        return True

    def _expect_scores(self, rows: list, stored: np.ndarray, scheduled: np.ndarray) -> None:
        """The next forward scores every token of the batch (``scheduled[i]`` tokens of request ``i``, stored from slot
        ``stored[i]`` in table row ``rows[i]``) into its own slot; a request not recorded (``None``: failed, or
        skipped) points its tokens at the scratch row. Hidden-state row ``t`` is token ``t`` of the batch."""
        skipped = np.array([r is None for r in rows], dtype=bool)
        row_of = np.array([self.scratch_row if r is None else r for r in rows], dtype=np.int64)
        first = np.where(skipped, 0, stored)  # a skipped request's tokens all go to the scratch row's slot 0
        offsets = np.arange(int(scheduled.sum())) - np.repeat(np.cumsum(scheduled) - scheduled, scheduled)
        slots = np.repeat(first, scheduled) + np.where(np.repeat(skipped, scheduled), 0, offsets)
        self.tracker.expect_scores(np.repeat(row_of, scheduled), slots)
