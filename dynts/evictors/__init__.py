"""Eviction methods. Each file registers one method; ``available_methods()`` lists them."""

from . import base
from . import dual_window, fixed, full, h2o, random_control, rkv, sepllm, snapkv, streamingllm, window  # noqa: F401  (registration side effects)
from .base import *  # noqa: F401,F403  (the contract: Evictor, TokenInfo, Segment, register, ...)
from .sepllm import separator_ids

__all__ = [*base.__all__, "separator_ids"]
