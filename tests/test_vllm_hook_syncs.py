"""The sync guard: dynts' vLLM worker hooks, V1 (``WorkerHooks``) and V2 (``RunnerV2Hooks``), driven by the
stand-in runners of ``eval/perf/vllm_hooks_bench.py`` (no vLLM needed), make no host sync and no blocking upload
on a plain decode step or an eviction round, for every method the plugin serves, counted on CPU by :class:`eval.perf.syncs.SyncCounter`
(what a GPU would pay: reads back, ``torch.tensor(data, device=...)``, copies of pageable host tensors). The same
counter catches deliberately syncing variants of the hooks, so the guard can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynts.core.upload import HostStaging
from eval.perf.syncs import SyncCounter
from eval.perf.vllm_hooks_bench import HooksBenchSettings, run_hooks_bench

pytestmark = pytest.mark.usefixtures("one_thread")


def counted(runner: str, method: str = "dynts") -> dict:
    return run_hooks_bench(HooksBenchSettings(rows=6, shape="tiny", dtype="float32", runner=runner, method=method,
                                              reps=1, warmup=0, plain_steps=3, count_syncs=True))


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("method", ["dynts", "streamingllm", "sepllm", "random", "window", "full"])
def test_neither_plain_steps_nor_eviction_rounds_wait(runner, method):
    """Every method the plugin serves: 0 syncs and 0 blocking uploads per plain step and per eviction round (the
    stale-score flags are read a round later; SepLLM's separator ids are placed on the device at bind time)."""
    result = counted(runner, method)
    syncs = result["syncs"]
    assert result["syncs_counter"] == "dispatch"
    assert syncs["event_rounds"] == (0 if method == "full" else 1) and syncs["plain_steps"] == 3
    assert result["syncs_per_plain_step"] == 0 and syncs["uploads_per_plain_step"] == 0
    assert result["syncs_per_event_round"] == 0 and syncs["uploads_per_event_round"] == 0


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_blocking_upload_in_an_evictor_is_caught(monkeypatch, runner):
    """What SepLLM did before its ids were placed at bind time: a ``torch.tensor(ids, device=...)`` per call."""
    from dynts.evictors.sepllm import SepLLM

    def select(self, info, select=SepLLM.select):
        torch.tensor(self.separator_token_ids, device=info.token_ids.device)
        return select(self, info)

    monkeypatch.setattr(SepLLM, "select", select)
    assert counted(runner, "sepllm")["syncs"]["uploads_per_event_round"] >= 1


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_stale_score_check_read_in_the_round_is_caught(monkeypatch, runner):
    """What select_kept did before: the round's stale-score flags read on the host with ``tolist()``."""
    from dynts.core import tracker

    select_kept = tracker.select_kept

    def reading(*args, **kwargs):
        out = select_kept(*args, **kwargs)
        [s.stale.tolist() for s in out if s.stale is not None]
        return out

    monkeypatch.setattr(tracker, "select_kept", reading)
    assert counted(runner)["syncs_per_event_round"] >= 1


def _pageable_upload(self: HostStaging, data: np.ndarray) -> torch.Tensor:
    """What the hooks did before the staging buffers: a pageable host tensor copied to the device."""
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.int64)).to(self.device, non_blocking=True)


def _blocking_upload(self: HostStaging, data: np.ndarray) -> torch.Tensor:
    """Host data made into a device tensor in one call: a blocking copy on a GPU."""
    return torch.tensor(np.asarray(data, dtype=np.int64).tolist(), dtype=torch.long, device=self.device).view(data.shape)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("variant", [_pageable_upload, _blocking_upload], ids=["pageable", "blocking"])
def test_a_syncing_upload_is_caught(monkeypatch, runner, variant):
    monkeypatch.setattr(HostStaging, "upload", variant)
    result = counted(runner)
    assert result["syncs_per_plain_step"] >= 1


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_scalar_read_in_a_hook_is_caught(monkeypatch, runner):
    from dynts.core.tracker import SlotTracker

    record_decode = SlotTracker.record_decode

    def reading(self, *args, **kwargs):
        rows, slots = record_decode(self, *args, **kwargs)
        int(slots.max())  # the kind of read that stalls the host under async scheduling
        return rows, slots

    monkeypatch.setattr(SlotTracker, "record_decode", reading)
    assert counted(runner)["syncs_per_plain_step"] >= 1


def test_the_counter_tells_host_tensors_from_device_tensors():
    """On CPU both are CPU tensors: host data made into tensors is tracked, and only its copies count."""
    device_tensor = torch.arange(4)
    counter = SyncCounter()
    with counter.counting():
        host = torch.from_numpy(np.arange(4))
        host.to(torch.int32).tolist()  # a host tensor read on the host: no sync
        device_tensor + host.to("cpu")  # a pageable host tensor to the device: counted
        device_tensor.to("cpu")  # already where it goes: not an upload
        device_tensor.copy_(host)  # counted
        torch.tensor([1, 2], device="cpu")  # counted
        staged = HostStaging("cpu").upload(np.arange(3))  # the audited path: not counted
        staged.sum().item()  # a read of a device tensor: counted
    assert (counter.now, counter.uploads) == (4, 3)
