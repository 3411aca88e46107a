"""Top-k selection of an eviction event: which slots of each row survive.

:func:`keep_top_indices` is the kernel behind :func:`dynts.evictors.base.keep_top`: the window
constraints of every method (question, local window, answer, sinks) arrive as ``+inf`` priority, pads
as invalid slots, and the result is the ``n_keep`` best slots per row in ascending order. The order is
total and deterministic: higher priority first, ties to the more recent (higher) slot, ``NaN`` above
``+inf`` and ``-0.0 == 0.0`` (torch's descending stable sort semantics), so the Triton path returns
the same indices as the torch path bit for bit.
"""

from __future__ import annotations

import torch

from .dispatch import backend_for

__all__ = ["keep_top_indices", "keep_top_torch"]


def keep_top_torch(priority: torch.Tensor, valid: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Torch reference of :func:`keep_top_indices` (a stable sort of the row read newest-first)."""
    priority = priority.float().masked_fill(~valid, float("-inf"))
    n = priority.shape[-1]
    recent_first = torch.arange(n - 1, -1, -1, device=priority.device).expand_as(priority)
    p = priority.gather(-1, recent_first)
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices
    kept = recent_first.gather(-1, order[:, :n_keep])
    return kept.sort(dim=-1).values


def keep_top_indices(priority: torch.Tensor, valid: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The ``n_keep`` slots of highest priority per row, pads (``~valid``) ranked as ``-inf``.

    Args:
        priority: ``[b, n]`` float; ``+inf`` marks protected slots.
        valid: ``[b, n]`` bool, False on padding.
        n_keep: slots kept per row; more than ``n`` keeps all ``n``.

    Returns ``[b, min(n_keep, n)]`` int64 ascending slot indices.
    """
    if priority.dim() != 2 or valid.shape != priority.shape:
        raise ValueError(f"priority {tuple(priority.shape)} and valid {tuple(valid.shape)} must both be [b, n]")
    if n_keep < 0:
        raise ValueError(f"n_keep={n_keep} must be >= 0")
    if min(n_keep, priority.shape[1]) > 0 and backend_for(priority) == "triton":
        from .triton_select import keep_top_triton

        return keep_top_triton(priority, valid, min(n_keep, priority.shape[1]))
    return keep_top_torch(priority, valid, n_keep)
