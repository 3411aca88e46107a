"""Compaction of K/V buffers at an eviction event (torch reference path)."""

from __future__ import annotations

import torch


def compact_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int) -> None:
    """Gather the kept slots of every buffer to its front, in place.

    Args:
        buffers: K/V tensors ``[b, h, capacity, d]`` (all layers).
        kept: ``[b, k]`` ascending slot indices, shared by all layers and heads.
        length: live slots before the event (``k <= length <= capacity``).
    """
    k = kept.shape[1]
    for t in buffers:
        idx = kept[:, None, :, None].expand(t.shape[0], t.shape[1], k, t.shape[3])
        t[:, :, :k] = t[:, :, :length].gather(2, idx)
