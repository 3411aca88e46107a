"""Tuning on dev: every method's settings, the baselines' and DynTS's own, chosen on
``set=dev`` problems from a grid file committed before any cell runs (``configs/tuning/*.yaml``), in two
stages that treat every method alike:

1. **own**: each method's own options (its ``grid``) at the shared cache settings (the grid's
   ``local_window`` / ``retention``, the final tables' W_l 32 and retention 0.4: every cell keeps the same
   ``n_keep``). Within each ``select.subsets`` entry that applies to the method (one whose settings the
   method has: ``token+q`` = ``{per_head: false, keep_question: true}``, ``best`` = ``{}``, ...) the winner
   is chosen.
2. **cache**: every distinct stage-1 winner of every method at each ``cache`` pair (W_l x retention, the
   shared pair included: that cell is the stage-1 cell itself), and each subset's final choice is made
   among its winner's cache cells.

All cells of a stage run through the harness (:func:`eval.harness.runner.run`) as one config, the model
loaded once: each cell's spec carries its own ``local_window=`` / ``retention=`` (per-method cache
settings, :mod:`eval.harness.methods`), and ``B`` is the grid's for all. The rule: the highest dev pass@1;
ties go to the default (the evictor's dataclass defaults and the shared cache settings, or the grid's
``default``): the tied cell differing from it in the fewest settings, then the first in grid order.

Written to ``--out``: ``cells/<key>.json`` + ``records/<key>.json`` per finished cell (atomically; a
stop loses at most the cell in progress; ``--resume`` skips them), ``grid.yaml`` + ``tuning.json`` (the
grid's sha256: another grid is refused), ``grid.md`` (every cell) and ``choices.json`` (per method and
subset the chosen spec, as ``dynts eval`` accepts it, with the runner-up and the default's score). The
harness's run dir (samples with texts) is ``runs/tuning/<out name>``. A grid reading any set but dev is
refused. ``python -m eval.harness.tuning specs CHOICES [CHOICES ...] --subsets token+q,head+q`` prints the chosen
specs (of several tunings in turn) as one ``--method`` list for a run at the given cache settings; with ``--window-shares`` each chosen ``W_l``
is written as its share of the tuning's budget (``local_window_share=``), so that a table at other budgets
keeps each method's balance of recent and selected entries (W_l 64 of B = 90 is W_l 37 of B = 52). The grid file and its validation:
:mod:`eval.harness.tuning_grid`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence


from .tuning_grid import (
    CACHE, DEV, FORMAT, ROOT, RULE, Grid, TuneCell, format_value, harness_config, load_grid, method_fields, repo_relative,
)

__all__ = ["Grid", "TuneCell", "cache_cells", "choices", "choose", "dry_run", "load_grid", "main", "run_grid",
           "short_spec", "table_specs", "window_share", "winners"]


# ------------------------------------------------------------------ choosing


def choose(rows: Sequence[dict[str, Any]], default: dict[str, Any]) -> dict[str, Any]:
    """The chosen row and the runner-up among ``rows`` (each ``{"setting", "pass@1", "order", ...}``): the
    highest pass@1; ties to the row closest to ``default`` (fewest differing settings), then grid order. Also
    the default's own row when it is in ``rows``, and how many rows tie at the top."""
    if not rows:
        raise ValueError("no finished cells to choose from")
    distance = lambda r: sum(1 for k, v in r["setting"].items() if k in default and default[k] != v)  # noqa: E731
    ranked = sorted(rows, key=lambda r: (-round(r["pass@1"], 9), distance(r), r["order"]))
    best = ranked[0]
    default_row = next((r for r in rows if all(r["setting"].get(k) == v for k, v in default.items())), None)
    return {"chosen": best, "runner_up": ranked[1] if len(ranked) > 1 else None, "default": default_row,
            "tied_at_top": sum(1 for r in rows if round(r["pass@1"], 9) == round(best["pass@1"], 9)),
            "chosen_minus_default_points": None if default_row is None else round(100 * (best["pass@1"] - default_row["pass@1"]), 2),
            "cells": len(rows)}


def _row(cell: TuneCell, result: dict[str, Any]) -> dict[str, Any]:
    return {"spec": cell.spec, "setting": cell.setting(), "order": cell.order, "key": result["key"],
            "pass@1": result["pass@1"], "pass@1_se": result["pass@1_se"], "n_keep": result.get("n_keep"),
            "selection_slots": result.get("selection_slots"), "mean_generated_tokens": result["mean_generated_tokens"],
            "loop_rate": result.get("loop_rate"), "seconds": result["seconds"]}


def winners(grid: Grid, finished: dict[TuneCell, dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """Stage 1: per method whose cells all finished, per applicable subset, the choice among its cells."""
    out = {}
    for method in grid.methods:
        cells = [c for c in grid.cells if c.method == method]
        if all(c in finished for c in cells):
            out[method] = {name: choose([_row(c, finished[c]) for c in cells if grid.in_subset(c, subset)],
                                        {**grid.defaults(method), **subset})
                           for name, subset in grid.subsets_of(method).items()}
    return out


def _cell_of(grid: Grid, row: dict[str, Any]) -> TuneCell:
    return next(c for c in grid.cells if c.order == row["order"])


def cache_cells(grid: Grid, won: dict[str, dict[str, dict[str, Any]]]) -> list[TuneCell]:
    """Stage 2: every distinct winner at every cache pair, in order (a stage-1 cell comes back as itself)."""
    out: list[TuneCell] = []
    for method, subsets in won.items():
        for winner in dict.fromkeys(_cell_of(grid, e["chosen"]) for e in subsets.values()):
            for w, r in grid.cache_pairs():
                cell = dataclasses.replace(winner, local_window=w, retention=r, order=len(grid.cells) + len(out))
                out.append(winner if cell == winner else cell)
    return list(dict.fromkeys(out))


def window_share(local_window: int, budget: int) -> float:
    """``local_window / budget`` with the fewest decimals (4 or more) that give ``local_window`` back at
    ``budget`` (:func:`eval.harness.methods.window_of_share`)."""
    from .methods import window_of_share

    for digits in range(4, 12):
        share = round(local_window / budget, digits)
        if window_of_share(share, budget) == local_window:
            return share
    raise ValueError(f"local_window={local_window} has no share of budget={budget}")


def short_spec(method: str, setting: dict[str, Any], local_window: int | None = None, retention: float | None = None,
               share_of: int | None = None) -> str:
    """``setting`` as the shortest spec naming it for a run at ``local_window`` / ``retention``: the preset
    fixing most of its options (``h2o-head+q``), the options off their evictor defaults, the cache settings
    that differ from the run's (``h2o-head+q:local_window=16``). ``share_of``: the budget ``setting`` was
    tuned at; its ``W_l`` is then written as ``local_window_share=W_l / share_of`` (always: a run at other
    budgets scales it), ``h2o-head+q:local_window_share=0.7111`` for ``W_l`` 64 at ``B = 90``."""
    from .methods import PRESETS, parse_method, spec_label

    fields = method_fields(method)
    options = {k: v for k, v in setting.items() if k not in CACHE}
    value = lambda k: options.get(k, fields[k].default if k in fields else None)  # noqa: E731
    name, fixed = method, {}
    for preset, text in PRESETS.items():
        parsed = parse_method(text)
        if parsed.name == method and len(parsed.options) > len(fixed) and all(value(k) == v for k, v in parsed.options):
            name, fixed = preset, dict(parsed.options)
    extra = [(k, v) for k, v in options.items() if k not in fixed and not (k in fields and fields[k].default == v)]
    cache = [(k, setting[k]) for k, run in zip(CACHE, (local_window, retention)) if k in setting and setting[k] != run]
    if share_of is not None and "local_window" in setting:
        cache = [("local_window_share", window_share(setting["local_window"], share_of))] + [
            (k, v) for k, v in cache if k != "local_window"]
    return parse_method(spec_label(name, extra + cache)).label


def choices(grid: Grid, finished: dict[TuneCell, dict], stage2: Sequence[TuneCell]) -> dict[str, Any]:
    """``choices.json``'s methods: per subset the stage-1 choice (``own``), the cache choice among its
    winner's cache cells (``cache``) and the final ``spec`` / ``short_spec``; ``complete`` once all are made."""
    won = winners(grid, finished)
    out, incomplete = {}, []
    for method in grid.methods:
        if method not in won:
            incomplete.append(method)
            continue
        entry = {"default_setting": grid.defaults(method), "subsets": {},
                 "cells": {"own": sum(c.method == method for c in grid.cells), "cache": sum(c.method == method for c in stage2)}}
        for name, own in won[method].items():
            winner = _cell_of(grid, own["chosen"])
            cells = [c for c in stage2 if dataclasses.replace(c, local_window=winner.local_window,
                                                               retention=winner.retention) == winner]
            sub: dict[str, Any] = {"subset": grid.subsets[name], "own": own, "cache": None}
            if cells and all(c in finished for c in cells):
                sub["cache"] = choose([_row(c, finished[c]) for c in cells],
                                      {**winner.setting(), "local_window": grid.local_window, "retention": grid.retention})
                final = sub["cache"]["chosen"]
                sub.update(spec=final["spec"], short_spec=short_spec(method, final["setting"], grid.local_window, grid.retention),
                           setting=final["setting"], **{"pass@1": final["pass@1"], "pass@1_se": final["pass@1_se"]})
            entry["subsets"][name] = sub
        if any(s["cache"] is None for s in entry["subsets"].values()):
            incomplete.append(method)
        out[method] = entry
    return {"methods": out, "incomplete": incomplete, "complete": not incomplete}


# ------------------------------------------------------------------ running


def _write_json(path: Path, obj: Any) -> None:
    from dynts.io import write_atomic

    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _prepare_out(grid: Grid, out: Path, resume: bool) -> None:
    from dynts.io import write_atomic

    meta = out / "tuning.json"
    if (out / "cells").is_dir() and any((out / "cells").glob("*.json")) and not resume:
        raise ValueError(f"{out} already holds finished cells; pass --resume to continue, or choose a new --out")
    if meta.is_file():
        old = json.loads(meta.read_text())
        if old.get("grid_sha256") != grid.sha256:
            raise ValueError(f"{out} was started with another grid (sha256 {old.get('grid_sha256', '?')[:12]}, now "
                             f"{grid.sha256[:12]}); a grid is fixed before its cells run: use a new --out")
        return
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "grid.yaml", grid.text)
    _write_json(meta, {"format": FORMAT, "grid": repo_relative(grid.path), "grid_sha256": grid.sha256, "git": git,
                       "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "benchmark": grid.benchmark, "stage_own_cells": len(grid.cells)})


def run_grid(grid: Grid, out: str | Path, run_dir: str | Path | None = None, resume: bool = False,
             runner: Callable[..., list[dict[str, Any]]] | None = None, loader: Callable[[str], Any] | None = None,
             log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Run (or resume) both stages of ``grid`` into ``out``; returns choices.json's content. ``runner`` /
    ``loader``: :func:`eval.harness.runner.run` and :func:`dynts.load` (tests pass stand-ins)."""
    from dynts.io import write_atomic

    from .methods import parse_method
    from .plan import plan_cells

    if grid.problems.get("set") != DEV or not grid.benchmark.endswith(f",set={DEV}"):
        raise ValueError(f"tuning reads set={DEV} only, not {grid.problems.get('set')!r}")
    out = Path(out)
    run_dir = Path(run_dir) if run_dir is not None else ROOT / "runs" / "tuning" / out.name
    if runner is None:
        from .runner import run as runner
    if loader is None:
        import dynts

        loader = dynts.load
    _prepare_out(grid, out, resume)
    finished: dict[TuneCell, dict] = {}
    reference: dict[str, dict] = {}
    stage2: list[TuneCell] = []  # known once stage own has finished
    loaded = None

    def stage(name: str, cells: Sequence[TuneCell], extra: Sequence[str] = ()) -> None:
        nonlocal loaded
        keys = {c.method.label: c.key for c in plan_cells(harness_config(grid, [*extra, *(c.spec for c in cells)], run_dir))}
        by_key: dict[str, Any] = {keys[parse_method(s).label]: s for s in extra}
        by_key.update({keys[c.spec]: c for c in cells})
        for key, item in by_key.items():
            if (out / "cells" / f"{key}.json").is_file() and (out / "records" / f"{key}.json").is_file():
                done(json.loads((out / "cells" / f"{key}.json").read_text()), item)
        todo = [item for key, item in by_key.items() if item not in finished and item not in reference]
        log(f"tune: stage {name}: {len(by_key) - len(todo)} of {len(by_key)} cells already in {out}")
        if not todo:
            return
        t0, ran = time.monotonic(), 0

        def after(result: dict[str, Any]) -> None:
            nonlocal ran
            item = by_key.get(result["key"])
            if item is None or item in finished or item in reference:
                return
            record = run_dir / "records" / f"{result['key']}.json"
            if not record.is_file():
                raise RuntimeError(f"the harness finished {result['key']} without its record")
            text = record.read_text()
            if not all(str(i).startswith(f"{DEV}:") for i in json.loads(text)["ids"]):
                raise RuntimeError(f"{result['key']}: a record of problems outside set={DEV}")
            write_atomic(out / "records" / f"{result['key']}.json", text)
            _write_json(out / "cells" / f"{result['key']}.json", result)  # the cell counts as finished once this exists
            done(result, item)
            ran += 1
            left = sum(i not in finished and i not in reference for i in by_key.values())
            log(f"tune: stage {name} [{len(by_key) - left}/{len(by_key)}] {getattr(item, 'spec', item)}: pass@1 "
                f"{100 * result['pass@1']:.1f} % ({result['seconds']:.0f} s; stage about {(time.monotonic() - t0) / ran * left / 3600:.1f} h left)")
            write_grid_md(grid, out, finished, stage2=stage2)

        loaded = loaded or loader(grid.model)
        specs = [i if isinstance(i, str) else i.spec for i in todo]
        for result in runner(harness_config(grid, specs, run_dir), after_cell=after, loaded=loaded):  # cells the run dir held come back too
            after(result)

    def done(result: dict[str, Any], item: Any) -> None:
        if isinstance(item, str):
            reference[item] = result
        else:
            finished[item] = result

    stage("own", grid.cells, grid.reference)
    stage2[:] = cache_cells(grid, winners(grid, finished))
    stage("cache", stage2)
    doc = {"format": FORMAT, "grid": repo_relative(grid.path), "grid_sha256": grid.sha256, "benchmark": grid.benchmark,
           "model": repo_relative(grid.model), "predictor": repo_relative(grid.predictor), "k": grid.k, "budget": grid.budget, "rule": RULE,
           "shared_cache": {"local_window": grid.local_window, "retention": grid.retention}, "cache_grid": grid.cache,
           "subsets": grid.subsets, **choices(grid, finished, stage2),
           "reference": {s: {"key": r["key"], "pass@1": r["pass@1"], "pass@1_se": r["pass@1_se"],
                             "mean_sequence": r["mean_prompt_tokens"] + r["mean_generated_tokens"]} for s, r in reference.items()}}
    _write_json(out / "choices.json", doc)
    write_grid_md(grid, out, finished, doc, stage2)
    return doc


# ------------------------------------------------------------------ reports


def pct(result: dict[str, Any] | None) -> str:
    """A cell's dev pass@1 in percent, one decimal ("" for no cell)."""
    return "" if result is None else f"{100 * result['pass@1']:.1f}"


def summary_table(doc: dict[str, Any]) -> list[str]:
    """The lines of a tuning's summary (its reference cell, then per method and subset the stage-own and
    stage-cache choices against the runner-up and the default): ``grid.md``'s head and docs/evaluation.md's
    tables (``python -m eval.harness.tuning table CHOICES``)."""
    lines = []
    if doc.get("reference"):
        lines += ["Reference: " + ", ".join(f"{s} {100 * r['pass@1']:.1f} % (mean sequence {r['mean_sequence']:.0f})"
                                            for s, r in doc["reference"].items()), ""]
    lines += ["| method | subset | stage own: chosen | % | runner-up % | default % | stage cache: W_l, retention | % | "
              "at the shared cache % | spec |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method, entry in doc["methods"].items():
        for name, sub in entry["subsets"].items():
            own, cache = sub["own"], sub["cache"] or {}
            mine = ",".join(f"{k}={format_value(v)}" for k, v in own["chosen"]["setting"].items() if k not in CACHE)
            c = cache.get("chosen")
            lines.append(f"| {method} | {name} | `{mine}` | {pct(own['chosen'])} | {pct(own['runner_up'])} | {pct(own['default'])} | "
                         + (f"{c['setting']['local_window']}, {c['setting']['retention']} | {pct(c)} | {pct(cache['default'])} | "
                            f"`{sub['short_spec']}` |" if c else "| | | |"))
    return lines


def write_grid_md(grid: Grid, out: Path, finished: dict[TuneCell, dict], doc: dict | None = None,
                  stage2: Sequence[TuneCell] = ()) -> None:
    from dynts.io import write_atomic

    lines = [f"# Tuning on dev: {grid.name}", "",
             f"`{repo_relative(grid.path)}` (sha256 {grid.sha256[:12]}), model `{repo_relative(grid.model)}`, predictor `{repo_relative(grid.predictor)}`, "
             f"`{grid.benchmark}`, k = {grid.k}, B = {grid.budget}; stage own at W_l {grid.local_window}, retention "
             f"{grid.retention}; stage cache at W_l {grid.cache['local_window']} x retention {grid.cache['retention']}. "
             f"{len(finished)} cells finished ({sum(c in finished for c in grid.cells)} of {len(grid.cells)} of stage own).",
             f"Rule: {RULE}.", ""]
    if doc:
        lines += [*summary_table(doc), ""]
    for method in grid.methods:
        cells = [c for c in grid.cells if c.method == method]
        axes = list(grid.methods[method]["grid"])
        lines += [f"## {method}: stage own ({sum(c in finished for c in cells)} of {len(cells)} cells)", "",
                  "| " + " | ".join(axes) + " | n_keep | dev pass@1 % | ± SE | mean tokens | loop % |", "|" + "---|" * (len(axes) + 5)]
        for cell in cells:
            r = finished.get(cell)
            values = " | ".join(format_value(cell.value(a)) for a in axes)
            lines.append(f"| {values} | " + (f"{r.get('n_keep')} | {pct(r)} | {100 * r['pass@1_se']:.1f} | "
                                              f"{r['mean_generated_tokens']:.0f} | {100 * r.get('loop_rate', 0):.0f} |" if r else "| | | | |"))
        lines.append("")
        winners_ = dict.fromkeys(dataclasses.replace(c, local_window=grid.local_window, retention=grid.retention)
                                 for c in stage2 if c.method == method)
        for winner in winners_:
            lines += [f"### {method} stage cache: `{','.join(f'{k}={format_value(v)}' for k, v in winner.options)}` "
                      "(dev pass@1 %, n_keep in brackets; rows W_l, columns retention)", "",
                      "| W_l | " + " | ".join(str(r) for r in grid.cache["retention"]) + " |", "|---|" + "---|" * len(grid.cache["retention"])]
            for w in grid.cache["local_window"]:
                row = [finished.get(dataclasses.replace(winner, local_window=w, retention=float(r))) for r in grid.cache["retention"]]
                lines.append(f"| {w} | " + " | ".join(f"{pct(x)} ({x.get('n_keep')})" if x else "" for x in row) + " |")
            lines.append("")
    write_atomic(out / "grid.md", "\n".join(lines))


def dry_run(grid: Grid, out: Path | None = None) -> str:
    """Stage 1's cells, stage 2's size (the most distinct winners each method can have x the new cache
    cells per winner) and the cost ``cost.seconds_per_sample`` projects."""
    lines = [f"grid {repo_relative(grid.path)} ({grid.sha256[:12]}): {grid.benchmark}, k = {grid.k}, B = {grid.budget}, "
             f"model {repo_relative(grid.model)}, predictor {repo_relative(grid.predictor)}", "stage own (the shared cache: "
             f"W_l {grid.local_window}, retention {grid.retention}):"]
    lines += [f"  {c.order + 1:4d}  {c.spec}" for c in grid.cells]
    pairs = grid.cache_pairs()
    new = len(pairs) - ((grid.local_window, grid.retention) in pairs)
    most = {m: grid.max_winners(m) for m in grid.methods}
    stage2 = sum(most.values()) * new
    lines.append(f"stage cache: each winner at W_l {grid.cache['local_window']} x retention {grid.cache['retention']} "
                 f"({new} new cells per winner); winners per method at most: "
                 + ", ".join(f"{m} {n} ({', '.join(grid.subsets_of(m))})" for m, n in most.items()))
    lines.append("  reference: " + (", ".join(grid.reference) or "none"))
    per_method = {m: sum(c.method == m for c in grid.cells) for m in grid.methods}
    n_cells = len(grid.cells) + stage2 + len(grid.reference)
    lines.append("cells: stage own " + ", ".join(f"{m} {n}" for m, n in per_method.items()) + f" = {len(grid.cells)}; "
                 f"stage cache at most {stage2}; + {len(grid.reference)} reference = at most {n_cells}")
    samples = grid.problems["n"] * grid.k
    done = len(list((out / "cells").glob("*.json"))) if out is not None and (out / "cells").is_dir() else 0
    if grid.seconds_per_sample:
        total = n_cells * samples * grid.seconds_per_sample
        lines.append(f"cost: {n_cells} cells x {samples} samples x {grid.seconds_per_sample} s/sample (cost.seconds_per_sample) "
                     f"= {total / 3600:.1f} h of one core ({grid.threads} thread(s))"
                     + (f"; {done} cells already in {out}, about {(n_cells - done) * samples * grid.seconds_per_sample / 3600:.1f} h left"
                        if done else ""))
    else:
        lines.append("cost: the grid gives no cost.seconds_per_sample to project from")
    return "\n".join(lines)


def table_specs(docs: dict[str, Any] | Sequence[dict[str, Any]], subsets: Sequence[str], methods: Sequence[str] = (),
                local_window: int | None = None, retention: float | None = None, window_shares: bool = False) -> list[str]:
    """The chosen specs of complete ``choices.json`` documents (one tuning's, or several in turn: e.g. a
    family's main grid and SepLLM's) for a ``dynts eval`` run at ``local_window`` / ``retention``: per method
    (all, or ``methods``) its choice in each of ``subsets`` that applies to it, or its ``best`` where none does
    (DynTS: no ``per_head``). ``window_shares``: each chosen ``W_l`` as its share of its tuning's budget
    (``local_window_share=``), for a run at other budgets. A name must be a subset or method of at least one
    document. Refuses an incomplete tuning."""
    docs = [docs] if isinstance(docs, dict) else list(docs)
    for doc in docs:
        if not doc.get("complete"):
            raise ValueError(f"the tuning is not complete (incomplete: {', '.join(doc.get('incomplete') or ['?'])}); "
                             "run scripts/tune_baselines.py --resume to finish it")
    known_subsets = list(dict.fromkeys(s for doc in docs for s in doc["subsets"]))
    known_methods = list(dict.fromkeys(m for doc in docs for m in doc["methods"]))
    for name in [*subsets, *methods]:
        if name not in known_subsets and name not in known_methods:
            raise ValueError(f"{name!r} is neither a subset ({', '.join(known_subsets)}) nor a method ({', '.join(known_methods)})")
    out = []
    for doc in docs:
        for method, entry in doc["methods"].items():
            if methods and method not in methods:
                continue
            names = [s for s in subsets if s in entry["subsets"]] or ["best"]
            for name in names:
                if name not in entry["subsets"]:
                    raise ValueError(f"{method} has no subset {name!r} (its subsets: {sorted(entry['subsets'])})")
                out.append(short_spec(method, entry["subsets"][name]["setting"], local_window, retention,
                                      doc["budget"] if window_shares else None))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """``scripts/tune_baselines.py``: run (or resume, or --dry-run) a grid."""
    p = argparse.ArgumentParser(prog="tune_baselines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", required=True, help="the committed grid file (configs/tuning/*.yaml)")
    p.add_argument("--out", required=True, help="report directory (cells, records, grid.md, choices.json)")
    p.add_argument("--run-dir", default=None, help="the harness run directory (default runs/tuning/<out name>)")
    p.add_argument("--resume", action="store_true", help="continue an --out that holds finished cells (they are skipped)")
    p.add_argument("--dry-run", action="store_true", help="validate, print the cells and the projected cost; run nothing")
    args = p.parse_args(argv)
    try:
        grid = load_grid(args.grid)
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
        for name, sub in entry["subsets"].items():
            if "spec" in sub:
                print(f"{method} {name}: {sub['short_spec']}  dev pass@1 {100 * sub['pass@1']:.1f} %")
    print(f"\n{args.out}/choices.json, {args.out}/grid.md" + ("" if doc["complete"] else f" (incomplete: {', '.join(doc['incomplete'])})"))
    return 0


def specs_main(argv: list[str] | None = None) -> int:
    """``python -m eval.harness.tuning specs CHOICES [CHOICES ...]``: the chosen specs as one ``--method`` list."""
    p = argparse.ArgumentParser(prog="python -m eval.harness.tuning specs", description=table_specs.__doc__)
    p.add_argument("choices", nargs="+", help="a tuning's choices.json (several: their specs in turn)")
    p.add_argument("--subsets", default="", help="comma list of subsets, e.g. token+q,head+q (a method none applies to: best)")
    p.add_argument("--methods", default="", help="comma list of methods (default: all)")
    p.add_argument("--local-window", type=int, default=None, help="the run's --local-window (settings equal to it are left out)")
    p.add_argument("--retention", type=float, default=None, help="the run's --retention (likewise)")
    p.add_argument("--window-shares", action="store_true",
                   help="each chosen W_l as local_window_share= of the tuning's budget (a run at other budgets scales it)")
    args = p.parse_args(argv)
    try:
        docs = []
        for path in map(Path, args.choices):
            if not path.is_file():
                raise ValueError(f"{path} does not exist: run the tuning first (scripts/tune_baselines.py)")
            docs.append(json.loads(path.read_text()))
        specs = table_specs(docs, [s for s in args.subsets.split(",") if s],
                            [m for m in args.methods.split(",") if m], args.local_window, args.retention, args.window_shares)
    except ValueError as err:
        print(f"tuning specs: error: {err}", file=sys.stderr)
        return 2
    print(",".join(specs))
    return 0


def table_main(argv: list[str] | None = None) -> int:
    """``python -m eval.harness.tuning table CHOICES``: the tuning's summary table (docs/evaluation.md)."""
    p = argparse.ArgumentParser(prog="python -m eval.harness.tuning table", description=summary_table.__doc__)
    p.add_argument("choices", help="a tuning's choices.json")
    args = p.parse_args(argv)
    path = Path(args.choices)
    if not path.is_file():
        print(f"tuning table: error: {path} does not exist: run the tuning first (scripts/tune_baselines.py)", file=sys.stderr)
        return 2
    print("\n".join(summary_table(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":  # pragma: no cover
    argv = sys.argv[1:]
    commands = {"specs": specs_main, "table": table_main}
    raise SystemExit(commands[argv[0]](argv[1:]) if argv[:1] and argv[0] in commands else main(argv))
