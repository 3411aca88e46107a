"""The bounded KV cache for transformers 5.x (:class:`BoundedCache`) and how a model is driven with it
(:func:`attach`, :func:`build_cache`)."""

from .attach import attach, build_cache
from .bounded import BoundedCache, BoundedLayer, CacheStats, incoming_tokens

__all__ = ["BoundedCache", "BoundedLayer", "CacheStats", "attach", "build_cache", "incoming_tokens"]
