"""Small device results read on the host a round later, without the host ever waiting for the device.

The paged engines' worker hooks must not make the host wait (under vLLM's async scheduling the host prepares
round ``N + 1`` while round ``N`` runs). A value the host needs from the device -- the stale-score flags of an
eviction round's evictor calls -- is copied with ``non_blocking=True`` into a persistent pinned host buffer and
read once the copy has run: :meth:`HostReadback.post` queues the copy (and a CUDA event after it),
:meth:`HostReadback.ready` hands back every posted result whose event has completed (polled, never waited on), in
posting order. On CPU the copy is a plain one and a result is ready at the next :meth:`HostReadback.ready`.

Its copies and reads run inside :func:`dynts.core.upload.audited_transfer`, so a sync counter (``eval.perf.syncs``)
knows them for the audited path they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .upload import audited_transfer

__all__ = ["HostReadback"]


class HostReadback:
    """Persistent (pinned on CUDA) host buffers for one worker's small device-to-host results.

    Args:
        device: where the results are computed.
        capacity: elements of each buffer (the largest result posted; more elements raise).
        buffers: buffers made up front; a result posted while every buffer still waits for its read makes one more.
    """

    def __init__(self, device: torch.device | str, capacity: int, buffers: int = 2) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be >= 1 (the largest result posted)")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.capacity = capacity
        self._free = [self._new() for _ in range(buffers)]
        self._posted: list[tuple[torch.Tensor, int, Any, torch.cuda.Event | None]] = []
        self.buffers_made = buffers

    def _new(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(self.capacity, dtype=torch.bool, pin_memory=self.pinned)

    def post(self, flags: torch.Tensor, payload: Any) -> None:
        """Queue the copy of ``flags`` (1-D bool, on the device) to the host; ``payload`` comes back with it."""
        n = flags.numel()
        if n > self.capacity:
            raise ValueError(f"a result of {n} flags exceeds the readback capacity {self.capacity}")
        if not self._free:
            self._free.append(self._new())
            self.buffers_made += 1
        host = self._free.pop()
        with audited_transfer(), torch.inference_mode(False):
            host[:n].copy_(flags.reshape(-1), non_blocking=self.pinned)
            event = None
            if self.pinned:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
        self._posted.append((host, n, payload, event))

    def ready(self) -> list[tuple[Any, np.ndarray]]:
        """``(payload, flags)`` of every posted result whose copy has run, oldest first (a later one waits behind an
        earlier one still in flight); the buffers go back to the pool."""
        out = []
        if not self._posted:
            return out
        with audited_transfer():
            while self._posted:
                host, n, payload, event = self._posted[0]
                if event is not None and not event.query():
                    break
                self._posted.pop(0)
                out.append((payload, host[:n].numpy().copy()))
                self._free.append(host)
        return out

    @property
    def pending(self) -> int:
        """Results posted and not yet handed back."""
        return len(self._posted)
