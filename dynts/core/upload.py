"""Host index lists to the device without making the host wait for it."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["upload"]


def upload(columns: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """The equal-length int lists ``columns`` as ``len(columns)`` long tensors ``[T]`` on ``device``, made by
    one host-to-device copy of a ``[len(columns), T]`` host tensor.

    On CUDA the host tensor is pinned and the copy is asynchronous: the host does not wait for the work
    already queued on the stream (a blocking copy of pageable memory would wait for the forward in flight,
    which under async scheduling is the next step's). torch's caching host allocator keeps the pinned block
    until the copy has run. Elsewhere it is a plain copy.
    """
    device = torch.device(device)
    host = torch.tensor(columns, dtype=torch.long, pin_memory=device.type == "cuda")
    return tuple(host.to(device, non_blocking=True).unbind(0))
