"""Scheduler side of the plugin (the EngineCore process): vLLM's requests and block pool translated into
:class:`dynts.core.policy.EvictionPolicy` calls -- eviction events, blocks back to the pool, admission by
bounded footprint, prefix caching limited to what never moves.

One counter drives a vLLM request: ``Request.num_computed_tokens`` (logical: RoPE positions, stop
checks, the token budget). Per request the plugin keeps ``shift`` = tokens evicted so far, so
``stored = num_computed_tokens - shift`` is what its blocks hold. Before every round:

1. each decoding request whose next token would overflow its budget (:meth:`dynts.Budget.due`, via
   :meth:`EvictionPolicy.event`) has an event: its blocks past
   ``ceil(n_keep / block_size)`` go back to the pool and ``shift += stored - n_keep``; the event
   ``(request, stored, n_keep)`` rides on the round's ``SchedulerOutput`` (``dynts_plan``) so the worker
   picks the kept slots and moves them to the front before anything writes into the freed blocks;
2. ``allocate_slots`` sees ``num_computed_tokens = stored`` (blocks follow the stored count);
3. waiting requests are admitted in FIFO order only while the pool covers every bounded request's
   reservation ``ceil(min(B, prompt + max_tokens) / block_size)`` (minus the blocks it holds), so a
   bounded request is never preempted into a re-prefill of a different trajectory; if vLLM preempts
   one that already evicted anyway, it finishes with ``finish_reason="error"`` instead of continuing on
   a wrong cache.

Per request the hooks count what :func:`dynts.core.metrics.usage_dynts` reports (peak stored slots,
events, evicted tokens, freed blocks); :meth:`SchedulerHooks.forget` hands them over when the request
finishes (they ride on its ``kv_transfer_params``: :mod:`dynts.vllm.metrics`).

Prefix caching stays on: a bounded request caches (and reuses) only full blocks inside the prefix its
method never moves (:meth:`dynts.evictors.Evictor.protected_prefix`; DynTS: the whole question), so
shared prompt blocks stay hashed and shared while decode-side slots are compacted. (The worker records
the metadata of a prefix-cache hit's tokens too: slots it never saw would count as padding and be
evicted first -- into the shared blocks.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..core import EvictionPolicy, RequestBudget
from ..core.policy import TRACE_ROUNDS
from .config import PluginConfig

__all__ = ["TRACE_ROUNDS", "SchedulerHooks", "StepPlan"]

logger = logging.getLogger("vllm.dynts")  # under vLLM's logger: its format, its level


@dataclass
class StepPlan:
    """What the scheduler tells the workers for one round (attached to ``SchedulerOutput.dynts_plan``).

    Attributes:
        events: ``(request_id, stored, n_keep)`` of every request evicting before this round's forward.
        shifts: tokens evicted so far, per request with ``shift > 0``.
        token_ids: for V2 runners, which keep no host copy of a request's tokens: ``(start, ids)`` per recorded
            request, the ids of its tokens from absolute index ``start`` that the scheduler learned since its last
            shipment (``start = 0`` the first time a request is scheduled, so a prefix-cache hit's tokens are
            included). Under async scheduling the token a round computes was sampled by the round still in
            flight: its id comes with the next round's plan, before that round's events.
    """

    events: list[tuple[str, int, int]] = field(default_factory=list)
    shifts: dict[str, int] = field(default_factory=dict)
    token_ids: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


class SchedulerHooks:
    """The plugin's state in one vLLM ``Scheduler`` (installed by :func:`dynts.vllm.patches.install`): it
    translates vLLM's requests and block pool into :class:`~dynts.core.policy.EvictionPolicy` calls."""

    def __init__(self, scheduler: Any, config: PluginConfig, ship_token_ids: bool = False) -> None:
        self.scheduler = scheduler
        self.config = config
        self.ship_token_ids = ship_token_ids  # the workers run vLLM's V2 runner (no host copy of token ids)
        self.shipped: dict[str, int] = {}  # per request: tokens whose ids the workers have been sent
        self.block_size = scheduler.block_size
        self.policy = EvictionPolicy(self.block_size, TRACE_ROUNDS)  # trace rows: (blocks in use, running)
        self.failed: set[str] = set()

    # ------------------------------------------------------------------ per request
    def entry(self, request: Any) -> RequestBudget:
        """The request's entry, opened with its own settings (the engine's, or its ``extra_args`` overrides)."""
        entry = self.policy.get(request.request_id)
        if entry is None:
            settings = self.config.for_request(request.sampling_params.extra_args if request.sampling_params else None)
            entry = self.policy.open(request.request_id, settings, request.num_prompt_tokens, request.max_tokens)
        return entry

    def budget_of(self, request: Any) -> RequestBudget | None:
        """The request's entry when it evicts (``None``: it runs with the full cache)."""
        entry = self.entry(request)
        return entry if entry.settings.bounded else None

    def shift(self, request: Any) -> int:
        entry = self.policy.get(request.request_id)
        return entry.shift if entry is not None else 0

    def cache_limit(self, request: Any) -> int | None:
        """Tokens whose full blocks this request may cache and reuse (``None``: no limit): the prefix its
        method keeps at every event, so those blocks are never rewritten."""
        entry = self.budget_of(request)
        return None if entry is None else entry.protected

    def forget(self, rid: str) -> dict[str, int]:
        """Drop a finished request's state; its statistics (``peak_slots``, ``evictions``, ``evicted_tokens``,
        ``freed_blocks``, ``peak_blocks``, and ``reserved_blocks`` for a bounded request; zeros without eviction)."""
        entry = self.policy.get(rid)
        stats = self.policy.finish(rid)
        self.shipped.pop(rid, None)
        if entry is None:
            return {"peak_slots": 0, "evictions": 0, "evicted_tokens": 0, "freed_blocks": 0, "peak_blocks": 0}
        if not entry.settings.bounded:
            stats.pop("reserved_blocks", None)
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
        """Eviction events of the decoding requests due this round (:meth:`EvictionPolicy.event`); their tail
        blocks go back to the pool."""
        plan = StepPlan()
        for request in self.scheduler.running:
            entry = self.entry(request)
            if not entry.may_evict:  # the full cache, or its length limit fits the budget
                continue
            decoding = request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)
            if not decoding:
                continue
            event = self.policy.event(request.request_id, entry, request.num_computed_tokens - entry.shift)
            if event is not None:
                self.policy.freed(entry, self._free_tail(event.request_id, event.keep_blocks))
                plan.events.append((event.request_id, event.stored, event.n_keep))
        return plan

    def _free_tail(self, rid: str, keep: int) -> int:
        """Return the blocks of a request past its first ``keep`` to the pool; count them."""
        manager = self._manager
        blocks = manager.req_to_blocks[rid]
        tail = blocks[keep:]
        if not tail:
            return 0
        del blocks[keep:]
        if manager.num_cached_block.get(rid, 0) > keep:
            manager.num_cached_block[rid] = keep
        manager.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def admissible(self, waiting: list[Any]) -> int:
        """How many of the waiting requests (FIFO) fit next to what the running bounded requests may still
        claim (:meth:`EvictionPolicy.admit`); a full-cache or resumed request reserves nothing."""
        if not waiting:
            return 0
        free = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        claimed = self.policy.claimed((self.budget_of(r), len(self._blocks(r.request_id))) for r in self.scheduler.running)
        needs = []
        for request in waiting:
            entry = self.budget_of(request)
            needs.append(None if entry is None or request.num_computed_tokens > 0 else entry.reserved_blocks)
        return self.policy.admit(needs, free, claimed)

    def on_preempt(self, request: Any) -> None:
        """A preempted bounded request that already evicted cannot be rebuilt by a re-prefill: fail it."""
        if self.policy.preempted(request.request_id):
            logger.warning("dynts: request %s fails: vLLM preempted it after its first eviction and a re-prefill "
                           "cannot rebuild its cache; it finishes with finish_reason='error', the engine goes on",
                           request.request_id)
            self.failed.add(request.request_id)

    def fail(self, faults: dict[str, str]) -> None:
        """Finish the requests a worker failed (request id -> why) with ``finish_reason="error"`` in this
        ``update_from_output`` (vLLM's error-request path: their blocks go back to the pool), one log line each;
        the engine and every other request go on."""
        for rid, reason in faults.items():
            if rid in self.scheduler.requests:
                logger.warning("dynts: request %s fails: %s; it finishes with finish_reason='error', the engine "
                               "goes on", rid, reason)
                self.scheduler.encoder_cache_mismatch_reqs.add(rid)

    def after_schedule(self, output: Any, plan: StepPlan) -> None:
        preempted = getattr(output, "preempted_req_ids", None)
        if preempted:  # preempted by this very round: its blocks are back in the pool, nothing to move
            plan.events = [event for event in plan.events if event[0] not in preempted]
        new = {r.req_id for r in output.scheduled_new_reqs} if self.ship_token_ids else ()
        for rid, scheduled in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            entry = self.entry(request)
            if entry.shift:
                plan.shifts[rid] = entry.shift
            if self.ship_token_ids and (entry.may_evict or self.config.settings.needs_scores):
                start = 0 if rid in new else self.shipped.get(rid, 0)
                known = request.all_token_ids  # sampled ids land here in update_from_output, one round late if async
                if len(known) > start or rid in new:
                    plan.token_ids[rid] = (start, list(known[start:]))
                    self.shipped[rid] = len(known)
            # num_computed_tokens already counts this round's tokens: the slots stored after its forward
            self.policy.scheduled(entry, request.num_computed_tokens - entry.shift, len(self._blocks(rid)))
        output.dynts_plan = plan
        in_use = self.blocks_in_use()
        self.policy.after_round(in_use, (in_use, len(self.scheduler.running)))
        if self.failed:
            # reported as finish_reason="error" by update_from_output (the scheduler's error-request path)
            self.scheduler.encoder_cache_mismatch_reqs.update(self.failed)
            self.failed.clear()

    def engine_stats(self) -> dict[str, Any]:
        pool = self._manager.block_pool
        return self.policy.engine_stats(blocks_in_use=self.blocks_in_use(), free_blocks=pool.get_num_free_blocks(),
                                        num_blocks=pool.num_gpu_blocks)
