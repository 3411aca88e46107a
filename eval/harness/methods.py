"""Method specs for ``dynts eval``: a registered eviction method plus settings of its dataclass,
and the DynTS ablations of the paper's Table 2 as named presets.

Spec syntax: ``name`` or ``name:key=value,key=value`` (values: ``true``/``false``, ints, floats or
strings), e.g. ``dynts:selection=random``. A comma list of specs is split so that ``key=value``
items stay with the spec before them: ``full,window,dynts:selection=random,keep_local=false,h2o``.
Any name in :func:`dynts.available_methods` works, so new evictors need no change here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterable

import dynts
from dynts.cli_options import parse_option_value
from dynts.evictors.base import EVICTORS, Evictor

__all__ = ["ABLATIONS", "CHAIN_ORACLES", "CONTROLS", "ORACLES", "PER_HEAD", "PRESETS", "QUESTION_PROTECTED", "MethodSpec", "parse_method", "parse_methods"]

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

# Methods registered by a module outside the library (imported on first use).
PLUGINS: dict[str, str] = {"testbed-oracle": "data_pipeline.testbed.oracle"}


@dataclass(frozen=True)
class MethodSpec:
    """A method to evaluate: registry ``name`` + dataclass ``options``; ``label`` names it in tables."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            opts = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.options)
            object.__setattr__(self, "label", f"{self.name}:{opts}" if opts else self.name)
        self.evictor()  # validates name and options now, before any generation

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

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options), "label": self.label}


def parse_method(spec: str) -> MethodSpec:
    """One spec (``name`` or ``name:key=value,...``, or a preset from :data:`PRESETS`)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec {spec!r} must be a non-empty string like 'dynts' or 'dynts:selection=random'")
    spec = spec.strip()
    if spec in PRESETS:
        parsed = parse_method(PRESETS[spec])
        return MethodSpec(parsed.name, parsed.options, label=spec)
    name, _, rest = spec.partition(":")
    options = []
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method {spec!r}: option {item!r} must look like key=value (e.g. dynts:selection=random)")
        options.append((key.strip(), parse_option_value(value.strip())))
    if name not in EVICTORS and name not in PLUGINS:
        raise ValueError(
            f"method {name!r} is unknown; choose one of {dynts.available_methods()}, "
            f"a plugin {sorted(PLUGINS)} or a preset {sorted(PRESETS)}"
        )
    return MethodSpec(name, tuple(options))


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
