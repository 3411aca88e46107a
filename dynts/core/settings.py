"""The eviction keywords, parsed and validated in one place.

Every entry point speaks the same seven keywords -- ``method``, ``budget``, ``local_window``,
``retention``, ``predictor``, ``think_end``, ``method_options`` (:data:`EVICTION_FIELDS`) --:
:func:`dynts.generate`, :func:`dynts.generate_batch`, :func:`dynts.rescue.rescue_generate`, the vLLM
plugin's ``additional_config["dynts"]`` and both servers' ``--kv-*`` flags. Each builds one
:class:`EvictionSettings`, which resolves method -> :class:`~dynts.evictors.Evictor` ->
:class:`~dynts.core.budget.Budget` and checks the predictor is there when the method scores tokens.

A configuration that stores eviction settings (an eval cell, a bench run, a server's flags) holds an
:class:`EvictionSpec`: the same seven fields as plain data (frozen, hashable, JSON-able), validated when
it is made by building its :class:`EvictionSettings` once; :meth:`EvictionSpec.build` returns them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Sequence

from ..evictors.base import EVICTORS, Evictor, make_evictor
from ..predictor import ImportancePredictor
from .budget import Budget

__all__ = ["EVICTION_FIELDS", "SERVED_STATISTICS", "EvictionSettings", "EvictionSpec", "add_eviction_arguments",
           "eviction_fields", "eviction_spec", "serving_methods"]

EVICTION_FIELDS = ("method", "budget", "local_window", "retention", "predictor", "think_end", "method_options")

# Statistics a paged engine provides to an evictor: predictor scores are computed from the final-norm
# hidden states of the packed batch; attention statistics are not gathered there.
SERVED_STATISTICS = frozenset({"scores"})


def serving_methods() -> list[str]:
    """Registered methods the paged engines (continuous batching, vLLM) run."""
    return sorted(name for name, cls in EVICTORS.items() if set(cls.requires) <= SERVED_STATISTICS)


@dataclass
class EvictionSettings:
    """What eviction one request (or a whole engine) runs.

    Args:
        method: a name from :func:`dynts.available_methods` or an :class:`~dynts.evictors.Evictor`.
        budget: ``B``, the most KV entries held (not needed for ``full``), or a whole
            :class:`~dynts.core.budget.Budget` (then ``local_window`` and ``retention`` come from it,
            e.g. ``sizing="official"`` or :meth:`Budget.from_paper`).
        local_window: ``W_l``, recent tokens always kept.
        retention: fraction of the selection window kept at an event.
        predictor: :class:`~dynts.ImportancePredictor`, its directory or ``"auto"`` (``dynts`` needs it).
        think_end: the delimiter closing the thinking segment: text, one token id or a sequence of ids
            (see :func:`dynts.thinking.think_end_ids`); the delimiter and the tokens after it are answer.
        method_options: fields of the method's dataclass (e.g. ``{"sink_size": 4}``).

    ``evictor`` and ``bounds`` (the :class:`Budget`, ``None`` for the full cache) are derived.
    """

    method: str | Evictor = "dynts"
    budget: int | Budget | None = None
    local_window: int | None = None
    retention: float = 0.4
    predictor: ImportancePredictor | str | Path | None = None
    think_end: str | int | Sequence[int] | None = "</think>"
    method_options: dict[str, Any] | None = None
    evictor: Evictor = field(init=False, repr=False)
    bounds: Budget | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.evictor = make_evictor(self.method, **(self.method_options or {}))
        self.bounds = None
        if self.bounded:
            if isinstance(self.budget, Budget):
                self.bounds = self.budget
            elif self.budget is None or self.local_window is None:
                raise ValueError(f"method={self.evictor.name!r} needs budget=... and local_window=... (e.g. 1024 and 128)")
            else:
                self.bounds = Budget(self.budget, self.local_window, self.retention)
        if self.needs_scores and self.predictor is None:
            raise ValueError(f"method={self.evictor.name!r} needs predictor=... (an ImportancePredictor or its directory)")

    @classmethod
    def pop_from(cls, keywords: MutableMapping[str, Any]) -> "EvictionSettings":
        """Settings from the eviction keywords in ``keywords`` (removed from it; the rest stays)."""
        return cls(**{name: keywords.pop(name) for name in EVICTION_FIELDS if name in keywords})

    @classmethod
    def resolve(cls, settings: "EvictionSettings | EvictionSpec | None",
                keywords: MutableMapping[str, Any]) -> "EvictionSettings":
        """``settings`` as given (an :class:`EvictionSpec` is built), or built from the eviction keywords in
        ``keywords`` (not both)."""
        if settings is None:
            return cls.pop_from(keywords)
        mixed = sorted(set(keywords) & set(EVICTION_FIELDS))
        if mixed:
            raise ValueError(f"pass either eviction=EvictionSettings(...) or the keywords {mixed}, not both")
        if isinstance(settings, EvictionSpec):
            return settings.build()
        if not isinstance(settings, EvictionSettings):
            raise ValueError(f"eviction must be an EvictionSettings or an EvictionSpec, got {type(settings).__name__}")
        return settings

    # ------------------------------------------------------------------ derived
    @property
    def bounded(self) -> bool:
        """False for the full cache (no eviction, no budget)."""
        return self.evictor.bounded

    @property
    def needs_scores(self) -> bool:
        return "scores" in self.evictor.requires

    def check_served(self) -> "EvictionSettings":
        """Raise ``ValueError`` unless a paged engine can run these settings (budget-only or scored
        methods; ``fixed`` with one row for every request); returns ``self``."""
        if self.evictor.per_head:
            raise ValueError(
                f"method={self.evictor.name!r} with per_head=True keeps a different set per KV head, but a paged "
                "engine's blocks hold every head of a token: pass per_head=False (one set for all heads) "
                "or use dynts.generate for per-head selection"
            )
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
        return self

    def check_prompt(self, prompt_length: int) -> None:
        """Raise ``ValueError`` unless a prompt of this length fits the budget (question + W_l + 1)."""
        if prompt_length < 1:
            raise ValueError("the prompt is empty; send at least one token")
        if self.bounds is not None:
            self.bounds.check_question(prompt_length)

    def n_keep(self, question_length: int) -> int | None:
        """Entries kept at an event for this prompt length (``None`` for the full cache)."""
        return self.bounds.n_keep(question_length) if self.bounds is not None else None

    def may_evict(self, prompt_length: int, max_new_tokens: int | None) -> bool:
        """False when a request can never have an event (:meth:`Budget.due`): it runs the full cache, or its
        prompt + ``max_new_tokens`` fit the budget. ``None``: no length limit (it may evict)."""
        if self.bounds is None:
            return False
        if max_new_tokens is None:
            return True
        return self.bounds.due(prompt_length + max_new_tokens - 1, 1, self.bounds.n_keep(prompt_length))

    def reserved_slots(self, prompt_length: int, max_new_tokens: int | None) -> int:
        """The most KV slots a request of this prompt can ever hold: ``min(B, prompt + new)``."""
        longest = prompt_length + (max_new_tokens if max_new_tokens is not None else math.inf)
        if self.bounds is None:
            return int(longest) if longest != math.inf else -1
        return int(min(self.bounds.budget, longest))

    def load_predictor(self, model: Any, **options: Any) -> ImportancePredictor | None:
        """The predictor placed for ``model`` when the method scores tokens, else ``None`` (no
        per-token MLP for methods that do not read scores); ``options`` go to
        :func:`dynts.predictor.load_predictor`."""
        if not self.needs_scores:
            return None
        from ..predictor import load_predictor

        return load_predictor(self.predictor, model, **options)


def _frozen(value: Any) -> Any:
    """``value`` with lists as tuples (hashable), recursively."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _thawed(value: Any) -> Any:
    """``value`` with tuples as lists (as JSON reads them back), recursively."""
    return [_thawed(v) for v in value] if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class EvictionSpec:
    """The seven eviction fields as plain data: what a configuration stores (frozen, hashable, JSON-able).

    The fields mean what :class:`EvictionSettings`' arguments mean, restricted to data: ``method`` a
    registered name, ``predictor`` a directory (or ``"auto"``), ``think_end`` text or token ids,
    ``method_options`` a mapping (held as sorted ``(name, value)`` pairs). ``budget`` is ``B`` or a
    :class:`~dynts.core.budget.Budget` (itself frozen; e.g. :meth:`Budget.from_paper`).

    Made, it is validated once by building its :class:`EvictionSettings` (a bad field raises
    ``ValueError`` naming it); :meth:`build` returns settings with the evictor and :class:`Budget` resolved.
    """

    method: str = "dynts"
    budget: int | Budget | None = None
    local_window: int | None = None
    retention: float = 0.4
    predictor: str | None = None
    think_end: str | int | tuple[int, ...] | None = "</think>"
    method_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise ValueError(f"method={self.method!r} must be a registered method name (an EvictionSpec is plain data)")
        options = self.method_options or ()
        options = options.items() if hasattr(options, "items") else options
        object.__setattr__(self, "method_options", tuple(sorted((str(k), _frozen(v)) for k, v in options)))
        if isinstance(self.predictor, Path):
            object.__setattr__(self, "predictor", str(self.predictor))
        if isinstance(self.think_end, list):
            object.__setattr__(self, "think_end", tuple(self.think_end))
        self.build()  # the one validation: evictor, budget, predictor

    def build(self, predictor: ImportancePredictor | None = None) -> EvictionSettings:
        """The :class:`EvictionSettings`; ``predictor``: an already loaded one instead of ``self.predictor``."""
        return EvictionSettings(self.method, self.budget, self.local_window, self.retention,
                                predictor if predictor is not None else self.predictor, self.think_end,
                                {k: _thawed(v) for k, v in self.method_options} or None)

    @property
    def bounded(self) -> bool:
        """False for the full cache (no eviction, no budget)."""
        return self.build().bounded

    def replace(self, **changes: Any) -> "EvictionSpec":
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON data (:meth:`from_dict` reads them back)."""
        budget = dataclasses.asdict(self.budget) if isinstance(self.budget, Budget) else self.budget
        return {"method": self.method, "budget": budget, "local_window": self.local_window,
                "retention": self.retention, "predictor": self.predictor, "think_end": _thawed(self.think_end),
                "method_options": {k: _thawed(v) for k, v in self.method_options}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EvictionSpec":
        fields = dict(data)
        if isinstance(fields.get("budget"), Mapping):
            fields["budget"] = Budget(**fields["budget"])
        return cls(**fields)


def add_eviction_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The ``--kv-method --kv-budget --kv-local-window --kv-retention --predictor`` flags of both servers;
    :func:`eviction_spec` reads them back. ``required``: budget and local window must be given."""
    parser.add_argument("--kv-method", default="dynts", help=f"one of {serving_methods()}")
    parser.add_argument("--kv-budget", type=int, default=None, required=required, help="B: most KV entries per request")
    parser.add_argument("--kv-local-window", type=int, default=None, required=required,
                        help="W_l: recent tokens always kept")
    parser.add_argument("--kv-retention", type=float, default=0.4, help="fraction of the selection window kept")
    parser.add_argument("--predictor", default=None, help="DynTS predictor directory (needed by --kv-method dynts)")


def eviction_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The eviction keywords set by :func:`add_eviction_arguments`' flags (``None`` ones left out): what
    the vLLM plugin's ``additional_config["dynts"]`` carries."""
    fields = {"method": args.kv_method, "budget": args.kv_budget, "local_window": args.kv_local_window,
              "retention": args.kv_retention, "predictor": args.predictor}
    return {k: v for k, v in fields.items() if v is not None}


def eviction_spec(args: argparse.Namespace, **fields: Any) -> EvictionSpec:
    """The :class:`EvictionSpec` of :func:`add_eviction_arguments`' flags; ``fields``: the others (e.g. ``think_end``)."""
    return EvictionSpec(**eviction_fields(args), **fields)
