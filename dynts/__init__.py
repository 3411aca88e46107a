"""dynts: keep only the KV entries of the thinking tokens that matter (DynTS, KV-Rescue)."""

# First: refuse an unsupported transformers release (ImportError naming it and the fix) before any
# module builds on its cache contract (dynts.hf_compat).
from . import hf_compat  # noqa: F401  (isort: skip)
from .core.budget import Budget
from .cache import BoundedCache
from .evictors import Evictor, Segment, TokenInfo, available_methods, make_evictor, register
from .cache import attach, build_cache
from .generate import GenerationResult, generate
from .predictor import ImportancePredictor, PredictorConfig


def load(name_or_path: str, **kwargs):
    """Load ``(model, tokenizer)`` offline: a bundled name, a local HF directory, a hub id in the
    local HF cache or a PEFT adapter directory; ``dtype``, ``device``, ``device_map``,
    ``attn_implementation``, ``adapter``... (see :func:`dynts.models.load`)."""
    from .models import load as load_model

    return load_model(name_or_path, **kwargs)


def generate_batch(model, tokenizer=None, prompts=(), **kwargs):
    """Continuous batching with a bounded KV cache per request (see :func:`dynts.serving.generate_batch`)."""
    from .serving import generate_batch as _generate_batch

    return _generate_batch(model, tokenizer, prompts, **kwargs)


__all__ = [
    "BoundedCache",
    "Budget",
    "Evictor",
    "GenerationResult",
    "ImportancePredictor",
    "PredictorConfig",
    "Segment",
    "TokenInfo",
    "attach",
    "available_methods",
    "build_cache",
    "generate",
    "generate_batch",
    "load",
    "make_evictor",
    "register",
]
__version__ = "0.1.0"
