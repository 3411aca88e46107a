"""What eviction a paged serving engine runs: a method, a budget, a local window (per engine, or per request)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..budget import Budget
from ..evictors import Evictor, make_evictor
from ..evictors.base import EVICTORS
from ..predictor import ImportancePredictor

__all__ = ["EvictionSettings", "serving_methods"]

# Statistics a served request can provide to an evictor: predictor scores are computed from the
# final-norm hidden states of the packed batch; attention statistics are not gathered in the engine.
SERVED_STATISTICS = frozenset({"scores"})


def serving_methods() -> list[str]:
    """Registered methods that :mod:`dynts.serving` runs inside continuous batching."""
    return sorted(name for name, cls in EVICTORS.items() if set(cls.requires) <= SERVED_STATISTICS)


@dataclass
class EvictionSettings:
    """Eviction settings of an engine or of one request (the arguments of :func:`dynts.generate`).

    Args:
        method: a name from :func:`serving_methods` or an :class:`~dynts.evictors.Evictor` instance.
        budget: ``B``, the most KV entries a request holds (not needed for ``full``).
        local_window: ``W_l``, recent tokens always kept.
        retention: fraction of the selection window kept at an event.
        predictor: :class:`~dynts.ImportancePredictor` or its directory (``dynts`` needs it).
        think_end: the delimiter closing the thinking segment: text, one token id or a sequence of ids
            (see :func:`dynts.thinking.think_end_ids`); the delimiter and the tokens after it are answer.
        method_options: fields of the method's dataclass (e.g. ``{"sink_size": 4}``).
    """

    method: str | Evictor = "dynts"
    budget: int | None = None
    local_window: int | None = None
    retention: float = 0.4
    predictor: ImportancePredictor | str | Path | None = None
    think_end: str | int | Sequence[int] | None = "</think>"
    method_options: dict[str, Any] | None = None
    evictor: Evictor = field(init=False, repr=False)
    bounds: Budget | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.evictor = make_evictor(self.method, **(self.method_options or {}))
        unsupported = set(self.evictor.requires) - SERVED_STATISTICS
        if unsupported:
            raise ValueError(
                f"method={self.evictor.name!r} needs attention statistics {sorted(unsupported)}, which "
                f"continuous batching does not gather; choose one of {serving_methods()} "
                "(or use dynts.generate for this method)"
            )
        keep = getattr(self.evictor, "keep", None)
        if self.evictor.name == "fixed" and keep is not None and len(keep) != 1:
            raise ValueError(
                f"method='fixed' got {len(keep)} rows of positions; a served engine applies one row to every "
                "request (requests are not batch rows): pass keep=[[...]]"
            )
        self.bounds = None
        if self.bounded:
            if self.budget is None or self.local_window is None:
                raise ValueError(
                    f"method={self.evictor.name!r} needs budget=... and local_window=... (e.g. 4096 and 512)"
                )
            self.bounds = Budget(self.budget, self.local_window, self.retention)
        if self.needs_scores and self.predictor is None:
            raise ValueError(f"method={self.evictor.name!r} needs predictor=... (an ImportancePredictor or its directory)")

    @property
    def bounded(self) -> bool:
        """False for the full cache (no eviction, no budget)."""
        return bool(getattr(self.evictor, "bounded", True))

    @property
    def needs_scores(self) -> bool:
        return "scores" in self.evictor.requires

    def check_prompt(self, prompt_length: int) -> None:
        """Raise ``ValueError`` unless a prompt of this length fits the budget (question + W_l + 1)."""
        if prompt_length < 1:
            raise ValueError("the prompt is empty; send at least one token")
        if self.bounds is not None:
            self.bounds.check_question(prompt_length)

    def reserved_slots(self, prompt_length: int, max_new_tokens: int | None) -> int:
        """The most KV slots a request of this prompt can ever hold: ``min(B, prompt + new)``."""
        longest = prompt_length + (max_new_tokens if max_new_tokens is not None else math.inf)
        if self.bounds is None:
            return int(longest) if longest != math.inf else -1
        return int(min(self.bounds.budget, longest))
