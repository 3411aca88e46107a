"""The evaluation harness: methods x budgets x local windows x retentions x benchmarks.

One *cell* is one benchmark under one method setting (:mod:`eval.harness.plan`). A cell generates
``k`` samples per question (paper 6.1: 5 samples, temperature 0.6, top-p 0.95, top-k 20), several
questions per ``dynts.generate`` call, and reports pass@1 (the mean over samples and questions),
throughput, peak KV memory and mean generated length (:mod:`eval.harness.cell_run`). The cells run
here one after another, or side by side in worker processes (:mod:`eval.harness.workers`).

Layout of a run directory::

    run.json                   settings shared by all cells (a resumed run must match them)
    cells/<key>.json           one finished cell: settings + metrics (written last, atomically)
    cells/<key>.partial.jsonl  finished batches of an unfinished cell (one JSON line per batch)
    samples/<key>.jsonl        every sample of a finished cell: text, extracted answer, correct
    records/<key>.json         its compact per-problem record (:mod:`eval.harness.records`)
    results.{json,csv,md}      rendered after every cell (:mod:`eval.harness.report`)
    accuracy_vs_*.png          plots, rendered when the run ends

Interrupt it at any point and run the same command again: finished cells are read back, an
unfinished cell restarts from its last finished batch.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from dynts.io import write_atomic

from .benchmarks import Benchmark, load_benchmark
from .cell_run import load_contexts, run_cell
from .config import EvalConfig
from .plan import Cell, fraction_budgets, plan_cells
from .workers import run_in_workers

__all__ = ["EvalConfig", "NUMERIC_LOAD_OPTIONS", "run"]


# load options that change the numbers (where the model runs does not): part of a run's settings
NUMERIC_LOAD_OPTIONS = ("dtype", "attn_implementation", "adapter", "merge_adapter")


def _check_run_dir(config: EvalConfig, load_options: dict[str, Any] | None = None) -> None:
    run_json = config.run_dir / "run.json"
    load = {k: str(v) for k, v in (load_options or {}).items() if k in NUMERIC_LOAD_OPTIONS and v is not None}
    settings = {**config.shared_settings(), **({"load": load} if load else {})}
    settings = json.loads(json.dumps(settings))  # as stored (tuples become lists)
    if run_json.is_file():
        old = json.loads(run_json.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise ValueError(
                f"run dir {config.run_dir} holds results made with other settings ({', '.join(diff)}); "
                "use a new --run-dir (cells of one run must be comparable)"
            )
    else:
        write_atomic(run_json, json.dumps(settings, indent=2))


def run(
    config: EvalConfig, after_cell: Callable[[dict], None] | None = None, load_options: dict[str, Any] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) every cell of ``config``; returns the cell results in plan order. Tables are
    rendered into the run dir after each finished cell (``after_cell`` is called too), plots at the end.
    ``load_options`` go to :func:`dynts.load` (``dtype``, ``device``, ``device_map``, ...).
    ``loaded``: ``(model, tokenizer)`` of ``config.model`` already loaded (with those ``load_options``), used
    instead of loading it again (a caller running several configs in one process, e.g. ``scripts/tune_baselines.py``).
    With ``config.budget_fractions`` the unbounded cells run first and the full cache's mean
    sequence sizes the fraction budgets (:func:`fraction_budgets`)."""
    from .report import write_reports

    benches = {spec: load_benchmark(spec, config.fields).head(config.limit) for spec in dict.fromkeys(config.benchmarks)}
    _check_run_dir(config, load_options)
    results: dict[str, dict] = {}
    cells = plan_cells(config)
    if config.budget_fractions:  # the full cache first: its mean trace sizes the fraction budgets
        first = [c for c in cells if c.budget is None]
        done = _run_cells(config, benches, first, results, load_options, after_cell, loaded)
        full = {c.benchmark: done[c.key] for c in first if c.method.name == "full"}
        cells = plan_cells(config, fraction_budgets(config, full))
    _run_cells(config, benches, cells, results, load_options, after_cell, loaded)
    ordered = [results[c.key] for c in cells]
    write_reports(config.run_dir, ordered)
    return ordered


def _run_cells(config: EvalConfig, benches: dict[str, Benchmark], cells: Sequence[Cell], results: dict[str, dict],
               load_options: dict[str, Any] | None, after_cell: Callable[[dict], None] | None,
               loaded: tuple[Any, Any] | None = None) -> dict[str, dict]:
    """Run (or read back) ``cells`` into ``results`` (by key), rendering the tables after each."""
    from tqdm.auto import tqdm

    from .report import write_reports

    for cell in cells:
        path = config.run_dir / "cells" / f"{cell.key}.json"
        if cell.key not in results and path.is_file():
            results[cell.key] = json.loads(path.read_text())
    todo = [c for c in cells if c.key not in results]
    with tqdm(total=len(cells), initial=len(cells) - len(todo), desc="cells", disable=not config.progress) as outer:

        def finished(cell: Cell, result: dict[str, Any]) -> None:
            results[cell.key] = result
            write_reports(config.run_dir, [results[c.key] for c in cells if c.key in results], plots=False)
            if after_cell:
                after_cell(result)
            outer.update(1)

        if config.workers > 1 and todo:  # even one cell: this process never loads the model beside the workers' copies
            if loaded is not None:
                raise ValueError(f"workers={config.workers}: each worker process loads the model itself; pass no loaded "
                                 "model, or workers=1")
            run_in_workers(config, todo, benches, load_options, finished)
            return results
        contexts = load_contexts(config, benches, todo, load_options, loaded) if todo else {}
        bar = tqdm if config.progress else None
        for cell in todo:
            finished(cell, run_cell(contexts[cell.benchmark], cell, config, bar))
    return results
