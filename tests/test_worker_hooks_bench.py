"""The worker-hooks bench (eval/perf/vllm_hooks_bench.py) drives the real dynts.vllm WorkerHooks on a stand-in
for vLLM's model runner: no vLLM needed (dynts.vllm.worker imports none at import time), so this runs in the main
venv. After every round each row's stored K/V, read through its block list, must hold the positions the evictor
kept followed by the new tokens; a broken slot copy is caught."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eval.perf.vllm_hooks_bench import LAYOUT_ORDERS, HooksBenchSettings, format_table, run_hooks_bench, vllm_kv_caches

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_runs_the_real_hooks_and_the_kept_slots_are_the_evictors(dtype):
    result = run_hooks_bench(HooksBenchSettings(rows=4, shape="tiny", dtype=dtype, reps=2, plain_steps=3, verify=True))
    # fill + warm-up + 2 timed + the counted cycle, each with one eviction round for all 4 rows
    assert result["verified"]["event_rounds"] == 4 and result["verified"]["rows_checked"] > 0
    assert result["cycles_timed"] == 2 and result["moved_slots_per_round"] > 0
    for kind in ("plain", "event"):
        assert set(result[kind]) == {"before_step", "after_prepare_inputs", "after_forward", "step", "runner_step"}
        assert result[kind]["step"]["host_us"] > 0
    assert result["syncs_counter"] == "dispatch"
    assert result["syncs_per_plain_step"] == 0  # a decode step without an event reads nothing back
    assert result["syncs_per_event_round"] == 0  # the stale-score flags are read a round later, never waited on
    assert "eviction round (4)" in format_table(result)


def test_a_broken_slot_copy_is_caught(monkeypatch):
    """The check can fail: with the round's slot move replaced by a no-op, the kept K/V stay where they were."""
    from dynts.kernels.paged import PagedKV

    monkeypatch.setattr(PagedKV, "move_", lambda self, kept, blocks: None)
    with pytest.raises(AssertionError, match="holds position"):
        run_hooks_bench(HooksBenchSettings(rows=2, shape="tiny", dtype="float32", reps=1, plain_steps=2, verify=True,
                                           count_syncs=False))


def test_streamingllm_runs_without_a_predictor():
    result = run_hooks_bench(HooksBenchSettings(rows=2, shape="tiny", dtype="float32", method="streamingllm", reps=1,
                                                plain_steps=2, verify=True, count_syncs=False))
    assert result["predictor_dtype"] is None and result["verified"]["event_rounds"] == 2


@pytest.mark.parametrize("layout", sorted(LAYOUT_ORDERS))
def test_kv_cache_views_have_the_logical_shape_in_the_layouts_memory_order(layout):
    caches = vllm_kv_caches(3, 5, 2, 4, 6, torch.float32, "cpu", layout)
    assert len(caches) == 3 and all(c.shape == (5, 2, 4, 6) for c in caches)
    logical = (3, 5, 2, 4, 6)
    order = LAYOUT_ORDERS[layout]
    strides = {}  # expected element stride of each logical axis: product of the sizes after it in memory order
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= logical[d]
    assert caches[1].stride() == tuple(strides[d] for d in (1, 2, 3, 4))
    assert caches[1].storage_offset() == strides[0]
    assert caches[0].untyped_storage().data_ptr() == caches[2].untyped_storage().data_ptr()  # one allocation


def test_cli_prints_the_table_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_vllm_hooks

    out = tmp_path / "hooks.json"
    assert bench_vllm_hooks.main(["--device", "cpu", "--rows", "3", "--dtype", "float32", "--shape", "tiny",
                                  "--reps", "1", "--plain-steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == 3 and result["shape_name"] == "tiny" and result["plain"]["step"]["done_us"] > 0


def test_gpu_check_dry_run_vllm_section(monkeypatch):
    """gpu_check's vllm section on CPU (tiny shapes): the slot copy on the LBNHC view, exact, warmed repeats; the
    hooks' checked run and their timing fields."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    out = gpu_check.vllm_check(torch.device("cpu"), dry_run=True)
    assert out["ok"] and out["layout"] == "LBNHC" and out["moved_slots"] > 0
    assert set(out["copy_ms_by_layout"]) == {"LBNHC", "LBHNC"}
    assert all(r["exact"] and len(r["ms"]) == out["repeats"] == 3 for r in out["copy_ms_by_layout"].values())
    assert out["copy_ms"] == out["copy_ms_by_layout"]["LBNHC"]["median_ms"]
    assert out["copy_ms_by_layout"]["LBNHC"]["strides"] != out["copy_ms_by_layout"]["LBHNC"]["strides"]
    assert out["hooks_verified"]["event_rounds"] >= 2
    assert out["hooks_us_per_plain_step"] > 0 and out["hooks_us_per_event_round"] > 0
    assert out["hooks_syncs_per_plain_step"] == 0 and out["hooks_syncs_per_event_round"] == 0
    assert out["hooks"]["rows"] == 4 and out["hooks"]["event"]["step"]["done_us"] > 0
    json.dumps(out)
