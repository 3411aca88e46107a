"""Policy traces with process labels: the training rows of a step-judging testbed PRM.

A PRM that KV-Rescue trusts alone has to catch the errors the search actually proposes: the evicted
base's (lost operands, loops, premature answers under every base evictor of the tables) and the
full-context helper's arithmetic slips. So its rows are the policies' own traces, not corrupted
reference traces: each :class:`TracePolicy` (a model, an eviction method, a budget) generates ``k``
traces per problem (:func:`eval.rescue.prm_traces.generate_traces`, with ``dynts.generate``) on
``train:prm-traces:...`` problems, and every step is labelled by the testbed's oracle
(:func:`process_labels`):

* a thinking step (the words after the previous ``;`` up to its own ``;``) is right when the exact step
  check (:func:`data_pipeline.testbed.steps.check_step`) passes it given the steps committed before
  it: the next key, operands copied from the question or the committed results, the value computed;
* the answer (``</think> rK= v``, the PRM's ``;`` appended as the search's scorer appends it) is right
  when the grader (:func:`data_pipeline.testbed.task.check_answer`) accepts the whole trace.

Shards (``<out_dir>/<policy>/<shard>.jsonl``: one ``{"tokens", "labels", "policy", "problem"}`` per
trace) are written atomically and skipped when present, so the generation resumes after a kill and stops
itself after ``max_seconds`` (``python -m eval.rescue.prm_traces --config CONFIG --max-minutes 14``). This module
holds what the trainer needs: the configuration, the labels and :func:`load_trace_rows` (``PRMConfig.trace_prob``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from data_pipeline.testbed import task
from data_pipeline.testbed.steps import check_step

__all__ = ["TraceConfig", "TracePolicy", "load_trace_rows", "process_labels", "shard_path", "trace_row"]

IGNORE = -100


@dataclass(frozen=True)
class TracePolicy:
    """One source of traces: ``model`` (``"base"`` or ``"helper"``) decoding under ``method`` (a
    ``dynts eval`` method spec, :func:`eval.harness.methods.parse_method`) at ``budget`` (None: full cache)."""

    model: str
    method: str = "full"
    budget: int | None = None

    @property
    def name(self) -> str:
        spec = self.method.split(":", 1)[0]
        return f"{self.model}-{spec}" + (f"-B{self.budget}" if self.budget is not None else "")


@dataclass
class TraceConfig:
    """What :func:`generate_traces` generates: the base under every ``methods`` x ``budgets`` and at full
    cache, the helper at full cache; ``shards`` shards of ``shard_problems`` problems x ``k`` traces each
    per policy (``helper_shards`` / ``full_shards`` for the two full-cache policies)."""

    out_dir: str
    base: str
    helper: str
    predictor: str | None = None
    family: str = "chain"
    methods: list[str] = field(default_factory=lambda: ["dynts", "rkv+q", "snapkv+q", "h2o+q", "sepllm", "window", "streamingllm"])
    budgets: list[int] = field(default_factory=lambda: [72, 119, 167])
    local_window: int = 32
    retention: float = 0.4
    shards: int = 1
    full_shards: int = 1
    helper_shards: int = 1
    shard_problems: int = 25
    k: int = 2
    min_think: int = 150
    max_think: int = 900
    namespace: str = "train:prm-traces"
    seed: int = 0
    batch_size: int = 50

    def __post_init__(self) -> None:
        task.check_family(self.family, "traces.family")
        if not self.namespace.startswith("train") and self.namespace.split(":")[0] not in ("dev", "test", task.GATE):
            raise ValueError(f"traces.namespace={self.namespace!r}: use 'train:...' for training rows, or dev / test / "
                             f"{task.GATE} for held-out rows (the final-only sets are not for PRM traces)")
        for name in ("shards", "full_shards", "helper_shards", "shard_problems", "k", "batch_size"):
            if getattr(self, name) < 0 or (name in ("shard_problems", "k", "batch_size") and getattr(self, name) < 1):
                raise ValueError(f"traces.{name}={getattr(self, name)!r} must be a positive count")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"traces.budgets={self.budgets!r}: every budget must be >= 1")
        if any(m.split(":")[0] == "dynts" for m in self.methods) and not self.predictor:
            raise ValueError("traces.methods has dynts: give traces.predictor (the base's trained predictor directory)")

    def policies(self) -> list[tuple[TracePolicy, int]]:
        """Every policy with its shard count: the two full caches, then the evicted base by budget, smallest first
        (so a partial run already holds every kind of error)."""
        out = [(TracePolicy("base"), self.full_shards), (TracePolicy("helper"), self.helper_shards)]
        return out + [(TracePolicy("base", m, b), self.shards) for b in self.budgets for m in self.methods]

    def problems(self, policy: TracePolicy, shard: int) -> list[task.Problem]:
        """The shard's problems: ``train:...`` seeds of their own per policy and shard; a held-out namespace
        (``dev``) draws its fixed set, each policy and shard its own block of ``shard_problems`` problems (policy
        ``p`` of :meth:`policies`, shard ``s``: block ``p * max_shards + s``)."""
        if self.namespace.startswith("train"):
            seeds = [f"{self.namespace}:{self.family}:{policy.name}:{shard}:{i}" for i in range(self.shard_problems)]
            return [task.make_problem(s, min_think=self.min_think, max_think=self.max_think, family=self.family, name=s)
                    for s in seeds]
        policies = self.policies()
        block = [p for p, _ in policies].index(policy) * max(n for _, n in policies) + shard
        everything = task.problem_set(self.namespace, (block + 1) * self.shard_problems, self.min_think, self.max_think,
                                      family=self.family)
        return everything[block * self.shard_problems :]


def process_labels(question: str, generated: Sequence[str], family: str = "chain") -> tuple[list[str], list[int]]:
    """``(tokens, labels)`` of one trace: ``tokens`` is the prompt (``<bos> question <think>``) and the
    generated words up to the answer's value (or the last ``;`` when the trace never closed its thinking),
    with ``;`` appended after the answer; ``labels`` is 1 / 0 at each step's ``;`` and at that final ``;``
    (the oracle, module docstring), ``IGNORE`` elsewhere."""
    words = [w for w in generated if w not in (task.EOS, task.PAD)]
    prompt = [task.BOS, *question.split(), task.THINK]
    close = words.index(task.END_THINK) if task.END_THINK in words else None
    thinking = words[:close] if close is not None else words
    tokens, labels = list(prompt), [IGNORE] * len(prompt)
    steps: list[str] = []
    start = 0
    for i, w in enumerate(thinking):
        if w != task.SEP:
            continue
        step = " ".join(thinking[start : i + 1])
        labels += [IGNORE] * (i - start) + [int(check_step(question, [*steps, step], family))]
        tokens += thinking[start : i + 1]
        steps.append(step)
        start = i + 1
    if close is None:
        return tokens, labels
    answer = words[start:]
    answer = answer[: answer.index(task.END_THINK) + 3]  # filler, </think>, rK=, v
    right = task.check_answer(question, " ".join([*thinking, *answer]), family)
    tokens += [*answer, task.SEP]
    labels += [IGNORE] * len(answer) + [int(right)]
    return tokens, labels


def trace_row(problem: task.Problem, text: str, policy: TracePolicy) -> dict[str, Any]:
    tokens, labels = process_labels(problem.question, text.split(), problem.family)
    return {"tokens": tokens, "labels": labels, "policy": policy.name, "problem": problem.name}


def shard_path(cfg: TraceConfig, policy: TracePolicy, shard: int) -> Path:
    return Path(cfg.out_dir) / policy.name / f"{shard:03d}.jsonl"


def load_trace_rows(out_dir: str | Path, policies: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every trace row under ``out_dir`` (optionally only ``policies``' names), in a fixed order."""
    root = Path(out_dir)
    if not root.is_dir():
        raise ValueError(f"trace directory {str(root)!r} does not exist: generate it first "
                         "(python -m eval.rescue.prm_traces --config CONFIG)")
    rows = []
    for path in sorted(root.glob("*/*.jsonl")):
        if policies is None or path.parent.name in policies:
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def iter_labelled(rows: Sequence[dict[str, Any]]) -> Iterator[tuple[list[str], list[int]]]:
    for r in rows:
        yield r["tokens"], r["labels"]
