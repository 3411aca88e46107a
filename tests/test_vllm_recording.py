"""The decode step's helpers of the vLLM worker hooks (``dynts/vllm/recording.py``): :class:`DecodeBatch` hands back
the last step's records only while nothing about them changed, :class:`DeviceShifts` uploads the shifts only when
they change."""

from __future__ import annotations

import numpy as np
import torch

from dynts.core import EvictionSettings, SlotTracker
from dynts.core.upload import HostStaging
from dynts.vllm.recording import DecodeBatch, DeviceShifts

CPU = torch.device("cpu")


def _tracker_with(rids: list[str]) -> SlotTracker:
    tracker = SlotTracker(EvictionSettings("window", 64, 8), CPU, think_end=None)
    for rid in rids:
        tracker.open(rid, 4)
    return tracker


def test_decode_batch_keeps_the_records_while_nothing_changed():
    tracker = _tracker_with(["a", "b", "c"])
    shifts = {"a": 3, "c": 1}
    batch = DecodeBatch()
    req_ids = ["c", "a", "b"]
    assert batch.get(req_ids, tracker.generation, shifts) is None
    kept = batch.put(req_ids, tracker.generation, shifts, [tracker.slots[r] for r in req_ids])
    assert kept.rows.tolist() == [tracker.slots[r].row for r in req_ids] and kept.shifts.tolist() == [1, 3, 0]
    assert batch.get(list(req_ids), tracker.generation, shifts) is kept  # equal ids, the same records and shifts
    assert batch.get(["a", "c", "b"], tracker.generation, shifts) is None  # the batch reordered
    assert batch.get(req_ids, tracker.generation, dict(shifts)) is None  # the round's shifts replaced
    tracker.release("b")
    tracker.open("b", 4)
    assert batch.get(req_ids, tracker.generation, shifts) is None  # a record reopened


def test_device_shifts_upload_only_when_they_change():
    shifts = DeviceShifts(HostStaging(CPU))
    per_row, scheduled = np.array([2, 0, 5]), np.array([1, 1, 1])
    rows, tokens, host = shifts(per_row, scheduled, 4, torch.int32, torch.int64, torch.int32)
    assert rows.dtype == torch.int32 and rows.tolist() == [2, 0, 5]
    assert tokens.tolist() == [2, 0, 5, 0] and host.dtype == torch.int32 and host.tolist() == [2, 0, 5]
    again = shifts(per_row.copy(), scheduled.copy(), 4, torch.int32, torch.int64, torch.int32)
    assert all(x is y for x, y in zip(again, (rows, tokens, host)))  # the same values: nothing uploaded
    rows2, tokens2, _ = shifts(np.array([2, 1, 5]), np.array([2, 1, 1]), 6, torch.int32, torch.int64)
    assert rows2.tolist() == [2, 1, 5] and tokens2.tolist() == [2, 2, 1, 5, 0, 0]
