#!/usr/bin/env python
"""Tune the baselines' settings, and DynTS's own, on dev problems (issue #52 item 2).

    python scripts/tune_baselines.py --grid configs/tuning/chain-fair.yaml --out reports/tuning/chain-fair \\
        [--resume] [--dry-run] [--run-dir runs/tuning/chain-fair]

The grid file (committed before any cell runs) names the model and predictor, the dev problems, ``k``,
the budget ``B``, each method's values to try and the selection rule. Every cell (one method setting)
runs through the evaluation harness (:func:`eval.harness.runner.run`) in this one process, the model
loaded once. The budget ``B`` is the same for every cell; ``local_window`` and ``retention`` stay the
cache's settings (as in ``dynts eval``): a method whose grid sweeps them runs one harness config per
``(local_window, retention)`` pair, so ``n_keep`` follows from ``B``, ``W_l`` and retention by the one
formula every method shares (docs/evaluation.md, "Tuning on dev").

What is written:

- ``<run-dir>/`` (default ``runs/tuning/<out name>``): the harness run directory (samples with texts,
  partial batches of the cell in progress; a stopped run resumes inside a cell);
- ``<out>/cells/<key>.json`` and ``<out>/records/<key>.json``: each finished cell's metrics and
  per-problem record, written atomically once the cell is done (a stop loses at most the cell in
  progress); ``--resume`` skips every cell found there;
- ``<out>/grid.yaml`` (the grid as run) and ``<out>/tuning.json`` (its sha256, the git revision);
- ``<out>/grid.md``: every cell's dev pass@1 per method; ``<out>/choices.json``: per method the chosen
  setting with its dev score, the runner-up and the default's score (methods whose cells all finished).

Selection rule: the highest dev pass@1; ties go to the method's default (the evictor's own dataclass
defaults and the grid's ``local_window`` / ``retention``, unless the grid's ``default`` says otherwise),
i.e. the tied cell differing from it in the fewest settings, then the first in grid order.

Only ``set=dev`` problems are read: a grid naming another set is refused before anything loads.
``--dry-run`` validates the grid, prints every cell and the cost the grid's ``cost.seconds_per_sample``
projects (an option an evictor does not have yet is reported, not refused, in a dry run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the repository's packages first
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

__all__ = ["Grid", "TuneCell", "choose", "enumerate_cells", "load_grid", "main", "run_grid"]

FORMAT = "dynts-tuning/1"
DEV = "dev"  # the only problem set tuning reads
CACHE_AXES = ("local_window", "retention")  # consumed by the harness (the cache), not by the evictor
TOP_KEYS = {"name", "model", "predictor", "problems", "k", "budget", "budget_from", "local_window", "retention",
            "batch_size", "threads", "seed", "max_new_tokens", "reference", "cost", "select", "methods"}
REQUIRED = ("model", "problems", "k", "budget", "methods")
PROBLEM_KEYS = {"family", "set", "n", "min_think", "max_think"}
METHOD_KEYS = {"grid", "exclude", "default"}
SELECT_KEYS = {"metric", "ties", "restrict"}
RULE = ("highest dev pass@1; ties to the method's default (the tied cell differing from it in the fewest "
        "settings, then the first in grid order)")


# ------------------------------------------------------------------ the grid


@dataclass(frozen=True)
class TuneCell:
    """One method setting: evictor ``options`` (the grid's axes only, in grid order) + the cache's W_l and retention."""

    method: str
    options: tuple[tuple[str, Any], ...]
    local_window: int
    retention: float
    order: int = 0  # position in grid order (ties)

    @property
    def spec(self) -> str:
        """The harness method spec (``name:key=value,...``)."""
        opts = ",".join(f"{k}={_fmt(v)}" for k, v in self.options)
        return f"{self.method}:{opts}" if opts else self.method

    def setting(self) -> dict[str, Any]:
        """Every tuned setting: the options and ``local_window`` / ``retention``."""
        return {**dict(self.options), "local_window": self.local_window, "retention": self.retention}


@dataclass
class Grid:
    """A validated grid file."""

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
    batch_size: int
    threads: int
    seed: int
    max_new_tokens: int | None
    reference: list[str]
    seconds_per_sample: float | None
    restrict: dict[str, dict[str, Any]]
    methods: dict[str, dict[str, Any]]
    cells: list[TuneCell] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)  # options no evictor has yet (dry run only)

    @property
    def benchmark(self) -> str:
        """The harness benchmark spec, e.g. ``testbed:n=100,family=chain,set=dev``."""
        p = self.problems
        family = "" if p["family"] == "copy" else f",family={p['family']}"  # as dynts eval names copy: no family
        extra = "".join(f",{k}={p[k]}" for k in ("min_think", "max_think") if k in p)
        return f"testbed:n={p['n']}{family}{extra},set={DEV}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def defaults(self, method: str) -> dict[str, Any]:
        """The setting ties go to: the grid's ``default``, else the evictor's dataclass default of every
        axis, else the grid's ``local_window`` / ``retention``."""
        fields = _evictor_fields(method)
        out = {}
        for axis in self.methods[method]["grid"]:
            if axis in CACHE_AXES:
                out[axis] = getattr(self, axis)
            elif axis in fields and fields[axis].default is not dataclasses.MISSING:
                out[axis] = fields[axis].default
        for axis in CACHE_AXES:
            out.setdefault(axis, getattr(self, axis))
        out.update(self.methods[method].get("default") or {})
        return out


def _rel(path: str | Path | None) -> str | None:
    """A path under the repository as the grid wrote it (relative), anything else as is."""
    if path is None:
        return None
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _evictor_fields(method: str) -> dict[str, dataclasses.Field]:
    from dynts.evictors.base import EVICTORS
    from eval.harness.methods import PLUGINS

    if method not in EVICTORS and method in PLUGINS:
        import importlib

        importlib.import_module(PLUGINS[method])
    return {f.name: f for f in dataclasses.fields(EVICTORS[method])}


def load_grid(path: str | Path, strict: bool = True) -> Grid:
    """Read and validate a grid file; every error is a ``ValueError`` naming the file and the field.
    ``strict=False`` (``--dry-run``) lists options an evictor does not have in ``Grid.pending``
    instead of refusing them."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    return _validate(raw, path, text, strict)


def _validate(raw: Any, path: Path, text: str, strict: bool) -> Grid:  # noqa: C901 (one check per field)
    import dynts
    from dynts.evictors.base import EVICTORS
    from eval.harness.methods import PLUGINS, parse_method

    def bad(where: str, msg: str) -> ValueError:
        return ValueError(f"{path}: {where}: {msg}")

    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the grid must be a mapping of {sorted(TOP_KEYS)}")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise bad(unknown[0], f"unknown field; the grid's fields are {sorted(TOP_KEYS)}")
    for key in REQUIRED:
        if key not in raw:
            raise bad(key, "missing (required: " + ", ".join(REQUIRED) + ")")

    problems = raw["problems"]
    if not isinstance(problems, dict):
        raise bad("problems", "must be a mapping like {family: chain, set: dev, n: 100}")
    unknown = sorted(set(problems) - PROBLEM_KEYS)
    if unknown:
        raise bad(f"problems.{unknown[0]}", f"unknown field; choose from {sorted(PROBLEM_KEYS)}")
    if problems.get("set") != DEV:
        raise bad("problems.set", f"{problems.get('set')!r}: tuning reads set={DEV} problems only (choices are made "
                                  "on dev; no other set may be read here)")
    if problems.get("family") not in ("copy", "chain"):
        raise bad("problems.family", f"{problems.get('family')!r} must be 'copy' or 'chain'")
    for key in ("n", "min_think", "max_think"):
        if key in problems and (not _is_int(problems[key]) or problems[key] < 1):
            raise bad(f"problems.{key}", f"{problems[key]!r} must be a positive integer")
    if "n" not in problems:
        raise bad("problems.n", "missing: how many dev problems (e.g. 100)")

    def positive_int(key: str, default: Any = None) -> Any:
        value = raw.get(key, default)
        if value is not None and (not _is_int(value) or value < 1):
            raise bad(key, f"{value!r} must be a positive integer")
        return value

    k, budget = positive_int("k"), positive_int("budget")
    batch_size, threads, seed = positive_int("batch_size", 100), positive_int("threads", 1), raw.get("seed", 0)
    max_new_tokens = positive_int("max_new_tokens")
    if not _is_int(seed) or seed < 0:
        raise bad("seed", f"{seed!r} must be an integer >= 0")
    local_window = raw.get("local_window", 32)
    retention = raw.get("retention", 0.4)
    if not _is_int(local_window) or local_window < 0:
        raise bad("local_window", f"{local_window!r} must be an integer >= 0")
    if isinstance(retention, bool) or not isinstance(retention, (int, float)) or not 0 < retention <= 1:
        raise bad("retention", f"{retention!r} must lie in (0, 1]")
    budget_from = raw.get("budget_from")
    if budget_from is not None:
        if not isinstance(budget_from, dict) or not {"fraction", "full_mean_sequence"} <= set(budget_from):
            raise bad("budget_from", "must give fraction and full_mean_sequence (and optionally source)")
        want = round(budget_from["fraction"] * budget_from["full_mean_sequence"])
        if want != budget:
            raise bad("budget", f"{budget} is not round({budget_from['fraction']} x {budget_from['full_mean_sequence']}) = {want}")

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
    if not isinstance(cost, dict):
        raise bad("cost", "must be a mapping like {seconds_per_sample: 0.3, source: 'how it was measured'}")
    unknown = sorted(set(cost) - {"seconds_per_sample", "source"})
    if unknown:
        raise bad(f"cost.{unknown[0]}", "unknown field; choose from ['seconds_per_sample', 'source']")
    seconds = cost.get("seconds_per_sample")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise bad("cost.seconds_per_sample", f"{seconds!r} must be a positive number")

    select = raw.get("select") or {}
    if not isinstance(select, dict):
        raise bad("select", "must be a mapping")
    unknown = sorted(set(select) - SELECT_KEYS)
    if unknown:
        raise bad(f"select.{unknown[0]}", f"unknown field; choose from {sorted(SELECT_KEYS)}")
    if select.get("metric", "pass@1") != "pass@1":
        raise bad("select.metric", f"{select['metric']!r}: only pass@1 (dev) is supported")
    if select.get("ties", "default") != "default":
        raise bad("select.ties", f"{select['ties']!r}: only 'default' is supported (ties go to the method's default)")
    restrict = select.get("restrict") or {}
    if not isinstance(restrict, dict) or not all(isinstance(v, dict) and v for v in restrict.values()):
        raise bad("select.restrict", "must map a name to a non-empty {setting: value} subset, e.g. '+q': {keep_question: true}")

    methods = raw["methods"]
    if not isinstance(methods, dict) or not methods:
        raise bad("methods", "must map method names to {grid: {option: [values]}}")
    pending: list[str] = []
    cells: list[TuneCell] = []
    seen_axes: set[str] = set(CACHE_AXES)
    for name, entry in methods.items():
        where = f"methods.{name}"
        if name not in EVICTORS and name not in PLUGINS:
            raise bad(where, f"unknown method; choose one of {dynts.available_methods()}")
        entry = entry or {}
        if not isinstance(entry, dict):
            raise bad(where, "must be a mapping with grid (and optionally exclude, default)")
        unknown = sorted(set(entry) - METHOD_KEYS)
        if unknown:
            raise bad(f"{where}.{unknown[0]}", f"unknown field; choose from {sorted(METHOD_KEYS)}")
        axes = entry.get("grid") or {}
        if not isinstance(axes, dict):
            raise bad(f"{where}.grid", "must map option names to lists of values")
        entry["grid"] = axes
        fields = _evictor_fields(name)
        for axis, values in axes.items():
            if axis not in fields and axis not in CACHE_AXES:
                msg = (f"{name} has no option {axis!r}; its options are {sorted(fields)} (and the cache's "
                       f"{', '.join(CACHE_AXES)})")
                if strict:
                    raise bad(f"{where}.grid.{axis}", msg)
                pending.append(f"{where}.grid.{axis}: {msg}")
            if not isinstance(values, list) or not values:
                raise bad(f"{where}.grid.{axis}", f"{values!r} must be a non-empty list of values")
            if any(isinstance(v, (list, dict)) or v is None for v in values) or len(set(map(repr, values))) != len(values):
                raise bad(f"{where}.grid.{axis}", f"{values!r} must list distinct scalar values")
            seen_axes.add(axis)
        for axis in CACHE_AXES:
            for value in axes.get(axis, []):
                ok = _is_int(value) and value >= 0 if axis == "local_window" else (
                    not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1)
                if not ok:
                    raise bad(f"{where}.grid.{axis}", f"{value!r} is not a valid {axis}")
        for part in ("exclude", "default"):
            items = entry.get(part) or ([] if part == "exclude" else {})
            for item in items if part == "exclude" else [items]:
                if not isinstance(item, dict):
                    raise bad(f"{where}.{part}", f"{item!r} must be a {{option: value}} mapping")
                for axis in item:
                    if axis not in axes:
                        raise bad(f"{where}.{part}.{axis}", f"not an axis of {name}'s grid ({sorted(axes)})")
        names = list(axes)
        for values in itertools.product(*(axes[a] for a in names)):
            setting = dict(zip(names, values))
            if any(all(setting[a] == v for a, v in ex.items()) for ex in entry.get("exclude") or []):
                continue
            options = tuple((a, v) for a, v in setting.items() if a not in CACHE_AXES)
            cell = TuneCell(name, options, setting.get("local_window", local_window),
                            float(setting.get("retention", retention)), order=len(cells))
            if not (pending and any(f"{where}.grid." in p for p in pending)):
                try:
                    parse_method(cell.spec)
                except ValueError as err:
                    raise bad(f"{where}.grid", f"cell {cell.spec}: {err}") from None
            cells.append(cell)
    for rname, subset in restrict.items():
        for axis in subset:
            if axis not in seen_axes:
                raise bad(f"select.restrict.{rname}.{axis}", f"not an axis of any method's grid ({sorted(seen_axes)})")
    if any("scores" in EVICTORS[m].requires for m in methods) and predictor is None:
        raise bad("predictor", "the grid has a method that needs predictor scores (dynts): name its predictor")
    grid = Grid(path, text, raw.get("name") or path.stem, model, predictor, problems, k, budget, local_window,
                float(retention), batch_size, threads, seed, max_new_tokens, reference,
                float(seconds) if seconds is not None else None, restrict, methods, cells, pending)
    if strict:  # every cell's eviction settings through the harness's own checks (budget, W_l, retention)
        for cells_ in groups(grid.cells).values():
            _config(grid, cells_, Path("runs/tuning/validate"))
    return grid


def enumerate_cells(grid: Grid) -> list[TuneCell]:
    """The grid's cells in grid order (methods as listed, axes as listed, the last axis fastest)."""
    return list(grid.cells)


def groups(cells: Sequence[TuneCell]) -> dict[tuple[int, float], list[TuneCell]]:
    """Cells by ``(local_window, retention)``: one harness config each."""
    out: dict[tuple[int, float], list[TuneCell]] = {}
    for cell in cells:
        out.setdefault((cell.local_window, cell.retention), []).append(cell)
    return out


def _config(grid: Grid, cells: Sequence[TuneCell], run_dir: Path, methods: Sequence[str] | None = None):
    from eval.harness.config import EvalConfig

    (local_window, retention), = {(c.local_window, c.retention) for c in cells} if cells else {(grid.local_window, grid.retention)}
    try:
        return EvalConfig(model=grid.model, benchmarks=[grid.benchmark], methods=list(methods or [c.spec for c in cells]),
                          budgets=[grid.budget], local_windows=[local_window], retentions=[retention], k=grid.k,
                          batch_size=grid.batch_size, seed=grid.seed, max_new_tokens=grid.max_new_tokens,
                          predictor=grid.predictor, run_dir=run_dir, progress=False)
    except ValueError as err:
        raise ValueError(f"{grid.path}: local_window={local_window}, retention={retention}: {err}") from None


# ------------------------------------------------------------------ choosing


def _distance(setting: dict[str, Any], default: dict[str, Any]) -> int:
    return sum(1 for k, v in setting.items() if k in default and default[k] != v)


def choose(rows: Sequence[dict[str, Any]], default: dict[str, Any]) -> dict[str, Any]:
    """The chosen row and the runner-up among ``rows`` (each ``{"setting", "pass@1", "order", ...}``):
    the highest pass@1; ties to the row closest to ``default`` (fewest differing settings), then grid order.
    Also the default's own row when it is in ``rows``, and how many rows tie at the top."""
    if not rows:
        raise ValueError("no finished cells to choose from")
    key = lambda r: (-round(r["pass@1"], 9), _distance(r["setting"], default), r["order"])  # noqa: E731
    ranked = sorted(rows, key=key)
    best = ranked[0]
    default_row = next((r for r in rows if all(r["setting"].get(k) == v for k, v in default.items())), None)
    return {
        "chosen": best,
        "runner_up": ranked[1] if len(ranked) > 1 else None,
        "default": default_row,
        "tied_at_top": sum(1 for r in rows if round(r["pass@1"], 9) == round(best["pass@1"], 9)),
        "chosen_minus_default_points": None if default_row is None else round(100 * (best["pass@1"] - default_row["pass@1"]), 2),
        "cells": len(rows),
    }


def _row(cell: TuneCell, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "spec": cell.spec, "setting": cell.setting(), "order": cell.order, "key": result["key"],
        "pass@1": result["pass@1"], "pass@1_se": result["pass@1_se"], "n_keep": result.get("n_keep"),
        "selection_slots": result.get("selection_slots"), "mean_generated_tokens": result["mean_generated_tokens"],
        "loop_rate": result.get("loop_rate"), "seconds": result["seconds"],
    }


def choices(grid: Grid, finished: dict[TuneCell, dict[str, Any]]) -> dict[str, Any]:
    """``choices.json``: per method whose cells all finished, the choice over all its cells and over
    each ``select.restrict`` subset that applies to it."""
    out: dict[str, Any] = {}
    incomplete = []
    for method in grid.methods:
        cells = [c for c in grid.cells if c.method == method]
        if not all(c in finished for c in cells):
            incomplete.append(method)
            continue
        rows = [_row(c, finished[c]) for c in cells]
        default = grid.defaults(method)
        entry = choose(rows, default)
        entry["default_setting"] = default
        fields = _evictor_fields(method)
        restricted = {}
        for rname, subset in grid.restrict.items():
            if not all(k in rows[0]["setting"] or k in fields for k in subset):
                continue  # a setting this method does not have

            def value(row: dict[str, Any], k: str) -> Any:  # a setting the grid does not sweep keeps its default
                return row["setting"][k] if k in row["setting"] else fields[k].default

            sub = [r for r in rows if all(value(r, k) == v for k, v in subset.items())]
            if sub:
                restricted[rname] = choose(sub, {**default, **subset})
        entry["restricted"] = restricted
        out[method] = entry
    return {"methods": out, "incomplete": incomplete}


# ------------------------------------------------------------------ running


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write_json(path: Path, obj: Any) -> None:
    from dynts.io import write_atomic

    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def cell_keys(grid: Grid, run_dir: Path) -> dict[TuneCell, str]:
    """The harness key of every cell (``cells/<key>.json``), by planning each group's harness config."""
    from eval.harness.methods import parse_method
    from eval.harness.runner import plan_cells

    keys = {}
    for cells in groups(grid.cells).values():
        planned = {c.method.label: c.key for c in plan_cells(_config(grid, cells, run_dir))}
        for cell in cells:
            keys[cell] = planned[parse_method(cell.spec).label]
    return keys


def finished_cells(grid: Grid, out: Path, keys: dict[TuneCell, str]) -> dict[TuneCell, dict[str, Any]]:
    """The cells whose result and record are in ``out``."""
    done = {}
    for cell, key in keys.items():
        path = out / "cells" / f"{key}.json"
        if path.is_file() and (out / "records" / f"{key}.json").is_file():
            done[cell] = json.loads(path.read_text())
    return done


def _prepare_out(grid: Grid, out: Path, resume: bool) -> None:
    meta = out / "tuning.json"
    started = (out / "cells").is_dir() and any((out / "cells").glob("*.json"))
    if started and not resume:
        raise ValueError(f"{out} already holds finished cells; pass --resume to continue, or choose a new --out")
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old.get("grid_sha256") != grid.sha256:
            raise ValueError(f"{out} was started with another grid (sha256 {old.get('grid_sha256', '?')[:12]}, now "
                             f"{grid.sha256[:12]}); a grid is fixed before its cells run: use a new --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    from dynts.io import write_atomic

    write_atomic(out / "grid.yaml", grid.text)
    _write_json(meta, {"format": FORMAT, "grid": _rel(grid.path), "grid_sha256": grid.sha256, "git": _git(),
                       "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "benchmark": grid.benchmark, "cells": len(grid.cells)})


def run_grid(grid: Grid, out: str | Path, run_dir: str | Path | None = None, resume: bool = False,
             runner: Callable[..., list[dict[str, Any]]] | None = None, loader: Callable[[str], Any] | None = None,
             log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Run (or resume) every cell of ``grid``; writes ``out`` as the module docstring says and returns
    the choices. ``runner`` / ``loader``: :func:`eval.harness.runner.run` and :func:`dynts.load` (tests
    pass stand-ins)."""
    if grid.problems.get("set") != DEV or not grid.benchmark.endswith(f",set={DEV}"):
        raise ValueError(f"tuning reads set={DEV} only, not {grid.problems.get('set')!r}")
    if grid.pending:
        raise ValueError(f"{grid.path}: " + "; ".join(grid.pending))
    out = Path(out)
    run_dir = Path(run_dir) if run_dir is not None else ROOT / "runs" / "tuning" / out.name
    if runner is None:
        from eval.harness.runner import run as runner
    if loader is None:
        import dynts

        loader = dynts.load
    _prepare_out(grid, out, resume)
    keys = cell_keys(grid, run_dir)
    finished = finished_cells(grid, out, keys)
    if finished:
        log(f"tune: {len(finished)} of {len(grid.cells)} cells already in {out}, skipped")
    loaded = None

    def save(result: dict[str, Any]) -> None:
        from dynts.io import write_atomic

        key = result["key"]
        record = run_dir / "records" / f"{key}.json"
        if not record.is_file():
            raise RuntimeError(f"the harness finished {key} without its record")
        text = record.read_text()
        if not all(str(i).startswith(f"{DEV}:") for i in json.loads(text)["ids"]):
            raise RuntimeError(f"{key}: a record of problems outside set={DEV}")
        write_atomic(out / "records" / f"{key}.json", text)
        _write_json(out / "cells" / f"{key}.json", result)  # the cell counts as finished once this exists

    t0, ran = time.monotonic(), 0
    todo_reference = [s for s in grid.reference if not (out / "reference" / f"{_slug(s)}.json").is_file()]
    if todo_reference:
        loaded = loaded or loader(grid.model)
        config = _config(grid, [], run_dir, methods=todo_reference)
        for spec, result in zip(todo_reference, runner(config, loaded=loaded)):
            save(result)
            _write_json(out / "reference" / f"{_slug(spec)}.json", {"spec": spec, "key": result["key"]})
            log(f"tune: reference {spec}: pass@1 {100 * result['pass@1']:.1f} %")
    for (local_window, retention), cells in groups(grid.cells).items():
        todo = [c for c in cells if c not in finished]
        if not todo:
            continue
        loaded = loaded or loader(grid.model)
        config = _config(grid, todo, run_dir)
        by_key = {keys[c]: c for c in todo}

        def after(result: dict[str, Any]) -> None:
            nonlocal ran
            save(result)
            cell = by_key.get(result["key"])
            if cell is not None:
                finished[cell] = result
                ran += 1
                left = len(grid.cells) - len(finished)
                eta = (time.monotonic() - t0) / ran * left
                log(f"tune: [{len(finished)}/{len(grid.cells)}] {cell.spec} W_l={local_window} r={retention}: "
                    f"pass@1 {100 * result['pass@1']:.1f} % ({result['seconds']:.0f} s; about {eta / 3600:.1f} h left)")
                write_grid_md(grid, out, finished)

        for result in runner(config, after_cell=after, loaded=loaded):  # cells the run dir already held come back too
            if result["key"] in by_key and by_key[result["key"]] not in finished:
                save(result)
                finished[by_key[result["key"]]] = result
        write_grid_md(grid, out, finished)
    chosen = choices(grid, finished)
    reference = {}
    for spec in grid.reference:
        ref = out / "reference" / f"{_slug(spec)}.json"
        if ref.is_file():
            key = json.loads(ref.read_text())["key"]
            cell = json.loads((out / "cells" / f"{key}.json").read_text())
            reference[spec] = {"key": key, "pass@1": cell["pass@1"], "pass@1_se": cell["pass@1_se"],
                               "mean_sequence": cell["mean_prompt_tokens"] + cell["mean_generated_tokens"]}
    doc = {"format": FORMAT, "grid": _rel(grid.path), "grid_sha256": grid.sha256, "benchmark": grid.benchmark,
           "model": _rel(grid.model), "predictor": _rel(grid.predictor), "k": grid.k, "budget": grid.budget, "rule": RULE,
           "restrict": grid.restrict, "reference": reference, **chosen}
    _write_json(out / "choices.json", doc)
    write_grid_md(grid, out, finished, doc)
    return doc


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-.+" else "-" for c in spec)


# ------------------------------------------------------------------ the table


def write_grid_md(grid: Grid, out: Path, finished: dict[TuneCell, dict[str, Any]], doc: dict[str, Any] | None = None) -> None:
    from dynts.io import write_atomic

    lines = [f"# Tuning on dev: {grid.name}", "",
             f"`{_rel(grid.path)}` (sha256 {grid.sha256[:12]}), model `{_rel(grid.model)}`, predictor `{_rel(grid.predictor)}`, "
             f"`{grid.benchmark}`, k = {grid.k}, B = {grid.budget}. {len(finished)} of {len(grid.cells)} cells finished.",
             f"Rule: {RULE}.", ""]
    if doc and doc.get("reference"):
        lines += ["Reference: " + ", ".join(f"{s} {100 * r['pass@1']:.1f} % (mean sequence {r['mean_sequence']:.0f})"
                                            for s, r in doc["reference"].items()), ""]
    picked = (doc or {}).get("methods", {})
    if picked:
        lines += ["| method | chosen setting | dev pass@1 % | runner-up | default's pass@1 % | chosen - default |", "|---|---|---|---|---|---|"]
        for method, entry in picked.items():
            for label, e in [(method, entry), *((f"{method} ({r})", x) for r, x in entry["restricted"].items())]:
                c, ru, d, gain = e["chosen"], e["runner_up"], e["default"], e["chosen_minus_default_points"]
                runner_up = f"`{_setting(ru)}` {100 * ru['pass@1']:.1f}" if ru else "-"
                default = f"{100 * d['pass@1']:.1f}" if d else "-"
                lines.append(f"| {label} | `{_setting(c)}` | {100 * c['pass@1']:.1f} | {runner_up} | {default} | "
                             f"{'-' if gain is None else f'{gain:+.1f}'} |")
        lines.append("")
    for method in grid.methods:
        cells = [c for c in grid.cells if c.method == method]
        axes = list(grid.methods[method]["grid"])
        lines += [f"## {method} ({sum(c in finished for c in cells)} of {len(cells)} cells)", "",
                  "| " + " | ".join(axes) + " | n_keep | dev pass@1 % | ± SE | mean tokens | loop % |",
                  "|" + "---|" * (len(axes) + 5)]
        for cell in cells:
            s, r = cell.setting(), finished.get(cell)
            values = " | ".join(_fmt(s[a]) for a in axes)
            if r is None:
                lines.append(f"| {values} | | | | | |")
            else:
                lines.append(f"| {values} | {r.get('n_keep')} | {100 * r['pass@1']:.1f} | {100 * r['pass@1_se']:.1f} | "
                             f"{r['mean_generated_tokens']:.0f} | {100 * r.get('loop_rate', 0):.0f} |")
        lines.append("")
    write_atomic(out / "grid.md", "\n".join(lines))


def _setting(row: dict[str, Any]) -> str:
    return ",".join(f"{k}={_fmt(v)}" for k, v in row["setting"].items())


# ------------------------------------------------------------------ command line


def dry_run(grid: Grid, out: Path | None = None) -> str:
    """The cells and their projected cost (``cost.seconds_per_sample`` x problems x k per cell)."""
    lines = [f"grid {_rel(grid.path)} ({grid.sha256[:12]}): {grid.benchmark}, k = {grid.k}, B = {grid.budget}, "
             f"model {_rel(grid.model)}, predictor {_rel(grid.predictor)}"]
    for note in grid.pending:
        lines.append(f"  NOT YET AN OPTION (a run refuses this grid until it is): {note}")
    for cell in grid.cells:
        lines.append(f"  {cell.order + 1:4d}  {cell.spec}  W_l={cell.local_window} r={cell.retention}")
    lines.append("  reference: " + (", ".join(grid.reference) or "none"))
    per_method = {m: sum(c.method == m for c in grid.cells) for m in grid.methods}
    lines.append("cells: " + ", ".join(f"{m} {n}" for m, n in per_method.items()) + f"; total {len(grid.cells)}"
                 f" + {len(grid.reference)} reference, in {len(groups(grid.cells))} (W_l, retention) harness configs")
    n_cells = len(grid.cells) + len(grid.reference)
    samples = grid.problems["n"] * grid.k
    done = 0
    if out is not None and (out / "cells").is_dir():
        done = len(list((out / "cells").glob("*.json")))
    if grid.seconds_per_sample:
        total = n_cells * samples * grid.seconds_per_sample
        lines.append(f"cost: {n_cells} cells x {samples} samples x {grid.seconds_per_sample} s/sample (cost.seconds_per_sample) "
                     f"= {total / 3600:.1f} h of one core ({grid.threads} thread(s) per process)"
                     + (f"; {done} cells already in {out}, about {(n_cells - done) * samples * grid.seconds_per_sample / 3600:.1f} h left"
                        if done else ""))
    else:
        lines.append("cost: the grid gives no cost.seconds_per_sample to project from")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tune_baselines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True, help="the committed grid file (configs/tuning/*.yaml)")
    p.add_argument("--out", required=True, help="report directory (cells, records, grid.md, choices.json)")
    p.add_argument("--run-dir", default=None, help="the harness run directory (default runs/tuning/<out name>)")
    p.add_argument("--resume", action="store_true", help="continue an --out that holds finished cells (they are skipped)")
    p.add_argument("--dry-run", action="store_true", help="validate, print the cells and the projected cost; run nothing")
    args = p.parse_args(argv)
    try:
        grid = load_grid(args.grid, strict=not args.dry_run)
        if args.dry_run:
            print(dry_run(grid, Path(args.out)))
            return 0
        from dynts.cli_options import set_threads

        set_threads(grid.threads)
        doc = run_grid(grid, args.out, args.run_dir, args.resume)
    except ValueError as err:
        print(f"tune_baselines: error: {err}", file=sys.stderr)
        return 2
    for method, entry in doc["methods"].items():
        c = entry["chosen"]
        print(f"{method}: {_setting(c)}  dev pass@1 {100 * c['pass@1']:.1f} %")
    if doc["incomplete"]:
        print("incomplete: " + ", ".join(doc["incomplete"]))
    print(f"\n{args.out}/choices.json, {args.out}/grid.md")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
