"""The pipeline's model loading: :func:`dynts.load` itself (one loading path for every module).

``model_path`` / ``load_tokenizer`` are :func:`dynts.models.resolve_path` /
:func:`dynts.models.load_tokenizer` (word-level testbed tokenizers load as saved, hub ids come
from the local HF cache, adapter directories load their base + adapter).

Defaults are the 7B-32B ones: every stage loads a backbone in bfloat16 (:func:`default_dtype`)
unless it is a bundled toy (:data:`dynts.models.BUNDLED`: float32 on CPU), and takes a
``device_map`` to shard it; :func:`check_device_map` refuses a ``device_map`` inside a
multi-process (DDP) job.
"""

from __future__ import annotations

from typing import Any

import torch

from dynts.models import BUNDLED, load_tokenizer
from dynts.models import resolve_path as model_path

__all__ = ["check_device_map", "default_dtype", "is_bundled_toy", "load_model", "load_tokenizer", "model_path"]


def is_bundled_toy(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names one of the small bundled models (testbed, SmolLM2-135M)."""
    return str(name_or_path) in BUNDLED


def default_dtype(name_or_path: str, dtype: str | None) -> str:
    """``dtype`` when given; else ``float32`` for a bundled toy and ``bfloat16`` for every other backbone."""
    if dtype is not None:
        return dtype
    return "float32" if is_bundled_toy(name_or_path) else "bfloat16"


def check_device_map(device_map: Any, processes: int | str, where: str) -> None:
    """Raise ``ValueError`` for a ``device_map`` in a job of several processes (DDP): each rank would
    shard its own copy of the backbone over every GPU."""
    if device_map is None or str(processes) == "1":
        return
    raise ValueError(
        f"{where}: device_map={device_map!r} with {processes} processes (DDP) would shard every rank's copy "
        "of the backbone over all GPUs; use device_map with one process (devices: 1) for a backbone too big "
        "for one GPU, or device_map: null with several devices (one copy per GPU)"
    )


def load_model(name_or_path: str, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, **options: Any):
    """``(model, tokenizer)`` in eval mode, offline: ``dynts.load(name_or_path, dtype=..., device=..., **options)``
    (``device_map``, ``attn_implementation``, ``adapter``... as in :func:`dynts.models.load`)."""
    import dynts

    return dynts.load(name_or_path, dtype=dtype, device=device, **options)
