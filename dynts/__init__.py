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
    "load",
    "make_evictor",
    "register",
]
__version__ = "0.1.0"
