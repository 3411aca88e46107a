"""The one eviction contract shared by every method and every caller.

A cache asks its evictor which of the stored entries to keep whenever the budget is reached. The
evictor sees per-slot metadata (:class:`TokenInfo`) and returns the kept slot indices per row.
By default selection is per token and shared by all layers and heads (as in the DynTS reference code),
so one index tensor per eviction event serves every layer. An evictor with ``per_head = True`` (H2O,
SnapKV and R-KV as their papers select) is called on one row per (batch row, layer, KV head) instead:
the cache gathers each head's own statistics into that row and compacts each head with its own kept
slots, under the same ``n_keep``. The evictor's code is the same for both.

Adding a method = one file with an ``@register("name")`` dataclass + an import in ``__init__``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, ClassVar

import torch

from ..kernels import keep_top_indices

__all__ = [
    "EVICTORS",
    "Evictor",
    "Segment",
    "TokenInfo",
    "available_methods",
    "keep_top",
    "make_evictor",
    "first_valid_mask",
    "local_and_question_mask",
    "recent_mask",
    "register",
]


class Segment(IntEnum):
    """What a cached token is: prompt, reasoning, answer (after the thinking delimiter) or padding."""

    QUESTION = 0
    THINKING = 1
    ANSWER = 2
    PAD = 3


# Statistics a cache can gather for an evictor (names used in ``Evictor.requires``).
STATISTICS = frozenset({"scores", "attention", "window_attention", "keys"})


@dataclass
class TokenInfo:
    """What an evictor sees at an eviction event. ``b`` rows, ``n`` stored slots per row.

    Slots are in the order the tokens arrived (oldest first); left pads sit at the front of a row.

    Attributes:
        positions: ``[b, n]`` absolute index of each slot in the (padded) sequence.
        segments: ``[b, n]`` :class:`Segment` codes.
        token_ids: ``[b, n]`` token id of each slot.
        n_keep: number of slots every row keeps after the event (same for all methods, paper C.3).
        local_window: ``W_l``, the most recent tokens every windowed method keeps.
        question_length: ``W_q``, the (padded) prompt width.
        scores: ``[b, n]`` predictor importance (DynTS), NaN where never scored.
        attention: ``[b, n]`` attention mass each slot received, accumulated over layers, heads
            and all queries since it entered the cache (H2O).
        window_attention: ``[b, w, n]`` attention of the last ``w`` queries, summed over layers
            and heads (SnapKV's observation window); slots newer than a query get 0.
        keys: ``[b, h_kv, n, d]`` key states of one reference layer (R-KV redundancy).

    For a ``per_head`` evictor each of the ``b`` rows is one (batch row, layer, KV head): ``attention``
    and ``window_attention`` are that head's (summed over the query heads of its group), ``keys`` is
    ``[b, 1, n, d]``, that head's keys.
    """

    positions: torch.Tensor
    segments: torch.Tensor
    token_ids: torch.Tensor
    n_keep: int
    local_window: int
    question_length: int
    scores: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    window_attention: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """``[b, n]`` True for real tokens (not padding)."""
        return self.segments != Segment.PAD

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)  # type: ignore[return-value]


class Evictor(ABC):
    """Decides which cached tokens survive an eviction event.

    Subclasses are ``@dataclass``es whose fields are the method's own settings (validated in
    ``__post_init__``); budget, local window and retention belong to the cache, so that every method
    keeps the same number of entries. ``requires`` names the statistics the cache must gather;
    ``bounded = False`` marks the full cache (no budget, no events).
    """

    name: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset()
    bounded: ClassVar[bool] = True  # False: the full cache (no budget, never evicts)
    per_head = False  # True: one selection per (batch row, layer, KV head); a dataclass field where a method offers it

    @abstractmethod
    def select(self, info: TokenInfo) -> torch.Tensor:
        """Return the kept slot indices, ``[b, info.n_keep]`` int64, ascending in each row."""

    def protected_prefix(self, question_length: int) -> int:
        """Leading slots this method keeps at every event (so they never move): a paged engine may share
        and cache the full blocks inside them. ``0`` unless the method says otherwise."""
        return 0

    def constants(self) -> dict[str, tuple[int, ...]]:
        """The host ids the method compares slots with on every call (e.g. SepLLM's separator ids), by name; each
        becomes a device tensor once (:meth:`constant`). Default: none."""
        return {}

    def place(self, device: torch.device | str, upload: Callable[[list[int]], torch.Tensor]) -> None:
        """Put every :meth:`constants` entry on ``device`` ahead of the calls, through ``upload`` (host ids to a
        long tensor on the device without blocking: a paged engine's pinned staging). Call it after :meth:`bind`."""
        for name, values in self.constants().items():
            tensor = upload(list(values))
            self.__dict__.setdefault("_constants", {})[(name, values, tensor.device)] = tensor

    def constant(self, name: str, device: torch.device) -> torch.Tensor:
        """The long tensor of :meth:`constants`' ``name`` on ``device``: placed (:meth:`place`), else made now and
        kept (one blocking copy per device, on a cache that is not paged)."""
        values = self.constants()[name]
        cache = self.__dict__.setdefault("_constants", {})
        key = (name, values, device)
        tensor = cache.get(key)
        if tensor is None:
            tensor = cache[key] = torch.tensor(values, dtype=torch.long, device=device)
        return tensor

    def bind(self, tokenizer) -> None:
        """Adapt settings that depend on the vocabulary (e.g. SepLLM's separator ids).

        :func:`dynts.generate` calls it with its tokenizer before decoding; the default does nothing.
        """

    def __call__(self, info: TokenInfo) -> torch.Tensor:
        kept = self.select(info)
        if kept.shape != (info.shape[0], info.n_keep):
            raise RuntimeError(
                f"evictor {self.name!r} returned indices of shape {tuple(kept.shape)}, "
                f"expected {(info.shape[0], info.n_keep)}"
            )
        return kept


EVICTORS: dict[str, type[Evictor]] = {}


def register(name: str) -> Callable[[type[Evictor]], type[Evictor]]:
    """Class decorator adding an evictor to the registry under ``name``."""

    def wrap(cls: type[Evictor]) -> type[Evictor]:
        if name in EVICTORS and EVICTORS[name] is not cls:
            raise ValueError(f"evictor name {name!r} is already registered by {EVICTORS[name]}")
        unknown = set(cls.requires) - STATISTICS
        if unknown:
            raise ValueError(f"{cls.__name__}.requires names unknown statistics {sorted(unknown)}")
        cls.name = name
        EVICTORS[name] = cls
        return cls

    return wrap


def available_methods() -> list[str]:
    """Names of all registered eviction methods."""
    return sorted(EVICTORS)


def make_evictor(method: str | Evictor, **options) -> Evictor:
    """Build an evictor from a registry name (``options`` are its dataclass fields) or pass one through."""
    if isinstance(method, Evictor):
        if options:
            raise ValueError("evictor options are only accepted with a method name, not an Evictor instance")
        return method
    if method not in EVICTORS:
        raise ValueError(f"method={method!r} is unknown; choose one of {available_methods()}")
    try:
        return EVICTORS[method](**options)
    except TypeError as err:
        raise ValueError(f"bad options for method={method!r}: {err}") from None


def keep_top(priority: torch.Tensor, info: TokenInfo) -> torch.Tensor:
    """Keep the ``info.n_keep`` slots of highest ``priority`` per row; pads go first.

    Ties are broken deterministically in favour of the more recent slot. ``priority``: ``[b, n]``
    float (``+inf`` = protected). Returns ``[b, n_keep]`` ascending slot indices.
    """
    return keep_top_indices(priority, info.valid, info.n_keep)  # torch, or Triton on CUDA (dynts.kernels)


def recent_mask(info: TokenInfo, window: int) -> torch.Tensor:
    """``[b, n]`` True on the ``window`` most recent slots of each row (slots are in arrival order)."""
    n = info.shape[1]
    return (torch.arange(n, device=info.positions.device) >= n - window).expand(info.shape)


def first_valid_mask(info: TokenInfo, count: int) -> torch.Tensor:
    """``[b, n]`` True on the first ``count`` real (non-pad) slots of each row (attention sinks)."""
    rank = info.valid.long().cumsum(-1)
    return info.valid & (rank <= count)


def local_and_question_mask(info: TokenInfo, keep_question: bool) -> torch.Tensor:
    """``[b, n]`` True on the local window and, with ``keep_question``, the prompt: the slots the
    attention-scored methods (H2O, SnapKV, R-KV and their ``+q`` presets) always keep."""
    protected = recent_mask(info, info.local_window)
    return protected | (info.segments == Segment.QUESTION) if keep_question else protected
