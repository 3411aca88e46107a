"""What one ``dynts rescue bench`` comparison runs: :class:`RescueEvalConfig`, the cells' settings and
the flat record (``results.json``'s ``config``, each cell's key) written from it."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from dynts.predictor import find_predictor
from dynts.rescue import DegenerationDetector, RescueConfig
from eval.rescue.table import CONTROLS
from eval.rescue.verifiers import DEFAULT_VERIFIER

__all__ = ["RECORD_FIELDS", "SEARCH_NAMES", "SETTINGS", "RescueEvalConfig", "check_settings", "detector_record"]

SETTINGS = ("full", "helper", "evict", "bon", "kvr", "kvr-noexit", "helper-search", "full-search")

#: The record's name of each step-search field it carries (``n`` is N, both ``n_base`` and ``n_helper``).
SEARCH_NAMES = {"n": "n_base", "delimiter": "step_delimiter", "max_steps": "max_steps", "max_step_tokens": "max_step_tokens",
                "detector": "detector", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
                "max_rows": "max_rows"}

#: The record's fields, in its order (the cells' keys of committed runs are digests of these names).
RECORD_FIELDS = ("benchmark", "out", "base", "helper", "prm", "methods", "method_options", "predictor", "budget",
                 "paper_budget", "headroom", "local_window", "retention", "n", "delimiter", "max_tokens", "max_steps",
                 "max_step_tokens", "degen_steps", "detector", "temperature", "top_p", "top_k", "seed", "limit",
                 "settings", "max_rows", "think_end", "trust_remote_code", "load_options")

_DETECTOR_FIELDS = ("entropy_threshold", "compress_threshold", "compress_window", "guard", "entropy_window", "include_context")


def check_settings(settings: Sequence[str], empty_ok: bool = True) -> None:
    """Refuse unknown ``--settings`` (and, unless ``empty_ok``, an empty list), naming the choices."""
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not (settings or empty_ok):
        raise ValueError(f"--settings {','.join(settings)!r}: {'unknown ' + ', '.join(unknown) if unknown else 'no setting'}; "
                         f"choose from {','.join(SETTINGS)}")


def detector_record(detector: DegenerationDetector) -> dict[str, Any]:
    """A detector as the record names it: its thresholds and windows, and ``loop`` only when on."""
    out = {name: getattr(detector, name) for name in _DETECTOR_FIELDS}
    if detector.loop is not None:
        out["loop"] = asdict(detector.loop)
    return out


@dataclass
class RescueEvalConfig:
    """One comparison: every setting in ``settings`` for every eviction ``method`` of the base.

    ``search``: the step search of the ``kvr`` cell, N = ``n_base`` = ``n_helper`` candidates per model
    per step, its detector on; every stepwise cell derives its own (:meth:`step_search`: its candidates,
    detector and ``max_tokens``). ``max_tokens``: the output cap of every cell (``None``: the benchmark's).
    ``degen_steps``: a trajectory is *degenerate* when it is incorrect and has at least this many
    committed steps (paper Table 2: 256 of at most 1024 steps; default ``search.max_steps // 4``).
    """

    benchmark: str
    out: str
    base: str = "testbed"
    helper: str = "testbed-helper"
    prm: str = DEFAULT_VERIFIER
    methods: tuple[str, ...] = ("dynts", "window")
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    predictor: str | None = None
    budget: int = 64
    paper_budget: bool = False  # budget = score-selected entries + headroom (KV-Rescue Appendix C)
    headroom: int = 128
    local_window: int = 16
    retention: float = 0.4
    search: RescueConfig = field(default_factory=RescueConfig)
    max_tokens: int | None = None
    degen_steps: int | None = None
    limit: int | None = None
    settings: tuple[str, ...] = SETTINGS
    think_end: str | None = "</think>"
    trust_remote_code: bool = False
    load_options: dict[str, Any] = field(default_factory=dict)  # dynts.load: dtype, device, device_map, ...

    def __post_init__(self) -> None:
        if self.predictor == "auto":  # the trained predictor of the base (dynts.predictor.find_predictor)
            self.predictor = str(find_predictor(self.base))
        check_settings(self.settings)
        n, n_helper = self.search.n_base, self.search.n_helper
        if n < 1 or n_helper != n:
            raise ValueError(f"search n_base={n!r}, n_helper={n_helper!r}: both must be N >= 1 (n, candidates per model per step)")
        if self.search.detector is None:
            raise ValueError("search detector=None: kvr and full-search screen base candidates (kvr-noexit runs without)")
        if self.degen_steps is None:
            self.degen_steps = max(1, self.search.max_steps // 4)
        for method in self.methods:  # every method's eviction settings, validated by the core now
            self.eviction(method)

    @property
    def n(self) -> int:
        """N: candidates per model per step."""
        return self.search.n_base

    def bounds(self):
        """The base's :class:`~dynts.core.budget.Budget`: ``budget`` is the physical bound ``B``, or with
        ``paper_budget`` the paper's score-selected entries (``B' = budget + headroom`` held)."""
        from dynts.core.budget import Budget

        if self.paper_budget:
            return Budget.from_paper(self.budget, self.headroom, self.local_window)
        return Budget(self.budget, self.local_window, self.retention)

    def eviction(self, method: str):
        """The base's :class:`~dynts.core.EvictionSpec` under ``method`` (``"full"``: no eviction)."""
        from dynts.core import EvictionSpec

        return EvictionSpec(method, self.bounds(), self.local_window, self.retention, self.predictor, self.think_end,
                            self.method_options.get(method))

    def candidates(self, setting: str) -> tuple[int, int, bool]:
        """``(n_base, n_helper, detector on)`` of a stepwise setting: ``bon`` N + 0 without the detector,
        ``kvr`` N + N with it, ``kvr-noexit`` N + N without it, ``full-search`` as ``kvr`` (its base
        unevicted), ``helper-search`` 0 + 2N (as many scored candidates per step as KV-Rescue; there
        are no base candidates to screen)."""
        n = self.n
        return {"bon": (n, 0, False), "kvr": (n, n, True), "kvr-noexit": (n, n, False),
                "full-search": (n, n, True), "helper-search": (0, 2 * n, False)}[setting]

    def step_search(self, setting: str, max_tokens: int) -> RescueConfig:
        """The :class:`~dynts.rescue.RescueConfig` of a stepwise cell: :attr:`search` with the setting's
        candidates (:meth:`candidates`), detector and the cell's ``max_tokens``."""
        n_base, n_helper, screened = self.candidates(setting)
        return replace(self.search, n_base=n_base, n_helper=n_helper, max_tokens=max_tokens,
                       detector=self.search.detector if screened else None)

    def record(self) -> dict[str, Any]:
        """The flat record of this config (:data:`RECORD_FIELDS`; each step-search field under its
        :data:`SEARCH_NAMES` name): ``results.json``'s ``config`` and the base of every cell's key."""
        out = {}
        for name in RECORD_FIELDS:
            if name == "detector":
                value = detector_record(self.search.detector)
            elif name in SEARCH_NAMES:
                value = getattr(self.search, SEARCH_NAMES[name])
            else:
                value = getattr(self, name)
            out[name] = copy.deepcopy(value)
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "RescueEvalConfig":
        """The config a :meth:`record` (e.g. a run's ``results.json`` ``config``) was written from."""
        record = dict(record)
        search = {SEARCH_NAMES[name]: record.pop(name) for name in SEARCH_NAMES if name in record}
        if "n_base" in search:
            search["n_helper"] = search["n_base"]
        for name in ("methods", "settings"):
            if name in record:
                record[name] = tuple(record[name])
        return cls(**record, search=RescueConfig(**search))

    def cell_settings(self, setting: str, method: str | None) -> dict[str, Any]:
        """What a cell's result depends on (its file is reused only when these match)."""
        from eval.harness.config import fingerprint

        keep = {k: v for k, v in self.record().items() if k not in ("out", "settings", "methods", "max_rows", "method_options")}
        if not keep["load_options"]:
            keep.pop("load_options")  # default loading: cells of earlier runs stay reusable
        if not keep["paper_budget"]:  # the physical budget: cells of earlier runs stay reusable
            keep.pop("paper_budget")
            keep.pop("headroom")
        keep.update(setting=setting, method=method, method_options=self.method_options.get(method or "", {}))
        # the weights, so that a retrained model, PRM or predictor never reuses an old cell
        prms = [fingerprint(p.removeprefix("likelihood:")) for p in self.prm.split("*")]  # A*B: a product of verifiers
        keep["weights"] = {"base": fingerprint(self.base), "helper": fingerprint(self.helper),
                           "prm": prms[0] if len(prms) == 1 else prms, "predictor": fingerprint(self.predictor)}
        from dynts.evictors.base import EVICTORS

        if method is not None and method in EVICTORS and "scores" not in EVICTORS[method].requires:
            keep.pop("predictor")  # the method never reads importance scores
            keep["weights"].pop("predictor")
        if setting == "evict":  # plain decoding of the evicted base: no PRM, no helper, no candidates
            for k in ("prm", "n", "detector"):
                keep.pop(k)
            keep["weights"] = {k: v for k, v in keep["weights"].items() if k in ("base", "predictor")}
        if setting == "bon":
            keep["weights"].pop("helper")
        if setting in ("full", "helper"):
            for k in ("budget", "local_window", "retention", "predictor", "prm", "n", "detector", "method_options",
                      "paper_budget", "headroom"):
                keep.pop(k, None)
            keep["weights"] = {k: keep["weights"][k] for k in (("base",) if setting == "full" else ("helper",))}
        if setting in CONTROLS:  # the step search without eviction: no budget, no predictor
            for k in ("budget", "local_window", "retention", "predictor", "method_options", "paper_budget", "headroom"):
                keep.pop(k, None)
            keep["weights"].pop("predictor", None)
            n_base, n_helper, _ = self.candidates(setting)
            keep["search"] = {"n_base": n_base, "n_helper": n_helper}  # candidates per step, explicitly
            if setting == "helper-search":  # no base candidates: nothing to screen, no base weights
                keep.pop("detector")
                keep["weights"].pop("base")
        return keep
