"""The scheduler side of per-request eviction in a paged engine: blocks, admission, events, preemption.

Both paged engines translate their scheduler's objects into these calls (transformers' continuous
batching in :mod:`dynts.serving.processor`, vLLM in :mod:`dynts.vllm.scheduler`):

1. :meth:`EvictionPolicy.open` a request when the scheduler first sees it: its ``n_keep``, the blocks it
   reserves (``ceil(min(B, prompt + max_new) / block_size)``, "needed to completion") and the prefix its
   method never moves;
2. :meth:`EvictionPolicy.admit` the longest FIFO prefix of the waiting requests whose reservations fit
   the free blocks next to what the running requests may still claim (:meth:`EvictionPolicy.claimed`),
   so a bounded request never runs out of blocks and is never preempted into a re-prefill;
3. :meth:`EvictionPolicy.event` before each round: a decoding request whose next token would overflow
   its budget (:meth:`dynts.Budget.due`) has an event; its blocks past ``ceil(n_keep / block_size)``
   go back to the pool (the adapter frees them and reports the count with :meth:`EvictionPolicy.freed`);
4. :meth:`EvictionPolicy.preempted`: a request preempted after an event cannot be rebuilt by a
   re-prefill (the engine would replay a different, unevicted trajectory): it must fail;
5. :meth:`EvictionPolicy.finish` drops the request and returns its statistics.

State is bounded: one :class:`~dynts.core.slots.RequestBudget` per request in flight, and a fixed-length
trace of the pool after each round (:data:`TRACE_ROUNDS`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from .settings import EvictionSettings
from .slots import RequestBudget

__all__ = ["Event", "EvictionPolicy"]

TRACE_ROUNDS = 4096  # rounds of (blocks in use, requests in flight) kept for engine_stats


@dataclass(frozen=True)
class Event:
    """One request's eviction event this round.

    Attributes:
        request_id: the engine's id.
        stored: slots it stored before the event.
        n_keep: slots it keeps (they move to slots ``0 .. n_keep - 1``).
        keep_blocks: blocks it keeps, ``ceil(n_keep / block_size)``; the rest go back to the pool.
    """

    request_id: str
    stored: int
    n_keep: int
    keep_blocks: int


class EvictionPolicy:
    """Per-request scheduler-side state and rules of one engine.

    Args:
        block_size: tokens per KV block of the engine's pool.
        trace_rounds: rounds kept in :attr:`block_trace` (older ones drop out).
    """

    def __init__(self, block_size: int, trace_rounds: int = TRACE_ROUNDS) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.block_size = block_size
        self.requests: dict[str, RequestBudget] = {}
        self.preemptions = 0
        self.peak_blocks_in_use = 0
        self.block_trace: deque[tuple] = deque(maxlen=trace_rounds)

    # ------------------------------------------------------------------ per request
    def blocks(self, slots: int) -> int:
        """Blocks that hold ``slots`` tokens."""
        return math.ceil(slots / self.block_size) if slots > 0 else 0

    def reservation(self, settings: EvictionSettings, prompt_length: int, max_new_tokens: int | None) -> int:
        """Blocks a request may hold at most (its admission reserves them): ``min(B, prompt + new)`` slots."""
        return self.blocks(settings.reserved_slots(prompt_length, max_new_tokens))

    def open(self, rid: str, settings: EvictionSettings, prompt_length: int, max_new_tokens: int | None,
             reserved_blocks: int | None = None) -> RequestBudget:
        """The request's entry, created on first use. ``reserved_blocks``: the engine's own count when its
        reservation is not :meth:`reservation` of this prompt (transformers after a soft reset)."""
        entry = self.requests.get(rid)
        if entry is None:
            if reserved_blocks is None:
                reserved_blocks = self.reservation(settings, prompt_length, max_new_tokens)
            entry = RequestBudget(
                settings, prompt_length, settings.n_keep(prompt_length), reserved_blocks=reserved_blocks,
                protected=settings.evictor.protected_prefix(prompt_length) if settings.bounded else prompt_length,
                may_evict=settings.may_evict(prompt_length, max_new_tokens),
            )
            self.requests[rid] = entry
        return entry

    def get(self, rid: str) -> RequestBudget | None:
        return self.requests.get(rid)

    def scheduled(self, entry: RequestBudget, stored: int, blocks: int) -> None:
        """After a round is scheduled: the request stores ``stored`` slots in ``blocks`` blocks (peaks)."""
        entry.peak_slots = max(entry.peak_slots, stored)
        entry.peak_blocks = max(entry.peak_blocks, blocks)

    def finish(self, rid: str) -> dict[str, int]:
        """Drop a request (finished, aborted or failed); returns its statistics (empty if unknown)."""
        entry = self.requests.pop(rid, None)
        return entry.stats() if entry is not None else {}

    # ------------------------------------------------------------------ admission
    def claimed(self, running: Iterable[tuple[RequestBudget | None, int]]) -> int:
        """Blocks the running bounded requests (``(entry, blocks held)``) may still claim."""
        return sum(max(0, e.reserved_blocks - held) for e, held in running if e is not None and e.settings.bounded)

    def admit(self, needs: Iterable[int | None], free: int, claimed: int) -> int:
        """How many of the waiting requests (FIFO, each its reservation in blocks; ``None``: it reserves
        nothing, e.g. a full-cache or resumed request) fit the ``free`` blocks next to ``claimed``."""
        admitted = 0
        for need in needs:
            if need is None:
                if claimed > free:
                    break
            elif claimed + need > free:
                break
            else:
                claimed += need
            admitted += 1
        return admitted

    # ------------------------------------------------------------------ per round
    def event(self, rid: str, entry: RequestBudget | None, stored: int) -> Event | None:
        """The request's event this round, if its next decoded token would overflow its budget; counts it
        (``shift``, ``evictions``, ``evicted_tokens``). ``stored``: the slots it stores now."""
        if entry is None or not entry.due(stored):
            return None
        entry.evicted(stored)
        return Event(rid, stored, entry.n_keep, self.blocks(entry.n_keep))

    def freed(self, entry: RequestBudget, blocks: int) -> None:
        """The adapter returned ``blocks`` tail blocks of the request to the pool."""
        entry.freed_blocks += blocks

    def preempted(self, rid: str) -> bool:
        """The engine preempted the request; True when it must fail (it evicted: a re-prefill would replay
        a different trajectory). Before its first event the re-prefill is exact and it goes on."""
        self.preemptions += 1
        entry = self.requests.get(rid)
        return entry is not None and entry.evictions > 0

    def after_round(self, blocks_in_use: int, trace_row: tuple) -> None:
        """Record the pool after a round: the peak, and the adapter's ``trace_row`` in the bounded trace."""
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks_in_use)
        self.block_trace.append(trace_row)

    def engine_stats(self, **pool: Any) -> dict[str, Any]:
        """Engine-wide statistics; ``pool``: the adapter's own readings (blocks in use, free, total)."""
        return {"preemptions": self.preemptions, "peak_blocks_in_use": self.peak_blocks_in_use, **pool,
                "block_trace": list(self.block_trace)}

    @staticmethod
    def failure(rid: str, entry: RequestBudget) -> str:
        """The error a request preempted after its events fails with (the fix included)."""
        return (f"request {rid} was preempted after {entry.evictions} eviction events; its evicted cache cannot be "
                "rebuilt by a re-prefill. Give the KV pool more blocks (num_blocks) or lower the budget.")
