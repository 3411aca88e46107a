"""Where a :class:`~dynts.cache.BoundedCache`'s live slots are: one :class:`Layout` per cache, shared by
reference with its layers, so a layer reads where to write and what to return without reading its cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout"]


@dataclass
class Layout:
    """Where the live slots of every layer's buffers are (one eviction compacts all layers at once).

    Attributes:
        length: slots stored before the forward in flight.
        seen: absolute tokens seen before it (``get_seq_length()``, the next position id).
        pending: tokens of the forward in flight.
        capacity: slots each buffer holds.
        static_step: the forward in flight is a static-shape decode step (static layout).
        write_index: ``[1]`` device slot the static decode step writes.
        seen_tensor: ``[]`` device copy of ``seen`` for the static decode step.
        slot_mask: ``[b, capacity]`` per-slot validity (static layout).
        holds_pads: may a stored slot be padding (a host flag: no per-step device read)?
        window_head: the ``window_attention`` row holding the oldest query row: the rows are a ring
            (a forward of ``q`` tokens advances it by ``min(q, w)`` and zeroes the rows it reuses, instead
            of shifting ``w x capacity`` floats per row every step); evictors see them in time order.
        window_row: ``[1]`` device row the static decode step adds its attention to (the newest).
    """

    length: int = 0
    seen: int = 0
    pending: int = 0
    capacity: int = 0
    static_step: bool = False
    write_index: torch.Tensor | None = None
    seen_tensor: torch.Tensor | None = None
    slot_mask: torch.Tensor | None = None
    holds_pads: bool = False
    window_head: int = 0
    window_row: torch.Tensor | None = None
