""":func:`dynts.core.upload.upload`: host index lists reach the device in one copy that does not make the host
wait (counted with :class:`eval.perf.syncs.SyncCounter`, which says on CPU what a GPU run would pay)."""

from __future__ import annotations

import pytest
import torch

from dynts.core import EvictionSettings, Forward, SlotTracker
from dynts.core.upload import upload
from eval.perf.syncs import SyncCounter

CPU = torch.device("cpu")


def test_upload_gives_each_column_as_a_long_tensor_on_the_device():
    rows, slots = upload(([3, 3, 5], [0, 1, 7]), CPU)
    assert rows.dtype == slots.dtype == torch.long and rows.device == CPU
    assert rows.tolist() == [3, 3, 5] and slots.tolist() == [0, 1, 7]
    (empty,) = upload(([],), CPU)
    assert empty.shape == (0,)


def test_upload_of_unequal_columns_is_refused():
    with pytest.raises(ValueError):
        upload(([1, 2], [3]), CPU)


def test_recording_a_decode_step_makes_no_blocking_upload_and_no_sync():
    tracker = SlotTracker(EvictionSettings("window", 32, 8), CPU, think_end=(9,))
    entry = tracker.open("r", 4, tracker.settings)
    tracker.record([Forward(entry, 0, 0, [1, 2, 3, 4])])
    counter = SyncCounter()
    with counter.counting():
        for step in range(4, 8):
            tracker.record([Forward(entry, step, step, [6])], score=True)
    assert counter.uploads == 0 and counter.now == 0
    assert tracker.table.positions[entry.row, :8].tolist() == list(range(8))
    assert tracker.table.token_ids[entry.row, 4:8].tolist() == [6] * 4
