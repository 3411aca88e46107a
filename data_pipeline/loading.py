"""Load a model and its tokenizer for the pipeline (``dynts.load`` + a word-level tokenizer fix).

transformers 5 maps every ``model_type: qwen2`` directory to ``Qwen2Tokenizer`` in
``AutoTokenizer``, a byte-level BPE that silently mangles a word-level vocabulary such as the
testbed's. Directories whose ``tokenizer_config.json`` names the generic fast tokenizer class are
therefore read with ``PreTrainedTokenizerFast`` directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_model", "load_tokenizer", "model_path"]

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def model_path(name_or_path: str) -> Path:
    """The local directory of a ``dynts.load`` name or path."""
    from dynts.models import _resolve

    return _resolve(name_or_path)[0]


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = model_path(name_or_path)
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if cls in GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(name_or_path: str, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` in eval mode, offline."""
    import dynts

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model, _ = dynts.load(name_or_path, dtype=dtype, device=device)
    return model, load_tokenizer(name_or_path)
