"""A stale score fails its request, never the engine, and the round never waits to find out: an eviction round
copies its stale-score flags to the host without blocking (``dynts.core.readback.HostReadback``) and the worker
reads them a round later. V1 and V2 worker hooks on the stand-in runners of ``eval/perf/vllm_hooks_bench.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynts.core.readback import HostReadback
from eval.perf.vllm_hooks_bench import HooksBench, HooksBenchSettings

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_stale_score_fails_that_request_a_round_later_and_the_rest_go_on(runner):
    bench = HooksBench(HooksBenchSettings(rows=6, shape="tiny", dtype="float32", runner=runner, method="dynts",
                                          reps=1, warmup=0, plain_steps=3, count_syncs=False))
    bench.allow_faults = True
    hooks, victim = bench.hooks, "req-2"
    with torch.no_grad():
        bench.fill()
        entry = hooks.tracker.slots[victim]
        hooks.tracker.table.scores[entry.row, entry.question_length + 1] = float("nan")  # a thinking token unscored
        bench.step(1)  # the eviction round: ranks the NaN, raises nothing, waits for nothing
        assert not hooks.failed and hooks.stale_flags.pending == 1
        bench.step(1)  # the next round reads the flags
    assert hooks.failed == {victim} and victim not in hooks.tracker.slots
    assert "no predictor score" in hooks.take_faults()[victim]
    assert hooks.stale_flags.pending == 0 and len(hooks.tracker.slots) == 5
    with torch.no_grad():
        bench.step(1)  # the engine goes on; the failed request (still scheduled) is recorded no more
    assert hooks.failed == {victim} and len(hooks.tracker.slots) == 5


def test_readback_hands_results_back_in_order_and_reuses_its_buffers():
    readback = HostReadback("cpu", capacity=4)
    readback.post(torch.tensor([True, False]), "first")
    readback.post(torch.tensor([False, False, True]), "second")
    readback.post(torch.tensor([True]), "third")  # both buffers taken: a third is made
    got = readback.ready()
    assert [p for p, _ in got] == ["first", "second", "third"] and readback.buffers_made == 3
    assert [f.tolist() for _, f in got] == [[True, False], [False, False, True], [True]]
    assert all(isinstance(f, np.ndarray) for _, f in got) and readback.pending == 0
    readback.post(torch.tensor([True]), "again")
    assert readback.buffers_made == 3 and readback.ready()[0][0] == "again"
    with pytest.raises(ValueError, match="exceeds the readback capacity 4"):
        readback.post(torch.zeros(5, dtype=torch.bool), "too many")
