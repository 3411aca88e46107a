"""Faults injected into the plugin to show that a check catches them (used by tests/vllm_driver.py and
tests/test_vllm_selfcheck.py)."""

from __future__ import annotations


def make_shift_stale() -> None:
    """Make the V2 worker map slots with each request's shift of the round before: the one-step-stale evicted
    count of the async bug the protocol must not have."""
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    before_step = RunnerV2Hooks.before_step

    def stale_before_step(self, scheduler_output):
        previous = dict(self.shifts)
        before_step(self, scheduler_output)
        self.shifts = previous  # the count of the round before: one step stale

    RunnerV2Hooks.before_step = stale_before_step
