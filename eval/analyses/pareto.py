"""Pareto retention curves (DynTS paper 3.2, Fig. 3 and 12; appendix B.1).

From a trace with answer-to-thinking importance, keep every question token and the top / bottom /
random ``p%`` of the thinking tokens, then let the model answer directly: append the answer cue
(the ``</think>`` delimiter, or a rule-based cue) and decode the answer, ``runs`` times. Accuracy per
strategy and ``p``, next to the same procedure with every thinking token kept ("full").

The retained context is built by the library's own eviction path: the trace is prefilled through
:func:`dynts.attach` into a :class:`~dynts.cache.BoundedCache` whose evictor is
:class:`~dynts.evictors.fixed.FixedPositions` holding the kept positions, one eviction event
compacts every layer to that set, and ``generate`` decodes from the compacted cache. The kept
entries therefore keep their original positions and the K/V they got with the whole trace in view
(what a decode-time eviction method leaves the model). ``context="reencode"`` instead re-encodes
the retained tokens as a fresh, contiguous prompt (the paper's vLLM procedure).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dynts.core.budget import fixed_budget
from dynts.evictors.fixed import FixedPositions
from dynts.hf_compat import cache_keyword
from dynts import attach, build_cache, generate
from dynts.io import write_atomic
from dynts.prompts import pad_id

from .traces import IMPORTANCE, check_traces

__all__ = [
    "PAPER_SAMPLING",
    "PERCENTS",
    "STRATEGIES",
    "ParetoConfig",
    "ParetoResult",
    "answer_from_kept",
    "math_grader",
    "pareto_curve",
    "select_thinking",
    "testbed_grader",
    "thinking_count",
]

PERCENTS = (2, 4, 6, 8, 10, 20, 30, 40, 50)
STRATEGIES = ("top", "bottom", "random")
CONTEXTS = ("cache", "reencode")
# DeepSeek-R1 sampling, used by the paper for every run (appendix B.1)
PAPER_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}

TraceGrader = Callable[[dict, str], bool]


def check_percent(percent: float) -> float:
    """``percent`` as a float in ``(0, 100]``, else ``ValueError``."""
    try:
        value = float(percent)
    except (TypeError, ValueError):
        raise ValueError(f"percent={percent!r} must be a number in (0, 100]") from None
    if not 0.0 < value <= 100.0 or math.isnan(value):
        raise ValueError(f"percent={percent!r} must lie in (0, 100] (the share of thinking tokens kept, e.g. 30)")
    return value


def thinking_count(thinking_tokens: int, percent: float) -> int:
    """Thinking tokens kept at ``percent``: ``round(T * p / 100)``, at least 1, at most ``T``."""
    p = check_percent(percent)
    return max(1, min(thinking_tokens, math.floor(thinking_tokens * p / 100.0 + 0.5)))


def select_thinking(
    importance: Sequence[float],
    question_len: int,
    answer_start: int,
    strategy: str,
    percent: float,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Absolute positions of the thinking tokens kept by ``strategy`` at ``percent`` (ascending).

    ``top`` / ``bottom``: highest / lowest importance (ties: the earlier token); ``random``: a
    uniform subset drawn with ``generator``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    scores = torch.as_tensor(list(importance[question_len:answer_start]), dtype=torch.float64)
    k = thinking_count(scores.numel(), percent)
    if strategy == "top":
        order = torch.sort(scores, descending=True, stable=True).indices
    elif strategy == "bottom":
        order = torch.sort(scores, stable=True).indices
    else:
        order = torch.randperm(scores.numel(), generator=generator)
    return sorted((order[:k] + question_len).tolist())


@torch.no_grad()
def answer_from_kept(
    model: torch.nn.Module,
    prefix: Sequence[int],
    question_len: int,
    keep: Sequence[Sequence[int]],
    cue: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: dict[str, Any] | None = None,
    context: str = "cache",
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """Answer tokens decoded after ``cue`` from the kept part of ``prefix``, one row per ``keep`` row.

    Args:
        prefix: question + thinking ids ``[L]`` (one trace).
        question_len: prompt tokens at the front of ``prefix`` (the cache's question window).
        keep: per row, the absolute positions of ``prefix`` to keep (equal sizes; include the question).
        cue: ids appended after the retained context (e.g. ``[</think>]``).
        context: ``"cache"`` (prefill the whole prefix, evict once to ``keep`` with the ``fixed``
            evictor, decode) or ``"reencode"`` (feed only the kept tokens as a new prompt).
        sampling: ``generate`` options (default greedy).

    Returns ``[rows, new]`` generated ids (rows that stopped early are padded).
    """
    if context not in CONTEXTS:
        raise ValueError(f"context={context!r} must be one of {CONTEXTS}")
    sizes = {len(set(row)) for row in keep}
    if len(sizes) != 1:
        raise ValueError("every keep row must hold the same number of positions (one eviction keeps n_keep per row)")
    length = len(prefix)
    if any(p < 0 or p >= length for row in keep for p in row):
        raise ValueError(f"keep holds positions outside the prefix [0, {length})")
    device = next(model.parameters()).device
    rows = len(keep)
    options = {"do_sample": False, **(sampling or {})}
    if pad_token_id is not None:
        options.setdefault("pad_token_id", pad_token_id)
    cue_t = torch.as_tensor(list(cue), dtype=torch.long, device=device).expand(rows, len(cue))
    if context == "reencode":
        ids = torch.tensor([[prefix[p] for p in sorted(set(row))] for row in keep], dtype=torch.long, device=device)
        ids = torch.cat([ids, cue_t], 1)
        return generate(model, input_ids=ids, method="full", max_new_tokens=max_new_tokens, **options).sequences

    ids = torch.as_tensor(list(prefix), dtype=torch.long, device=device).expand(rows, length)
    kept = sizes.pop()
    budget = fixed_budget(kept, question_len, length + len(cue) + max_new_tokens)
    cache = build_cache(model, FixedPositions([sorted(set(row)) for row in keep]), budget)
    cache_kw = cache_keyword(model)
    full = torch.cat([ids, cue_t], 1)
    with attach(model, cache):
        model(input_ids=ids[:, :question_len], logits_to_keep=1, **{cache_kw: cache})
        if length > question_len:
            model(input_ids=ids[:, question_len:], logits_to_keep=1, **{cache_kw: cache})
        if kept < length:
            cache.evict()  # the one eviction event: every layer compacted to the kept positions
        out = model.generate(
            input_ids=full, attention_mask=torch.ones_like(full), max_new_tokens=max_new_tokens,
            **{cache_kw: cache}, **options,
        )
    if cache.stats.evictions > (1 if kept < length else 0):  # pragma: no cover - capacity covers decoding
        raise RuntimeError("the fixed-set cache evicted during decoding; its capacity was too small")
    return out[:, full.shape[1] :]


# ------------------------------------------------------------------ grading


def testbed_grader(tokenizer: Any) -> TraceGrader:
    """The testbed's exact check: the answer after ``</think>`` names the asked key and carries the
    value that key's step has in the trace's own (full) thinking."""
    from data_pipeline.grading import TestbedGrader

    graders = {}  # one per task family (a trace without ``family`` is a copy trace)
    decoded: dict[tuple, tuple[str, str]] = {}

    def grade(trace: dict, completion: str) -> bool:
        key = (trace["question_id"], trace["sample_id"])
        if key not in decoded:
            ids, q, a = trace["input_ids"], int(trace["question_len"]), int(trace["answer_start"])
            decoded.clear()  # one trace at a time
            decoded[key] = tokenizer.decode(ids[:q]), tokenizer.decode(ids[q:a])
        question, thinking = decoded[key]
        family = trace.get("family") or "copy"
        grader = graders.setdefault(family, TestbedGrader(family=family))
        return grader.grade(question, f"{thinking} {completion}").correct

    return grade


def math_grader() -> TraceGrader:
    """math-verify against the trace's ``gold`` answer."""
    from data_pipeline.grading import MathGrader

    grader = MathGrader()
    return lambda trace, completion: grader.grade(str(trace["gold"]), completion).correct


# ------------------------------------------------------------------ the curve


@dataclass
class ParetoConfig:
    """Settings of :func:`pareto_curve`.

    Args:
        percents: shares of thinking tokens kept, each in ``(0, 100]`` (paper: 2..50).
        strategies: any of ``top``, ``bottom``, ``random``.
        runs: answers sampled per trace and condition (paper: 5).
        max_new_tokens: answer length cap.
        answer_cue: text appended after the retained context; ``None`` re-uses the first
            ``cue_tokens`` answer tokens of the trace (its ``</think>`` delimiter or rule-based cue).
        context: ``"cache"`` (fixed-set eviction, default) or ``"reencode"`` (paper B.1).
        sampling: ``generate`` options (default: the paper's R1 sampling).
        only_correct: use only traces whose original answer was correct.
        seed: seeds the random selection and the sampling.
    """

    percents: Sequence[float] = PERCENTS
    strategies: Sequence[str] = STRATEGIES
    runs: int = 5
    max_new_tokens: int = 8
    answer_cue: str | None = None
    cue_tokens: int = 1
    context: str = "cache"
    sampling: dict[str, Any] = field(default_factory=lambda: dict(PAPER_SAMPLING))
    only_correct: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.percents:
            raise ValueError("percents is empty; e.g. percents=(2, 4, 6, 8, 10, 20, 30, 40, 50)")
        self.percents = tuple(check_percent(p) for p in self.percents)
        self.strategies = tuple(self.strategies)
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise ValueError(f"strategies={list(self.strategies)} must be a non-empty subset of {STRATEGIES}")
        for name in ("runs", "max_new_tokens", "cue_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.context not in CONTEXTS:
            raise ValueError(f"context={self.context!r} must be one of {CONTEXTS}")


@dataclass
class ParetoResult:
    """Per-answer records of :func:`pareto_curve` and their summary.

    ``records``: one dict per (trace, strategy, percent, run) with ``correct``, the ``completion``,
    ``agrees_with_full``, ``thinking_tokens`` and ``kept_thinking``; strategy ``"full"`` (percent
    100) is the reference.
    """

    records: list[dict[str, Any]]
    config: ParetoConfig

    def accuracy(self, strategy: str, percent: float = 100.0) -> float:
        hits = [r["correct"] for r in self.records if r["strategy"] == strategy and r["percent"] == float(percent)]
        if not hits:
            raise ValueError(f"no records for strategy={strategy!r} percent={percent}")
        return sum(hits) / len(hits)

    @property
    def full_accuracy(self) -> float:
        return self.accuracy("full", 100.0)

    def summary(self) -> list[dict[str, Any]]:
        """One row per (strategy, percent): ``accuracy``, ``answers``, ``traces``, ``kept_fraction``,
        ``recovery`` (accuracy / full accuracy) and ``agreement`` (share of answers identical to the
        full-thinking answer of the same run; meaningful with greedy decoding, and for models that
        rarely get the gold answer)."""
        groups: dict[tuple[str, float], list[dict]] = {}
        for r in self.records:
            groups.setdefault((r["strategy"], r["percent"]), []).append(r)
        full = self.full_accuracy if ("full", 100.0) in groups else float("nan")
        out = []
        for (strategy, percent), recs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0])):
            acc = sum(r["correct"] for r in recs) / len(recs)
            out.append({
                "strategy": strategy,
                "percent": percent,
                "accuracy": acc,
                "answers": len(recs),
                "traces": len({(r["question_id"], r["sample_id"]) for r in recs}),
                "kept_fraction": sum(r["kept_thinking"] / r["thinking_tokens"] for r in recs) / len(recs),
                "recovery": acc / full if full > 0 else float("nan"),
                "agreement": sum(r["agrees_with_full"] for r in recs) / len(recs),
            })
        return out

    def write_csv(self, path: str | Path, *, per_answer: bool = False) -> Path:
        """The summary (or every record) as CSV."""
        rows = self.records if per_answer else self.summary()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return path


def _cue(tokenizer: Any, trace: dict, config: ParetoConfig) -> list[int]:
    if config.answer_cue is not None:
        cue = tokenizer.encode(config.answer_cue, add_special_tokens=False)
        if not cue:
            raise ValueError(f"answer_cue={config.answer_cue!r} encodes to no tokens")
        return cue
    a = int(trace["answer_start"])
    return list(trace["input_ids"][a : a + config.cue_tokens])


def _load_records(path: Path, config: ParetoConfig, per_trace: int) -> list[dict]:
    """Records already written to ``path`` by a run with the same ``config`` (resume).

    Only traces with all ``per_trace`` records are kept (a run killed mid-write leaves a partial
    trace or a cut line); the file is rewritten without the rest, so their traces are redone.
    """
    meta = path.with_suffix(".config.json")
    stored = json.loads(meta.read_text()) if meta.is_file() else None
    wanted = json.loads(json.dumps(asdict(config)))
    if stored is not None and stored != wanted:
        raise ValueError(f"{path} was written with other settings ({meta}); pass another records path or delete it")
    if not path.is_file():
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(wanted, indent=1))
        return []
    lines = path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    counts: dict[tuple, int] = {}
    for r in records:
        counts[(r["question_id"], r["sample_id"])] = counts.get((r["question_id"], r["sample_id"]), 0) + 1
    complete = [r for r in records if counts[(r["question_id"], r["sample_id"])] == per_trace]
    if len(complete) != len(lines):
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in complete))
    return complete


def pareto_curve(
    model: torch.nn.Module,
    tokenizer: Any,
    traces: Any,
    config: ParetoConfig | None = None,
    grader: TraceGrader | None = None,
    *,
    records_path: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ParetoResult:
    """Accuracy when the model answers from the question + a share of its thinking.

    Args:
        traces: trace dataset with ``importance`` (:mod:`eval.analyses.traces`).
        grader: ``grade(trace, completion) -> bool`` (:func:`testbed_grader`, :func:`math_grader`);
            ``completion`` is the decoded cue + answer.
        records_path: JSONL written trace by trace; a rerun skips the traces already there (resume).
        progress: called with ``(traces done, traces total)``.
    """
    config = config or ParetoConfig()
    check_traces(traces, importance=True)
    if grader is None:
        raise ValueError("grader is required: eval.analyses.pareto.testbed_grader(tokenizer) or eval.analyses.pareto.math_grader()")
    rows = [r for r in traces if r["correct"] or not config.only_correct]
    if not rows:
        raise ValueError("no trace left (only_correct=True and no trace is correct)")
    path = Path(records_path) if records_path is not None else None
    conditions = [("full", 100.0)] + [(s, p) for s in config.strategies for p in config.percents]
    records = _load_records(path, config, len(conditions) * config.runs) if path is not None else []
    done = {(r["question_id"], r["sample_id"]) for r in records}
    pad = pad_id(tokenizer)
    for t, trace in enumerate(rows):
        key = (trace["question_id"], trace["sample_id"])
        if key in done:
            continue
        ids, q, a = list(trace["input_ids"]), int(trace["question_len"]), int(trace["answer_start"])
        cue = _cue(tokenizer, trace, config)
        question = list(range(q))
        new: list[dict] = []
        full_answers: list[str] = []
        for c, (strategy, percent) in enumerate(conditions):
            seed = config.seed * 1_000_003 + t * 1009 + c
            gen = torch.Generator().manual_seed(seed)
            if strategy == "full":
                keep = [list(range(a))] * config.runs
            elif strategy == "random":
                keep = [question + select_thinking(trace[IMPORTANCE], q, a, strategy, percent, gen) for _ in range(config.runs)]
            else:
                keep = [question + select_thinking(trace[IMPORTANCE], q, a, strategy, percent)] * config.runs
            torch.manual_seed(seed)
            out = answer_from_kept(
                model, ids[:a], q, keep, cue, max_new_tokens=config.max_new_tokens,
                sampling=config.sampling, context=config.context, pad_token_id=pad,
            )
            for run in range(config.runs):
                completion = tokenizer.decode(cue + out[run].tolist(), skip_special_tokens=True)
                if strategy == "full":
                    full_answers.append(completion)
                new.append({
                    "question_id": trace["question_id"], "sample_id": trace["sample_id"],
                    "strategy": strategy, "percent": percent, "run": run,
                    "thinking_tokens": a - q, "kept_thinking": len(keep[run]) - q,
                    "correct": bool(grader(trace, completion)), "completion": completion,
                    "agrees_with_full": completion == full_answers[run],
                })
        records += new
        if path is not None:
            with open(path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in new))
        if progress is not None:
            progress(t + 1, len(rows))
    return ParetoResult(records, config)
