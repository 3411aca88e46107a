"""Scheduler side of the plugin (the EngineCore process): eviction events, blocks back to the pool,
admission by bounded footprint, prefix caching limited to what never moves.

One counter drives a vLLM request: ``Request.num_computed_tokens`` (logical: RoPE positions, stop
checks, the token budget). Per request the plugin keeps ``shift`` = tokens evicted so far, so
``stored = num_computed_tokens - shift`` is what its blocks hold. Before every round:

1. each decoding request whose next token would overflow its budget (``stored + 1 > B`` and
   ``stored > n_keep``, the event rule of :class:`dynts.BoundedCache`) has an event: its blocks past
   ``ceil(n_keep / block_size)`` go back to the pool and ``shift += stored - n_keep``; the event
   ``(request, stored, n_keep)`` rides on the round's ``SchedulerOutput`` (``dynts_plan``) so the worker
   picks the kept slots and moves them to the front before anything writes into the freed blocks;
2. ``allocate_slots`` sees ``num_computed_tokens = stored`` (blocks follow the stored count);
3. waiting requests are admitted in FIFO order only while the pool covers every bounded request's
   reservation ``ceil(min(B, prompt + max_tokens) / block_size)`` (minus the blocks it holds), so a
   bounded request is never preempted into a re-prefill of a different trajectory; if vLLM preempts
   one that already evicted anyway, it finishes with ``finish_reason="error"`` instead of continuing on
   a wrong cache.

Per request the hooks count what :func:`dynts.paged.metrics.usage_dynts` reports (peak stored slots,
events, evicted tokens, freed blocks); :meth:`SchedulerHooks.forget` hands them over when the request
finishes (they ride on its ``kv_transfer_params``: :mod:`dynts.vllm.metrics`).

Prefix caching stays on: a bounded request caches (and reuses) only full blocks inside the prefix its
method never moves (:meth:`dynts.evictors.Evictor.protected_prefix`; DynTS: the whole question), so
shared prompt blocks stay hashed and shared while decode-side slots are compacted. (The worker records
the metadata of a prefix-cache hit's tokens too: slots it never saw would count as padding and be
evicted first -- into the shared blocks.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..paged import EvictionSettings
from .config import PluginConfig

__all__ = ["TRACE_ROUNDS", "SchedulerHooks", "StepPlan"]

TRACE_ROUNDS = 4096  # rounds of (blocks in use, requests running) kept: the most recent ones


@dataclass
class StepPlan:
    """What the scheduler tells the workers for one round (attached to ``SchedulerOutput.dynts_plan``).

    Attributes:
        events: ``(request_id, stored, n_keep)`` of every request evicting before this round's forward.
        shifts: tokens evicted so far, per request with ``shift > 0``.
    """

    events: list[tuple[str, int, int]] = field(default_factory=list)
    shifts: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestBudget:
    """Host-side state of one bounded request in the scheduler."""

    settings: EvictionSettings
    n_keep: int
    reserved_blocks: int
    protected: int
    shift: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    freed_blocks: int = 0


class SchedulerHooks:
    """The plugin's state in one vLLM ``Scheduler``; installed by :func:`dynts.vllm.patches.install`."""

    def __init__(self, scheduler: Any, config: PluginConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        self.block_size = scheduler.block_size
        self.requests: dict[str, RequestBudget | None] = {}
        self.peaks: dict[str, list[int]] = {}  # every scheduled request: [peak stored slots, peak blocks]
        self.failed: set[str] = set()
        self.preemptions = 0
        self.peak_blocks_in_use = 0
        self.block_trace: deque[tuple[int, int]] = deque(maxlen=TRACE_ROUNDS)  # (blocks in use, running) per round

    # ------------------------------------------------------------------ per request
    def budget_of(self, request: Any) -> RequestBudget | None:
        """The request's bounded state (``None``: it runs with the full cache)."""
        rid = request.request_id
        if rid not in self.requests:
            settings = self.config.for_request(request.sampling_params.extra_args if request.sampling_params else None)
            state = None
            if settings.bounded:
                q = request.num_prompt_tokens
                longest = q + (request.max_tokens or 0)
                state = RequestBudget(
                    settings=settings,
                    n_keep=settings.bounds.n_keep(q),
                    reserved_blocks=math.ceil(min(settings.bounds.budget, longest) / self.block_size),
                    protected=settings.evictor.protected_prefix(q),
                )
            self.requests[rid] = state
        return self.requests[rid]

    def shift(self, request: Any) -> int:
        state = self.requests.get(request.request_id)
        return state.shift if state is not None else 0

    def cache_limit(self, request: Any) -> int | None:
        """Tokens whose full blocks this request may cache and reuse (``None``: no limit): the prefix its
        method keeps at every event, so those blocks are never rewritten."""
        state = self.budget_of(request)
        return None if state is None else state.protected

    def forget(self, rid: str) -> dict[str, int]:
        """Drop a finished request's state; its statistics (``peak_slots``, ``evictions``, ``evicted_tokens``,
        ``freed_blocks``, ``peak_blocks``, and ``reserved_blocks`` for a bounded request; zeros without eviction)."""
        state = self.requests.pop(rid, None)
        peak_slots, peak_blocks = self.peaks.pop(rid, (0, 0))
        stats = {"peak_slots": peak_slots, "evictions": 0, "evicted_tokens": 0, "freed_blocks": 0,
                 "peak_blocks": peak_blocks}
        if state is not None:
            stats.update(evictions=state.evictions, evicted_tokens=state.evicted_tokens,
                         freed_blocks=state.freed_blocks, reserved_blocks=state.reserved_blocks)
        return stats

    # ------------------------------------------------------------------ per round
    @property
    def _manager(self) -> Any:
        """vLLM's manager of the one KV cache group (full attention): per-request blocks and the pool."""
        return self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]

    def _blocks(self, rid: str) -> list:
        return self._manager.req_to_blocks[rid]

    def blocks_in_use(self) -> int:
        pool = self._manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block

    def before_schedule(self) -> StepPlan:
        """Eviction events of the decoding requests due this round; their tail blocks go back to the pool."""
        sched = self.scheduler
        plan = StepPlan()
        for request in sched.running:
            state = self.budget_of(request)
            if state is None:
                continue
            decoding = request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)
            stored = request.num_computed_tokens - state.shift
            if decoding and stored + 1 > state.settings.bounds.budget and stored > state.n_keep:
                state.freed_blocks += self._free_tail(request.request_id, state.n_keep)
                state.shift += stored - state.n_keep
                state.evictions += 1
                state.evicted_tokens += stored - state.n_keep
                plan.events.append((request.request_id, stored, state.n_keep))
        return plan

    def _free_tail(self, rid: str, n_keep: int) -> int:
        """Return the blocks past ``ceil(n_keep / block_size)`` of a request to the pool; count them."""
        manager = self._manager
        blocks = manager.req_to_blocks[rid]
        keep = math.ceil(n_keep / self.block_size)
        tail = blocks[keep:]
        if not tail:
            return 0
        del blocks[keep:]
        if manager.num_cached_block.get(rid, 0) > keep:
            manager.num_cached_block[rid] = keep
        manager.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def admissible(self, waiting: list[Any]) -> int:
        """How many of the waiting requests (FIFO) fit next to what the running bounded requests may still claim."""
        free = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        claimed = 0
        for request in self.scheduler.running:
            state = self.budget_of(request)
            if state is not None:
                claimed += max(0, state.reserved_blocks - len(self._blocks(request.request_id)))
        admitted = 0
        for request in waiting:
            state = self.budget_of(request)
            if state is None or request.num_computed_tokens > 0:
                if claimed > free:
                    break
                admitted += 1
                continue
            if claimed + state.reserved_blocks > free:
                break
            claimed += state.reserved_blocks
            admitted += 1
        return admitted

    def on_preempt(self, request: Any) -> None:
        """A preempted bounded request that already evicted cannot be rebuilt by a re-prefill: fail it."""
        self.preemptions += 1
        state = self.requests.get(request.request_id)
        if state is not None and state.evictions > 0:
            self.failed.add(request.request_id)

    def after_schedule(self, output: Any, plan: StepPlan) -> None:
        for rid in output.num_scheduled_tokens:
            state = self.requests.get(rid)
            shift = state.shift if state is not None else 0
            if shift:
                plan.shifts[rid] = shift
            peak = self.peaks.setdefault(rid, [0, 0])
            # num_computed_tokens already counts this round's tokens: the slots stored after its forward
            peak[0] = max(peak[0], self.scheduler.requests[rid].num_computed_tokens - shift)
            peak[1] = max(peak[1], len(self._blocks(rid)))
        output.dynts_plan = plan
        in_use = self.blocks_in_use()
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, in_use)
        self.block_trace.append((in_use, len(self.scheduler.running)))
        if self.failed:
            # reported as finish_reason="error" by update_from_output (the scheduler's error-request path)
            self.scheduler.encoder_cache_mismatch_reqs.update(self.failed)
            self.failed.clear()

    def engine_stats(self) -> dict[str, Any]:
        pool = self._manager.block_pool
        return {
            "preemptions": self.preemptions,
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "blocks_in_use": self.blocks_in_use(),
            "free_blocks": pool.get_num_free_blocks(),
            "num_blocks": pool.num_gpu_blocks,
            "block_trace": list(self.block_trace),
        }
