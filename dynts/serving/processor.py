"""Per-request eviction inside transformers' continuous batching (``ContinuousBatchProcessor``).

One counter drives the engine: ``RequestState.position_offset`` is a request's RoPE position, its key
length, its read/write indices through the block table, its block count and the scheduler's budget.
Here it counts the *stored* slots. A per-request ``shift`` (tokens evicted so far) is added to that
request's slice of ``position_ids`` after the batch tensors are built, so RoPE positions stay
absolute while the keys of the kept tokens sit contiguously at the front of the request's pages.

At the end of every round (:meth:`EvictingBatchProcessor.update_batch`) each decoding request whose
next token would overflow the budget (``stored + 1 > B``, the rule of :class:`dynts.BoundedCache`)
has an eviction event: its :class:`~dynts.TokenInfo` goes to the evictor, the kept slots are
gathered to the front of the request's pages -- one ``index_select``/``index_copy_`` over all layers
and all evicting requests of the round -- its tail blocks go back to the pool, and its row of the
:class:`~dynts.serving.slots.SlotTable` is compacted the same way.

Memory: a request is admitted only when the pool can cover its reservation (``ceil(min(B, prompt +
max_new) / page)`` blocks) on top of what the requests in flight may still claim, so an evicting
request never runs out of blocks and is never preempted into a re-prefill (which would replay a
different, unevicted trajectory). Prefix block sharing and async batching are switched off by the
manager (:mod:`dynts.serving.manager`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Callable, Sequence

import torch
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from ..evictors.base import Segment
from ..thinking import DelimiterMatcher
from .settings import EvictionSettings
from .slots import RequestSlots, SlotTable

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
    slots: dict[str, RequestSlots]
    finished_stats: dict[str, dict[str, int]]

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
        self.delimiter = DelimiterMatcher(think_end) if think_end is not None else None
        self.allocator = self.cache.cache_allocators["full_attention"]
        self.page = self.allocator.tokens_per_page
        self.table = SlotTable(torch.device(self.model_device), width=max(256, settings.budget or 0))
        self.slots = {}
        self.finished_stats = finished_stats if finished_stats is not None else {}
        self.pending_scores: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.preemptions = 0
        self.peak_blocks_in_use = 0
        # after every round: (seconds since attach, blocks in use, requests in flight)
        self.block_trace: list[tuple[float, int, int]] = []
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
            before = set(self.scheduler.active_requests)
            done = offload(*args, **kwargs)
            self.preemptions += len(before - set(self.scheduler.active_requests))
            self._after_preemption()
            return done

        self.offloading_manager.offload_requests = guarded_offload
        self.sampler = None
        self.batch_in_flight = False  # a batch was prepared and not yet updated (dynts.serving.admission)

    def attach_sampler(self, sampler) -> None:
        """Sample every request with its own parameters (:class:`~dynts.serving.sampling.PerRequestSampler`
        replaces the engine's batch-wide sampling step)."""
        self.sampler = sampler
        self.model_runner._sample = sampler

    def _flat_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocator's cache as ``[rows, kv_heads, head_dim]`` and, per layer and K/V, the offset
        that maps a physical token index ``p`` to its row: ``p + offset`` (one gather serves all layers)."""
        views = self.allocator._kv_token_views  # layer -> (keys, values): row views into one flat tensor
        flat = views[self.allocator.layer_indices[0]][0]  # the first layer's keys start at row 0
        origin, row = flat.storage_offset(), flat.stride(0)
        offsets = [(t.storage_offset() - origin) // row for layer in self.allocator.layer_indices for t in views[layer]]
        return flat, torch.tensor(offsets, dtype=torch.long, device=flat.device)

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "settings"):
            for rid in list(self.slots):
                self._release(rid)
            self.pending_scores = None

    # ------------------------------------------------------------------ memory
    def free_blocks_in_pool(self) -> int:
        pool, index = self.cache.pool, self.allocator.index
        return pool.count_free_blocks(index) + pool.num_free_sectors * self.allocator.blocks_per_sector

    def blocks_in_use(self) -> int:
        return sum(len(t) for t in self.allocator.block_table.values())

    def reservation(self, state: RequestState) -> int:
        """Blocks a request may hold at most (its admission reserves them)."""
        # after a soft reset, generated tokens move from max_new_tokens to the prompt: the sum is unchanged
        slots = self.settings.reserved_slots(len(state.initial_tokens), state.max_new_tokens)
        return math.ceil(slots / self.page) if slots > 0 else 0

    def _admissible(self, waiting: list[RequestState]) -> list[RequestState]:
        """The longest prefix of ``waiting`` whose reservations fit the pool next to the requests in flight."""
        if not self.settings.bounded:
            return waiting
        free = self.free_blocks_in_pool()
        claimed = 0
        for rid, state in self.scheduler.active_requests.items():
            claimed += max(0, self.reservation(state) - len(self.allocator.block_table.get(rid, ())))
        admitted = []
        for state in waiting:
            need = self.reservation(state)
            if need > self.allocator.num_blocks:  # would wait forever: fail it now, with the fix
                self.scheduler.waiting_requests.pop(state.request_id, None)
                if state.request_id in self.scheduler.waiting_requests_order:
                    self.scheduler.waiting_requests_order.remove(state.request_id)
                self._handle_request_error(ValueError(
                    f"request {state.request_id} reserves {need} KV blocks (min(budget, prompt + max_new_tokens) / "
                    f"page) but the pool holds {self.allocator.num_blocks}; lower the budget or add blocks (num_blocks)"
                ), state)
                continue
            if claimed + need > free:
                break
            claimed += need
            admitted.append(state)
        return admitted

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
        return ready

    def update_batch(self) -> None:
        super().update_batch()
        self._release_finished()
        if self.settings.bounded:
            self._evict_due()
        self.batch_in_flight = False
        self._round += 1
        in_use = self.blocks_in_use()
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, in_use)
        self.block_trace.append((time.perf_counter() - self._started, in_use, len(self.scheduler.active_requests)))

    def _request_slots(self, state: RequestState) -> RequestSlots:
        entry = self.slots.get(state.request_id)
        if entry is None:
            q = prompt_length(state)
            bounds = self.settings.bounds
            entry = RequestSlots(
                row=self.table.acquire_row(),
                question_length=q,
                n_keep=bounds.n_keep(q) if bounds is not None else None,
                reserved_blocks=self.reservation(state),
            )
            self.slots[state.request_id] = entry
        return entry

    def _record_batch(self) -> None:
        """Write the metadata of the batch's new tokens and shift their positions to absolute ones."""
        if not self.settings.bounded:  # the full cache: statistics only, the engine runs as shipped
            for future in self.inputs_and_outputs.requests_in_batch:
                entry = self._request_slots(future.state)
                entry.peak_slots = max(entry.peak_slots, future.state.position_offset)
                entry.peak_blocks = max(entry.peak_blocks, len(self.allocator.block_table.get(future.state.request_id, ())))
            return
        rows, slots, positions, segments, tokens, shifts = [], [], [], [], [], []
        shifted = False
        for future in self.inputs_and_outputs.requests_in_batch:
            state, q = future.state, future.query_length
            entry = self._request_slots(state)
            stored = state.position_offset - q  # slots stored before this forward
            start = stored + entry.shift  # absolute index of the first new token
            prompt = state.initial_tokens
            if start >= len(prompt):
                new = state.generated_tokens[start - len(prompt) : start - len(prompt) + q]
            else:
                new = prompt[start : start + q]
            if len(new) != q:
                raise RuntimeError(f"request {state.request_id}: cannot find the {q} tokens of this forward")
            seg = self._segments(entry, new, start, stored)
            rows += [entry.row] * q
            slots += range(stored, stored + q)
            positions += range(start, start + q)
            segments += seg
            tokens += new
            shifts += [entry.shift] * q
            shifted = shifted or entry.shift > 0
            entry.peak_slots = max(entry.peak_slots, stored + q)
            entry.peak_blocks = max(entry.peak_blocks, len(self.allocator.block_table.get(state.request_id, ())))
        total = len(rows)
        self.table.ensure_width(max(slots) + 1)
        device = self.table.device
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        row_t, slot_t = as_long(rows), as_long(slots)
        self.table.write(row_t, slot_t, as_long(positions), as_long(segments), as_long(tokens))
        self.pending_scores = (row_t, slot_t, total) if self.settings.needs_scores else None
        if shifted:
            ids = self.inputs_and_outputs.position_ids
            ids[:total] += torch.tensor(shifts, dtype=ids.dtype, device=ids.device)

    def _segments(self, entry: RequestSlots, new: list[int], start: int, stored: int) -> list[int]:
        """Segments of a forward's ``new`` tokens (absolute index ``start`` on), by the rule of
        :class:`dynts.BoundedCache`: thinking until the request has emitted the whole delimiter; the
        delimiter (all its tokens, also those stored by earlier forwards, relabelled in the table) and
        everything after it are answer. The matcher state is one host integer per request."""
        seg, generated = [], 0
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

    def write_scores(self, hidden_states: torch.Tensor, predictor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Score the new tokens of the forward in flight from the final-norm output ``[1, T, h]``."""
        if self.pending_scores is None:
            return
        rows, slots, total = self.pending_scores
        self.pending_scores = None
        if hidden_states.dim() != 3 or hidden_states.shape[1] < total:
            return
        self.table.scores[rows, slots] = predictor(hidden_states[0, :total]).float()

    def request_stats(self, rid: str) -> dict[str, int]:
        """Statistics of a request in flight or finished (empty if unknown)."""
        entry = self.slots.get(rid)
        if entry is not None:
            return entry.stats()
        return dict(self.finished_stats.get(rid, {}))

    def _release_finished(self) -> None:
        active, waiting = self.scheduler.active_requests, self.scheduler.waiting_requests
        for rid in [r for r in self.slots if r not in active and r not in waiting]:
            self._release(rid)

    def _after_preemption(self) -> None:
        """A request sent back to the waiting queue keeps its cache only when offloaded to CPU; a soft reset
        re-prefills prompt + generated tokens, which replays a different (unevicted) trajectory once the
        request has evicted: fail such a request with a clear error instead of continuing wrongly."""
        waiting = self.scheduler.waiting_requests
        for rid in [r for r in self.slots if r in waiting and not waiting[r].is_cpu_offloaded]:
            entry = self.slots[rid]
            if entry.evictions == 0:
                self._release(rid)  # nothing evicted yet: the re-prefill is exact, start a fresh entry
                continue
            state = waiting.pop(rid)
            if rid in self.scheduler.waiting_requests_order:
                self.scheduler.waiting_requests_order.remove(rid)
            self._release(rid)
            self._handle_request_error(RuntimeError(
                f"request {rid} was preempted after {entry.evictions} eviction events; its evicted cache cannot be "
                "rebuilt by a re-prefill. Give the KV pool more blocks (num_blocks) or lower the budget."
            ), state)

    def _release(self, rid: str) -> None:
        entry = self.slots[rid]
        self.finished_stats[rid] = entry.stats()  # published before the entry leaves (readers in other threads)
        del self.slots[rid]
        self.table.release_row(entry.row)

    # ------------------------------------------------------------------ eviction
    def _evict_due(self) -> None:
        budget = self.settings.bounds.budget
        groups: dict[tuple[int, int], list[tuple[RequestState, RequestSlots]]] = defaultdict(list)
        for rid, state in self.scheduler.active_requests.items():
            entry = self.slots.get(rid)
            if entry is None or state.status != RequestStatus.DECODING:
                continue
            stored = state.position_offset
            if stored + 1 > budget and stored > entry.n_keep:
                groups[(entry.question_length, stored)].append((state, entry))
        if not groups:
            return
        src, dst = [], []
        for (question_length, stored), members in groups.items():
            n_keep = members[0][1].n_keep
            rows = torch.tensor([e.row for _, e in members], dtype=torch.long, device=self.table.device)
            info = self.table.token_info(rows, stored, n_keep, self.settings.bounds.local_window, question_length)
            if self.settings.needs_scores:
                stale = info.scores.isnan() & (info.segments == Segment.THINKING)
                if bool(stale.any()):
                    raise RuntimeError(f"method={self.settings.evictor.name!r}: thinking tokens without predictor scores")
            kept = self.settings.evictor(info)  # [g, n_keep]
            self.table.compact(rows, kept)
            physical = torch.tensor(
                [self.allocator.get_read_indices(s.request_id, 0, stored) for s, _ in members],
                dtype=torch.long, device=self._flat.device,
            )  # [g, stored]
            src.append(physical.gather(1, kept.to(physical.device)).flatten())
            dst.append(physical[:, :n_keep].flatten())
            for state, entry in members:
                freed = self._pop_tail_blocks(state.request_id, n_keep)
                state.position_offset = n_keep
                entry.shift += stored - n_keep
                entry.evictions += 1
                entry.evicted_tokens += stored - n_keep
                entry.freed_blocks += freed
        self._gather_rows(torch.cat(src), torch.cat(dst))

    def _gather_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy token rows ``src`` -> ``dst`` (physical indices) in every layer's keys and values at once."""
        offsets = self._layer_offsets.unsqueeze(1)
        src_all, dst_all = (src.unsqueeze(0) + offsets).flatten(), (dst.unsqueeze(0) + offsets).flatten()
        flat = self._flat
        flat.index_copy_(0, dst_all, flat.index_select(0, src_all))

    def _pop_tail_blocks(self, rid: str, n_keep: int) -> int:
        """Return the blocks past ``ceil(n_keep / page)`` of a request to the pool; count them."""
        table = self.allocator.block_table[rid]
        keep = math.ceil(n_keep / self.page)
        tail = table[keep:]
        del table[keep:]
        freed = [b for b in tail if self.allocator.ledger.release(b, no_cache=True)]
        if freed:
            self.cache.pool.free_blocks(self.allocator.index, freed)
        return len(tail)
