"""``EvalConfig``: the settings of one ``dynts eval`` run, validated up front (bad input raises
``ValueError`` naming the parameter before anything is loaded or generated)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from data_pipeline.grading import GRADE_ON
from dynts.core import EvictionSpec
from dynts.predictor import find_predictor

from .benchmarks import JsonlFields
from .methods import MethodSpec, parse_methods

__all__ = ["EvalConfig", "fingerprint"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class EvalConfig:
    """Everything ``dynts eval`` needs.

    Args:
        model: ``dynts.load`` name or a local HF directory.
        benchmarks: benchmark specs (:func:`eval.harness.benchmarks.load_benchmark`).
        methods: method specs (:mod:`eval.harness.methods`), e.g. ``["full", "window", "dynts"]``.
        budgets: cache budgets ``B`` (bounded methods run once per value).
        budget_fractions: budgets as shares of the full cache's mean sequence (prompt + generated
            tokens) on each benchmark, ``B = round(f * mean full seq)``, resolved after the ``full``
            cell ran (it must be among ``methods``); with ``budgets`` both sets run.
        vacuous: what to do with a budget whose ``n_keep`` leaves no selection slot (question + local
            window fill it, so every question-protecting method keeps the same set): ``"flag"`` (run
            it, mark the cell ``selection_slots: 0``; tables call it vacuous) or ``"refuse"`` (raise
            before generating; ``dynts eval --final`` refuses unless ``--allow-vacuous``). ``"refuse"``
            refuses cells at the run's W_l only: a method whose own spec sets its W_l (a tuned
            ``local_window_share=`` carried to a small budget) is flagged, its setting being its own.
        local_windows: ``W_l`` values; ``None`` = half of each budget.
        retentions: selection-window retention ratios.
            A method spec's own ``local_window=`` (or ``local_window_share=``, ``W_l = round(share x B)`` per
            budget) / ``retention=`` (:data:`eval.harness.methods.CACHE_OPTIONS`) replaces these for that method
            (one value instead of the run's list; the budgets stay the run's).
            Each method's settings are :meth:`evictions` (one :class:`~dynts.core.EvictionSpec` per cell,
            validated by the core when the config is made).
        k: samples per question (pass@1 is their mean).
        limit: first ``limit`` questions of each benchmark (``None`` = all).
        max_new_tokens: generation cap (``None`` = each benchmark's default; paper 16,384).
        batch_size: sequences per ``dynts.generate`` call (the ``k`` samples of a question count).
        temperature / top_p / top_k: sampling (paper); ``greedy`` decodes greedily (needs ``k == 1``).
        predictor: ImportancePredictor directory or ``"auto"`` (the one trained on ``model``), needed
            by methods that require scores (DynTS).
        seed: base seed; batch ``j`` of every cell draws from ``seed`` and ``j`` (common random
            numbers across methods).
        run_dir: where results go (resumable).
        fields: how to read ``.jsonl`` benchmarks.
        chat_template: render prompts with the tokenizer's chat template.
        think_end: token closing the thinking segment.
        grade_on: what the grader reads: ``answer`` (the text after ``think_end``; a trace that never
            closes its thinking is unanswered), ``full`` (the whole text) or ``auto`` (``answer`` when
            the tokenizer knows ``think_end``, else ``full``); see :mod:`data_pipeline.grading`.
        progress: show tqdm progress bars.
        workers: processes running cells side by side, each loading the model once (:mod:`eval.harness.workers`);
            the samples are the same as with one (the torch threads are split among them).
    """

    model: str
    benchmarks: Sequence[str]
    methods: Sequence[str]
    budgets: Sequence[int] = ()
    budget_fractions: Sequence[float] = ()
    local_windows: Sequence[int] | None = None
    retentions: Sequence[float] = (0.4,)
    k: int = 5
    limit: int | None = None
    max_new_tokens: int | None = None
    batch_size: int = 8
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    greedy: bool = False
    predictor: str | None = None
    seed: int = 0
    run_dir: str | Path = "runs/eval"
    fields: JsonlFields = field(default_factory=JsonlFields)
    chat_template: bool = True
    think_end: str = "</think>"
    grade_on: str = "auto"
    progress: bool = True
    vacuous: str = "flag"
    workers: int = 1

    def __post_init__(self) -> None:
        if not self.benchmarks:
            raise ValueError("benchmarks is empty; e.g. benchmarks=['gsm8k'] (--benchmark gsm8k)")
        self.method_specs: list[MethodSpec] = parse_methods(self.methods)
        bad = [f for f in self.budget_fractions if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1]
        if bad:
            raise ValueError(f"budget_fractions must be shares in (0, 1) of the full cache's mean sequence, e.g. 0.25; got {bad}")
        if self.budget_fractions and not any(not m.bounded and m.name == "full" for m in self.method_specs):
            raise ValueError("budget_fractions are shares of the full cache's mean trace: add the full cache (--method full,...)")
        if any(m.bounded for m in self.method_specs) and not self.budgets and not self.budget_fractions:
            raise ValueError("bounded methods need budgets, e.g. budgets=[1024] (--budget 1024) or budget_fractions=[0.25] "
                             "(--budget-fraction 0.25)")
        if self.vacuous not in ("flag", "refuse"):
            raise ValueError(f"vacuous={self.vacuous!r} must be 'flag' or 'refuse'")
        if not self.retentions:
            raise ValueError("retentions is empty; e.g. retentions=[0.4] (--retention 0.4)")
        if self.predictor == "auto":  # the trained predictor of this model (dynts.predictor.find_predictor)
            self.predictor = str(find_predictor(self.model))
        for method in self.method_specs:  # every cell's eviction settings, validated by the core now
            self.evictions(method)
        if not _is_int(self.k) or self.k < 1:
            raise ValueError(f"k={self.k!r} must be an integer >= 1 (samples per question)")
        if self.greedy and self.k > 1:
            raise ValueError(f"greedy decoding with k={self.k} repeats identical samples; use k=1 or sampling")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} must be an integer >= 1")
        if not _is_int(self.workers) or self.workers < 1:
            raise ValueError(f"workers={self.workers!r} must be an integer >= 1 (--workers: processes running cells side by side)")
        if self.limit is not None and (not _is_int(self.limit) or self.limit < 1):
            raise ValueError(f"limit={self.limit!r} must be a positive integer or None")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not self.greedy and (self.temperature <= 0 or not 0 < self.top_p <= 1 or not _is_int(self.top_k) or self.top_k < 0):
            raise ValueError("sampling needs temperature > 0, top_p in (0, 1] and an integer top_k >= 0 (0 = off)")
        if self.predictor is not None and not (Path(self.predictor) / "predictor_config.json").is_file():
            raise ValueError(f"predictor={self.predictor!r} is not a directory written by ImportancePredictor.save_pretrained")
        if self.grade_on not in ("auto", *GRADE_ON):
            raise ValueError(f"grade_on={self.grade_on!r} must be 'auto', 'answer' or 'full' (--grade-on)")
        self.run_dir = Path(self.run_dir)

    def evictions(self, method: MethodSpec, budgets: Sequence[int] | None = None) -> list[EvictionSpec]:
        """The eviction settings ``method`` runs under: once for the full cache, else one per budget x local
        window (default half the budget) x retention, the method's own ``local_window`` (or its
        ``local_window_share`` of each budget) / ``retention`` in place of the run's where its spec sets them. ``budgets``: these instead of ``self.budgets`` (the
        fraction budgets, once the full cache sized them)."""
        budgets = self.budgets if budgets is None else budgets
        own = dict(method.cache)
        if not method.bounded:
            grid = [{}]
        else:
            grid = [{"budget": b, "local_window": lw, "retention": float(r)} for b in budgets
                    for lw in ([method.local_window_at(b)] if method.sets_local_window else self.local_windows or [b // 2])
                    for r in ([own["retention"]] if "retention" in own else self.retentions)]
        specs = []
        for bounds in grid:
            try:
                specs.append(EvictionSpec(method.name, **bounds, predictor=self.predictor if "scores" in method.requires else None,
                                          think_end=self.think_end, method_options=method.options))
            except ValueError as err:
                source = {k: "its spec" for k in own}
                if "local_window_share" in own:
                    source["local_window"] = f"its local_window_share={own['local_window_share']} x B"
                flags = "".join(f" {k}={v} ({source[k]})" if k in source else f" --{k.replace('_', '-')} {v}"
                                for k, v in bounds.items() if v is not None)
                raise ValueError(f"method {method.label}{flags}: {err}") from None
        return specs

    def sampling(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def shared_settings(self) -> dict[str, Any]:
        """Settings every cell of a run shares; a resumed run must have the same. (The predictor
        is part of the cells that use it, so score-free cells can be reused when it changes.)"""
        return {
            "model": self.model,
            "model_fingerprint": fingerprint(self.model),
            "k": self.k,
            "limit": self.limit,
            "max_new_tokens": self.max_new_tokens,
            "batch_size": self.batch_size,
            "sampling": self.sampling(),
            "seed": self.seed,
            "fields": dataclasses.asdict(self.fields),
            "chat_template": self.chat_template,
            "think_end": self.think_end,
            "grade_on": self.grade_on,
        }


def fingerprint(path_or_name: str | os.PathLike | None) -> str | None:
    """A digest of the weight/config files of a local directory (or of a bundled testbed model's), so that a
    run dir never mixes results of two different checkpoints.

    Files under 64 MiB (testbed models, predictors, configs) count by name and bytes only, so a fresh clone or
    another machine gets the same digest and resumes a carried run; larger files (a real model's shards) by name,
    size and mtime, since reading them would take minutes: such a checkpoint copied elsewhere starts new cells."""
    if path_or_name is None:
        return None
    path = Path(path_or_name)
    if not path.is_dir():
        from dynts.models import TESTBED, checkpoints_dir

        if str(path_or_name) not in TESTBED:
            return None
        path = checkpoints_dir() / TESTBED[str(path_or_name)]
    if not path.is_dir():
        return None
    digest = hashlib.sha256()
    for f in sorted(f for f in path.iterdir() if f.suffix in {".safetensors", ".json"}):
        stat = f.stat()
        if stat.st_size < 64 * 2**20:
            digest.update(f"{f.name}:{stat.st_size};".encode())
            digest.update(f.read_bytes())
        else:
            digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]
