"""Admission that cannot kill the engine: limits checked before a request is queued, failures kept to
the requests they belong to.

:class:`Limits` answers, for every method including ``full``, whether a request fits at all: its
prompt against the budget (``B >= prompt + W_l + 1``), the model's ``max_position_embeddings`` and
the KV pool; its ``max_tokens`` against the server cap (:func:`default_max_tokens`) and, for the full
cache, ``prompt + max_tokens`` against the context and the pool. A request that cannot fit is refused
at once with an :class:`AdmissionError` naming the limit, instead of being scheduled into a pool
that can never hold it.

:func:`isolate_failure` is what the engine loop does with an exception (see
:meth:`~dynts.serving.manager.EvictingBatchingManager._generation_loop_body`): the requests it
belongs to get the error and leave the engine; the loop keeps serving the others.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..core import EvictionSettings

__all__ = ["EVICTING_MAX_TOKENS", "AdmissionError", "Limits", "RequestFailure", "default_max_tokens",
           "isolate_failure"]

logger = logging.getLogger(__name__)

# Default server cap on generated tokens per request for evicting methods (their cache never fills, so
# only EOS or this cap ends a runaway request); ``--max-tokens`` changes it.
EVICTING_MAX_TOKENS = 32768


class AdmissionError(ValueError):
    """A request that cannot be served as sent (the client gets HTTP 400 with this message)."""


class RequestFailure(RuntimeError):
    """An engine error that belongs to one request: only that request fails."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


def default_max_tokens(settings: EvictionSettings, max_position_embeddings: int | None) -> int:
    """The server cap on ``max_tokens``: the model's context for ``full``, :data:`EVICTING_MAX_TOKENS` when evicting."""
    if not settings.bounded and max_position_embeddings:
        return int(max_position_embeddings)
    return EVICTING_MAX_TOKENS


@dataclass(frozen=True)
class Limits:
    """What one request may ask of an engine.

    Args:
        settings: the engine's eviction settings.
        num_blocks: KV blocks in the pool.
        page_size: tokens per block.
        max_position_embeddings: the model's context (``None``: unknown, not checked).
        max_tokens: the server cap on generated tokens per request.
    """

    settings: EvictionSettings
    num_blocks: int
    page_size: int
    max_position_embeddings: int | None
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "page_size", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def context(self) -> int:
        """Most tokens (prompt + generated) one full-cache request can hold."""
        limit = self.pool_tokens
        return min(limit, self.max_position_embeddings) if self.max_position_embeddings else limit

    def _context_reason(self) -> str:
        if self.max_position_embeddings and self.max_position_embeddings <= self.pool_tokens:
            return f"the model's max_position_embeddings={self.max_position_embeddings}"
        return f"the KV pool ({self.num_blocks} blocks x {self.page_size} tokens = {self.pool_tokens}; --num-blocks)"

    def admit(self, prompt_length: int, max_tokens: int | None) -> int:
        """The ``max_new_tokens`` a request runs with; raise :class:`AdmissionError` when it cannot fit."""
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise AdmissionError(f"max_tokens={max_tokens!r} must be a positive int")
        if max_tokens is not None and max_tokens > self.max_tokens:
            raise AdmissionError(f"max_tokens={max_tokens} is over this server's cap of {self.max_tokens} tokens "
                                 "per request (set by `dynts serve --max-tokens`)")
        try:
            self.settings.check_prompt(prompt_length)
        except ValueError as err:
            raise AdmissionError(f"the prompt is {prompt_length} tokens: {err}") from None
        if not self.settings.bounded:
            context = self.context()
            if prompt_length >= context:
                raise AdmissionError(f"the prompt is {prompt_length} tokens; this server holds at most {context} "
                                     f"tokens per request ({self._context_reason()})")
            if max_tokens is None:
                return min(self.max_tokens, context - prompt_length)
            if prompt_length + max_tokens > context:
                raise AdmissionError(
                    f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) = {prompt_length + max_tokens} is over "
                    f"the {context} tokens one request can hold ({self._context_reason()}); lower max_tokens to "
                    f"{context - prompt_length} or less")
            return max_tokens
        if self.max_position_embeddings and prompt_length > self.max_position_embeddings:
            raise AdmissionError(f"the prompt is {prompt_length} tokens, over the model's max_position_embeddings="
                                 f"{self.max_position_embeddings}")
        new = self.max_tokens if max_tokens is None else max_tokens
        need = math.ceil(self.settings.reserved_slots(prompt_length, new) / self.page_size)
        if need > self.num_blocks:
            raise AdmissionError(f"the request reserves {need} KV blocks (min(budget, prompt + max_tokens) / page) but "
                                 f"the pool holds {self.num_blocks}; lower the budget or start with more --num-blocks")
        return new


def isolate_failure(processor, error: Exception) -> list[str]:
    """Fail the requests ``error`` belongs to and free their blocks; return their ids.

    A :class:`RequestFailure` names its request. Otherwise the requests of the batch in flight fail
    when the error came from its forward or update; an error while scheduling (e.g. a request that
    outgrew the pool) fails the request in flight holding the most blocks, and the loop tries again.
    """
    scheduler = processor.scheduler
    rid = getattr(error, "request_id", None)
    if isinstance(rid, str):
        states = [s for s in (scheduler.active_requests.get(rid), scheduler.waiting_requests.get(rid)) if s is not None]
    elif getattr(processor, "batch_in_flight", False):
        states = [f.state for f in processor.inputs_and_outputs.requests_in_batch
                  if f.state.request_id in scheduler.active_requests]
    else:
        states = []
    if not states and scheduler.active_requests:
        tables = processor.cache.cache_allocators
        held = lambda s: sum(len(a.block_table.get(s.request_id, ())) for a in tables.values())  # noqa: E731
        states = [max(scheduler.active_requests.values(), key=held)]
    failed = []
    for state in states:
        processor.fail_request(state, error)
        failed.append(state.request_id)
    processor.batch_in_flight = False
    logger.error("engine error, request(s) %s failed, the engine keeps serving: %s: %s",
                 failed, type(error).__name__, error, exc_info=error)
    return failed
