"""Compaction of K/V buffers at an eviction event: gather the kept slots to the front, in place.

Token-level selection (one kept set for every layer and head, as in the DynTS reference code) passes
one ``[b, k]`` index tensor for all buffers. Per-head selection (each KV head of each layer keeps its
own top-k, as H2O, SnapKV and R-KV select in their papers) passes ``[b, L, h, k]`` and each buffer's
layer. Either way one call moves every layer's keys and values: the Triton path in one launch for all
buffers (:func:`dynts.kernels.triton_kernels.compact_triton_`); the torch path below is the reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .dispatch import backend_for

__all__ = ["compact_", "compact_torch_", "per_buffer_index"]


def per_buffer_index(kept: torch.Tensor, layer: int) -> torch.Tensor:
    """The ``[b, h or 1, k]`` kept slots of one buffer of ``layer``: ``kept`` is ``[b, k]`` (every layer and
    head) or ``[b, L, h, k]`` (per layer and KV head)."""
    return kept[:, None] if kept.dim() == 2 else kept[:, layer]


def _check(kept: torch.Tensor, buffers: Sequence[torch.Tensor], layers: Sequence[int] | None) -> list[int]:
    if kept.dim() == 2:
        return [0] * len(buffers)
    if kept.dim() != 4 or layers is None or len(layers) != len(buffers):
        raise ValueError(
            f"kept of shape {tuple(kept.shape)}: pass [b, k] (every layer and head) or [b, L, h, k] with "
            "layers=[the layer of each buffer]"
        )
    return list(layers)


def compact_torch_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int,
                   layers: Sequence[int] | None = None) -> None:
    """Torch reference of :func:`compact_` (one gather per buffer into a temporary)."""
    k = kept.shape[-1]
    for t, layer in zip(buffers, _check(kept, buffers, layers)):
        index = per_buffer_index(kept, layer)
        idx = index[..., None].expand(t.shape[0], t.shape[1], k, t.shape[3])
        t[:, :, :k] = t[:, :, :length].gather(2, idx)


def compact_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int, layers: Sequence[int] | None = None) -> None:
    """Gather the kept slots of every buffer to its front, in place.

    Args:
        buffers: K/V tensors ``[b, h, capacity, d]`` (all layers; of a sharded model, on several
            devices).
        kept: ``[b, k]`` ascending slot indices shared by all layers and heads, or ``[b, L, h, k]``
            ascending per layer and KV head (per-head selection).
        length: live slots before the event (``k <= length <= capacity``).
        layers: with a per-head ``kept``, the layer of each buffer (e.g. ``[0, 0, 1, 1, ...]`` for
            keys and values of each layer).

    Buffers are grouped by device and ``kept`` is copied once to each device that holds buffers
    (one copy per device per event, not one per layer); each group runs on its own device.
    """
    groups: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
    for t, layer in zip(buffers, _check(kept, buffers, layers)):
        group = groups.setdefault(t.device, ([], []))
        group[0].append(t)
        group[1].append(layer)
    for device, (group, group_layers) in groups.items():
        index = kept if kept.device == device else kept.to(device)
        per_layer = group_layers if kept.dim() == 4 else None
        if backend_for(index) == "triton":
            from .triton_kernels import compact_triton_

            compact_triton_(group, index, length, per_layer)
        else:
            compact_torch_(group, index, length, per_layer)
