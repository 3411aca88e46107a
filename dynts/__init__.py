"""dynts: keep only the KV entries of the thinking tokens that matter (DynTS, KV-Rescue)."""

from .budget import Budget
from .cache import BoundedCache
from .evictors import Evictor, Segment, TokenInfo, available_methods, make_evictor, register
from .generate import GenerationResult, attach, build_cache, generate
from .predictor import ImportancePredictor, PredictorConfig


def load(name_or_path: str, **kwargs):
    """Load ``(model, tokenizer)``: a local HF directory, ``smollm2-135m`` or the bundled testbed."""
    from .models import load as _load

    return _load(name_or_path, **kwargs)


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
