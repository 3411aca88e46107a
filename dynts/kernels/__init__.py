"""Eviction-event kernels: a torch reference everywhere, Triton on CUDA where it is installed."""

from .compact import compact_

__all__ = ["compact_"]
