"""The bounded KV cache for transformers 5.x (:class:`BoundedCache`) and how a model is driven with it
(:func:`attach`, :func:`build_cache`)."""

from .attach import attach, build_cache
from .bounded import BoundedCache
from .parts import CacheStats
from .layers import BoundedLayer, StaticBoundedLayer, incoming_tokens
from .retire import RowRetirement
from .scores import PredictorScores

__all__ = ["BoundedCache", "BoundedLayer", "CacheStats", "PredictorScores", "RowRetirement", "StaticBoundedLayer", "attach", "build_cache",
           "incoming_tokens"]
