"""Per-request eviction in a paged KV cache, independent of the serving engine.

:class:`EvictionSettings` says what a request runs (method, budget, local window, retention,
predictor); :class:`SlotTracker` holds every request's slot metadata, applies the event rule, calls
the :class:`~dynts.evictors.Evictor` and returns the kept slots; :func:`copy_plan` turns them into the
physical rows that move. The transformers engine (:mod:`dynts.serving`) and the vLLM plugin
(:mod:`dynts.vllm`) are thin adapters over it.
"""

from .settings import SERVED_STATISTICS, EvictionSettings, serving_methods
from .slots import RequestSlots, SlotTable
from .tracker import EvictionGroup, Forward, SlotTracker, copy_plan

__all__ = [
    "SERVED_STATISTICS",
    "EvictionGroup",
    "EvictionSettings",
    "Forward",
    "RequestSlots",
    "SlotTable",
    "SlotTracker",
    "copy_plan",
    "serving_methods",
]
