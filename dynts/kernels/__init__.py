"""Eviction-event kernels: a torch reference everywhere, Triton on CUDA where it is installed.

Every kernel has a torch path and a Triton path with the same signature; :func:`backend_for` picks
one per call (``DYNTS_KERNELS=auto|torch|triton`` overrides it). The Triton module is imported only
when its path is taken, so importing ``dynts`` never imports ``triton``. :func:`warm_up_kernels` compiles an
engine's kernels at start-up (once: budgets and round widths are run-time values).
"""

from .compact import compact_, compact_torch_
from .dispatch import BACKEND_ENV, backend_for, triton_available
from .paged import PagedKV, SlotGeometry
from .select import keep_top_indices, keep_top_torch
from .warm_up import compiled_variants, warm_up_kernels

__all__ = [
    "BACKEND_ENV",
    "PagedKV",
    "SlotGeometry",
    "backend_for",
    "compact_",
    "compiled_variants",
    "compact_torch_",
    "keep_top_indices",
    "keep_top_torch",
    "triton_available",
    "warm_up_kernels",
]
