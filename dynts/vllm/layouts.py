"""Moving KV slots inside vLLM's paged caches, one function per attention-backend layout.

A slot is ``block_id * block_size + offset``. Every function copies the slots ``src`` to ``dst``
(1-D int64 tensors of equal length, on the cache's device) in one layer's cache tensor, in place;
the right-hand side is gathered before anything is written, and callers pass rows in
:func:`dynts.core.copy_plan` order in bounded chunks. Each layout is unit-tested on tensors of its
exact shape (``tests/test_vllm_layouts.py``); the plugin refuses a backend that has none here.

| backend (ISA) | tensor ``[blocks, kv_heads, block_size, 2 * head]`` holds, per block and head |
|---|---|
| ``CPU_ATTN`` (``vec``, ``vec16``: AVX2 / AVX-512 without AMX) | keys dimension-major ``[head, block_size]``, then values slot-major ``[block_size, head]`` |
| ``FLASH_ATTN`` (and ``TRITON_ATTN``: the same logical view) | ``[block_size, 2 * head]`` as a logical view (keys then values per slot); strides may permute it |
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["COPY_CHUNK", "LAYOUTS", "SlotCopy", "copy_slots_cpu_vec", "copy_slots_paged", "layout_for"]

COPY_CHUNK = 8192  # slots moved per layer per copy: bounds the scratch of one eviction round

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


# (backend name, CPU ISA or None) -> slot copy. Only layouts with a test on their exact shape.
LAYOUTS: dict[tuple[str, str | None], SlotCopy] = {
    ("CPU_ATTN", "vec"): copy_slots_cpu_vec,
    ("CPU_ATTN", "vec16"): copy_slots_cpu_vec,
    ("FLASH_ATTN", None): copy_slots_paged,
    ("TRITON_ATTN", None): copy_slots_paged,
}


def layout_for(backend: str, isa: str | None = None) -> SlotCopy:
    """The slot copy of an attention backend (``isa``: the CPU kernel's), or a clear error."""
    key = (backend, isa if backend == "CPU_ATTN" else None)
    if key not in LAYOUTS:
        known = sorted(f"{b}" + (f"/{i}" if i else "") for b, i in LAYOUTS)
        raise NotImplementedError(
            f"dynts.vllm has no tested KV slot layout for attention backend {backend!r}"
            + (f" (CPU kernel {isa!r})" if backend == "CPU_ATTN" else "")
            + f"; supported: {known}. Serve this model without dynts, or pick a supported backend "
            "(e.g. --attention-backend FLASH_ATTN on GPU)"
        )
    return LAYOUTS[key]
