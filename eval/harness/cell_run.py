"""Running one cell: generate its ``k`` samples per question in batches, grade them, summarise.

A cell's batches are its ``(question, sample)`` pairs sorted by prompt length; each batch is one ``dynts.generate``
call seeded by its index only (:func:`batch_seed`), so a cell's samples do not depend on which process runs it or
when. A finished batch is appended to ``cells/<key>.partial.jsonl`` at once, and an interrupted cell resumes from its
last finished batch; the cell is finished once ``cells/<key>.json`` exists (written last, atomically), beside its
``samples/<key>.jsonl`` and ``records/<key>.json``. The run directory's layout is :mod:`eval.harness.runner`'s.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import dynts
from dynts.io import write_atomic
from dynts.prompts import pad_rows, pad_id
from data_pipeline.grading import answer_after_delimiter, grade_text, resolve_grade_on

from .benchmarks import Benchmark
from .config import EvalConfig
from .plan import Cell, selection_slots
from .prompts import encode_prompts, user_message
from .records import eval_record, write_record

__all__ = ["CellContext", "batch_seed", "load_contexts", "load_model", "row_events", "run_cell", "summarize"]


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


@dataclass
class CellContext:
    """What all cells of one benchmark share: the loaded model, tokenizer and predictor, and the tokenized prompts."""

    model: Any
    tokenizer: Any
    predictor: Any
    bench: Benchmark
    prompt_ids: list[list[int]]
    max_new_tokens: int


def _batches(ctx: CellContext, k: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """``(question, sample)`` pairs in batches, sorted by prompt length (less padding)."""
    pairs = sorted(((i, s) for i in range(len(ctx.prompt_ids)) for s in range(k)), key=lambda p: (len(ctx.prompt_ids[p[0]]), p))
    return [pairs[j : j + batch_size] for j in range(0, len(pairs), batch_size)]


def batch_seed(config: EvalConfig, index: int) -> int:
    """The torch seed of batch ``index`` (every cell's batch ``index`` draws the same numbers)."""
    return config.seed * 1_000_003 + index


def _run_batch(ctx: CellContext, cell: Cell, config: EvalConfig, pairs: list[tuple[int, int]], index: int) -> dict:
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


def _check_vacuous(cell: Cell, ctx: CellContext) -> None:
    if selection_slots(cell, [len(p) for p in ctx.prompt_ids]) == 0:
        raise ValueError(
            f"budget={cell.budget} (W_l = {cell.local_window}, retention {cell.retention}) leaves no selection slot on "
            f"{cell.benchmark}: n_keep = question + local window, so every question-protecting method keeps the same "
            "set (a vacuous cell); raise the budget, lower --local-window, or run it flagged with --allow-vacuous"
        )


def run_cell(ctx: CellContext, cell: Cell, config: EvalConfig, bar: Callable | None = None) -> dict[str, Any]:
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


def load_contexts(
    config: EvalConfig, benches: dict[str, Benchmark], todo: Sequence[Cell], load_options: dict[str, Any] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, CellContext]:
    """Load the model once (or take ``loaded``) and tokenize the prompts of every benchmark that has work left."""
    from dynts.predictor import load_predictor

    model, tokenizer = loaded if loaded is not None else load_model(config.model, **(load_options or {}))
    predictor = load_predictor(config.predictor, model) if config.predictor is not None else None
    contexts = {}
    for spec in dict.fromkeys(c.benchmark for c in todo):
        bench = benches[spec]
        messages = [user_message(e, bench) for e in bench.examples]
        contexts[spec] = CellContext(
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
