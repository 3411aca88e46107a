"""Host index data to the device without making the host wait for it.

Every per-step and per-round upload of the paged engines' worker hooks goes through :class:`HostStaging`:
the host data is written into a persistent pinned buffer and copied with ``non_blocking=True``, so the host
never waits for the work queued on the stream (a pageable copy, or ``torch.tensor(list, device=...)``, waits
for the forward in flight -- under vLLM's async scheduling, the next step's). A pinned buffer is written again
only once the copy that last read it has run (a CUDA event per buffer, polled, never waited on: a busy ring
grows by one buffer instead). Elsewhere (CPU) an upload is a copy of the data made into a tensor (no ring,
nothing pinned): one tensor operation, what a hook's step pays on vLLM's CPU runner.

The buffers outlive the call that made them and are shared by threads, so they are made and written under
``torch.inference_mode(False)``: a buffer made inside ``torch.inference_mode()`` (vLLM's worker, a user's
evaluation block) would be an inference tensor that no later call outside inference mode may write. The
uploaded tensors are plain tensors, usable in either mode.

:func:`transfer_active` tells a sync counter (``eval.perf.syncs``) that the code running is an audited transfer:
these uploads, or :class:`~dynts.core.readback.HostReadback`'s reads (both enter :func:`audited_transfer`).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

__all__ = ["HostStaging", "audited_transfer", "transfer_active", "upload"]

_LOCAL = threading.local()


def transfer_active() -> bool:
    """True inside :func:`audited_transfer`: :class:`HostStaging` copying host data to the device, or
    :class:`~dynts.core.readback.HostReadback` copying to or reading its pinned host buffers."""
    return getattr(_LOCAL, "depth", 0) > 0


class _AuditedTransfer:
    """The context of :func:`audited_transfer` (a plain class: entered on every upload, cheaper than a generator's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _LOCAL.depth -= 1


_AUDITED = _AuditedTransfer()


def audited_transfer() -> _AuditedTransfer:
    """Mark the block as one of dynts' audited host-device transfers (pinned, never waited on) for this thread."""
    return _AUDITED


class HostStaging:
    """Persistent (pinned on CUDA) host buffers for one worker's uploads to ``device``.

    Args:
        device: where the uploaded tensors go.
        capacity: elements of the first buffer; a buffer added later holds the largest upload seen so far.
    """

    def __init__(self, device: torch.device | str, capacity: int = 4096) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.capacity = capacity
        self._lock = threading.Lock()  # one worker thread in an engine; a lock keeps shared use (tests, threads) safe
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

    def _buffer(self, numel: int) -> int:
        """Index of a ring buffer of at least ``numel`` int64 elements that no queued copy still reads."""
        for i, (host, event) in enumerate(self._ring):
            if host.numel() >= numel and (event is None or event.query()):
                return i
        self.capacity = max(self.capacity, numel)
        host = torch.empty(self.capacity, dtype=torch.long, pin_memory=self.pinned)
        self._ring.append((host, None))
        return len(self._ring) - 1

    def upload(self, data: np.ndarray) -> torch.Tensor:
        """``data`` (any integer array) as an int64 tensor of its shape on the device: one copy, never waited on."""
        if self.device.type == "cpu":
            return self._host_copy(data)
        flat = np.ascontiguousarray(data, dtype=np.int64).reshape(-1)
        with self._lock, audited_transfer(), torch.inference_mode(False):
            i = self._buffer(flat.size)
            host = self._ring[i][0]
            staged = host[: flat.size]
            staged.copy_(torch.from_numpy(flat))
            out = staged.to(self.device, non_blocking=True)
            event = None
            if self.pinned:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            self._ring[i] = (host, event)
        return out.view(data.shape)

    @staticmethod
    def _host_copy(data: np.ndarray) -> torch.Tensor:
        """:meth:`upload` on CPU: an int64 copy of ``data`` as a tensor (a plain one, even under inference mode)."""
        with audited_transfer():
            copy = np.array(data, dtype=np.int64)
            if not torch.is_inference_mode_enabled():
                return torch.from_numpy(copy)
            with torch.inference_mode(False):
                return torch.from_numpy(copy)

    def columns(self, columns: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
        """Equal-length int lists as ``len(columns)`` int64 tensors ``[T]`` on the device (one copy)."""
        return tuple(self.upload(np.asarray(columns, dtype=np.int64).reshape(len(columns), -1)).unbind(0))


_SHARED: dict[torch.device, HostStaging] = {}


def upload(columns: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """The equal-length int lists ``columns`` as ``len(columns)`` long tensors ``[T]`` on ``device``, through one
    :class:`HostStaging` per device (one copy, never waited on)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    staging = _SHARED.get(device)
    if staging is None:
        staging = _SHARED[device] = HostStaging(device)
    return staging.columns(columns)
