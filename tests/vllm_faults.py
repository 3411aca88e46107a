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


def make_lost_shipment(victim: str, at: int) -> None:
    """Make the V2 worker lose one request's ``at``-th shipment of token ids (counting from 1): the next one arrives
    from an index the worker does not hold, a scheduler/worker disagreement confined to that request. ``victim``:
    the request id as given to vLLM (vLLM may suffix it)."""
    _lose_shipment(lambda hooks, rid: rid == victim or rid.startswith(victim + "-"), at)


def make_marked_lost_shipment(marker: str, at: int) -> None:
    """The same fault for every request whose ``extra_args`` carry the key ``marker`` (over HTTP: ``vllm_xargs``)."""
    def marked(hooks, rid):
        params = hooks.params.get(rid)
        return params is not None and marker in (params.extra_args or {})

    _lose_shipment(marked, at)


def make_forgotten_request(victim: str, at: int) -> None:
    """Make the worker (V1 or V2 runner) lose its record of one request right before that request's ``at``-th
    eviction event (counting from 1): the event then names a request the worker does not track, a fault confined
    to that request. ``victim``: the request id as given to vLLM (vLLM may suffix it)."""
    _before_event(victim, at, lambda hooks, entry: hooks.tracker.release(next(
        rid for rid, e in hooks.tracker.slots.items() if e is entry)))  # the worker's record of it is gone


def make_unscored_request(victim: str, at: int) -> None:
    """Make the worker (V1 or V2 runner) clear the predictor score of one of a request's thinking tokens right before
    that request's ``at``-th eviction event (counting from 1): its evictor then ranks a token without a score (a stale
    score), a fault confined to that request. ``victim``: the request id as given to vLLM (vLLM may suffix it)."""
    _before_event(victim, at, lambda hooks, entry: hooks.tracker.table.scores[entry.row, entry.question_length]
                  .fill_(float("nan")))


def _before_event(victim: str, at: int, fault) -> None:
    """Run ``fault(hooks, entry)`` on the victim's record right before its ``at``-th event, on both runners."""
    from dynts.vllm.worker import WorkerHooks
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    seen: dict[str, int] = {}

    def faulty(before_step):
        def faulty_before_step(self, scheduler_output):
            plan = getattr(scheduler_output, "dynts_plan", None)
            for rid, _, _ in (plan.events if plan is not None else ()):
                if rid == victim or rid.startswith(victim + "-"):
                    seen[rid] = seen.get(rid, 0) + 1
                    if seen[rid] == at and rid in self.tracker.slots:
                        fault(self, self.tracker.slots[rid])
            before_step(self, scheduler_output)

        return faulty_before_step

    for hooks in (WorkerHooks, RunnerV2Hooks):
        hooks.before_step = faulty(hooks.before_step)


def _lose_shipment(is_victim, at: int) -> None:
    """Drop a victim's ``at``-th shipment of token ids from the plan before the V2 worker sees it."""
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    before_step = RunnerV2Hooks.before_step
    seen: dict[str, int] = {}

    def lossy_before_step(self, scheduler_output):
        plan = getattr(scheduler_output, "dynts_plan", None)
        if plan is not None and plan.token_ids:
            for rid in [rid for rid in plan.token_ids if is_victim(self, rid)]:
                seen[rid] = seen.get(rid, 0) + 1
                if seen[rid] == at:
                    plan.token_ids = {r: v for r, v in plan.token_ids.items() if r != rid}  # it never arrives
        before_step(self, scheduler_output)

    RunnerV2Hooks.before_step = lossy_before_step


# Loaded as ``sitecustomize`` by a server under test (tests/test_vllm_server.py): every process of it (API server,
# engine core) injects the fault named by the environment before vLLM starts.
SITECUSTOMIZE = """
import os, sys
sys.path.insert(0, os.environ["DYNTS_FAULTS_DIR"])
from vllm_faults import make_marked_lost_shipment
make_marked_lost_shipment(os.environ["DYNTS_FAULT_MARK"], int(os.environ["DYNTS_FAULT_AT"]))
"""
