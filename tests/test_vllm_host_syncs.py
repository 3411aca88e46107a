"""The plugin's worker hooks on vLLM 0.34's V2 runner (async scheduling on) make no host sync and no blocking upload on a
decode step or an eviction round, for every evicting method the plugin serves: counted with
:class:`eval.perf.syncs.SyncCounter` in one engine run of ``scripts/bench_serve_vllm.py`` per method (what a GPU would
pay; on CPU nothing waits). Runs on the V2 test bed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.version import Version

pytest.importorskip("vllm", reason="needs vLLM's 0.34 CPU build (make check-vllm-v2)")

from dynts.models import checkpoints_dir  # noqa: E402
from dynts.vllm.compat import installed_vllm  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(Version(Version(installed_vllm()).base_version) < Version("0.34"),
                                 reason="counted on vLLM 0.34's V2 runner (make check-vllm-v2)")]

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def counted_run(dynts: dict) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from bench_serve_vllm import engine_run
    finally:
        sys.path.remove(str(SCRIPTS))
    return engine_run({"model": "testbed", "requests": 4, "prompt": 32, "generate": 96, "block_size": 32,
                       "num_blocks": 20, "max_batch_tokens": 256, "dynts": dynts, "count_syncs": True})


def test_no_host_sync_on_a_plain_step_without_events(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    quiet = counted_run({"method": "streamingllm", "budget": 129, "local_window": 16})  # nothing to evict
    assert quiet["async_scheduling"] and quiet["plain_steps"] > 50 and quiet["event_rounds"] == 0
    assert quiet["syncs_per_plain_step"] == 0 and quiet["uploads_per_plain_step"] == 0


@pytest.mark.parametrize("method", ["dynts", "streamingllm", "sepllm", "random", "window"])
def test_no_host_sync_on_a_plain_step_or_an_eviction_round(monkeypatch, method):
    """Every evicting method the plugin serves: 0 syncs and 0 blocking uploads per plain step and per eviction round
    (the stale-score flags are read a round later, the evictors' constants were placed at bind time)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    extra = {"predictor": str(checkpoints_dir() / "testbed-predictor")} if method == "dynts" else {}
    evicting = counted_run({"method": method, "budget": 64, "local_window": 16, **extra})
    assert evicting["event_rounds"] > 0 and evicting["plain_steps"] > 0
    assert evicting["syncs_per_plain_step"] == 0 and evicting["uploads_per_plain_step"] == 0
    assert evicting["syncs_per_event_round"] == 0 and evicting["uploads_per_event_round"] == 0
