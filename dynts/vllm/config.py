"""The plugin's configuration, the vLLM way: ``additional_config={"dynts": {...}}`` for the engine,
``SamplingParams.extra_args`` for one request.

Engine (``vllm serve MODEL --additional-config '{"dynts": {...}}'`` or ``vllm.LLM(...,
additional_config=...)``): the arguments of :func:`dynts.generate` -- ``method``, ``budget``,
``local_window``, ``retention``, ``predictor`` (a directory), ``think_end``, ``method_options``; and
``max_budget``, the largest budget a request may ask for (default: the engine's ``budget``). The worker's slot
table is reserved at start-up for ``max_budget`` slots per request (:mod:`dynts.vllm.memory`), so a request asking
for more is refused.

Per request (``SamplingParams(extra_args={"dynts": {"method": "window", "budget": 512}})``, or over
HTTP the flat ``vllm_xargs`` keys ``dynts_method``, ``dynts_budget``, ``dynts_local_window``,
``dynts_retention``): any of method / budget / local_window / retention / method_options. The
predictor is the engine's. Bad values are a ``ValueError`` naming the field (HTTP 400).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..core import EVICTION_FIELDS, EvictionSettings, EvictionSpec

__all__ = ["ENGINE_FIELDS", "MAX_VARIANTS", "REQUEST_FIELDS", "PluginConfig", "asks_for_dynts", "engine_asks_for_dynts",
           "request_overrides"]

PLUGIN_FIELDS = ("max_budget",)  # the engine's own: the slot table's width
ENGINE_FIELDS = EVICTION_FIELDS + PLUGIN_FIELDS  # the eviction keywords of dynts.generate (dynts.core.settings)
REQUEST_FIELDS = tuple(f for f in EVICTION_FIELDS if f not in ("predictor", "think_end"))  # those are the engine's
FLAT_PREFIX = "dynts_"
MAX_VARIANTS = 64  # per-request setting variants kept (least recently used dropped; a running request keeps its own)


def asks_for_dynts(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request's ``extra_args`` carry dynts fields (nested ``dynts`` or flat ``dynts_*`` keys)."""
    return bool(extra_args) and any(key == "dynts" or key.startswith(FLAT_PREFIX) for key in extra_args)


def engine_asks_for_dynts(vllm_config: Any) -> bool:
    """Whether the engine was started with an ``additional_config["dynts"]`` entry."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return "dynts" in extra


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The dynts fields a request brings in ``extra_args`` (nested ``{"dynts": {...}}`` or flat ``dynts_*``)."""
    if not extra_args:
        return {}
    out: dict[str, Any] = {}
    nested = extra_args.get("dynts")
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise ValueError(f"extra_args['dynts'] must be an object of {list(REQUEST_FIELDS)}, got {type(nested).__name__}")
        out.update(nested)
    for key, value in extra_args.items():
        if key.startswith(FLAT_PREFIX):
            out[key[len(FLAT_PREFIX):]] = value
    unknown = sorted(set(out) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"unknown dynts request fields {unknown}; a request may set {list(REQUEST_FIELDS)} "
                         "(the predictor is the server's)")
    return out


def _budget_of(settings: EvictionSettings) -> int | None:
    """``B`` of bounded settings (``None`` for the full cache)."""
    return None if settings.bounds is None else settings.bounds.budget


@dataclass
class PluginConfig:
    """The engine's eviction settings (an :class:`~dynts.core.EvictionSpec`, validated by the core) and a bounded
    cache of per-request variants (one evictor per variant, the :data:`MAX_VARIANTS` most recently used).

    Args:
        engine: the ``additional_config["dynts"]`` mapping.

    Attributes:
        max_budget: the largest budget a request may run with (``max_budget``, default the engine's budget; ``None``
            when the engine has none: then no request may ask for one).
    """

    engine: Mapping[str, Any]
    spec: EvictionSpec = field(init=False)
    settings: EvictionSettings = field(init=False)
    max_budget: int | None = field(init=False)
    _variants: OrderedDict[tuple, EvictionSettings] = field(init=False, default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, Mapping):
            raise ValueError(f"additional_config['dynts'] must be an object of {list(ENGINE_FIELDS)}")
        unknown = sorted(set(self.engine) - set(ENGINE_FIELDS))
        if unknown:
            raise ValueError(f"unknown additional_config['dynts'] fields {unknown}; choose from {list(ENGINE_FIELDS)}")
        eviction = {k: v for k, v in self.engine.items() if k not in PLUGIN_FIELDS}
        try:
            self.spec = EvictionSpec(**{"method": "dynts", **eviction})
        except TypeError as err:
            raise ValueError(f"bad dynts settings: {err}") from None
        self.settings = self.spec.build().check_served()
        self.max_budget = self._max_budget(self.engine.get("max_budget"))

    def _max_budget(self, value: Any) -> int | None:
        budget = _budget_of(self.settings)
        if value is None:
            return budget
        if isinstance(value, bool) or not isinstance(value, int) or value < max(1, budget or 0):
            raise ValueError(f"max_budget={value!r} must be an int >= the engine's budget ({budget or 1}); it is the "
                             "largest budget a request may ask for (e.g. max_budget=8192)")
        return value

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "PluginConfig | None":
        """The plugin's config from a ``VllmConfig``; ``None`` (plugin inert) without a ``dynts`` entry."""
        return cls(vllm_config.additional_config["dynts"]) if engine_asks_for_dynts(vllm_config) else None

    def _check_width(self, settings: EvictionSettings) -> None:
        """Refuse a request's budget that the slot table reserved at start-up cannot hold."""
        budget = _budget_of(settings)
        if budget is None or (self.max_budget is not None and budget <= self.max_budget):
            return
        if self.max_budget is None:
            raise ValueError(f"budget={budget}: this server reserved no per-request budget (its method has none); start "
                             f"the server with additional_config {{'dynts': {{..., 'max_budget': {budget}}}}}")
        raise ValueError(f"budget={budget} exceeds this server's max_budget={self.max_budget} (the slots it reserved per "
                         f"request at start-up); ask for budget <= {self.max_budget} or start the server with "
                         f"additional_config {{'dynts': {{..., 'max_budget': {budget}}}}}")

    @property
    def predictor(self) -> Any:
        return self.settings.predictor

    @property
    def variants(self) -> int:
        """Per-request settings variants cached now (at most :data:`MAX_VARIANTS`)."""
        return len(self._variants)

    def for_request(self, extra_args: Mapping[str, Any] | None) -> EvictionSettings:
        """The settings one request runs with (the engine's, or its overrides on top)."""
        overrides = request_overrides(extra_args)
        if not overrides:
            return self.settings
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        found = self._variants.get(key)
        if found is not None:
            self._variants.move_to_end(key)
        else:
            changes = dict(overrides)
            if "method" in overrides and "method_options" not in overrides:
                changes["method_options"] = ()  # the engine's options belong to the engine's method
            found = self.spec.replace(**changes).build().check_served()
            self._check_width(found)
            if found.needs_scores and not self.settings.needs_scores:
                raise ValueError(f"method={found.evictor.name!r} needs the predictor, which this server does not load; "
                                 "start it with additional_config {'dynts': {'method': 'dynts', 'predictor': DIR, ...}}")
            self._variants[key] = found
            while len(self._variants) > MAX_VARIANTS:
                self._variants.popitem(last=False)
        return found
