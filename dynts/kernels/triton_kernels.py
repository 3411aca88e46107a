"""Triton kernels of the eviction event (imported only when the Triton path is taken).

* :func:`compact_triton_` moves the kept K/V slots of every layer to the front of its buffer, in
  place, in ONE launch: the grid is ``(buffers, b * h_kv)`` and each program walks one row. The kept
  slots are one ``[b, k]`` set for every buffer (token-level selection) or ``[b, L, h, k]`` (per layer
  and KV head): a program reads its indices at ``batch, layer of its buffer, head`` through strides
  (0 for the dimensions a token-level set does not have).
(Keep-top selection, the event's other kernel, is :mod:`dynts.kernels.triton_select`.)

In-place gather safety. ``kept`` is ascending with ``kept[i] >= i`` (``k <= length`` distinct
indices). Slot ``s`` is written only by output ``i = s`` and read only by the output ``j`` with
``kept[j] = s``, so ``j <= s``: a slot is never read after a *later* output wrote it. A program
walks its row front to back in tiles of ``BLOCK_N`` outputs; tile ``t`` reads slots ``>= t*BLOCK_N``
and writes slots ``< (t+1)*BLOCK_N``, so tiles ``< t`` never wrote what tile ``t`` reads. Inside a
tile a thread may read a slot another thread of the same tile writes (``kept[j] = i``, ``j < i``):
the whole tile is loaded, then ``tl.debug_barrier()`` (a CTA barrier), then stored. Rows (batch x
head x buffer) are disjoint, so programs never race with each other. Identity moves
(``kept[i] == i``, e.g. the protected question window) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["JIT_KERNELS", "compact_triton_"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit(do_not_specialize=["k", "kept_stride", "layer_stride", "head_stride"])  # the event's width: run-time
def _compact_kernel(
    table,  # int64 [n_buffers]: data pointers of the buffers (same shape, dtype, contiguous)
    layer_table,  # int64 [n_buffers]: each buffer's layer (its index into kept's layer dimension)
    kept_ptr,  # int64 [b, k] or [b, L, h, k]
    k,
    kept_stride,  # batch stride
    layer_stride,  # 0 for a token-level kept set
    head_stride,  # 0 for a token-level kept set
    n_heads,
    capacity,
    head_dim,
    DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    buf = tl.program_id(0)
    row = tl.program_id(1)  # b * n_heads + head
    batch = row // n_heads
    head = row % n_heads
    layer = tl.load(layer_table + buf)
    index_ptr = kept_ptr + batch * kept_stride + layer * layer_stride + head * head_stride
    base = tl.load(table + buf).to(tl.pointer_type(DTYPE))
    row_ptr = base + row.to(tl.int64) * capacity * head_dim
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    for start in range(0, k, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        nmask = offs < k
        src = tl.load(index_ptr + offs, mask=nmask, other=0)
        move = (nmask & (src != offs))[:, None] & dmask[None, :]
        vals = tl.load(row_ptr + src[:, None] * head_dim + offs_d[None, :], mask=move)
        tl.debug_barrier()  # every read of this tile happens before any write of it
        tl.store(row_ptr + offs[:, None] * head_dim + offs_d[None, :], vals, mask=move)


_TABLES: dict[tuple, torch.Tensor] = {}


def _device_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Device int64 tensor of ``values`` (buffer addresses, layer numbers), cached: preallocated buffers
    keep their addresses between events, so the host-to-device copy happens once, not at every event. Made
    outside inference mode: a cached table serves later calls whatever their mode."""
    key = (str(device), *values)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        with torch.inference_mode(False):
            table = _TABLES[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return table


def _pointer_table(group: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return _device_table(tuple(t.data_ptr() for t in group), device)


def compact_triton_(buffers: list[torch.Tensor], kept: torch.Tensor, length: int,
                    layers: list[int] | None = None) -> None:
    """Triton path of :func:`dynts.kernels.compact_` (same signature and result)."""
    kept = kept.contiguous()
    b, k = kept.shape[0], kept.shape[-1]
    per_head = kept.dim() == 4
    if per_head and (layers is None or len(layers) != len(buffers)):
        raise ValueError("a per-head kept [b, L, h, k] needs layers=[the layer of each buffer]")
    if k > length:
        raise ValueError(f"kept has {k} slots but only length={length} are live")
    groups: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
    for i, t in enumerate(buffers):
        if not t.is_contiguous() or t.dtype not in _TL_DTYPES or t.shape[0] != b or t.device != kept.device:
            raise ValueError(
                f"compact_triton_ needs contiguous {sorted(map(str, _TL_DTYPES))} buffers [b={b}, h, capacity, d] "
                f"on {kept.device}; got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if per_head and t.shape[1] != kept.shape[2]:
            raise ValueError(f"kept has {kept.shape[2]} heads per layer, a buffer {t.shape[1]}")
        group = groups.setdefault((tuple(t.shape), t.dtype), ([], []))
        group[0].append(t)
        group[1].append(layers[i] if per_head else 0)
    layer_stride, head_stride = (kept.stride(1), kept.stride(2)) if per_head else (0, 0)
    for (shape, dtype), (group, group_layers) in groups.items():  # one launch per layout; one in practice
        _, heads, capacity, head_dim = shape
        table = _pointer_table(group, kept.device)
        layer_table = _device_table(tuple(group_layers), kept.device)
        _compact_kernel[(len(group), b * heads)](
            table, layer_table, kept, k, kept.stride(0), layer_stride, head_stride, heads, capacity, head_dim,
            DTYPE=_TL_DTYPES[dtype], BLOCK_N=64, BLOCK_D=triton.next_power_of_2(head_dim),
        )


JIT_KERNELS = {"compact": _compact_kernel}  # by name, for dynts.kernels.compiled_variants
