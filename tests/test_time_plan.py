"""The running deadline of the GPU commands (:mod:`eval.perf.time_plan`): a step runs only when its estimate fits in
what is left, a step that does not fit is recorded with both numbers, and the plan shown before a run makes the same
decision."""

from __future__ import annotations

import math

import pytest

from eval.perf.time_plan import Deadline, Step, format_plan, time_plan


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_steps_refuse_estimates_they_cannot_keep():
    with pytest.raises(ValueError, match="estimate_s=0"):
        Step("x", 0, "nothing")
    with pytest.raises(ValueError, match="cap_s=5"):
        Step("x", 10, "a guess", cap_s=5)
    with pytest.raises(ValueError, match="budget_s=0"):
        Deadline(0)


def test_plan_skips_what_does_not_fit_and_still_runs_a_later_shorter_step():
    steps = [Step("a", 100, "measured"), Step("b", 300, "a guess"), Step("c", 50, "measured")]
    plan = time_plan(steps, 200)
    assert [r["runs"] for r in plan["steps"]] == [True, False, True]
    assert plan["planned_s"] == 150 and plan["skipped"] == ["b"]
    assert [r["start_s"] for r in plan["steps"]] == [0, None, 100]
    text = format_plan("cmd", plan)
    assert "150 s planned of a 200 s budget" in text and "would skip: b" in text


def test_deadline_records_each_skip_with_its_estimate_and_what_was_left():
    clock = FakeClock()
    deadline = Deadline(200, clock=clock)
    big, small = Step("big", 150, "a guess", cap_s=400), Step("small", 40, "measured", cap_s=60)
    assert deadline.admits(big) and deadline.box(big) == 195  # what is left less the reserve, under the cap
    clock.now = 120
    assert not deadline.admits(big, batch=16)
    assert deadline.admits(small) and deadline.box(small) == 60  # the cap
    clock.now = 170
    assert deadline.box(small) == 25
    assert deadline.skipped == [{"section": "big", "batch": 16, "estimate_s": 150, "left_s": 80.0,
                                 "reason": "would not fit: ~150 s estimated, 80 s left"}]


def test_no_deadline_admits_everything_unboxed():
    deadline = Deadline(math.inf)
    step = Step("huge", 1e6, "a guess", cap_s=2e6)
    assert deadline.admits(step) and math.isinf(deadline.box(step)) and not deadline.skipped
