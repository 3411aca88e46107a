"""One eviction round in a paged KV cache (vLLM's): every kept slot of every request, in every layer, moved
to the front slots of the request's blocks, in place.

A paged engine stores a request's logical slot ``j`` at the physical slot ``blocks[j // bs] * bs + j % bs``
of its block list. After an event the request keeps the logical slots ``kept`` (ascending, ``kept[i] >= i``)
and they move to logical slots ``0 .. n_keep - 1``. :class:`PagedKV` holds every layer's cache of one
engine and does the whole round's move -- all requests, all layers, keys and values -- from two device
tensors: ``kept`` ``[R, K]`` and the requests' block lists ``blocks`` ``[R, M]``. The physical plan is built
on the device (no host read, no host sync); on CUDA with Triton it is one kernel launch
(:func:`dynts.kernels.triton_paged.move_paged_triton_`), elsewhere a torch reference in bounded chunks.

Where a slot's keys and values lie is a :class:`SlotGeometry`: the cache tensor of a layer is the logical
``[blocks, kv_heads, block_size, content]`` view vLLM hands the attention backend (any strides), and the
geometry says, relative to ``(block, head)``, the offset of key / value dimension ``d`` of the slot at
offset ``s`` in its block: ``offset + s * slot + d * dim`` (:mod:`dynts.vllm.layouts` gives it per backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dispatch import backend_for

__all__ = ["MOVE_CHUNK", "PagedKV", "SlotGeometry", "physical_slots"]

MOVE_CHUNK = 8192  # slots the torch path moves per gather: bounds its scratch


@dataclass(frozen=True)
class SlotGeometry:
    """Where one slot's keys and values lie inside a ``(block, head)`` of a paged cache, in elements.

    Attributes:
        block: stride of a block.
        head: stride of a KV head.
        head_dim: dimensions of one key (and of one value).
        key_offset / key_slot / key_dim: key dimension ``d`` of the slot at offset ``s`` is at
            ``key_offset + s * key_slot + d * key_dim``.
        value_offset / value_slot / value_dim: the same for values.
    """

    block: int
    head: int
    head_dim: int
    key_offset: int
    key_slot: int
    key_dim: int
    value_offset: int
    value_slot: int
    value_dim: int

    @property
    def joint(self) -> bool:
        """Values follow keys on one content axis (FlashAttention's ``[..., 2 * head]``): a slot moves as one row."""
        return (self.value_slot, self.value_dim) == (self.key_slot, self.key_dim) \
            and self.value_offset == self.key_offset + self.head_dim * self.key_dim

    def views(self, kv: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
        """``[blocks, kv_heads, block_size, d]`` views of ``kv`` (no copy) that hold every slot's keys and values:
        one of ``d = 2 * head_dim`` when :attr:`joint`, else keys and values apart (``d = head_dim``)."""
        base = kv.storage_offset()
        if self.joint:
            shape = (kv.shape[0], kv.shape[1], block_size, 2 * self.head_dim)
            return (kv.as_strided(shape, (self.block, self.head, self.key_slot, self.key_dim), base + self.key_offset),)
        shape = (kv.shape[0], kv.shape[1], block_size, self.head_dim)
        return (kv.as_strided(shape, (self.block, self.head, self.key_slot, self.key_dim), base + self.key_offset),
                kv.as_strided(shape, (self.block, self.head, self.value_slot, self.value_dim), base + self.value_offset))


def physical_slots(blocks: torch.Tensor, logical: torch.Tensor, block_size: int) -> torch.Tensor:
    """``blocks[r, j // bs] * bs + j % bs`` for every logical slot ``j`` of ``logical`` ``[R, K]`` (int64)."""
    block = blocks.gather(1, torch.div(logical, block_size, rounding_mode="floor")).long()
    return block * block_size + logical % block_size


class PagedKV:
    """Every attention layer's paged KV cache of one engine (one KV-cache group), and the round's slot move.

    Args:
        caches: per-layer logical views ``[blocks, kv_heads, block_size, content]`` of one shape, dtype, device
            and strides (vLLM views one allocation per layer in the same layout).
        block_size: slots per block.
        geometry: where a slot's keys and values lie (:mod:`dynts.vllm.layouts`).

    The caches' addresses are read once here (the Triton path's pointer table is uploaded now, not per round).
    """

    def __init__(self, caches: list[torch.Tensor], block_size: int, geometry: SlotGeometry) -> None:
        if not caches:
            raise ValueError("PagedKV needs at least one layer's cache")
        first = caches[0]
        for kv in caches:
            if (kv.shape, kv.stride(), kv.dtype, kv.device) != (first.shape, first.stride(), first.dtype, first.device):
                raise ValueError(
                    "every layer's KV cache must share shape, strides, dtype and device; got "
                    f"{tuple(kv.shape)}/{kv.stride()}/{kv.dtype}/{kv.device} beside "
                    f"{tuple(first.shape)}/{first.stride()}/{first.dtype}/{first.device} (serve one KV-cache group)")
        if first.dim() != 4 or first.shape[2] != block_size:
            raise ValueError(f"a paged cache is [blocks, kv_heads, block_size={block_size}, content]; got {tuple(first.shape)}")
        self.caches, self.block_size, self.geometry = caches, block_size, geometry
        self.device = first.device
        self.views = [geometry.views(kv, block_size) for kv in caches]
        self.triton = backend_for(first) == "triton"
        self.pointers, self.aligned = None, False
        if self.triton:
            from .triton_paged import layer_pointers, layers_aligned

            self.pointers, self.aligned = layer_pointers(caches), layers_aligned(caches)

    def move_(self, kept: torch.Tensor, blocks: torch.Tensor) -> None:
        """Move logical slot ``kept[r, i]`` to logical slot ``i`` of request row ``r``, in every layer, in place.

        Args:
            kept: ``[R, K]`` int64 on the caches' device: each row ascending with ``kept[r, i] >= i``; a row that
                keeps fewer than ``K`` slots is padded with ``kept[r, i] = i`` (nothing moves there).
            blocks: ``[R, M]`` integer block ids of each row, ``M >= ceil(max kept / bs)``; a row's columns past its
                own blocks are never read for a moved slot.
        """
        if kept.dim() != 2 or blocks.dim() != 2 or kept.shape[0] != blocks.shape[0]:
            raise ValueError(f"kept [R, K] and blocks [R, M] must share R; got {tuple(kept.shape)} and {tuple(blocks.shape)}")
        if kept.numel() == 0:
            return
        if self.triton:
            from .triton_paged import move_paged_triton_

            move_paged_triton_(self, kept, blocks)
        else:
            self.move_torch_(kept, blocks)

    def warm_up(self, blocks_dtype: torch.dtype = torch.int64) -> bool:
        """Compile the Triton move for these caches now, not at the first eviction round: one launch of a round that
        moves nothing (one row keeping its slots in place: every load and store is masked off), so the caches are
        neither read nor written. ``blocks_dtype``: the dtype the rounds' block lists arrive in (the worker's pinned
        staging uploads int64). Returns whether a kernel was launched (``False`` on the torch path: nothing to
        compile)."""
        if not self.triton:
            return False
        width = 2 * 32 + 1  # more than one tile of the move (any width: the kernel is compiled for none)
        kept = torch.arange(width, device=self.device)[None]
        blocks = torch.zeros(1, -(-width // self.block_size), dtype=blocks_dtype, device=self.device)
        self.move_(kept, blocks)
        return True

    def move_torch_(self, kept: torch.Tensor, blocks: torch.Tensor) -> None:
        """The torch reference of :meth:`move_` (every pair moved, identities too, in chunks of :data:`MOVE_CHUNK`
        taken row by row in ascending destination order: a chunk gathers before it writes, and a later chunk
        never reads a slot an earlier one wrote, since ``kept[r, i] >= i``). Reads nothing back to the host."""
        bs = self.block_size
        rows, width = kept.shape
        dst_logical = torch.arange(width, device=kept.device).expand(rows, width)
        src = physical_slots(blocks, kept, bs).reshape(-1)
        dst = physical_slots(blocks, dst_logical, bs).reshape(-1)
        for lo in range(0, src.numel(), MOVE_CHUNK):
            s, d = src[lo : lo + MOVE_CHUNK], dst[lo : lo + MOVE_CHUNK]
            sb, so = torch.div(s, bs, rounding_mode="floor"), s % bs
            db, do = torch.div(d, bs, rounding_mode="floor"), d % bs
            for views in self.views:
                for view in views:
                    view[db, :, do] = view[sb, :, so]
