"""Triton path of :meth:`dynts.kernels.paged.PagedKV.move_`: one launch moves every kept slot of every request
in every layer (keys and values), imported only when that path is taken.

The grid is ``(layers, requests, kv_heads)``; a program walks its request's ``kept`` front to back in tiles
of ``BLOCK_N`` outputs, computes the physical source and destination slots from the request's block list on
the device, and moves the ``head_dim`` elements of the key and of the value of each slot. Values are moved as
integers of their width (bf16/fp16 as int16, fp32 as int32, 8-bit as int8): the move is bitwise by
construction.

In-place safety is :mod:`dynts.kernels.triton_kernels`'s argument on logical slots (a request's block list
maps logical slots one to one onto physical ones): ``kept`` ascending with ``kept[i] >= i``, so a tile reads
logical slots ``>= its first output`` and earlier tiles wrote only slots below it; inside a tile the whole
tile is loaded, then ``tl.debug_barrier()``, then stored. Requests own disjoint blocks and heads disjoint
elements, so programs never race. Identity moves (``kept[i] == i``: the question window, the padding of
a request that keeps fewer than ``K``) are skipped.

Compiled once per engine. The round's widths (``K`` kept slots, ``M`` blocks per row) are run-time values that
Triton does not specialise on (``do_not_specialize``), and everything else the kernel is compiled for -- the
element width, ``head_dim``, the block size, the cache strides, the alignment of the layers' addresses -- is
fixed by the engine's caches: :meth:`dynts.kernels.paged.PagedKV.warm_up` compiles it at start-up with a
round that moves nothing. Every layer's address is checked once to be 16-byte aligned (the CUDA allocator's
blocks always are); then the kernel is told so (``tl.multiple_of``), which a pointer loaded from a table
otherwise hides from the compiler, so a slot's ``head_dim`` elements move in vector loads and stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import ALIGNMENT, contiguous_aligned

__all__ = ["JIT_KERNELS", "layer_pointers", "layers_aligned", "move_paged_triton_"]

_AS_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # element size -> the integer type moved


@triton.jit(do_not_specialize=["k", "kept_stride", "blocks_stride"])
def _move_paged_kernel(
    layers_ptr,  # int64 [L]: each layer's cache address
    kept_ptr,  # int64 [R, K]
    blocks_ptr,  # int [R, M]
    k,
    kept_stride,
    blocks_stride,
    block_size,
    block_stride,
    head_stride,
    head_dim,
    key_offset,
    key_slot,
    key_dim,
    value_offset,
    value_slot,
    value_dim,
    ELEM: tl.constexpr,
    ALIGNED: tl.constexpr,  # every layer's address is a multiple of ALIGNMENT bytes
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    layer = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    base = tl.load(layers_ptr + layer).to(tl.pointer_type(ELEM))
    if ALIGNED:
        base = tl.multiple_of(base, 16)  # dispatch.ALIGNMENT (a pointer's divisibility is in bytes)
    base += head.to(tl.int64) * head_stride
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    key_d = (key_offset + offs_d * key_dim).to(tl.int64)
    value_d = (value_offset + offs_d * value_dim).to(tl.int64)
    for start in range(0, k, BLOCK_N):
        out = start + tl.arange(0, BLOCK_N)
        nmask = out < k
        src = tl.load(kept_ptr + row * kept_stride + out, mask=nmask, other=0)
        moving = nmask & (src != out)
        src_block = tl.load(blocks_ptr + row * blocks_stride + src // block_size, mask=moving, other=0).to(tl.int64)
        dst_block = tl.load(blocks_ptr + row * blocks_stride + out // block_size, mask=moving, other=0).to(tl.int64)
        src_k = src_block * block_stride + (src % block_size) * key_slot  # relative to (block, head)
        dst_k = dst_block * block_stride + (out % block_size) * key_slot
        src_v = src_block * block_stride + (src % block_size) * value_slot
        dst_v = dst_block * block_stride + (out % block_size) * value_slot
        mask = moving[:, None] & dmask[None, :]
        keys = tl.load(base + src_k[:, None] + key_d[None, :], mask=mask)
        values = tl.load(base + src_v[:, None] + value_d[None, :], mask=mask)
        tl.debug_barrier()  # every read of this tile happens before any write of it
        tl.store(base + dst_k[:, None] + key_d[None, :], keys, mask=mask)
        tl.store(base + dst_v[:, None] + value_d[None, :], values, mask=mask)


def layers_aligned(caches: list[torch.Tensor]) -> bool:
    """Whether every layer's address is a multiple of :data:`~dynts.kernels.dispatch.ALIGNMENT` bytes (read once)."""
    return all(kv.data_ptr() % ALIGNMENT == 0 for kv in caches)


def layer_pointers(caches: list[torch.Tensor]) -> torch.Tensor:
    """The layers' cache addresses as a device int64 tensor (one upload, when the caches are set up; made outside
    inference mode, so that rounds in either mode read it)."""
    with torch.inference_mode(False):
        return torch.tensor([kv.data_ptr() for kv in caches], dtype=torch.int64, device=caches[0].device)


def move_paged_triton_(paged, kept: torch.Tensor, blocks: torch.Tensor) -> None:
    """Move every kept slot of ``paged`` (a :class:`~dynts.kernels.paged.PagedKV`) in one launch."""
    kept = contiguous_aligned(kept)
    blocks = contiguous_aligned(blocks)
    g = paged.geometry
    element = paged.caches[0].element_size()
    if element not in _AS_INT:
        raise ValueError(f"cannot move KV elements of {element} bytes")
    rows, k = kept.shape
    heads = paged.caches[0].shape[1]
    _move_paged_kernel[(len(paged.caches), rows, heads)](
        paged.pointers, kept, blocks, k, kept.stride(0), blocks.stride(0), paged.block_size,
        g.block, g.head, g.head_dim, g.key_offset, g.key_slot, g.key_dim, g.value_offset, g.value_slot, g.value_dim,
        ELEM=_AS_INT[element], ALIGNED=paged.aligned, BLOCK_N=32,
        BLOCK_D=triton.next_power_of_2(g.head_dim),
    )


JIT_KERNELS = {"paged_move": _move_paged_kernel}  # by name, for dynts.kernels.compiled_variants
