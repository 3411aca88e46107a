"""The evaluation harness: methods x budgets x local windows x retentions x benchmarks.

One *cell* is one benchmark under one method setting. A cell generates ``k`` samples per question
(paper 6.1: 5 samples, temperature 0.6, top-p 0.95, top-k 20), several questions per
``dynts.generate`` call, and reports pass@1 (the mean over samples and questions), throughput,
peak KV memory and mean generated length.

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

import hashlib
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import dynts
from dynts.io import write_atomic  # re-exported: eval.harness.runner.write_atomic
from dynts.prompts import pad_rows, pad_id
from data_pipeline.grading import answer_after_delimiter, grade_text, resolve_grade_on

from .benchmarks import Benchmark, load_benchmark
from dynts.core import EvictionSpec

from .config import EvalConfig
from .methods import MethodSpec
from .prompts import encode_prompts, user_message
from .records import eval_record, write_record

__all__ = ["Cell", "EvalConfig", "batch_seed", "fraction_budgets", "plan_cells", "run", "run_cell", "selection_slots", "summarize", "write_atomic"]


@dataclass(frozen=True)
class Cell:
    """One benchmark under one method setting.

    Attributes:
        benchmark: the benchmark spec.
        method: the method as the run names it (its ``label`` in tables, e.g. a preset).
        eviction: what ``dynts.generate`` runs (:class:`~dynts.core.EvictionSpec`).
        predictor: fingerprint of the predictor, for methods that use its scores.
    """

    benchmark: str
    method: MethodSpec
    eviction: EvictionSpec
    predictor: str | None = None  # fingerprint of the predictor, for methods that use its scores
    budget_fraction: float | None = None  # the share of the full cache's mean sequence ``budget`` came from

    @property
    def budget(self) -> int | None:
        """``B`` (``None`` for the full cache, as are ``local_window`` and ``retention``)."""
        return self.eviction.budget if self.eviction.bounded else None

    @property
    def local_window(self) -> int | None:
        return self.eviction.local_window if self.eviction.bounded else None

    @property
    def retention(self) -> float | None:
        return self.eviction.retention if self.eviction.bounded else None

    @property
    def key(self) -> str:
        """File-name-safe, unique and readable."""
        parts = [self.benchmark, self.method.label]
        if self.budget is not None:
            parts += [f"B{self.budget}", f"W{self.local_window}", f"r{self.retention}"]
        text = "_".join(parts)
        slug = "".join(c if c.isalnum() or c in "-." else "-" for c in text)[:80]
        return f"{slug}-{hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:8]}"

    def as_dict(self) -> dict[str, Any]:
        out = {
            "benchmark": self.benchmark,
            "method": self.method.as_dict(),
            "budget": self.budget,
            "local_window": self.local_window,
            "retention": self.retention,
        }
        if self.predictor is not None:
            out["predictor"] = self.predictor
        if self.budget_fraction is not None:
            out["budget_fraction"] = self.budget_fraction
        return out


def plan_cells(config: EvalConfig, fraction_budgets: dict[str, list[tuple[int, float]]] | None = None) -> list[Cell]:
    """All cells, benchmark-major; the full cache runs once per benchmark. Cells of score-based
    methods carry the predictor's fingerprint (a retrained predictor makes new cells).
    ``fraction_budgets``: per benchmark, ``(budget, fraction)`` resolved from
    ``config.budget_fractions`` (:func:`fraction_budgets`); without it those cells are not planned yet."""
    from .config import fingerprint

    scores = None
    if config.predictor:  # by content where it is a local directory, so that a clone elsewhere reuses the cells
        digest = fingerprint(config.predictor)
        scores = f"{Path(config.predictor).name}@{digest}" if digest else str(Path(config.predictor).resolve())
    cells = []
    for bench in config.benchmarks:
        extra = (fraction_budgets or {}).get(bench, [])
        for method in config.method_specs:
            predictor = scores if "scores" in method.requires else None
            cells += [Cell(bench, method, eviction, predictor) for eviction in config.evictions(method)]
            if method.bounded:
                cells += [Cell(bench, method, eviction, predictor, fraction) for budget, fraction in extra
                          for eviction in config.evictions(method, budgets=[budget])]
    return cells


def fraction_budgets(config: EvalConfig, full_cells: dict[str, dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``config.budget_fractions`` as budgets per benchmark: ``round(f * S)`` with ``S`` the full cache's
    mean sequence there (``mean_prompt_tokens + mean_generated_tokens`` of its finished cell, by
    benchmark in ``full_cells``)."""
    out = {}
    for bench in config.benchmarks:
        if bench not in full_cells:
            raise ValueError(f"budget fractions of {bench}: its full-cache cell has not run (add --method full)")
        c = full_cells[bench]
        seq = c["mean_prompt_tokens"] + c["mean_generated_tokens"]
        out[bench] = [(max(1, round(f * seq)), float(f)) for f in config.budget_fractions]
    return out


def selection_slots(cell: Cell, prompt_lengths: Sequence[int]) -> int | None:
    """The fewest selection slots a prompt of this cell keeps per event, ``n_keep - W_q - W_l`` at the
    longest prompt (0: a *vacuous* budget, question + local window fill ``n_keep``); None for the
    full cache."""
    if cell.budget is None:
        return None
    budget = dynts.Budget(cell.budget, cell.local_window, cell.retention)
    q = max(prompt_lengths)
    return budget.n_keep(q) - q - cell.local_window


# ------------------------------------------------------------------ files


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


def _read_partial(path: Path) -> dict[int, dict]:
    """Finished batches of an unfinished cell (a torn last line from a kill is ignored)."""
    done: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[batch["batch"]] = batch
    return done


def _append_line(path: Path, obj: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------ running


@dataclass
class _Context:
    """What all cells of one benchmark share."""

    model: Any
    tokenizer: Any
    predictor: Any
    bench: Benchmark
    prompt_ids: list[list[int]]
    max_new_tokens: int


def _batches(ctx: _Context, k: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """``(question, sample)`` pairs in batches, sorted by prompt length (less padding)."""
    pairs = sorted(((i, s) for i in range(len(ctx.prompt_ids)) for s in range(k)), key=lambda p: (len(ctx.prompt_ids[p[0]]), p))
    return [pairs[j : j + batch_size] for j in range(0, len(pairs), batch_size)]


def batch_seed(config: EvalConfig, index: int) -> int:
    """The torch seed of batch ``index`` (every cell's batch ``index`` draws the same numbers)."""
    return config.seed * 1_000_003 + index


def _run_batch(ctx: _Context, cell: Cell, config: EvalConfig, pairs: list[tuple[int, int]], index: int) -> dict:
    seed = batch_seed(config, index)
    torch.manual_seed(seed)
    input_ids, attention_mask = pad_rows([ctx.prompt_ids[i] for i, _ in pairs], pad_id(ctx.tokenizer))
    result = dynts.generate(
        ctx.model, ctx.tokenizer, input_ids=input_ids, attention_mask=attention_mask,
        eviction=cell.eviction.build(predictor=ctx.predictor), max_new_tokens=ctx.max_new_tokens, retire_finished=True,
        **config.sampling(),
    )
    stats = result.stats
    records = []
    grade_on = resolve_grade_on(config.grade_on, ctx.tokenizer, config.think_end)
    events = row_events(cell, input_ids.shape[1])
    for row, ((i, s), ids, text, length, done) in enumerate(zip(pairs, result.sequences.tolist(), result.texts, stats["lengths"], stats["finished"])):
        example = ctx.bench.examples[i]
        answer = answer_after_delimiter(ids, ctx.tokenizer, config.think_end)
        grade = grade_text(ctx.bench.grader, example.answer, text, answer, grade_on)
        records.append({
            "question": i, "sample": s, "id": example.id, "seed": seed, "row": row, "correct": grade.correct, "extracted": grade.extracted,
            "source": grade.source, "tokens": length, "truncated": not done, "answered": answer is not None,
            "grade_on": grade_on, "looped": ctx.bench.loops(text, ids[:length]), "evictions": events(length), "text": text,
        })
    return {
        "batch": index, "pairs": [list(p) for p in pairs], "rows": len(pairs), "seconds": stats["seconds"],
        "new_tokens": stats["new_tokens"], "peak_cache_tokens": stats["peak_cache_tokens"],
        "peak_kv_bytes": stats["peak_kv_bytes"], "evictions": stats["evictions"],
        "evicted_tokens": stats["evicted_tokens"], "records": records,
    }


def row_events(cell: Cell, width: int) -> Callable[[int], int]:
    """Eviction events a row of ``width`` padded prompt slots went through while generating ``length``
    tokens (:meth:`dynts.Budget.events`; 0 for the full cache). The cell's measured ``evictions`` count
    events per batch; this is the share each sample lived through."""
    budget = cell.eviction.build().bounds
    if budget is None:
        return lambda length: 0
    return lambda length: budget.events(width, length)


def summarize(batches: Sequence[dict], n_questions: int, k: int) -> dict[str, Any]:
    """Cell metrics from its batches.

    ``pass@1`` = mean over questions of the fraction of its ``k`` samples graded correct;
    ``pass@1_std`` = standard deviation of the accuracy of the ``k`` sample runs (0 when k = 1);
    ``pass@1_se`` = one standard error of ``pass@1`` over questions (``pstdev / sqrt(n)`` of the
    per-question scores: the binomial ``sqrt(p (1 - p) / n)`` when k = 1);
    ``tokens_per_second`` = generated tokens / generation seconds; ``peak_kv_mib_per_sequence`` =
    the largest batch's peak K/V bytes divided by its rows.
    """
    records = [r for b in batches for r in b["records"]]
    per_question: dict[int, list[bool]] = {}
    per_sample: dict[int, list[bool]] = {}
    for r in records:
        per_question.setdefault(r["question"], []).append(r["correct"])
        per_sample.setdefault(r["sample"], []).append(r["correct"])
    runs = [sum(v) / len(v) for v in per_sample.values()]
    scores = [sum(v) / len(v) for v in per_question.values()]
    seconds = sum(b["seconds"] for b in batches)
    new_tokens = sum(b["new_tokens"] for b in batches)
    return {
        "questions": n_questions,
        "samples": len(records),
        "k": k,
        "pass@1": statistics.mean(scores),
        "pass@1_std": statistics.pstdev(runs) if len(runs) > 1 else 0.0,
        "pass@1_se": statistics.pstdev(scores) / math.sqrt(len(scores)),
        "parse_rate": sum(r["extracted"] is not None for r in records) / len(records),
        "truncated_rate": sum(r["truncated"] for r in records) / len(records),
        "loop_rate": sum(r.get("looped", False) for r in records) / len(records),
        "mean_generated_tokens": statistics.mean(r["tokens"] for r in records),
        "tokens_per_second": new_tokens / seconds if seconds > 0 else math.inf,
        "seconds": seconds,
        "peak_cache_tokens": max(b["peak_cache_tokens"] for b in batches),
        "peak_kv_mib_per_sequence": max(b["peak_kv_bytes"] / b["rows"] for b in batches) / 2**20,
        "evictions": sum(b["evictions"] for b in batches),
        "evictions_per_sample": statistics.mean(r.get("evictions", 0) for r in records),
        "evicted_tokens": sum(b["evicted_tokens"] for b in batches),
    }


def _check_vacuous(cell: Cell, ctx: _Context) -> None:
    if selection_slots(cell, [len(p) for p in ctx.prompt_ids]) == 0:
        raise ValueError(
            f"budget={cell.budget} (W_l = {cell.local_window}, retention {cell.retention}) leaves no selection slot on "
            f"{cell.benchmark}: n_keep = question + local window, so every question-protecting method keeps the same "
            "set (a vacuous cell); raise the budget, lower --local-window, or run it flagged with --allow-vacuous"
        )


def run_cell(ctx: _Context, cell: Cell, config: EvalConfig, bar: Callable | None = None) -> dict[str, Any]:
    """Generate, grade and summarise one cell (resuming from its finished batches)."""
    cells_dir = config.run_dir / "cells"
    partial_path = cells_dir / f"{cell.key}.partial.jsonl"
    plan = _batches(ctx, config.k, config.batch_size)
    done = {j: b for j, b in _read_partial(partial_path).items() if j < len(plan) and b["pairs"] == [list(p) for p in plan[j]]}
    cells_dir.mkdir(parents=True, exist_ok=True)
    progress = bar(total=len(plan), desc=cell.key[:48], leave=False, initial=len(done)) if bar else None
    for j, pairs in enumerate(plan):
        if j in done:
            continue
        done[j] = _run_batch(ctx, cell, config, pairs, j)
        _append_line(partial_path, done[j])
        if progress:
            progress.update(1)
    if progress:
        progress.close()
    batches = [done[j] for j in range(len(plan))]
    records = sorted((r for b in batches for r in b["records"]), key=lambda r: (r["question"], r["sample"]))
    write_atomic(config.run_dir / "samples" / f"{cell.key}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    ids = [e.id for e in ctx.bench.examples[: len(ctx.prompt_ids)]]
    slots = selection_slots(cell, [len(p) for p in ctx.prompt_ids])
    flags = {} if slots is None else {"selection_slots": slots}
    write_record(config.run_dir, eval_record(cell.key, {**cell.as_dict(), **flags}, ids, config.k, records))
    prompt = statistics.mean(len(ids) for ids in ctx.prompt_ids)
    n_keep = cell.eviction.build().n_keep(round(prompt))
    result = {
        "key": cell.key, **cell.as_dict(), "benchmark_size": len(ctx.prompt_ids),
        "max_new_tokens": ctx.max_new_tokens, "mean_prompt_tokens": prompt, "n_keep": n_keep, **flags,
        **summarize(batches, len(ctx.prompt_ids), config.k),
    }
    write_atomic(cells_dir / f"{cell.key}.json", json.dumps(result, indent=2))  # the cell is finished once this exists
    partial_path.unlink(missing_ok=True)
    return result


def load_model(name_or_path: str, **load_options: Any):
    """``(model, tokenizer)`` through :func:`dynts.load` (``dtype``, ``device``, ``device_map``, ...)."""
    return dynts.load(name_or_path, **load_options)


def _contexts(
    config: EvalConfig, benches: dict[str, Benchmark], todo: Sequence[Cell], load_options: dict[str, Any] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, _Context]:
    """Load the model once (or take ``loaded``) and tokenize the prompts of every benchmark that has work left."""
    from dynts.predictor import load_predictor

    model, tokenizer = loaded if loaded is not None else load_model(config.model, **(load_options or {}))
    predictor = load_predictor(config.predictor, model) if config.predictor is not None else None
    contexts = {}
    for spec in dict.fromkeys(c.benchmark for c in todo):
        bench = benches[spec]
        messages = [user_message(e, bench) for e in bench.examples]
        contexts[spec] = _Context(
            model, tokenizer, predictor, bench, encode_prompts(tokenizer, messages, config.chat_template),
            config.max_new_tokens or bench.max_new_tokens,
        )
    for cell in todo:  # fail before generating anything, not after hours
        longest = max(len(p) for p in contexts[cell.benchmark].prompt_ids)
        try:
            cell.eviction.build().check_prompt(longest)
        except ValueError as err:
            raise ValueError(f"{cell.key}: the longest {cell.benchmark} prompt: {err}") from None
        if config.vacuous == "refuse" and not cell.method.sets_local_window:
            _check_vacuous(cell, contexts[cell.benchmark])  # at the run's W_l: the budget is too small for the run
    return contexts


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
            from .workers import run_in_workers

            if loaded is not None:
                raise ValueError(f"workers={config.workers}: each worker process loads the model itself; pass no loaded "
                                 "model, or workers=1")
            run_in_workers(config, todo, benches, load_options, finished)
            return results
        contexts = _contexts(config, benches, todo, load_options, loaded) if todo else {}
        bar = tqdm if config.progress else None
        for cell in todo:
            finished(cell, run_cell(contexts[cell.benchmark], cell, config, bar))
    return results
