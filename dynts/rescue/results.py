"""What :func:`~dynts.rescue.rescue_generate` returns: committed steps, per-problem results and the
decode-cost summary (KV-Rescue paper, Tables 1-2 columns)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["EXIT_SIGNALS", "ProblemResult", "RescueResult", "Step", "summarize"]

EXIT_SIGNALS = ("entropy", "compression", "repeat", "pattern")  # detector signals that abort base candidates


@dataclass
class Step:
    """One committed step: its tokens, text, which model wrote it (and which of its candidates),
    and its PRM score."""

    tokens: list[int]
    text: str
    source: str
    score: float | None
    candidate: int = 0


@dataclass
class ProblemResult:
    """Outcome of one problem.

    Attributes:
        text: the solution (committed steps decoded, special tokens skipped).
        steps: the committed :class:`Step` list (``source`` is ``"base"`` or ``"helper"``).
        end: why decoding stopped: ``eos``, ``max_tokens``, ``max_steps`` or ``degenerate`` (every
            candidate of a step was aborted and there was no helper).
        stats: decode-cost counters (see :func:`rescue_generate`).
    """

    text: str
    steps: list[Step]
    end: str
    stats: dict[str, Any]

    @property
    def sources(self) -> list[str]:
        return [s.source for s in self.steps]

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s.tokens]


@dataclass
class RescueResult:
    """Output of :func:`rescue_generate`: per-problem results and mean decode-cost stats."""

    problems: list[ProblemResult]
    stats: dict[str, Any]

    @property
    def texts(self) -> list[str]:
        return [p.text for p in self.problems]


def summarize(results: Sequence[ProblemResult]) -> dict[str, Any]:
    """Mean per-problem decode cost (paper Table 1/2 columns) over ``results``."""
    if not results:
        return {"problems": 0}
    mean = lambda key: statistics.mean(r.stats[key] for r in results)  # noqa: E731
    base_candidates = sum(r.stats["base_candidates"] for r in results)
    committed = sum(r.stats["committed_steps"] for r in results)
    return {
        "problems": len(results),
        "committed_steps": mean("committed_steps"),
        "output_tokens": mean("output_tokens"),
        "base_tokens": mean("base_tokens"),
        "helper_tokens": mean("helper_tokens"),
        "early_exit_fraction": sum(r.stats["early_exits"] for r in results) / base_candidates if base_candidates else 0.0,
        "exit_fraction_by_signal": {k: sum(r.stats.get(f"exit_{k}", 0) for r in results) / base_candidates if base_candidates else 0.0
                                    for k in EXIT_SIGNALS},
        "helper_share": sum(r.stats["helper_steps"] for r in results) / committed if committed else 0.0,
        "ends": {e: sum(r.end == e for r in results) for e in sorted({r.end for r in results})},
    }
