"""The pipeline's model loading: :func:`dynts.load` itself (one loading path for every module).

``model_path`` / ``load_tokenizer`` are :func:`dynts.models.resolve_path` /
:func:`dynts.models.load_tokenizer` (word-level testbed tokenizers load as saved, hub ids come
from the local HF cache, adapter directories load their base + adapter).
"""

from __future__ import annotations

from typing import Any

import torch

from dynts.models import load_tokenizer
from dynts.models import resolve_path as model_path

__all__ = ["load_model", "load_tokenizer", "model_path"]


def load_model(name_or_path: str, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, **options: Any):
    """``(model, tokenizer)`` in eval mode, offline: ``dynts.load(name_or_path, dtype=..., device=..., **options)``
    (``device_map``, ``attn_implementation``, ``adapter``... as in :func:`dynts.models.load`)."""
    import dynts

    return dynts.load(name_or_path, dtype=dtype, device=device, **options)
