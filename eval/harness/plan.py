"""What a run computes: its cells (:class:`Cell`), planned from an :class:`~eval.harness.config.EvalConfig`.

One *cell* is one benchmark under one method setting (a budget, local window and retention for the bounded methods).
:func:`plan_cells` lists a config's cells benchmark-major; budgets given as fractions of the full cache's mean sequence
are resolved from its finished cell (:func:`fraction_budgets`). Running a cell is :mod:`eval.harness.cell_run`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import dynts
from dynts.core import EvictionSpec

from .config import EvalConfig
from .methods import MethodSpec

__all__ = ["Cell", "fraction_budgets", "plan_cells", "selection_slots"]


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
