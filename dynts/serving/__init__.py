"""Serving with eviction: per-request bounded KV caches inside transformers' continuous batching.

``dynts.generate_batch`` runs a list of prompts; :func:`init_evicting_batching` builds a manager for
requests arriving over time; ``dynts serve`` exposes it as an OpenAI-compatible server. See
``docs/serving.md``.
"""

from .compat import SUPPORTED_TRANSFORMERS, check_transformers_version, missing_internals

check_transformers_version()

from .batch import ServedResult, generate_batch  # noqa: E402
from .manager import EvictingBatchingManager, init_evicting_batching  # noqa: E402
from .processor import EvictingBatchProcessor  # noqa: E402
from ..core import EvictionSettings, serving_methods  # noqa: E402

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "EvictingBatchProcessor",
    "EvictingBatchingManager",
    "EvictionSettings",
    "ServedResult",
    "check_transformers_version",
    "generate_batch",
    "init_evicting_batching",
    "missing_internals",
    "serving_methods",
]
