"""Per-request eviction inside transformers' continuous batching: the engine's adapter onto :mod:`dynts.core`.

One counter drives the engine: ``RequestState.position_offset`` is a request's RoPE position, its key
length, its read/write indices through the block table, its block count and the scheduler's budget.
Here it counts the *stored* slots. A per-request ``shift`` (tokens evicted so far) is added to that
request's slice of ``position_ids`` after the batch tensors are built, so RoPE positions stay
absolute while the keys of the kept tokens sit contiguously at the front of the request's pages.

Where the adapter meets transformers (every other call leads into the core:
:class:`~dynts.core.policy.EvictionPolicy` on the scheduler side, :class:`~dynts.core.tracker.SlotTracker`
on the worker side, each with its own record per request: :class:`~dynts.core.slots.RequestBudget` and
:class:`~dynts.core.slots.RequestRow`):

| transformers object | how dynts hooks it | what runs |
|---|---|---|
| ``ContinuousBatchProcessor`` | ``__class__`` swap in ``EvictingBatchingManager._create_batch_processor`` (transformers builds the processor inside its generation thread) | :class:`EvictingBatchProcessor` |
| ``prepare_next_batch`` | override | ``_record_batch``: ``EvictionPolicy.open``, ``SlotTracker.open`` / ``record``, positions shifted |
| ``update_batch`` | override | ``SlotTracker.write_scores``; ``_evict_due``: ``EvictionPolicy.event`` -> ``SlotTracker.evict`` -> ``copy_plan`` -> ``_gather_rows`` / ``_pop_tail_blocks`` |
| ``scheduler._get_waiting_candidates`` | instance attribute wrapped | ``_admissible``: ``EvictionPolicy.claimed`` / ``admit`` |
| ``offloading_manager.offload_requests`` | instance attribute wrapped | ``_after_preemption``: ``EvictionPolicy.preempted`` per preempted request; one preempted after an event fails (``fail_request``) |
| ``model_runner._sample`` | instance attribute replaced (per-request sampling only) | :class:`~dynts.serving.sampling.PerRequestSampler` |
| the model's final norm | forward hook (the manager's) | ``stash_hidden``: a copy into a static buffer, CUDA-graph safe |

At the end of every round (:meth:`EvictingBatchProcessor.update_batch`) each decoding request whose
next token would overflow the budget (:meth:`dynts.Budget.due`) has an eviction event: its
:class:`~dynts.TokenInfo` goes to the evictor, the kept slots that move (:func:`~dynts.core.copy_plan`)
are copied to the front of the request's pages in every layer, a bounded chunk of rows at a time
(:meth:`EvictingBatchProcessor._gather_rows`), its tail blocks go back to the pool, and its row of the
:class:`~dynts.core.SlotTable` is compacted the same way.

DynTS scores are graph-safe: the forward (captured in a CUDA graph or not) only copies the final-norm
output into a static buffer (:meth:`EvictingBatchProcessor.stash_hidden`, called by the manager's
forward hook); the predictor and the slot bookkeeping run after the forward or graph replay, at the
start of :meth:`EvictingBatchProcessor.update_batch`, outside any graph.

Memory: a request is admitted only when the pool can cover its reservation (``ceil(min(B, prompt +
max_new) / page)`` blocks) on top of what the requests in flight may still claim, so an evicting
request never runs out of blocks and is never preempted into a re-prefill (which would replay a
different, unevicted trajectory). Prefix block sharing and async batching are switched off by the
manager (:mod:`dynts.serving.manager`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from ..core import EvictionPolicy, EvictionSettings, Forward, RequestBudget, RequestRow, SlotTracker, copy_plan

__all__ = ["EvictingBatchProcessor"]


def prompt_length(state: RequestState) -> int:
    """The request's own prompt length (after a soft reset ``initial_tokens`` also holds generated tokens)."""
    return getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)


class EvictingBatchProcessor(ContinuousBatchProcessor):
    """A ``ContinuousBatchProcessor`` that bounds every request's KV cache to a budget.

    Built by :class:`~dynts.serving.manager.EvictingBatchingManager` (its ``_create_batch_processor``
    re-classes the stock processor and calls :meth:`attach_eviction`).
    """

    settings: EvictionSettings
    tracker: SlotTracker

    # ------------------------------------------------------------------ setup
    def attach_eviction(self, settings: EvictionSettings, think_end: Sequence[int] | None,
                        finished_stats: dict[str, dict[str, int]] | None = None) -> None:
        """Switch eviction on; ``think_end`` are the delimiter's token ids (:func:`dynts.thinking.think_end_ids`,
        ``None``: every generated token is thinking); ``finished_stats`` (owned by the caller) receives each
        request's statistics."""
        if len(self.cache.cache_allocators) != 1 or "full_attention" not in self.cache.cache_allocators:
            raise ValueError(
                f"dynts serving supports models whose layers all use full attention; this model has "
                f"{sorted(self.cache.cache_allocators)} layer groups (sliding-window/hybrid layers keep a ring "
                "buffer that never frees blocks early)"
            )
        if self.use_async_batching:
            raise ValueError("eviction needs synchronous batching: set ContinuousBatchingConfig(use_async_batching=False)")
        if self.cache.use_prefix_sharing and settings.bounded:
            raise ValueError("eviction needs prefix block sharing off: ContinuousBatchingConfig(allow_block_sharing=False)")
        self.settings = settings
        self.allocator = self.cache.cache_allocators["full_attention"]
        self.page = self.allocator.tokens_per_page
        self.tracker = SlotTracker(settings, self.model_device, think_end)
        self.policy = EvictionPolicy(self.page)  # trace rows: (seconds since attach, blocks in use, requests in flight)
        self.finished_stats = finished_stats if finished_stats is not None else {}
        self._started = time.perf_counter()
        self._round = 0
        # physical row offsets of every layer's keys and values inside the allocator's flat token view
        flat, offsets = self._flat_view()
        self._flat = flat
        self._layer_offsets = offsets
        # admission control: hand the scheduler only the waiting requests whose reservation fits
        original = self.scheduler._get_waiting_candidates
        self.scheduler._get_waiting_candidates = lambda: self._admissible(original())
        offload = self.offloading_manager.offload_requests

        def guarded_offload(*args, **kwargs):
            before = list(self.scheduler.active_requests)
            done = offload(*args, **kwargs)
            self._after_preemption([rid for rid in before if rid not in self.scheduler.active_requests])
            return done

        self.offloading_manager.offload_requests = guarded_offload
        self.sampler = None
        self.predictor = None
        self.hidden_buffer: torch.Tensor | None = None
        self.batch_in_flight = False  # a batch was prepared and not yet updated (dynts.serving.admission)

    def attach_sampler(self, sampler) -> None:
        """Sample every request with its own parameters (:class:`~dynts.serving.sampling.PerRequestSampler`
        replaces the engine's batch-wide sampling step)."""
        self.sampler = sampler
        self.model_runner._sample = sampler

    def attach_predictor(self, predictor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score every forward's new tokens with ``predictor`` (DynTS). Allocates the static buffer
        ``[rows, hidden]`` (model dtype) the forward hook writes into: ``rows`` covers the largest padded
        batch the engine runs (``max_batch_tokens``, or ``max_requests_per_batch`` on the decode path)."""
        rows = max(self.max_batch_tokens, self.cb_config.max_requests_per_batch or 0)
        self.predictor = predictor
        self.hidden_buffer = torch.empty(rows, self.config.hidden_size, dtype=self.model_dtype,
                                         device=self.model_device)

    def stash_hidden(self, hidden_states: torch.Tensor) -> None:
        """Copy the final-norm output ``[1, T, h]`` (``T``: padded batch tokens) into the static buffer.
        Graph-safe: one copy between fixed addresses, no host reads, shapes fixed by the graph."""
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        if hidden.shape[0] > self.hidden_buffer.shape[0]:
            raise RuntimeError(f"forward of {hidden.shape[0]} tokens; the hidden-state buffer holds "
                               f"{self.hidden_buffer.shape[0]}")
        self.hidden_buffer[: hidden.shape[0]].copy_(hidden)

    def _flat_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocator's cache as ``[rows, kv_heads, head_dim]`` and, per layer and K/V, the offset
        that maps a physical token index ``p`` to its row: ``p + offset`` (one gather serves all layers)."""
        views = self.allocator._kv_token_views  # layer -> (keys, values): row views into one flat tensor
        flat = views[self.allocator.layer_indices[0]][0]  # the first layer's keys start at row 0
        origin, row = flat.storage_offset(), flat.stride(0)
        offsets = [(t.storage_offset() - origin) // row for layer in self.allocator.layer_indices for t in views[layer]]
        return flat, torch.tensor(offsets, dtype=torch.long, device=flat.device)

    @property
    def slots(self) -> dict[str, RequestRow]:
        """The worker records of the requests in flight (the tracker's)."""
        return self.tracker.slots

    @property
    def table(self):
        """The tracker's :class:`~dynts.core.SlotTable`."""
        return self.tracker.table

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "settings"):
            for rid in list(self.policy.requests):
                self._release(rid)
            self.tracker.pending_scores = None

    # ------------------------------------------------------------------ memory
    def free_blocks_in_pool(self) -> int:
        pool, index = self.cache.pool, self.allocator.index
        return pool.count_free_blocks(index) + pool.num_free_sectors * self.allocator.blocks_per_sector

    def blocks_in_use(self) -> int:
        return sum(len(t) for t in self.allocator.block_table.values())

    def reservation(self, state: RequestState) -> int:
        """Blocks a request may hold at most (its admission reserves them)."""
        # after a soft reset, generated tokens move from max_new_tokens to the prompt: the sum is unchanged
        return self.policy.reservation(self.settings, len(state.initial_tokens), state.max_new_tokens)

    def _admissible(self, waiting: list[RequestState]) -> list[RequestState]:
        """The longest prefix of ``waiting`` whose reservations fit the pool next to the requests in flight
        (:meth:`dynts.core.policy.EvictionPolicy.admit`); a request that can never fit fails now."""
        if not self.settings.bounded:
            return waiting
        claimed = self.policy.claimed((self._entry(state), len(self.allocator.block_table.get(rid, ())))
                                      for rid, state in self.scheduler.active_requests.items())
        fitting = []
        for state in waiting:
            need = self.reservation(state)
            if need > self.allocator.num_blocks:  # would wait forever: fail it now, with the fix
                self.fail_request(state, ValueError(
                    f"request {state.request_id} reserves {need} KV blocks (min(budget, prompt + max_new_tokens) / "
                    f"page) but the pool holds {self.allocator.num_blocks}; lower the budget or add blocks (num_blocks)"
                ))
                continue
            fitting.append((state, need))
        admitted = self.policy.admit((need for _, need in fitting), self.free_blocks_in_pool(), claimed)
        return [state for state, _ in fitting[:admitted]]

    # ------------------------------------------------------------------ per round
    def prepare_next_batch(self) -> bool:
        self.batch_in_flight = False
        ready = super().prepare_next_batch()
        self._release_finished()
        if ready:
            self._record_batch()
            if self.sampler is not None:
                self.sampler.prepare(self.inputs_and_outputs.requests_in_batch)
                self.sampler.forget(set(self.scheduler.active_requests))
        self.batch_in_flight = ready
        if ready:
            self._order_before_forward()
        return ready

    def _order_before_forward(self) -> None:
        """The engine computes on its own stream; what this processor queued on the current stream since
        the last forward (eviction copies, the predictor reading the hidden-state buffer, the shifted
        position ids) must finish before the next forward reads or overwrites those tensors."""
        stream = self.inputs_and_outputs.compute_stream
        if stream is not None:
            stream.wait_stream(torch.get_device_module(stream.device).current_stream(stream.device))

    def update_batch(self) -> None:
        if self.predictor is not None:  # the forward (or its graph replay) is done: score its new tokens
            self.write_scores(self.hidden_buffer, self.predictor)
        super().update_batch()
        self._release_finished()
        if self.settings.bounded:
            self._evict_due()
        self.batch_in_flight = False
        self._round += 1
        in_use = self.blocks_in_use()
        self.policy.after_round(in_use, (time.perf_counter() - self._started, in_use, len(self.scheduler.active_requests)))

    def _entry(self, state: RequestState) -> RequestBudget:
        """The request's record in the policy (reservation, shift, statistics), opened on first use."""
        return self.policy.open(state.request_id, self.settings, prompt_length(state), None,
                                reserved_blocks=self.reservation(state))

    def _request_slots(self, state: RequestState) -> tuple[RequestBudget, RequestRow]:
        """The request's two records: the policy's and the tracker's (its table row), opened on first use."""
        entry = self._entry(state)
        return entry, self.tracker.open(state.request_id, entry.question_length, entry.settings)

    def _record_batch(self) -> None:
        """Write the metadata of the batch's new tokens and shift their positions to absolute ones."""
        if not self.settings.bounded:  # the full cache: statistics only, the engine runs as shipped
            for future in self.inputs_and_outputs.requests_in_batch:
                state = future.state
                self.policy.scheduled(self._request_slots(state)[0], state.position_offset,
                                      len(self.allocator.block_table.get(state.request_id, ())))
            return
        forwards, shifts = [], []
        for future in self.inputs_and_outputs.requests_in_batch:
            state, q = future.state, future.query_length
            entry, row = self._request_slots(state)
            stored = state.position_offset - q  # slots stored before this forward
            start = stored + entry.shift  # absolute index of the first new token
            prompt = state.initial_tokens
            if start >= len(prompt):
                new = state.generated_tokens[start - len(prompt) : start - len(prompt) + q]
            else:
                new = prompt[start : start + q]
            if len(new) != q:
                raise RuntimeError(f"request {state.request_id}: cannot find the {q} tokens of this forward")
            forwards.append(Forward(row, start, stored, new))
            shifts += [entry.shift] * q
            self.policy.scheduled(entry, stored + q, len(self.allocator.block_table.get(state.request_id, ())))
        self.tracker.record(forwards, score=self.settings.needs_scores)
        if any(shifts):
            ids = self.inputs_and_outputs.position_ids
            ids[: len(shifts)] += torch.tensor(shifts, dtype=ids.dtype, device=ids.device)

    def write_scores(self, hidden_states: torch.Tensor, predictor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score the new tokens of the last forward from its final-norm output ``[T', h]`` (``T' >= T``)."""
        with torch.no_grad():
            self.tracker.write_scores(hidden_states, predictor)

    def request_stats(self, rid: str) -> dict[str, int]:
        """Statistics of a request in flight or finished (empty if unknown)."""
        if rid in self.slots:
            return self.policy.get(rid).stats()
        return dict(self.finished_stats.get(rid, {}))

    def _release_finished(self) -> None:
        active, waiting = self.scheduler.active_requests, self.scheduler.waiting_requests
        for rid in [r for r in self.policy.requests if r not in active and r not in waiting]:
            self._release(rid)

    def _after_preemption(self, preempted: Sequence[str]) -> None:
        """The engine preempted ``preempted`` (:meth:`~dynts.core.policy.EvictionPolicy.preempted` counts each).
        A request sent back to the waiting queue keeps its cache only when offloaded to CPU; a soft reset
        re-prefills prompt + generated tokens, which replays a different (unevicted) trajectory once the
        request has evicted: such a request fails with a clear error instead of continuing wrongly."""
        must_fail = {rid for rid in preempted if self.policy.preempted(rid)}
        waiting = self.scheduler.waiting_requests
        for rid in [r for r in preempted if r in self.slots and r in waiting and not waiting[r].is_cpu_offloaded]:
            if rid not in must_fail:
                self._release(rid)  # nothing evicted yet: the re-prefill is exact, start a fresh entry
                continue
            self.fail_request(waiting[rid], RuntimeError(self.policy.failure(rid, self.policy.get(rid))))

    def fail_request(self, state: RequestState, error: Exception) -> None:
        """Fail one request, running or waiting: its entry released (statistics kept), ``error`` delivered to its
        client with the tokens it generated, its blocks back to the pool, and out of the scheduler's queues."""
        rid = state.request_id
        if hasattr(self, "settings") and rid in self.policy.requests:
            self._release(rid)
        self._handle_request_error(error, state)  # reads a running request's tokens: before the scheduler drops it
        self.scheduler.finish_request(rid)
        self.scheduler.waiting_requests.pop(rid, None)
        if rid in self.scheduler.waiting_requests_order:
            self.scheduler.waiting_requests_order.remove(rid)

    def _release(self, rid: str) -> None:
        """Drop a request from the table and the policy; its statistics stay in :attr:`finished_stats`."""
        if rid in self.slots:
            self.tracker.release(rid)
        self.finished_stats[rid] = self.policy.finish(rid)

    # ------------------------------------------------------------------ eviction
    def _evict_due(self) -> None:
        """The round's events (:meth:`dynts.core.policy.EvictionPolicy.event`): kept slots from the tracker,
        K/V rows moved, tail blocks back to the pool, ``position_offset`` = the kept count."""
        due = []
        for rid, state in self.scheduler.active_requests.items():
            row = self.slots.get(rid)
            if row is not None and state.status == RequestStatus.DECODING:
                budget = self.policy.get(rid)
                event = self.policy.event(rid, budget, state.position_offset)
                if event is not None:
                    due.append((state, row, event, budget))
        if not due:
            return
        states = {id(row): (state, event, budget) for state, row, event, budget in due}
        src, dst = [], []
        for group in self.tracker.evict([(row, event.stored, event.n_keep) for _, row, event, _ in due]):
            members = [states[id(e)] for e in group.entries]
            physical = torch.tensor(
                [self.allocator.get_read_indices(s.request_id, 0, group.stored) for s, _, _ in members],
                dtype=torch.long, device=self._flat.device,
            )  # [g, stored]
            moved = copy_plan(group.kept, physical)
            src.append(moved[0])
            dst.append(moved[1])
            for state, event, budget in members:
                self.policy.freed(budget, self._pop_tail_blocks(state.request_id, event.keep_blocks))
                state.position_offset = group.n_keep
        self._gather_rows(torch.cat(src), torch.cat(dst))

    def _gather_rows(self, src: torch.Tensor, dst: torch.Tensor, chunk: int = 4096) -> None:
        """Copy token rows ``src`` -> ``dst`` (physical indices, :func:`~dynts.core.copy_plan` order) in every
        layer's keys and values, ``chunk`` rows of every layer at a time (bounded scratch)."""
        offsets = self._layer_offsets.unsqueeze(1)
        flat = self._flat
        for lo in range(0, src.numel(), chunk):
            s, d = src[lo : lo + chunk], dst[lo : lo + chunk]
            flat.index_copy_(0, (d.unsqueeze(0) + offsets).flatten(), flat.index_select(0, (s.unsqueeze(0) + offsets).flatten()))

    def _pop_tail_blocks(self, rid: str, keep: int) -> int:
        """Return the blocks of a request past its first ``keep`` to the pool; count them."""
        table = self.allocator.block_table[rid]
        tail = table[keep:]
        del table[keep:]
        freed = [b for b in tail if self.allocator.ledger.release(b, no_cache=True)]
        if freed:
            self.cache.pool.free_blocks(self.allocator.index, freed)
        return len(tail)
