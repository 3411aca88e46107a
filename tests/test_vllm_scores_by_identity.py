"""Scores by identity: every hidden-state row of a forward is scored into its own token's slot, whatever the worker
skips. One request of eight fails (the worker lost its record right before its event; or it maps slots with a stale
evicted count, so it would store past its reserved slot-table row) and stays scheduled for three more
rounds, as under vLLM's async scheduling; the other seven requests' slot tables -- DynTS scores, positions, segments,
token ids -- are bitwise those of the same rounds without the fault, and nothing is raised. V1 (``WorkerHooks``) and
V2 (``RunnerV2Hooks``, token ids one round late) on the stand-in runners of ``eval/perf/vllm_hooks_bench.py``."""

from __future__ import annotations

import pytest
import torch

from eval.perf.vllm_hooks_bench import HooksBench, HooksBenchSettings

pytestmark = pytest.mark.usefixtures("one_thread")

FAULTED = "req-3"


def slot_tables(runner: str, fault: str | None) -> dict[str, dict[str, torch.Tensor]]:
    """Every tracked request's stored slots (each column of the table) after a fill, an eviction round for every
    row and three plain steps. ``fault``: ``"forgotten"``, the worker loses its record of :data:`FAULTED` right before
    the round; ``"stale"``, the worker maps FAULTED's slots with the evicted count of before the round (none) from the
    next step on, so it would store past its reserved slot-table row."""
    bench = HooksBench(HooksBenchSettings(rows=8, shape="tiny", dtype="float32", runner=runner, method="dynts",
                                          reps=1, warmup=0, plain_steps=3, count_syncs=False))
    bench.allow_faults = True
    hooks = bench.hooks
    with torch.no_grad():
        bench.fill()
        if fault == "forgotten":
            hooks.tracker.release(FAULTED)
        if fault == "stale":
            before_step, rounds = hooks.before_step, []

            def stale_before_step(scheduler_output):
                before_step(scheduler_output)
                rounds.append(1)
                if len(rounds) > 1:  # after the eviction round: FAULTED's slots mapped as if nothing was evicted
                    hooks.shifts = {**hooks.shifts, FAULTED: 0}

            hooks.before_step = stale_before_step
        for _ in range(4):  # the eviction round, then plain steps with the failed request still scheduled
            bench.step(1)
    assert (FAULTED in hooks.failed) == (fault is not None)
    if fault == "stale":
        assert "past the" in hooks.faults[FAULTED] and "max_budget" in hooks.faults[FAULTED], hooks.faults
        assert hooks.tracker.table.width == bench.budget  # the reserved table never grew
    table = hooks.tracker.table
    out = {}
    for row in bench.rows:
        entry = hooks.tracker.slots.get(row.rid)
        if entry is not None:
            out[row.rid] = {name: column[entry.row, : row.stored].clone() for name, column in table.columns()}
    return out


@pytest.mark.parametrize("fault", ["forgotten", "stale"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_failed_request_leaves_every_other_requests_scores_alone(runner, fault):
    faulted, clean = slot_tables(runner, fault), slot_tables(runner, None)
    assert FAULTED not in faulted and set(faulted) == set(clean) - {FAULTED} and len(faulted) == 7
    for rid, columns in faulted.items():
        for name, got in columns.items():
            want = clean[rid][name]
            assert torch.equal(got.isnan(), want.isnan()), f"{rid} {name}"
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{rid}: {name} differ from the run without the fault"
        assert not columns["scores"].isnan().all()  # scored at all
