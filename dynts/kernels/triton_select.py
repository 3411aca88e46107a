"""Triton path of :func:`dynts.kernels.keep_top_indices`: the ``n_keep`` best slots of each row, tiled.

One program per row walks the row in tiles of ``TILE`` slots (never the whole row at once, so a row of 64k
slots neither spills registers nor compiles a kernel of its own):

1. the threshold: the largest 32-bit order key ``T`` with ``#{key >= T} >= n_keep``, by bisection over the key
   space (32 passes over the row, each counting ``key >= mid`` tile by tile);
2. one pass counts the slots above ``T`` and the slots tied at ``T``;
3. one pass writes the kept slots in ascending order: every slot above ``T``, and of the tied ones the
   ``n_keep - #above`` most recent (a running count of ties carried from tile to tile), each at its running
   output position (a cumulative sum carried from tile to tile).

The order key maps float32 priorities onto ``[0, 2^32)`` preserving their order: pads (``~valid``) are
``-inf``, ``-0.0`` ties with ``0.0``, every ``NaN`` ties above ``+inf`` -- the total order of
:func:`dynts.kernels.select.keep_top_torch` (torch's stable descending sort read newest-first), so both paths
return the same indices bit for bit.

Compiled once per device. The tile is a compile-time constant (:data:`KEEP_TOP_TILE`) and the row length, the
budget and the strides are run-time values that Triton does not specialise on (``do_not_specialize``); the
pointers are kept 16-byte aligned (a misaligned view is copied first), so every call reuses the kernel that
:func:`dynts.kernels.warm_up.warm_up_kernels` compiled at start-up, whatever the budget.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import contiguous_aligned

__all__ = ["JIT_KERNELS", "KEEP_TOP_TILE", "keep_top_triton"]

KEEP_TOP_TILE = 2048  # slots a program holds at once (8 per thread at 8 warps)


@triton.jit
def _order_keys(prio_row, valid_row, index, n):
    """int64 order keys of the slots ``index`` of one row: ``[0, 2^32)`` in priority order, ``-1`` past ``n``."""
    inside = index < n
    p = tl.load(prio_row + index, mask=inside, other=0.0).to(tl.float32)
    valid = tl.load(valid_row + index, mask=inside, other=0) != 0
    p = tl.where(valid, p, float("-inf"))
    p = tl.where(p == 0.0, 0.0, p)  # -0.0 ties with 0.0
    # order-preserving map float32 -> [0, 2^32): flip the magnitude bits of negatives, shift by 2^31
    bits = p.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
    key = tl.where(p != p, 4294967295, key)  # NaN above +inf, all NaNs tie
    return tl.where(inside, key, -1)  # past the row: below everything


@triton.jit(do_not_specialize=["n", "n_keep", "prio_stride", "valid_stride", "out_stride"])
def _keep_top_kernel(
    prio_ptr,  # float32 [b, n]
    valid_ptr,  # int8 [b, n]
    out_ptr,  # int64 [b, n_keep]
    n,
    n_keep,
    prio_stride,
    valid_stride,
    out_stride,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    prio_row = prio_ptr + row * prio_stride
    valid_row = valid_ptr + row * valid_stride
    out_row = out_ptr + row * out_stride
    offs = tl.arange(0, TILE)
    # 1. threshold: the largest T with #{key >= T} >= n_keep
    lo = tl.full([], 0, tl.int64)
    hi = tl.full([], 4294967295, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        count = tl.full([], 0, tl.int32)
        for start in range(0, n, TILE):
            key = _order_keys(prio_row, valid_row, start + offs, n)
            count += tl.sum((key >= mid).to(tl.int32), axis=0)
        ok = count >= n_keep
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    # 2. how many are above it, how many tie at it
    above_total = tl.full([], 0, tl.int32)
    tied_total = tl.full([], 0, tl.int32)
    for start in range(0, n, TILE):
        key = _order_keys(prio_row, valid_row, start + offs, n)
        above_total += tl.sum((key > lo).to(tl.int32), axis=0)
        tied_total += tl.sum((key == lo).to(tl.int32), axis=0)
    need = n_keep - above_total  # tied slots kept: the most recent ones
    # 3. write the kept slots in ascending order
    tied_seen = tl.full([], 0, tl.int32)
    written = tl.full([], 0, tl.int32)
    for start in range(0, n, TILE):
        index = start + offs
        key = _order_keys(prio_row, valid_row, index, n)
        tied = (key == lo).to(tl.int32)
        tied_before = tied_seen + tl.cumsum(tied, axis=0) - tied  # ties at earlier slots of the row
        keep = (key > lo) | ((tied != 0) & (tied_total - tied_before <= need))
        kept = keep.to(tl.int32)
        slot = written + tl.cumsum(kept, axis=0) - 1
        tl.store(out_row + slot, index.to(tl.int64), mask=keep)
        tied_seen += tl.sum(tied, axis=0)
        written += tl.sum(kept, axis=0)


def keep_top_triton(priority: torch.Tensor, valid: torch.Tensor, n_keep: int, tile: int = KEEP_TOP_TILE) -> torch.Tensor:
    """Triton path of :func:`dynts.kernels.keep_top_indices` (same signature and result; ``1 <= n_keep <= n``).

    Args:
        priority: ``[b, n]`` float (any float dtype; compared in float32).
        valid: ``[b, n]`` bool, False on padding.
        n_keep: slots kept per row.
        tile: slots a program holds at once, a power of two >= 16 (tests use small tiles to walk many).

    Returns ``[b, n_keep]`` int64 ascending slot indices.
    """
    b, n = priority.shape
    if not 1 <= n_keep <= n:
        raise ValueError(f"n_keep={n_keep} must be in [1, n={n}]")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile={tile} must be a power of two >= 16")
    out = torch.empty(b, n_keep, dtype=torch.int64, device=priority.device)
    if b == 0:
        return out
    priority = contiguous_aligned(priority.float())
    valid = contiguous_aligned(valid.to(torch.int8))
    _keep_top_kernel[(b,)](
        priority, valid, out, n, n_keep, priority.stride(0), valid.stride(0), out.stride(0),
        TILE=tile, num_warps=max(1, min(8, tile // 256)),
    )
    return out


JIT_KERNELS = {"keep_top": _keep_top_kernel}  # by name, for dynts.kernels.compiled_variants
