"""Which implementation an eviction-event kernel runs: Triton on CUDA when importable, torch elsewhere.

``DYNTS_KERNELS`` overrides the choice: ``auto`` (default), ``torch`` (always the reference path) or
``triton`` (always Triton; on a CPU this needs ``TRITON_INTERPRET=1`` set before ``triton`` is first
imported, which runs the kernels in Triton's interpreter, ~1000x slower: for tests only).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["ALIGNMENT", "BACKEND_ENV", "BACKENDS", "backend_for", "contiguous_aligned", "triton_available"]

BACKEND_ENV = "DYNTS_KERNELS"
BACKENDS = ("auto", "torch", "triton")
ALIGNMENT = 16  # bytes: the address alignment the Triton kernels are compiled for (Triton's own specialisation)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the ``triton`` package can be found (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a kernel whose operands live where ``tensor`` does."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r} must be one of {BACKENDS}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise ValueError(f"{BACKEND_ENV}=triton but triton is not installed; pip install triton or unset {BACKEND_ENV}")
        if not tensor.is_cuda and not _interpreting():
            raise ValueError(
                f"{BACKEND_ENV}=triton on a {tensor.device.type} tensor needs TRITON_INTERPRET=1 "
                "(set before triton is imported); or unset it to use the torch path"
            )
        return "triton"
    return "triton" if tensor.is_cuda and triton_available() else "torch"


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at an :data:`ALIGNMENT`-byte address (a copy where it is not). Triton compiles a kernel
    once per alignment of its pointer arguments: tensors passed through here always hit the variant compiled at
    start-up (a fresh allocation is always aligned; only a view at an odd offset is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()
