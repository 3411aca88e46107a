"""Where vLLM's paged caches keep a slot's keys and values, one entry per attention-backend layout.

A slot is ``block_id * block_size + offset``. Per layout there are two descriptions of the same thing:

* a :class:`~dynts.kernels.paged.SlotGeometry` (:func:`geometry_for`): the strides the worker's eviction round
  moves every layer's kept slots with (:class:`dynts.kernels.PagedKV`: one Triton launch on CUDA);
* a slot copy (:func:`layout_for`): ``src`` -> ``dst`` physical slots (1-D int64 tensors of equal length) in one
  layer's cache tensor, in place, the right-hand side gathered before anything is written -- the reference the
  geometry is checked against, itself checked against vLLM's own cache writers on tensors of the exact shape
  (``tests/test_vllm_layouts.py``).

The plugin refuses a backend that has no entry here.

| backend (ISA) | tensor ``[blocks, kv_heads, block_size, 2 * head]`` holds, per block and head |
|---|---|
| ``CPU_ATTN`` (``vec``, ``vec16``: AVX2 / AVX-512 without AMX) | keys dimension-major ``[head, block_size]``, then values slot-major ``[block_size, head]`` |
| ``FLASH_ATTN`` (and ``TRITON_ATTN``: the same logical view) | ``[block_size, 2 * head]`` as a logical view (keys then values per slot); strides may permute it |
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.paged import SlotGeometry

__all__ = ["GEOMETRIES", "LAYOUTS", "SlotCopy", "copy_slots_cpu_vec", "copy_slots_paged", "geometry_for",
           "layout_for"]

SlotCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]


def _split(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def copy_slots_paged(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
    """FlashAttention's logical view ``[blocks, kv_heads, block_size, 2 * head]``: one slot is
    ``kv[b, :, s, :]`` (keys and values of every head), whatever the physical strides."""
    (bs, ss), (bd, sd) = _split(src, block_size), _split(dst, block_size)
    kv[bd, :, sd] = kv[bs, :, ss]


def copy_slots_cpu_vec(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
    """vLLM's CPU attention (``vec``/``vec16`` kernels): within a block and head the keys are stored
    dimension-major ``[head, block_size]`` and the values slot-major ``[block_size, head]``."""
    blocks, heads, size, twice = kv.shape
    if size != block_size or not kv.is_contiguous():
        raise ValueError(f"CPU KV cache of shape {tuple(kv.shape)} is not a contiguous [blocks, heads, {block_size}, 2*head]")
    head = twice // 2
    halves = kv.view(blocks, heads, 2, block_size * head)
    keys = halves[:, :, 0].view(blocks, heads, head, block_size)
    values = halves[:, :, 1].view(blocks, heads, block_size, head)
    (bs, ss), (bd, sd) = _split(src, block_size), _split(dst, block_size)
    keys[bd, :, :, sd] = keys[bs, :, :, ss]
    values[bd, :, sd] = values[bs, :, ss]


def geometry_paged(kv: torch.Tensor) -> SlotGeometry:
    """FlashAttention's logical view ``[blocks, kv_heads, block_size, 2 * head]``, any strides: keys are content
    ``0 .. head - 1`` of the slot, values ``head .. 2 * head - 1``."""
    block, head, slot, content = kv.stride()
    half = kv.shape[3] // 2
    return SlotGeometry(block, head, half, 0, slot, content, half * content, slot, content)


def geometry_cpu_vec(kv: torch.Tensor) -> SlotGeometry:
    """vLLM's CPU attention: per block and head, keys ``[head, block_size]`` then values ``[block_size, head]``."""
    blocks, heads, size, twice = kv.shape
    if not kv.is_contiguous():
        raise ValueError(f"CPU KV cache of shape {tuple(kv.shape)} is not contiguous")
    half = twice // 2
    return SlotGeometry(kv.stride(0), kv.stride(1), half, 0, 1, size, size * half, half, 1)


# (backend name, CPU ISA or None) -> slot copy / geometry. Only layouts with a test on their exact shape.
LAYOUTS: dict[tuple[str, str | None], SlotCopy] = {
    ("CPU_ATTN", "vec"): copy_slots_cpu_vec,
    ("CPU_ATTN", "vec16"): copy_slots_cpu_vec,
    ("FLASH_ATTN", None): copy_slots_paged,
    ("TRITON_ATTN", None): copy_slots_paged,
}
GEOMETRIES: dict[tuple[str, str | None], Callable[[torch.Tensor], SlotGeometry]] = {
    ("CPU_ATTN", "vec"): geometry_cpu_vec,
    ("CPU_ATTN", "vec16"): geometry_cpu_vec,
    ("FLASH_ATTN", None): geometry_paged,
    ("TRITON_ATTN", None): geometry_paged,
}


def geometry_for(backend: str, isa: str | None, kv: torch.Tensor) -> SlotGeometry:
    """The slot geometry of one layer's cache ``kv`` under an attention backend, or a clear error."""
    return GEOMETRIES[_key(backend, isa)](kv)


def layout_for(backend: str, isa: str | None = None) -> SlotCopy:
    """The slot copy of an attention backend (``isa``: the CPU kernel's), or a clear error."""
    return LAYOUTS[_key(backend, isa)]


def _key(backend: str, isa: str | None) -> tuple[str, str | None]:
    key = (backend, isa if backend == "CPU_ATTN" else None)
    if key not in LAYOUTS:
        known = sorted(f"{b}" + (f"/{i}" if i else "") for b, i in LAYOUTS)
        raise NotImplementedError(
            f"dynts.vllm has no tested KV slot layout for attention backend {backend!r}"
            + (f" (CPU kernel {isa!r})" if backend == "CPU_ATTN" else "")
            + f"; supported: {known}. Serve this model without dynts, or pick a supported backend "
            "(e.g. --attention-backend FLASH_ATTN on GPU)"
        )
    return key
