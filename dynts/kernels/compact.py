"""Compaction of K/V buffers at an eviction event: gather the kept slots to the front, in place.

All layers share one ``kept`` index tensor (selection is per token, paper 4.2), so one call moves
every layer's keys and values. The Triton path does it in one launch for all buffers
(:func:`dynts.kernels.triton_kernels.compact_triton_`); the torch path below is the reference.
"""

from __future__ import annotations

import torch

from .dispatch import backend_for

__all__ = ["compact_", "compact_torch_"]


def compact_torch_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int) -> None:
    """Torch reference of :func:`compact_` (one gather per buffer into a temporary)."""
    k = kept.shape[1]
    for t in buffers:
        idx = kept[:, None, :, None].expand(t.shape[0], t.shape[1], k, t.shape[3])
        t[:, :, :k] = t[:, :, :length].gather(2, idx)


def compact_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int) -> None:
    """Gather the kept slots of every buffer to its front, in place.

    Args:
        buffers: K/V tensors ``[b, h, capacity, d]`` (all layers; of a sharded model, on several
            devices).
        kept: ``[b, k]`` ascending slot indices, shared by all layers and heads.
        length: live slots before the event (``k <= length <= capacity``).

    Buffers are grouped by device and ``kept`` is copied once to each device that holds buffers
    (one copy per device per event, not one per layer); each group runs on its own device.
    """
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in buffers:
        groups.setdefault(t.device, []).append(t)
    for device, group in groups.items():
        index = kept if kept.device == device else kept.to(device)
        if backend_for(index) == "triton":
            from .triton_kernels import compact_triton_

            compact_triton_(group, index, length)
        else:
            compact_torch_(group, index, length)
