"""Eviction methods. Each file registers one method; ``available_methods()`` lists them."""

from . import dual_window, fixed, full, h2o, random_control, rkv, sepllm, snapkv, streamingllm, window  # noqa: F401  (registration side effects)
from .base import (
    EVICTORS,
    Evictor,
    Segment,
    TokenInfo,
    available_methods,
    keep_top,
    make_evictor,
    recent_mask,
    register,
)
from .sepllm import separator_ids

__all__ = [
    "EVICTORS",
    "Evictor",
    "Segment",
    "TokenInfo",
    "available_methods",
    "keep_top",
    "make_evictor",
    "recent_mask",
    "register",
    "separator_ids",
]
