"""The tuning grid file (``configs/tuning/*.yaml``): its cells and its validation.

:func:`load_grid` reads and validates one file into a :class:`Grid` (stage 1's :class:`TuneCell` list, the
cache pairs of stage 2, the selection subsets); every bad field is refused with its name and the fix, and a
grid reading any problem set but dev is refused. Running the grid and choosing: :mod:`eval.harness.tuning`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

__all__ = ["CACHE", "DEV", "FORMAT", "Grid", "ROOT", "RULE", "TuneCell", "format_value", "harness_config", "load_grid", "method_fields",
           "repo_relative"]

ROOT = Path(__file__).resolve().parents[2]
FORMAT = "dynts-tuning/2"
DEV = "dev"  # the only problem set tuning reads
CACHE = ("local_window", "retention")
TOP_KEYS = {"name", "model", "predictor", "problems", "k", "budget", "budget_from", "local_window", "retention", "cache",
            "batch_size", "threads", "seed", "max_new_tokens", "reference", "cost", "select", "methods"}
REQUIRED = ("model", "problems", "k", "budget", "cache", "select", "methods")
PROBLEM_KEYS = {"family", "set", "n", "min_think", "max_think"}
RULE = ("highest dev pass@1; ties to the default (the tied cell differing from it in the fewest settings, then "
        "the first in grid order)")


def format_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_share(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x <= 1


def repo_relative(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def method_fields(method: str) -> dict[str, dataclasses.Field]:
    import importlib

    from dynts.evictors.base import EVICTORS

    from .methods import PLUGINS

    if method not in EVICTORS and method in PLUGINS:
        importlib.import_module(PLUGINS[method])
    return {f.name: f for f in dataclasses.fields(EVICTORS[method])}


@dataclass(frozen=True)
class TuneCell:
    """One method setting: evictor ``options`` (grid order) at the cache's ``local_window`` / ``retention``."""

    method: str
    options: tuple[tuple[str, Any], ...]
    local_window: int
    retention: float
    order: int = field(default=0, compare=False)  # grid order (ties)

    @property
    def spec(self) -> str:
        """The ``dynts eval`` spec, the cache settings explicit: ``rkv:mix_lambda=0.05,...,local_window=32,retention=0.4``."""
        items = [*self.options, ("local_window", self.local_window), ("retention", self.retention)]
        return f"{self.method}:" + ",".join(f"{k}={format_value(v)}" for k, v in items)

    def setting(self) -> dict[str, Any]:
        return {**dict(self.options), "local_window": self.local_window, "retention": self.retention}

    def value(self, key: str) -> Any:
        """A setting, or the evictor's default for an option the grid does not sweep."""
        setting = self.setting()
        return setting[key] if key in setting else method_fields(self.method)[key].default


@dataclass
class Grid:
    """A validated grid file; ``cells`` are stage 1's."""

    path: Path
    text: str
    name: str
    model: str
    predictor: str | None
    problems: dict[str, Any]
    k: int
    budget: int
    local_window: int
    retention: float
    cache: dict[str, list]
    batch_size: int
    threads: int
    seed: int
    max_new_tokens: int | None
    reference: list[str]
    seconds_per_sample: float | None
    subsets: dict[str, dict[str, Any]]
    methods: dict[str, dict[str, Any]]
    cells: list[TuneCell] = field(default_factory=list)

    @property
    def benchmark(self) -> str:
        p = self.problems
        family = "" if p["family"] == "copy" else f",family={p['family']}"  # as dynts eval names copy: no family
        extra = "".join(f",{k}={p[k]}" for k in ("min_think", "max_think") if k in p)
        return f"testbed:n={p['n']}{family}{extra},set={DEV}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def defaults(self, method: str) -> dict[str, Any]:
        """The setting ties go to: each axis's evictor default and the shared cache settings, then the grid's ``default``."""
        fields = method_fields(method)
        out = {a: fields[a].default for a in self.methods[method]["grid"] if fields[a].default is not dataclasses.MISSING}
        return {**out, "local_window": self.local_window, "retention": self.retention, **(self.methods[method].get("default") or {})}

    def subsets_of(self, method: str) -> dict[str, dict[str, Any]]:
        """The subsets that apply to ``method`` (it has every setting they fix)."""
        fields = method_fields(method)
        return {name: s for name, s in self.subsets.items() if all(k in fields for k in s)}

    def in_subset(self, cell: TuneCell, subset: dict[str, Any]) -> bool:
        return all(cell.value(k) == v for k, v in subset.items())

    def cache_pairs(self) -> list[tuple[int, float]]:
        return [(w, float(r)) for w in self.cache["local_window"] for r in self.cache["retention"]]

    def max_winners(self, method: str) -> int:
        """The most distinct stage-1 winners ``method`` can have: a subset that is the union of other
        applicable subsets inside it has its winner among theirs."""
        cells = [c for c in self.cells if c.method == method]
        sets = {n: frozenset(c for c in cells if self.in_subset(c, s)) for n, s in self.subsets_of(method).items()}
        covered = [n for n, s in sets.items() if s == frozenset().union(*(t for m, t in sets.items() if m != n and t < s))]
        return len(sets) - len(covered)


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file; every error is a ``ValueError`` naming the file and the field."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    return _validate(raw, path, text)


def _validate(raw: Any, path: Path, text: str) -> Grid:  # noqa: C901 (one check per field)
    import dynts
    from dynts.evictors.base import EVICTORS

    from .methods import PLUGINS, parse_method

    def bad(where: str, msg: str) -> ValueError:
        return ValueError(f"{path}: {where}: {msg}")

    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the grid must be a mapping of {sorted(TOP_KEYS)}")
    for key in sorted(set(raw) - TOP_KEYS):
        raise bad(key, f"unknown field; the grid's fields are {sorted(TOP_KEYS)}")
    for key in REQUIRED:
        if key not in raw:
            raise bad(key, "missing (required: " + ", ".join(REQUIRED) + ")")
    problems = raw["problems"]
    if not isinstance(problems, dict):
        raise bad("problems", "must be a mapping like {family: chain, set: dev, n: 100}")
    for key in sorted(set(problems) - PROBLEM_KEYS):
        raise bad(f"problems.{key}", f"unknown field; choose from {sorted(PROBLEM_KEYS)}")
    if problems.get("set") != DEV:
        raise bad("problems.set", f"{problems.get('set')!r}: tuning reads set={DEV} problems only (choices are made "
                                  "on dev; no other set may be read here)")
    if problems.get("family") not in ("copy", "chain"):
        raise bad("problems.family", f"{problems.get('family')!r} must be 'copy' or 'chain'")
    if "n" not in problems:
        raise bad("problems.n", "missing: how many dev problems (e.g. 100)")
    for key in ("n", "min_think", "max_think"):
        if key in problems and (not _is_int(problems[key]) or problems[key] < 1):
            raise bad(f"problems.{key}", f"{problems[key]!r} must be a positive integer")

    def positive_int(key: str, default: Any = None) -> Any:
        value = raw.get(key, default)
        if value is not None and (not _is_int(value) or value < 1):
            raise bad(key, f"{value!r} must be a positive integer")
        return value

    k, budget, max_new_tokens = positive_int("k"), positive_int("budget"), positive_int("max_new_tokens")
    batch_size, threads, seed = positive_int("batch_size", 100), positive_int("threads", 1), raw.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise bad("seed", f"{seed!r} must be an integer >= 0")
    local_window, retention = raw.get("local_window", 32), raw.get("retention", 0.4)
    if not _is_int(local_window) or local_window < 0:
        raise bad("local_window", f"{local_window!r} must be an integer >= 0")
    if not _is_share(retention):
        raise bad("retention", f"{retention!r} must lie in (0, 1]")
    budget_from = raw.get("budget_from")
    if budget_from is not None:
        if not isinstance(budget_from, dict) or not {"fraction", "full_mean_sequence"} <= set(budget_from):
            raise bad("budget_from", "must give fraction and full_mean_sequence (and optionally source)")
        want = round(budget_from["fraction"] * budget_from["full_mean_sequence"])
        if want != budget:
            raise bad("budget", f"{budget} is not round({budget_from['fraction']} x {budget_from['full_mean_sequence']}) = {want}")
    cache = raw["cache"]
    if not isinstance(cache, dict) or set(cache) != set(CACHE):
        raise bad("cache", "must give the stage-2 values of both local_window and retention, e.g. "
                           "{local_window: [16, 32, 64], retention: [0.2, 0.4, 0.6]}")
    for key, ok in (("local_window", lambda v: _is_int(v) and v >= 0), ("retention", _is_share)):
        values = cache[key]
        if not isinstance(values, list) or not values or not all(ok(v) for v in values) or len(set(values)) != len(values):
            raise bad(f"cache.{key}", f"{values!r} must be a non-empty list of distinct valid {key} values")

    model = raw["model"]
    if not isinstance(model, str) or not model:
        raise bad("model", "must be a dynts.load name or a checkpoint directory")
    if not Path(model).is_absolute() and (ROOT / model).is_dir():  # paths in a grid are the repository's
        model = str(ROOT / model)
    predictor = raw.get("predictor")
    if isinstance(predictor, str) and not Path(predictor).is_absolute():
        predictor = str(ROOT / predictor)
    if predictor is not None and not (Path(predictor) / "predictor_config.json").is_file():
        raise bad("predictor", f"{predictor!r} is not a predictor directory (no predictor_config.json)")
    reference = raw.get("reference") or []
    if not isinstance(reference, list) or not all(isinstance(r, str) for r in reference):
        raise bad("reference", "must be a list of method specs run once for context (e.g. [full]); they are never chosen")
    for spec in reference:
        try:
            parse_method(spec)
        except ValueError as err:
            raise bad(f"reference.{spec}", str(err)) from None
    cost = raw.get("cost") or {}
    if not isinstance(cost, dict) or set(cost) - {"seconds_per_sample", "source"}:
        raise bad("cost", "must be a mapping like {seconds_per_sample: 0.3, source: 'how it was measured'}")
    seconds = cost.get("seconds_per_sample")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise bad("cost.seconds_per_sample", f"{seconds!r} must be a positive number")
    select = raw["select"]
    if not isinstance(select, dict) or set(select) - {"metric", "ties", "subsets"}:
        raise bad("select", "must be a mapping of metric, ties and subsets")
    if select.get("metric", "pass@1") != "pass@1":
        raise bad("select.metric", f"{select['metric']!r}: only pass@1 (dev) is supported")
    if select.get("ties", "default") != "default":
        raise bad("select.ties", f"{select['ties']!r}: only 'default' is supported (ties go to the default)")
    subsets = select.get("subsets")
    if not isinstance(subsets, dict) or not subsets or not all(isinstance(v, dict) for v in subsets.values()):
        raise bad("select.subsets", "must map a name to the {setting: value} it fixes, e.g. 'token+q': "
                                    "{per_head: false, keep_question: true}, best: {}")

    methods = raw["methods"]
    if not isinstance(methods, dict) or not methods:
        raise bad("methods", "must map method names to {grid: {option: [values]}}")
    cells: list[TuneCell] = []
    for name, entry in methods.items():
        where = f"methods.{name}"
        if name not in EVICTORS and name not in PLUGINS:
            raise bad(where, f"unknown method; choose one of {dynts.available_methods()}")
        entry = methods[name] = entry or {}
        if not isinstance(entry, dict) or set(entry) - {"grid", "exclude", "default"}:
            raise bad(where, "must be a mapping with grid (and optionally exclude, default)")
        axes = entry["grid"] = entry.get("grid") or {}
        fields = method_fields(name)
        for axis, values in axes.items():
            if axis in CACHE:
                raise bad(f"{where}.grid.{axis}", "the cache stage sweeps it for every method (the grid's cache)")
            if axis not in fields:
                raise bad(f"{where}.grid.{axis}", f"{name} has no option {axis!r}; its options are {sorted(fields)}")
            if not isinstance(values, list) or not values:
                raise bad(f"{where}.grid.{axis}", f"{values!r} must be a non-empty list of values")
            if any(isinstance(v, (list, dict)) or v is None for v in values) or len(set(map(repr, values))) != len(values):
                raise bad(f"{where}.grid.{axis}", f"{values!r} must list distinct scalar values")
        for part in ("exclude", "default"):
            items = entry.get(part) or ([] if part == "exclude" else {})
            for item in items if part == "exclude" else [items]:
                if not isinstance(item, dict):
                    raise bad(f"{where}.{part}", f"{item!r} must be a {{option: value}} mapping")
                for axis in item:
                    if axis not in axes:
                        raise bad(f"{where}.{part}.{axis}", f"not an axis of {name}'s grid ({sorted(axes)})")
        for values in itertools.product(*axes.values()):
            setting = dict(zip(axes, values))
            if any(all(setting[a] == v for a, v in ex.items()) for ex in entry.get("exclude") or []):
                continue
            cell = TuneCell(name, tuple(setting.items()), local_window, float(retention), order=len(cells))
            try:
                parse_method(cell.spec)
            except ValueError as err:
                raise bad(f"{where}.grid", f"cell {cell.spec}: {err}") from None
            cells.append(cell)
    if any("scores" in EVICTORS[m].requires for m in methods) and predictor is None:
        raise bad("predictor", "the grid has a method that needs predictor scores (dynts): name its predictor")
    grid = Grid(path, text, raw.get("name") or path.stem, model, predictor, problems, k, budget, local_window,
                float(retention), cache, batch_size, threads, seed, max_new_tokens, reference,
                float(seconds) if seconds is not None else None, subsets, methods, cells)
    for sname, subset in subsets.items():
        for key in subset:
            if not any(key in method_fields(m) for m in methods):
                raise bad(f"select.subsets.{sname}.{key}", "no method of the grid has this setting")
    for method in methods:
        applicable = grid.subsets_of(method)
        if not applicable:
            raise bad(f"methods.{method}", f"no select.subsets entry applies (each fixes a setting {method} lacks); add best: {{}}")
        for sname, subset in applicable.items():
            if not any(c.method == method and grid.in_subset(c, subset) for c in cells):
                raise bad(f"select.subsets.{sname}", f"no {method} cell has {subset}")
    # every cell, and each method's default at every cache pair, through the harness's own checks
    probes = [TuneCell(m, tuple((a, grid.defaults(m)[a]) for a in methods[m]["grid"] if a in grid.defaults(m)), w, r)
              for m in methods for w, r in grid.cache_pairs()]
    harness_config(grid, [c.spec for c in cells + probes], Path("runs/tuning/validate"))
    return grid


def harness_config(grid: Grid, specs: Sequence[str], run_dir: Path):
    """The harness config (:class:`eval.harness.config.EvalConfig`) that runs ``specs`` on ``grid``'s problems."""
    from .config import EvalConfig

    try:  # every bounded spec sets its own local_window and retention; the run's values are the shared ones
        return EvalConfig(model=grid.model, benchmarks=[grid.benchmark], methods=list(specs), budgets=[grid.budget],
                          local_windows=[grid.local_window], retentions=[grid.retention], k=grid.k,
                          batch_size=grid.batch_size, seed=grid.seed, max_new_tokens=grid.max_new_tokens,
                          predictor=grid.predictor, run_dir=run_dir, progress=False)
    except ValueError as err:
        raise ValueError(f"{grid.path}: {err}") from None

