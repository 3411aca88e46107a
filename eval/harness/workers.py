"""Cells side by side in worker processes (``dynts eval --workers N``).

Each worker is a spawned process that loads the model and predictor once (with the run's load options: one copy of
the model per worker), tokenizes the prompts and checks every cell left to run, so a cell the run refuses fails every
worker before any of them generates. It then runs the cells it is handed, one at a time, through
:func:`eval.harness.cell_run.run_cell`, writing only that cell's files, exactly as a single process does.

The benchmarks are the ones this process loaded, handed over as they are: a final-only set is read here, once, inside
the run's ledger block (:func:`eval.harness.ledger.final_run`), and no worker reads it again.

A batch draws from the run's seed and its index only (:func:`eval.harness.cell_run.batch_seed`), so a cell's samples do
not depend on which worker ran it or when: with the same torch threads per process, a run with workers is
sample-for-sample the run without them, and either one resumes the other's run dir. The parent renders the tables
and calls ``after_cell`` as cells finish (in the order they finish); the run returns its cells in plan order.

Threads: the parent's torch threads (``--threads T``, or torch's default) are split, ``max(1, T // N)`` per worker.
Devices: ``--device cuda`` (no index) spreads the workers over the visible GPUs, worker ``i`` on ``cuda:(i mod GPUs)``;
any other placement is every worker's.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Sequence

import torch

from .benchmarks import Benchmark
from .cell_run import load_contexts, run_cell
from .config import EvalConfig
from .plan import Cell

__all__ = ["run_in_workers", "worker_load_options", "worker_threads"]

_WORKER: dict[str, Any] = {}  # this worker process's loaded contexts and config, or the error that stopped it


def worker_threads(workers: int, threads: int | None = None) -> int:
    """Torch threads of each of ``workers`` processes sharing ``threads`` (default: this process's)."""
    return max(1, (torch.get_num_threads() if threads is None else threads) // workers)


def worker_load_options(load_options: dict[str, Any] | None, index: int, gpus: int) -> dict[str, Any]:
    """Worker ``index``'s load options: ``device="cuda"`` puts it on GPU ``index mod gpus`` when ``gpus > 1``."""
    options = dict(load_options or {})
    if options.get("device") == "cuda" and gpus > 1:
        options["device"] = f"cuda:{index % gpus}"
    return options


def _start(config: EvalConfig, cells: Sequence[Cell], benches: dict[str, Benchmark], load_options: dict[str, Any] | None,
           threads: int, indices: Any) -> None:
    """Worker initializer: load once, tokenize and check every cell; an error is kept and raised by each task."""
    torch.set_num_threads(threads)
    try:
        options = worker_load_options(load_options, indices.get(), torch.cuda.device_count())
        for cell in cells:
            cell.method.evictor()  # registers a plugin method here too (eval.harness.methods.PLUGINS: the oracles)
        _WORKER.update(config=config, contexts=load_contexts(config, benches, cells, options))
    except Exception as err:  # raised in the parent by the first task, with its own type and message
        _WORKER["error"] = err


def _run(cell: Cell) -> dict[str, Any]:
    if "error" in _WORKER:
        raise _WORKER["error"]
    return run_cell(_WORKER["contexts"][cell.benchmark], cell, _WORKER["config"])


def run_in_workers(config: EvalConfig, cells: Sequence[Cell], benches: dict[str, Benchmark],
                   load_options: dict[str, Any] | None, finished: Callable[[Cell, dict[str, Any]], None]) -> None:
    """Run ``cells`` of ``benches`` (spec -> the benchmark this process loaded) on ``config.workers`` spawned
    processes, handed out in plan order; ``finished(cell, result)`` is called here as each one ends. The first cell
    that fails stops the handing out: cells already running finish (their files are kept for a resume), then its
    error is raised here."""
    workers = min(config.workers, len(cells))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    indices = context.Queue()  # each worker takes its index (its GPU) from here
    for index in range(workers):
        indices.put(index)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                               initargs=(config, list(cells), {c.benchmark: benches[c.benchmark] for c in cells}, load_options,
                                         worker_threads(workers), indices))
    try:
        pending: dict[Future, Cell] = {pool.submit(_run, cell): cell for cell in cells}
        while pending:
            done, _ = wait(pending, return_when=FIRST_EXCEPTION)
            for future in [f for f in pending if f in done]:  # in plan order among those that ended together
                cell = pending.pop(future)
                finished(cell, future.result())  # a worker's error is raised here
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
