"""The small parts a :class:`~dynts.cache.BoundedCache` is made of, besides its layers and slot table:
its configuration (:class:`CacheConfig`), its rows' labelling state (:class:`RowLabels`) and its counters
(:class:`CacheStats`); :class:`Part` exposes a part's fields as attributes of the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..core.budget import Budget
from ..core.segments import label_rows
from ..evictors.base import Evictor
from ..thinking import DelimiterMatcher

__all__ = ["CacheConfig", "CacheStats", "Part", "RowLabels"]


@dataclass(frozen=True)
class CacheConfig:
    """What a cache evicts with and how it is laid out (fixed for its lifetime; arguments of
    :class:`~dynts.cache.BoundedCache`).

    Attributes:
        evictor: the method.
        budget: the :class:`Budget` (``None`` only for an unbounded evictor).
        think_end_token_id: the delimiter's token id(s) closing the thinking segment, or ``None``.
        observation_window: query rows kept for ``window_attention``.
        keys_layer: layer (non-negative) whose keys feed ``TokenInfo.keys``.
        static: fixed-capacity buffers and static-shape decode steps.
        max_length: capacity of a static full cache.
        defer_scores: score eager decode steps in one batched predictor call.
        kv_heads: the model's KV heads per layer; needed by a ``per_head`` evictor (one selection per
            layer and KV head).
    """

    evictor: Evictor
    budget: Budget | None
    think_end_token_id: int | Sequence[int] | None
    observation_window: int
    keys_layer: int
    static: bool = False
    max_length: int | None = None
    defer_scores: bool = False
    kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.bounded and self.budget is None:
            raise ValueError(f"method={self.evictor.name!r} evicts and needs a budget (e.g. budget=1024, local_window=128)")
        if not isinstance(self.observation_window, int) or self.observation_window < 1:
            raise ValueError(f"observation_window={self.observation_window!r} must be a positive int")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ValueError(f"max_length={self.max_length!r} must be a positive int (prompt + new tokens)")
        if self.kv_heads is not None and (isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int)
                                          or self.kv_heads < 1):
            raise ValueError(f"kv_heads={self.kv_heads!r} must be a positive int (the model's num_key_value_heads)")
        if self.per_head and self.kv_heads is None:
            raise ValueError(
                f"method={self.evictor.name!r} with per_head=True selects per KV head and needs kv_heads=... "
                "(the model's num_key_value_heads; dynts.build_cache passes it)"
            )

    @property
    def per_head(self) -> bool:
        """One selection per (batch row, layer, KV head) instead of one per batch row."""
        return self.bounded and bool(self.evictor.per_head)

    @property
    def bounded(self) -> bool:
        """False for an unbounded evictor (``full``): no budget, no events."""
        return self.evictor.bounded

    @property
    def requires(self) -> frozenset[str]:
        """Statistics the evictor reads (none when it never runs)."""
        return frozenset(self.evictor.requires) if self.bounded else frozenset()


@dataclass
class RowLabels:
    """Per-row labelling state of generated tokens (:func:`dynts.core.segments.label_rows`).

    Attributes:
        delimiter: matcher of the thinking delimiter (``None``: every generated token is thinking).
        in_answer: ``[b]`` the row has emitted the whole delimiter.
        think_match: ``[b]`` delimiter tokens matched so far (the automaton's state).
    """

    delimiter: DelimiterMatcher | None
    in_answer: torch.Tensor | None = None
    think_match: torch.Tensor | None = None

    @classmethod
    def for_delimiter(cls, think_end_token_id: int | Sequence[int] | None, in_answer: torch.Tensor | None = None,
                      think_match: torch.Tensor | None = None) -> "RowLabels":
        """Labels for the delimiter's id(s) (``None``: none), optionally with each row's state."""
        ids = (think_end_token_id,) if isinstance(think_end_token_id, int) else think_end_token_id
        return cls(DelimiterMatcher(ids) if ids is not None else None, in_answer, think_match)

    def allocate(self, rows: int, device: torch.device) -> None:
        self.in_answer = torch.zeros(rows, dtype=torch.bool, device=device)
        self.think_match = torch.zeros(rows, dtype=torch.long, device=device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the state of batch rows ``rows`` ``[r]``."""
        if self.in_answer is not None:
            rows = rows.to(self.in_answer.device)
            self.in_answer, self.think_match = self.in_answer.index_select(0, rows), self.think_match.index_select(0, rows)

    def label(self, input_ids: torch.Tensor, valid: torch.Tensor, segments: torch.Tensor,
              token_ids: torch.Tensor) -> torch.Tensor:
        """Segments ``[b, q]`` of generated tokens ``input_ids`` (``valid`` real ones) after the stored
        ``segments`` / ``token_ids`` ``[b, n]`` (relabelled in place when a delimiter completes)."""
        out, self.think_match = label_rows(self.delimiter, input_ids, valid, self.in_answer, self.think_match,
                                           segments, token_ids)
        return out


@dataclass
class CacheStats:
    """Counters a cache keeps while it runs (per batch, not per row)."""

    evictions: int = 0
    evicted_tokens: int = 0
    peak_cache_tokens: int = 0
    kv_bytes_per_token: int = 0
    event_steps: list[int] = field(default_factory=list)

    @property
    def peak_kv_bytes(self) -> int:
        """Bytes of K/V held at the peak (all layers, all rows)."""
        return self.peak_cache_tokens * self.kv_bytes_per_token

    def event(self, evicted: int, seen: int) -> None:
        """Count one eviction event that dropped ``evicted`` slots after ``seen`` tokens."""
        self.evictions += 1
        self.evicted_tokens += evicted
        self.event_steps.append(seen)


class Part:
    """A cache attribute that is the field ``name`` of its part ``part`` (``None`` while the part is).
    Only the ``layout`` part's fields are written through; the other parts are read here and written on
    the part itself (``cache.table``'s columns in place)."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        part = getattr(cache, self.part)
        return None if part is None else getattr(part, self.name)

    def __set__(self, cache, value) -> None:
        if self.part != "layout":
            raise AttributeError(f"{self.name} belongs to the cache's {self.part}; write it there")
        setattr(cache.layout, self.name, value)
