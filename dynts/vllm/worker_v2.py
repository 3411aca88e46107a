"""Worker side of the plugin on vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``; vLLM 0.34's
only runner, the CPU runner included).

The V2 runner keeps no host copy of a request's block ids or token ids, derives positions, ``seq_lens`` and
slot mappings on the device from ``num_computed_tokens``, and leaves the hidden states of the forward in
``execute_model_state``. Per round (every method bound on the runner object by :mod:`dynts.vllm.patches`):

1. ``execute_model``, first thing -- before ``update_requests`` zeroes newly allocated blocks, which may be
   the tail blocks the scheduler just freed: the round's finished and preempted requests are forgotten, new
   ones registered (their block ids and sampling parameters are read from the ``SchedulerOutput``, as vLLM
   itself reads them), and every event of the round's :class:`~dynts.vllm.scheduler.StepPlan` runs the
   :class:`~dynts.evictors.Evictor` and moves the kept K/V to the front slots of the request's blocks in every
   layer; its block count in the runner's ``BlockTables`` is cut to the scheduler's, so the round's new
   blocks append right after the kept ones;
2. ``prepare_attn`` (after ``prepare_inputs`` built positions and ``seq_lens``, before any attention metadata):
   the scheduled tokens' positions, ids (shipped by the scheduler: ``StepPlan.token_ids``) and segments are
   recorded; ``seq_lens`` drops by each request's ``shift`` in the runner's persistent buffer (what a captured
   graph reads) and the slot mappings are computed from ``position - shift`` while RoPE keeps the logical
   positions;
3. ``execute_model``, after the forward (outside any captured region): ``seq_lens`` gets its logical values
   back for the sampler; ``sample_tokens``, after vLLM's own (its copy of the sampled tokens to the host queued
   first): the predictor scores the final-norm hidden states of every scheduled token.

A plan that contradicts what the worker holds (ids from the wrong index, ids missing, an event before the ids of its
stored tokens arrived, an event for a request it does not track) fails that one request (:meth:`RunnerV2Hooks._fail`)
and never raises inside ``execute_model``: the scheduler learns why from the round's output
(:func:`dynts.vllm.runners.report_faults`) and finishes it with ``finish_reason="error"``.
"""

from __future__ import annotations

from itertools import compress, repeat
from typing import Any

import numpy as np
import torch

from ..core import Forward
from .recording import DecodeRequests, LateBatch
from .worker import WorkerHooks

__all__ = ["RunnerV2Hooks"]


class RunnerV2Hooks(WorkerHooks):
    """The plugin's state in one V2 model runner (``GPUModelRunner`` of ``vllm.v1.worker.gpu``)."""

    def __init__(self, runner: Any, config: Any, kernel_block_sizes: Any = None, state: Any = None) -> None:
        super().__init__(runner, config, kernel_block_sizes, state)
        self.blocks: dict[str, list[int]] = {}  # block ids of the one KV group, as the scheduler allocated them
        self.params: dict[str, Any] = {}  # SamplingParams per request
        self.known: dict[str, tuple[int, list[int]]] = {}  # ids received and not yet recorded: (first index, ids)
        self.unlabelled: dict[str, list[tuple[int, int]]] = {}  # (position, slot) scored but waiting for their id
        self.lowered: tuple[torch.Tensor, torch.Tensor] | None = None  # (seq_lens rows, shifts) restored after the forward
        self.hidden: torch.Tensor | None = None  # the forward's final-norm output, scored after sample_tokens
        self.late_batch: LateBatch | None = None  # a decode step's tokens scored before their ids arrived

    # ------------------------------------------------------------------ the runner's request state
    def sampling_params(self, rid: str) -> Any:
        return self.params[rid]

    def block_ids(self, rid: str) -> list[int]:
        return self.blocks[rid]

    def holds_blocks(self, rid: str) -> bool:
        return rid in self.blocks

    def _forget(self, rid: str) -> None:
        if rid in self.tracker.slots:
            self.tracker.release(rid)
        self.shifts.pop(rid, None)
        self.untracked.discard(rid)
        self.blocks.pop(rid, None)
        self.params.pop(rid, None)
        self.known.pop(rid, None)
        self.unlabelled.pop(rid, None)
        self.failed.discard(rid)
        self.faults.pop(rid, None)

    # ------------------------------------------------------------------ one request's fault
    def _fail(self, rid: str, reason: str) -> None:
        """:meth:`WorkerHooks._fail`; its held ids go now, its slot-table row at the next round (this round's
        recording may still hold it) and it is recorded no more."""
        super()._fail(rid, reason)
        self.known.pop(rid, None)
        self.unlabelled.pop(rid, None)

    def _drop_failed(self) -> None:
        """:meth:`WorkerHooks._drop_failed`, and the ids held for them dropped."""
        super()._drop_failed()
        for rid in self.failed:
            self.known.pop(rid, None)
            self.unlabelled.pop(rid, None)

    # ------------------------------------------------------------------ per round
    def before_step(self, scheduler_output: Any) -> None:
        """Forget finished and preempted requests, register new ones, run the round's events, then take the
        round's new blocks."""
        plan = getattr(scheduler_output, "dynts_plan", None)
        if self.late_batch is not None:  # last decode step's tokens, scored without their ids
            if not self._label_late_batch(scheduler_output, plan):
                self._unpack_late_batch()
        for rid in [*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())]:
            self._forget(rid)
        self._read_stale()  # earlier rounds' stale-score flags whose copy has run: those requests fail
        for new in scheduler_output.scheduled_new_reqs:
            self._forget(new.req_id)  # a resumed request re-prefills from scratch
            self.blocks[new.req_id] = list(new.block_ids[0])
            self.params[new.req_id] = new.sampling_params
        if plan is not None:
            self._drop_failed()
            self._receive_all(plan.token_ids)
            self._label_late()
            if plan.shifts != self.shifts:  # (the same mapping while they repeat: DecodeBatch)
                self.shifts = dict(plan.shifts)
            if plan.events:
                for rid, _, _ in plan.events:
                    if rid not in self.failed and self.unlabelled.get(rid):
                        self._fail(rid, "it evicts before the ids of its stored tokens arrived (the scheduler's plan "
                                        "is out of step with the worker)")
                self._drop_failed()
                self._evict(plan.events)  # a failed or untracked request's blocks are cut, nothing of it moves
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_blocks in compress(zip(cached.req_ids, cached.new_block_ids), cached.new_block_ids):
            if rid in self.blocks:  # the requests given new blocks (``None``: none)
                self.blocks[rid].extend(new_blocks[0])

    def _truncate_blocks(self, rid: str, keep: int) -> None:
        """Cut a request's blocks to its first ``keep`` (the scheduler freed the rest), here and in the runner's
        block table (its count: the round's new blocks are appended after it)."""
        del self.blocks[rid][keep:]
        tables = self.runner.block_tables
        index = self.runner.req_states.req_id_to_index.get(rid)
        if index is not None and tables.num_blocks.np[0, index] > keep:
            tables.num_blocks.np[0, index] = keep

    def before_attention(self, batch: Any) -> torch.Tensor | None:
        """Record the scheduled tokens; lower ``seq_lens`` by each request's shift (in place). Returns the
        positions the slot mappings must use (``position - shift``), or ``None`` when nothing is shifted.

        A token whose id has not arrived yet (async scheduling: it is being sampled by the round in flight) is
        scored now and labelled when its id comes with the next plan (:meth:`_label_late`)."""
        num_reqs = batch.num_reqs
        scheduled = batch.num_scheduled_tokens[:num_reqs]
        req_ids = batch.req_ids[:num_reqs]
        decode = num_reqs > 0 and batch.num_tokens == num_reqs and scheduled.max() == 1  # one token each
        known = self._decode_requests(req_ids) if decode else None
        shift_rows = known.shifts if known is not None else np.fromiter(map(self.shifts.get, req_ids, repeat(0)),
                                                                        dtype=np.int64, count=num_reqs)
        if self._fail_overflowing(req_ids, batch.num_computed_tokens_np[:num_reqs] - shift_rows + scheduled):
            known = None  # a request failed: recorded no more
        if known is None or not self._decode_step(batch, req_ids, known):
            self._any_step(batch, req_ids, scheduled, shift_rows.tolist())
        if not shift_rows.any():
            return None
        rows, tokens, _ = self.device_shifts(shift_rows, scheduled, batch.positions.shape[0], batch.seq_lens.dtype,
                                             batch.positions.dtype)
        lowered = batch.seq_lens[:num_reqs]
        lowered -= rows
        self.lowered = (lowered, rows)
        return batch.positions - tokens

    def _decode_step(self, batch: Any, req_ids: list[str], known: DecodeRequests) -> bool:
        """A decode step (one token each) of requests already recorded (``known``: their
        :class:`~dynts.vllm.recording.DecodeRequests`), none waiting for ids, in one vectorised pass: under async
        scheduling every token waits for its id (scored now, labelled by :meth:`_label_late_batch`), under
        synchronous scheduling every id is held and recorded now. ``False`` (nothing done) for any other step."""
        unlabelled = self.unlabelled
        if unlabelled and any(map(unlabelled.__contains__, req_ids)):
            return False
        computed = batch.num_computed_tokens_np[: len(req_ids)].astype(np.int64)  # a copy: the late batch keeps it
        stored = computed - known.shifts
        held = list(map(self.known.get, req_ids)) if self.known else None
        positions = tuple(computed.tolist())
        if held is None or all(h is None or (not h[1] and h[0] == p) for h, p in zip(held, positions)):  # no id yet
            places = self.tracker.place_decode(known.rows, stored, computed, score=self.predictor is not None)
            self.late_batch = LateBatch(list(req_ids), known.entries, known.rows, computed, stored, positions, places)
            return True
        if not all(h is not None and h[0] == p and len(h[1]) == 1 for h, p in zip(held, positions)):
            return False
        tokens = [h[1][0] for h in held]
        self.known.update((rid, (p + 1, [])) for rid, p in zip(req_ids, positions))
        self.tracker.record_decode(known.entries, computed, stored, tokens, score=self.predictor is not None,
                                   rows=known.rows)
        return True

    def _any_step(self, batch: Any, req_ids: list[str], scheduled: np.ndarray, shift_list: list[int]) -> None:
        """Record any step (prefill chunks, requests seen first, prefix-cache hits, ids partly known) request by
        request; every token of the batch is scored into its own slot (a request not recorded: the scratch row)."""
        states, num_reqs = self.runner.req_states, len(req_ids)
        get_entry, unlabelled = self.tracker.slots.get, self.unlabelled
        forwards, cached = [], []
        score_rows: list[int] = []
        score_slots: list[int] = []
        for rid, q, computed, shift in zip(req_ids, scheduled.tolist(), batch.num_computed_tokens_np[:num_reqs].tolist(),
                                           shift_list):
            entry, opened = get_entry(rid), False
            if entry is None:
                entry, opened = self.entry_of(rid, int(states.prompt_len.np[states.req_id_to_index[rid]]))
                if entry is None:  # not recorded (failed, or never evicting): its tokens' scores go to scratch
                    score_rows += [self.scratch_row] * q
                    score_slots += [0] * q
                    continue
            if opened and computed > 0:  # a prefix-cache hit: the shared prompt blocks hold these tokens already
                cached.append(Forward(entry, 0, 0, self._take(rid, 0, computed, require=True)))
            stored = computed - shift
            waiting = unlabelled.get(rid)
            ids = [] if waiting else self._take(rid, computed, q)
            if ids:
                forwards.append(Forward(entry, computed, stored, ids))
            if len(ids) < q:
                if waiting is None:
                    waiting = unlabelled[rid] = []
                waiting.extend((computed + j, stored + j) for j in range(len(ids), q))
            score_rows += [entry.row] * q
            score_slots += range(stored, stored + q)
        if cached:
            self.tracker.record(cached)  # metadata only: these tokens are not in this forward's hidden states
        if forwards:
            self.tracker.record(forwards)
        if self.predictor is not None and score_rows:  # every token of the batch, in its order
            self.tracker.pending_scores = (*self.staging.columns((score_rows, score_slots)), len(score_rows))

    # ------------------------------------------------------------------ token ids from the scheduler
    def _receive_all(self, token_ids: dict[str, tuple[int, list[int]]]) -> None:
        """Take the plan's shipments of ids. The common one under async scheduling -- the one id of the one token a
        request was scored without, from exactly where the worker expects it -- labels that token at once, every
        such request in one vectorised record (:meth:`SlotTracker.record_decode`); any other goes through
        :meth:`_receive` and :meth:`_label_late`."""
        late, known, failed, get_entry = self.unlabelled, self.known, self.failed, self.tracker.slots.get
        entries, positions, slots, tokens = [], [], [], []
        for rid, (start, ids) in token_ids.items():
            waiting, held = late.get(rid), known.get(rid)
            if (waiting is not None and len(waiting) == 1 and len(ids) == 1 and waiting[0][0] == start
                    and (held is None or (not held[1] and held[0] == start)) and rid not in failed):
                entry = get_entry(rid)
                if entry is not None:
                    (position, slot), = waiting
                    entries.append(entry)
                    positions.append(position)
                    slots.append(slot)
                    tokens.append(ids[0])
                    del late[rid]
                    known[rid] = (start + 1, [])
                    continue
            self._receive(rid, start, ids)
        if entries:  # positions, segments and ids; their scores stay
            self.tracker.record_decode(entries, positions, slots, tokens, keep_scores=True)

    def _label_late_batch(self, scheduler_output: Any, plan: Any) -> bool:
        """Label the last decode step's tokens (:attr:`late_batch`) when the plan brings exactly their ids -- the
        steady state under async scheduling: the same requests, each shipped the one id from the index it waits
        for, none finished, preempted or failed -- in one vectorised record, deferred to the tracker's next table
        operation (the next decode step's places: one upload for both); ``False`` (nothing done) otherwise."""
        late = self.late_batch
        rids = late.rids
        shipped = None if plan is None else plan.token_ids
        if (not shipped or self.failed or scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids
                or len(shipped) != len(rids) or list(shipped) != rids):
            return False
        starts, ids = zip(*shipped.values())
        if starts != late.starts:
            return False
        try:
            tokens = [token for (token,) in ids]  # exactly one id each
        except ValueError:
            return False
        self.late_batch = None
        self.tracker.record_decode(late.entries, late.positions, late.slots, tokens, keep_scores=True, rows=late.rows,
                                   places=late.places, defer=True)  # their scores stay; written with the next places
        plan.token_ids = {}  # taken
        if self.known:  # nothing is held for them now (an earlier general step's records)
            for rid in rids:
                self.known.pop(rid, None)
        return True

    def _unpack_late_batch(self) -> None:
        """The last decode step's unlabelled tokens into the per-request records (:attr:`unlabelled`, :attr:`known`)
        the general path reads."""
        late, self.late_batch = self.late_batch, None
        slots = late.slots.tolist()
        self.unlabelled.update((rid, [(p, s)]) for rid, p, s in zip(late.rids, late.starts, slots))
        self.known.update((rid, (p, [])) for rid, p in zip(late.rids, late.starts))

    def _receive(self, rid: str, start: int, ids: list[int]) -> None:
        """Take a shipment of ids (absolute indices ``start ..``), contiguous with what is held."""
        if rid in self.failed:
            return
        held = self.known.get(rid)
        if held is None or start == 0:
            self.known[rid] = (start, list(ids))
            return
        first, have = held
        if start != first + len(have):
            self._fail(rid, f"its token ids arrive from index {start} while the worker holds "
                            f"{first}..{first + len(have)} (scheduler and worker disagree)")
            return
        have.extend(ids)

    def _take(self, rid: str, start: int, count: int, require: bool = False) -> list[int]:
        """The held ids of indices ``start ..`` (at most ``count``; fewer when the rest has not arrived), dropped
        once taken."""
        first, have = self.known.get(rid, (start, []))
        if first > start or (require and first + len(have) < start + count):
            self._fail(rid, f"the worker has no token ids for its indices {start}..{start + count} (scheduler and "
                            "worker disagree)")
            return []
        ids = have[start - first : start - first + count]
        self.known[rid] = (start + len(ids), have[start - first + len(ids):])
        return ids

    def _label_late(self) -> None:
        """Record the metadata of scored tokens whose ids just arrived (their scores are kept)."""
        forwards = []
        for rid, waiting in list(self.unlabelled.items()):
            entry = self.tracker.slots.get(rid)
            if entry is None:
                self._fail(rid, "its scored tokens wait for their ids but the worker does not track it")
                continue
            ids = self._take(rid, waiting[0][0], len(waiting))
            if not ids:
                continue
            forwards.append(Forward(entry, waiting[0][0], waiting[0][1], ids))
            del waiting[: len(ids)]
            if not waiting:
                del self.unlabelled[rid]
        if forwards:
            self.tracker.record(forwards, keep_scores=True)  # positions, segments and ids; their scores stay

    def after_execute(self) -> None:
        """Give ``seq_lens`` back its logical values (the sampler tells a finished prefill by ``seq_len >=
        prefill_len``: a resumed request's stored length may be shorter) and keep the forward's final-norm hidden
        states for :meth:`after_sample` (``sample_tokens`` drops the runner's reference to them)."""
        if self.lowered is not None:
            rows, shifts = self.lowered
            rows += shifts
            self.lowered = None
        self.hidden = None
        if self.predictor is None or self.tracker.pending_scores is None:
            return
        state = getattr(self.runner, "execute_model_state", None)
        hidden = getattr(state, "hidden_states", None)
        if not isinstance(hidden, torch.Tensor):  # an intermediate pipeline stage: not the last rank
            self.tracker.pending_scores = None
            return
        self.hidden = hidden

    def after_sample(self) -> None:
        """Score the recorded tokens from the forward's final-norm hidden states, queued after ``sample_tokens`` has
        queued the sampled tokens' copy to the host, so that copy never waits behind the predictor."""
        hidden, self.hidden = self.hidden, None
        if hidden is None or self.tracker.pending_scores is None:
            return
        with torch.no_grad():
            self.tracker.write_scores(hidden, self.predictor)
