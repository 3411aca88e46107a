"""Compile an engine's eviction kernels at start-up, so that no request waits on Triton's compiler.

Triton compiles a kernel at its first launch for each new combination of compile-time constants, integer
specialisations and pointer alignments; seconds on a GPU. The eviction round's two kernels are written to be
compiled once per engine: keep-top's tile is a constant and the budget, row length and strides are run-time
values (:mod:`dynts.kernels.triton_select`); the paged move is compiled for the engine's caches and not for the
round's widths (:mod:`dynts.kernels.triton_paged`). :func:`warm_up_kernels` launches each once, when the engine
sets up its KV cache, without touching it; :func:`compiled_variants` counts what Triton has compiled, so a check
can show that an eviction round after the warm-up compiles nothing.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .dispatch import backend_for
from .paged import PagedKV
from .select import keep_top_indices

__all__ = ["compiled_variants", "warm_up_kernels"]


def warm_up_kernels(paged: PagedKV | None = None, device: torch.device | str | None = None, *,
                    blocks_dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    """Compile the eviction round's Triton kernels now: the paged move for ``paged``'s caches and keep-top.

    Call it once per worker after its KV cache is allocated and before the first request (in vLLM: after
    ``initialize_kv_cache`` has built the worker hooks; the caches' addresses, dtype, head size, block size and
    layer count are what the move is compiled for). Nothing is read from or written to the caches: the move's
    launch keeps every slot in place (all its loads and stores masked off), keep-top runs on a tiny row of its own.
    On the torch path (CPU, or ``DYNTS_KERNELS=torch``) there is nothing to compile and nothing runs.

    Args:
        paged: the engine's caches (:class:`PagedKV`); ``None`` compiles keep-top only (a transformers cache).
        device: where keep-top runs; defaults to ``paged``'s device.
        blocks_dtype: the dtype of the block lists the rounds pass to :meth:`PagedKV.move_` (the worker's pinned
            staging uploads int64).

    Returns ``{"backend": "triton" | "torch", "kernels": [names launched], "seconds": wall time}``.
    """
    if paged is None and device is None:
        raise ValueError("warm_up_kernels needs paged= (the engine's caches) or device= (keep-top only)")
    device = torch.device(device) if device is not None else paged.device
    started = time.perf_counter()
    probe = torch.zeros(1, device=device)
    kernels: list[str] = []
    if backend_for(probe) == "triton":
        if paged is not None and paged.warm_up(blocks_dtype):
            kernels.append("paged_move")
        priority = torch.arange(64, dtype=torch.float32, device=device)[None]
        keep_top_indices(priority, torch.ones_like(priority, dtype=torch.bool), 16)
        kernels.append("keep_top")
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # compiled and run: the time is the compile's, once, at start-up
    return {"backend": "triton" if kernels else "torch", "kernels": kernels, "seconds": time.perf_counter() - started}


def compiled_variants() -> dict[str, int | None]:
    """How many compiled variants Triton holds of each eviction kernel, over every device (``None`` where this
    Triton's JIT keeps its cache elsewhere, or under ``TRITON_INTERPRET=1``, which compiles nothing). A round
    that compiles nothing leaves the counts unchanged. Imports Triton: call it only where Triton runs."""
    from . import triton_kernels, triton_paged, triton_select

    counts: dict[str, int | None] = {}
    kernels = {**triton_paged.JIT_KERNELS, **triton_select.JIT_KERNELS, **triton_kernels.JIT_KERNELS}
    for name, kernel in kernels.items():
        caches = getattr(kernel, "device_caches", None)
        try:
            counts[name] = sum(len(entry[0]) for entry in caches.values()) if caches is not None else None
        except (TypeError, IndexError):  # another Triton's layout
            counts[name] = None
    return counts
