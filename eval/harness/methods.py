"""Method specs for ``dynts eval``: a registered eviction method plus settings of its dataclass,
and the DynTS ablations of the paper's Table 2 as named presets.

Spec syntax: ``name`` or ``name:key=value,key=value`` (values: ``true``/``false``, ints, floats or
strings), e.g. ``dynts:selection=random``. A comma list of specs is split so that ``key=value``
items stay with the spec before them: ``full,window,dynts:selection=random,keep_local=false,h2o``.
Any name in :func:`dynts.available_methods` works, so new evictors need no change here.

Per-method cache settings: ``local_window=``, ``local_window_share=`` and ``retention=`` in a spec are
the harness's, not the evictor's (no evictor has fields of those names): they are taken out of the options
before the evictor is built and set that method's :class:`dynts.Budget` (the run's budget ``B``, this
``W_l`` / retention) in place of ``--local-window`` / ``--retention``, e.g.
``rkv:per_head=true,mix_lambda=0.05,retention=0.6``. ``local_window_share=s`` sets ``W_l`` per budget,
``round(s x B)``: how a ``W_l`` tuned at one budget carries to the others (a tuned ``W_l`` of 64 at
``B = 90`` is ``local_window_share=0.7111``, ``W_l`` 37 at ``B = 52``).
They stay in the label (so in cell keys, tables and records). A preset takes further options too:
``h2o+q:local_window=16`` is ``h2o:keep_question=true`` at ``W_l = 16``, labelled as written.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import dynts
from dynts.cli_options import parse_option_value
from dynts.evictors.base import EVICTORS, Evictor

__all__ = ["ABLATIONS", "CACHE_OPTIONS", "CHAIN_ORACLES", "CONTROLS", "ORACLES", "PER_HEAD", "PRESETS", "QUESTION_PROTECTED", "MethodSpec", "method_id", "parse_method", "parse_methods", "spec_label",
           "window_of_share"]

# Paper Table 2 under the equal-n_keep contract of C.3 (every method keeps the same count, so
# "without X" gives X's slots to the next candidates instead of shrinking the cache).
ABLATIONS: dict[str, str] = {
    "dynts-no-question": "dynts:keep_question=false",  # w.o. Q: the prompt competes by score
    "dynts-no-thinking": "window:keep_question=true",  # w.o. T: question + most recent, no selection
    "dynts-no-local": "dynts:keep_local=false",  # w.o. L: no protected local window
    "t-random": "dynts:selection=random",  # thinking tokens chosen at random
    "t-bottom": "dynts:selection=bottom",  # thinking tokens with the LOWEST predicted importance
}

# Controls that isolate what a selection adds: each attention baseline with the question protection
# DynTS gets ("+q"), and the testbed's ground-truth oracles by kept-set shape (data_pipeline.testbed.oracle).
CONTROLS: dict[str, str] = {
    "h2o+q": "h2o:keep_question=true",
    "snapkv+q": "snapkv:keep_question=true",
    "rkv+q": "rkv:keep_question=true",
    # the attention scorers at their papers' granularity: each KV head of each layer keeps its own top-k
    "h2o-head": "h2o:per_head=true",
    "h2o-head+q": "h2o:per_head=true,keep_question=true",
    "snapkv-head": "snapkv:per_head=true",
    "snapkv-head+q": "snapkv:per_head=true,keep_question=true",
    "rkv-head": "rkv:per_head=true",
    "rkv-head+q": "rkv:per_head=true,keep_question=true",
    "oracle-step": "testbed-oracle:keep_step=true",  # question + the asked step (9 tokens) + recent
    "oracle-value": "testbed-oracle",  # question + the asked key and its value + recent
    "oracle-token": "testbed-oracle:keep_key=false",  # question + the asked value token alone + recent
    # the chain family (benchmark testbed:family=chain): every result until the asked step, then its closure
    "chain-oracle-step": "testbed-oracle:family=chain,keep_step=true",  # whole steps + recent
    "chain-oracle-value": "testbed-oracle:family=chain",  # keys, values and operand names rJ + recent
}

PRESETS: dict[str, str] = {**ABLATIONS, **CONTROLS}
PER_HEAD = [name for name in CONTROLS if "-head" in name]
QUESTION_PROTECTED = [name for name in CONTROLS if name.endswith("+q") and name not in PER_HEAD]
ORACLES = [name for name in CONTROLS if name.startswith("oracle-")]
CHAIN_ORACLES = [name for name in CONTROLS if name.startswith("chain-oracle-")]

# Spec options the harness consumes (this method's cache settings), never passed to the evictor.
CACHE_OPTIONS = ("local_window", "local_window_share", "retention")

# Methods registered by a module outside the library (imported on first use).
PLUGINS: dict[str, str] = {"testbed-oracle": "data_pipeline.testbed.oracle"}


@dataclass(frozen=True)
class MethodSpec:
    """A method to evaluate: registry ``name`` + dataclass ``options``; ``label`` names it in tables;
    ``cache``: this method's own ``local_window`` (or ``local_window_share``) / ``retention`` (:data:`CACHE_OPTIONS`),
    overriding the run's."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    cache: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", spec_label(self.name, [*self.options, *self.cache]))
        evictor = self.evictor()  # validates name and options now, before any generation
        _check_cache(self.label, self.cache, evictor.bounded)
        clash = sorted({k for k, _ in self.cache} & {f.name for f in dataclasses.fields(evictor)})
        if clash:  # the harness takes these: an evictor field of that name could never be set
            raise ValueError(f"method {self.label!r}: {self.name} has its own option {clash[0]!r}, which the harness "
                             "reads as this method's cache setting; rename the evictor's field")

    def evictor(self) -> Evictor:
        if self.name not in EVICTORS and self.name in PLUGINS:
            importlib.import_module(PLUGINS[self.name])
        return dynts.make_evictor(self.name, **dict(self.options))

    @property
    def bounded(self) -> bool:
        """False for the full cache (it ignores budget, local window and retention)."""
        return self.evictor().bounded

    @property
    def requires(self) -> frozenset[str]:
        return frozenset(type(self.evictor()).requires)

    @property
    def local_window(self) -> int | None:
        """This method's ``W_l`` (``None``: the run's)."""
        return dict(self.cache).get("local_window")

    @property
    def local_window_share(self) -> float | None:
        """This method's ``W_l`` as a share of each budget (``None``: not set)."""
        return dict(self.cache).get("local_window_share")

    @property
    def sets_local_window(self) -> bool:
        """Whether this method's spec sets its own ``W_l`` (``local_window=`` or ``local_window_share=``)."""
        return self.local_window is not None or self.local_window_share is not None

    def local_window_at(self, budget: int) -> int | None:
        """This method's ``W_l`` at ``budget``: its ``local_window``, or its ``local_window_share`` of it
        (:func:`window_of_share`), or ``None`` (the run's)."""
        share = self.local_window_share
        return window_of_share(share, budget) if share is not None else self.local_window

    @property
    def retention(self) -> float | None:
        """This method's retention (``None``: the run's)."""
        return dict(self.cache).get("retention")

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "options": dict(self.options), "label": self.label}
        if self.cache:  # only then (cells without overrides keep their keys)
            out["cache"] = dict(self.cache)
        return out


def method_id(method: "MethodSpec | Mapping[str, Any]") -> str:
    """What a method is, whatever it is called: its registry name with its options and cache settings, each
    sorted (``h2o+q`` is ``h2o:keep_question=true``); a :class:`MethodSpec` or its :meth:`~MethodSpec.as_dict`
    (a cell's ``"method"``) give the same text. The final-set ledger freezes these."""
    if isinstance(method, MethodSpec):
        method = method.as_dict()
    items = sorted(dict(method.get("options") or {}).items()) + sorted(dict(method.get("cache") or {}).items())
    return spec_label(str(method["name"]), items)


def window_of_share(share: float, budget: int) -> int:
    """``round(share x budget)``, halves rounding up: the ``W_l`` a ``local_window_share=`` gives at ``budget``."""
    return int(share * budget + 0.5)


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def spec_label(name: str, items: Iterable[tuple[str, Any]]) -> str:
    """The spec text of ``name`` with ``items`` (``name:key=value,...``; booleans lower-case), the label of tables."""
    opts = ",".join(f"{k}={_fmt(v)}" for k, v in items)
    return f"{name}:{opts}" if opts else name


def _check_cache(label: str, cache: tuple[tuple[str, Any], ...], bounded: bool) -> None:
    """Raise ``ValueError`` naming the option unless ``cache`` holds valid per-method cache settings."""
    if {"local_window", "local_window_share"} <= {k for k, _ in cache}:
        raise ValueError(f"method {label!r}: give local_window= (tokens) or local_window_share= (a share of each "
                         "budget), not both")
    for key, value in cache:
        if key not in CACHE_OPTIONS:
            raise ValueError(f"method {label!r}: {key!r} is not a cache option ({', '.join(CACHE_OPTIONS)})")
        if not bounded:
            raise ValueError(f"method {label!r}: {key}= does not apply: this method keeps every entry (no budget)")
        if key == "local_window" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"method {label!r}: local_window={value!r} must be an integer >= 0 (this method's W_l, "
                             "in place of --local-window)")
        if key == "local_window_share" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1):
            raise ValueError(f"method {label!r}: local_window_share={value!r} must lie in [0, 1) (this method's W_l as a "
                             "share of each budget, e.g. 0.25)")
        if key == "retention" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
            raise ValueError(f"method {label!r}: retention={value!r} must lie in (0, 1] (this method's retention, "
                             "in place of --retention)")


def parse_method(spec: str) -> MethodSpec:
    """One spec (``name`` or ``name:key=value,...``, or a preset from :data:`PRESETS`, optionally with
    more options: ``h2o+q:local_window=16``); :data:`CACHE_OPTIONS` become the spec's ``cache``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec {spec!r} must be a non-empty string like 'dynts' or 'dynts:selection=random'")
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    items: list[tuple[str, Any]] = []
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method {spec!r}: option {item!r} must look like key=value (e.g. dynts:selection=random)")
        if key.strip() in dict(items):
            raise ValueError(f"method {spec!r}: option {key.strip()!r} is given twice")
        items.append((key.strip(), parse_option_value(value.strip())))
    cache = tuple((k, float(v) if k in ("retention", "local_window_share") and isinstance(v, int) and not isinstance(v, bool) else v)
                  for k, v in items if k in CACHE_OPTIONS)
    options = [(k, v) for k, v in items if k not in CACHE_OPTIONS]
    if name in PRESETS:  # the preset's options, then these (which override them)
        base = parse_method(PRESETS[name])
        merged = {**dict(base.options), **dict(options)}
        return MethodSpec(base.name, tuple(merged.items()), label=spec_label(name, [*options, *cache]), cache=cache)
    if name not in EVICTORS and name not in PLUGINS:
        raise ValueError(
            f"method {name!r} is unknown; choose one of {dynts.available_methods()}, "
            f"a plugin {sorted(PLUGINS)} or a preset {sorted(PRESETS)}"
        )
    return MethodSpec(name, tuple(options), cache=cache)


def split_specs(text: str) -> list[str]:
    """Split a comma list of specs, keeping ``key=value`` items with the spec before them."""
    specs: list[str] = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item.split("=", 1)[0]:
            if not specs:
                raise ValueError(f"method list {text!r} starts with an option {item!r}; write name:key=value")
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        else:
            specs.append(item)
    return specs


def parse_methods(values: Iterable[str]) -> list[MethodSpec]:
    """Specs from one or more comma lists; duplicates (same label) are dropped."""
    out: dict[str, MethodSpec] = {}
    for value in values:
        for spec in split_specs(value):
            parsed = parse_method(spec)
            out.setdefault(parsed.label, parsed)
    if not out:
        raise ValueError("no methods given; e.g. --method full,window,streamingllm,dynts")
    return list(out.values())
