"""Time plans for the commands a lent GPU runs: each step's estimate, the plan inside a budget, a running deadline.

A lending is 15 minutes of device time in all (the machine's start included) and one command at most 10
minutes, so each prepared command (``scripts/gpu_check.py``, ``python -m eval.perf.vllm_gpu_bundle``) runs its
steps most informative first against a running deadline: a step runs only when its estimate fits in what is left
(its time box is what is left, at most its cap), and a step that does not fit is recorded as skipped with both
numbers, never silently dropped. :func:`time_plan` shows the same decision before anything runs (``--dry-run``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["DEFAULT_BUDGET_S", "Deadline", "Step", "time_plan"]

DEFAULT_BUDGET_S = 540.0  # one command: inside the 600 s a call may run, with room to write its JSON


@dataclass(frozen=True)
class Step:
    """One step of a command's plan.

    Attributes:
        name: the step's label (its key in the command's JSON).
        estimate_s: wall seconds it is expected to take on the lent GPU, start-up and compiles included.
        basis: where the estimate comes from (a measured run, or why it is a guess).
        cap_s: its time box (``None``: what is left).
    """

    name: str
    estimate_s: float
    basis: str
    cap_s: float | None = None

    def __post_init__(self) -> None:
        if not self.estimate_s > 0:
            raise ValueError(f"Step {self.name!r}: estimate_s={self.estimate_s} must be > 0")
        if self.cap_s is not None and self.cap_s < self.estimate_s:
            raise ValueError(f"Step {self.name!r}: cap_s={self.cap_s} is below its estimate_s={self.estimate_s}")


def time_plan(steps: list[Step], budget_s: float) -> dict[str, Any]:
    """What a run of ``steps`` inside ``budget_s`` would do if every step took its estimate: in order, a step runs
    when its estimate fits in what is left (a later, shorter step may still run after one is skipped).

    Returns ``{"budget_s", "planned_s", "steps": [{name, estimate_s, basis, cap_s, runs, start_s}], "skipped"}``.
    """
    clock, rows, skipped = 0.0, [], []
    for step in steps:
        runs = clock + step.estimate_s <= budget_s
        rows.append({**asdict(step), "runs": runs, "start_s": clock if runs else None})
        if runs:
            clock += step.estimate_s
        else:
            skipped.append(step.name)
    return {"budget_s": budget_s, "planned_s": clock, "steps": rows, "skipped": skipped}


def format_plan(title: str, plan: dict[str, Any]) -> str:
    """The plan as lines of text: each step's start, estimate and basis, then what it would skip."""
    lines = [f"{title}: {plan['planned_s']:.0f} s planned of a {plan['budget_s']:.0f} s budget"]
    for row in plan["steps"]:
        at = f"{row['start_s']:>5.0f} s" if row["runs"] else "  skip "
        lines.append(f"  {at}  {row['name']:<40} ~{row['estimate_s']:>4.0f} s  ({row['basis']})")
    if plan["skipped"]:
        lines.append(f"  would skip: {', '.join(plan['skipped'])}")
    return "\n".join(lines)


@dataclass
class Deadline:
    """A running deadline of ``budget_s`` seconds from its creation (``math.inf``: none, as in a CPU dry run).

    :meth:`admits` says whether a step's estimate fits in what is left and records the step under :attr:`skipped`
    when it does not; :meth:`box` is the time box of a step that runs.
    """

    budget_s: float
    clock: Callable[[], float] = time.perf_counter
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ValueError(f"budget_s={self.budget_s} must be > 0")
        self.started = self.clock()

    def left(self) -> float:
        return self.budget_s - (self.clock() - self.started)

    def admits(self, step: Step, **record: Any) -> bool:
        """Whether ``step`` fits; if not, it is recorded as skipped (with ``record``'s fields beside the numbers)."""
        left = self.left()
        if step.estimate_s <= left:
            return True
        self.skipped.append({"section": step.name, **record, "estimate_s": step.estimate_s, "left_s": round(left, 1),
                             "reason": f"would not fit: ~{step.estimate_s:.0f} s estimated, {max(0.0, left):.0f} s left"})
        return False

    def box(self, step: Step, reserve_s: float = 5.0) -> float:
        """Seconds ``step`` may run: what is left less ``reserve_s`` (to write the JSON), at most its cap."""
        if math.isinf(self.budget_s):
            return math.inf
        return max(1.0, min(step.cap_s or math.inf, self.left() - reserve_s))
