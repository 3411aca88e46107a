"""The DynTS importance predictor (paper 4.1): an MLP ``d -> 2d -> d/2 -> 1`` on the final hidden state.

A predictor is bound to the base model it was trained on: :class:`BaseModelFingerprint` (name,
revision, layer count, hidden and vocabulary sizes, a hash of the final-norm weights) is saved in
its config, and :meth:`ImportancePredictor.check_base_model` refuses any other model. Models of one
hidden size (R1-Distill-Llama-8B, Qwen3-8B, Llama-3.1-8B: 4096) are told apart by the hash.
:func:`find_predictor` looks a trained predictor up by its base model (``predictor="auto"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from .io import write_atomic

__all__ = [
    "BaseModelFingerprint",
    "ImportancePredictor",
    "PREDICTOR_PATH_ENV",
    "PREDICTOR_PREFIX",
    "PredictorConfig",
    "final_norm",
    "find_predictor",
    "model_basename",
    "norm_weight_hash",
    "predictor_label",
]

CONFIG_NAME = "predictor_config.json"
WEIGHTS_NAME = "predictor.safetensors"
CARD_NAME = "README.md"
PREDICTOR_PREFIX = "dynts-predictor-"  # a predictor for base model NAME lives in dynts-predictor-NAME
PREDICTOR_PATH_ENV = "DYNTS_PREDICTOR_PATH"  # extra directories searched by find_predictor (os.pathsep-separated)
ACTIVATIONS = {"softplus": nn.Softplus, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module producing ``model``'s final hidden state (the LM head's input), which the predictor reads."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for name in ("norm", "final_layernorm", "ln_f"):
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    raise ValueError(f"cannot find the final norm of {type(model).__name__}; DynTS needs it to score tokens")


def norm_weight_hash(weight: torch.Tensor | None) -> str | None:
    """sha256 of a final-norm weight ``[d]``, the same for every dtype and device it was loaded in.

    The weight is rounded to bfloat16 and hashed as little-endian float32 CPU bytes: one checkpoint
    loaded in float32 or bfloat16, on CPU or any GPU, hashes alike (a bfloat16 checkpoint also in
    float16). ``None`` for a missing or meta (not yet loaded) weight.
    """
    if weight is None or weight.device.type == "meta":
        return None
    values = weight.detach().to(torch.bfloat16).to("cpu", torch.float32).contiguous().numpy().astype("<f4")
    return hashlib.sha256(values.tobytes()).hexdigest()


def model_basename(name_or_path: str | os.PathLike) -> str:
    """The model's own name: ``org/NAME``, ``.../NAME``, or ``NAME`` from an HF cache snapshot path
    (``.../models--org--NAME/snapshots/<commit>``)."""
    parts = Path(str(name_or_path).rstrip("/")).parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 1 < len(parts) and parts[i + 1] == "snapshots":
            return part.split("--")[-1]
    return parts[-1] if parts else ""


@dataclass
class BaseModelFingerprint:
    """The base model a predictor was trained on.

    Attributes:
        name_or_path: the name or path it was loaded by (for people; models are compared by the
            fields below, so a moved checkpoint still matches).
        revision: the hub commit, when known.
        num_hidden_layers / hidden_size / vocab_size: from the (text) config.
        final_norm_sha256: :func:`norm_weight_hash` of the final-norm weight, ``None`` when unknown.
    """

    name_or_path: str = ""
    revision: str | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    final_norm_sha256: str | None = None

    @classmethod
    def from_config(
        cls, config: Any, final_norm_weight: torch.Tensor | None = None, name_or_path: str | None = None,
        revision: str | None = None,
    ) -> "BaseModelFingerprint":
        """From a transformers config (and the final norm's weight ``[d]``): what an engine that
        holds no HF model object (vLLM) has."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            name_or_path=str(name_or_path or getattr(config, "_name_or_path", "") or ""),
            revision=revision or getattr(config, "_commit_hash", None),
            num_hidden_layers=getattr(text, "num_hidden_layers", None),
            hidden_size=getattr(text, "hidden_size", None),
            vocab_size=getattr(text, "vocab_size", None),
            final_norm_sha256=norm_weight_hash(final_norm_weight),
        )

    @classmethod
    def from_model(cls, model: nn.Module, name_or_path: str | None = None, revision: str | None = None) -> "BaseModelFingerprint":
        """From a Hugging Face model (any dtype, device or device_map)."""
        weight = getattr(final_norm(model), "weight", None)
        name = name_or_path or getattr(model, "name_or_path", None)
        return cls.from_config(model.config, weight if isinstance(weight, torch.Tensor) else None, name, revision)

    def differences(self, other: "BaseModelFingerprint") -> list[str]:
        """The fields in which ``other`` is another model (fields unknown on either side are skipped;
        names only count when neither side knows the weights' hash)."""
        out = [
            f"{name} {mine} != {theirs}"
            for name in ("num_hidden_layers", "hidden_size", "vocab_size", "final_norm_sha256")
            if (mine := getattr(self, name)) is not None and (theirs := getattr(other, name)) is not None and mine != theirs
        ]
        if (self.final_norm_sha256 is None or other.final_norm_sha256 is None) and self.name_or_path and other.name_or_path:
            if model_basename(self.name_or_path).lower() != model_basename(other.name_or_path).lower():
                out.append(f"name {model_basename(self.name_or_path)!r} != {model_basename(other.name_or_path)!r}")
        return out

    def describe(self) -> str:
        rev = f"@{self.revision[:12]}" if self.revision else ""
        return (f"{self.name_or_path or '<unnamed>'}{rev} (layers {self.num_hidden_layers}, hidden {self.hidden_size}, "
                f"vocab {self.vocab_size}, final norm {str(self.final_norm_sha256)[:12]})")


@dataclass
class PredictorConfig:
    """Everything needed to rebuild a predictor.

    Args:
        hidden_size: ``d``, the backbone's final hidden size.
        activation: one of ``softplus`` (the authors' code), ``relu``, ``gelu``, ``silu``, ``tanh``.
        backbone: name or path of the backbone the predictor was trained on.
        label_transform: how training labels were normalised (see ``trainers``), for the record.
        label: the importance label it learned (a name of ``dynts.importance.LABELS``: ``answer`` is the paper's
            answer-to-thinking attention); ``""`` when not recorded.
        extra: free-form training hyperparameters, saved for provenance.
        base_model: the :class:`BaseModelFingerprint` of the backbone (``None``: unbound, only the
            hidden size is checked); a dict is converted.
    """

    hidden_size: int
    activation: str = "softplus"
    backbone: str = ""
    label_transform: str = "log1p-zscore"
    extra: dict = field(default_factory=dict)
    base_model: BaseModelFingerprint | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_size, int) or self.hidden_size < 2:
            raise ValueError(f"hidden_size={self.hidden_size!r} must be an int >= 2 (the backbone's hidden size)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} must be one of {sorted(ACTIVATIONS)}")
        if not isinstance(self.label, str):
            raise ValueError(f"label={self.label!r} must be a string: the importance label the predictor learned "
                             "(a name of dynts.importance.LABELS), or '' when not recorded")
        if isinstance(self.base_model, dict):
            self.base_model = BaseModelFingerprint(**self.base_model)
        if self.base_model is not None and self.base_model.hidden_size not in (None, self.hidden_size):
            raise ValueError(
                f"base_model.hidden_size={self.base_model.hidden_size} != hidden_size={self.hidden_size}: "
                "the fingerprint belongs to another backbone"
            )


class ImportancePredictor(nn.Module):
    """Predicts one importance score per token from the backbone's final hidden state.

    Input ``[..., d]`` hidden states, output ``[...]`` scores (float32).
    """

    def __init__(self, config: PredictorConfig | int, **kwargs):
        super().__init__()
        if isinstance(config, int):
            config = PredictorConfig(hidden_size=config, **kwargs)
        self.config = config
        self._accepted: list[BaseModelFingerprint] = []  # models accepted by check_base_model(strict=False)
        d, act = config.hidden_size, ACTIVATIONS[config.activation]
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), act(), nn.Linear(2 * d, d // 2), act(), nn.Linear(d // 2, 1))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def check_base_model(self, model: BaseModelFingerprint, *, strict: bool = True) -> None:
        """Raise ``ValueError`` unless ``model`` is the base model this predictor was trained on.

        ``strict=False`` warns instead, once per model (later checks against it pass silently).
        A predictor without a fingerprint (``config.base_model is None``) checks the hidden size only.
        """
        base = self.config.base_model
        if base is None:
            problems = [] if model.hidden_size in (None, self.hidden_size) else [f"hidden_size {self.hidden_size} != {model.hidden_size}"]
        else:
            problems = base.differences(model)
        if not problems or model in self._accepted:
            return
        trained = base.describe() if base is not None else f"a backbone of hidden size {self.hidden_size}"
        message = (
            f"this predictor was trained on {trained}, not on {model.describe()} ({'; '.join(problems)}): "
            "its scores would be noise on another model"
        )
        if strict:
            raise ValueError(f"{message}; train one for this model (docs/pipeline.md) or pass strict=False to use it anyway")
        warnings.warn(f"{message}; used anyway (strict=False)", stacklevel=3)
        self._accepted.append(model)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden states have size {hidden_states.shape[-1]} but the predictor expects "
                f"hidden_size={self.hidden_size}; use a predictor trained on this backbone"
            )
        weight = self.mlp[0].weight
        return self.mlp(hidden_states.to(weight.dtype)).squeeze(-1).float()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``predictor.safetensors`` + ``predictor_config.json`` into ``directory`` (atomically)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        write_atomic(out / WEIGHTS_NAME, save(tensors, metadata={"format": "pt"}))
        write_atomic(out / CONFIG_NAME, json.dumps(asdict(self.config), indent=2))
        return out

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu") -> "ImportancePredictor":
        """Load a predictor saved by :meth:`save_pretrained` (safetensors only; nothing is unpickled)."""
        path = Path(directory)
        cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not cfg_file.is_file() or not weights.is_file():
            raise ValueError(
                f"predictor={str(path)!r} must be a directory with {CONFIG_NAME} and {WEIGHTS_NAME} "
                "(written by ImportancePredictor.save_pretrained)"
            )
        try:
            config = PredictorConfig(**json.loads(cfg_file.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"{cfg_file} is not a valid predictor config: {err}") from None
        model = cls(config)
        try:
            state = load_file(str(weights), device=str(map_location))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{weights} is corrupted or not a safetensors file: {err}") from None
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"{weights} does not match {cfg_file}: {err}") from None
        return model


def _hub_cache_dir() -> Path:
    """The local HF hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, else huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_snapshots(repo_name: str) -> list[Path]:
    """Snapshot directories of cached hub repos ``*/repo_name`` (``refs/main`` first), nothing downloaded."""
    found = []
    for repo in sorted(_hub_cache_dir().glob(f"models--*--{repo_name}")):
        ref = repo / "refs" / "main"
        snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
        snapshots += sorted((repo / "snapshots").glob("*"))
        found += [s for s in snapshots if (s / CONFIG_NAME).is_file()][:1]
    return found


def _search_dirs(search_dirs: Sequence[str | os.PathLike] | None) -> list[Path]:
    from .models import checkpoints_dir

    env = [p for p in os.environ.get(PREDICTOR_PATH_ENV, "").split(os.pathsep) if p]
    return list(dict.fromkeys(Path(p).expanduser() for p in [*(search_dirs or ()), *env, checkpoints_dir()]))


def _training_hint(base: str) -> str:
    from .models import configs_dir

    configs = sorted((configs_dir() / "predictor").glob("*.pipeline.yaml"))
    names = (f"/{base.lower()}\n", f" {base.lower()}\n")  # `model: .../NAME` or `model: NAME`
    match = next((c for c in configs if any(n in c.read_text().lower() for n in names)), None)
    config = str(match) if match else "configs/predictor/<your model>.pipeline.yaml (copy r1-distill-qwen-7b.pipeline.yaml)"
    return f"dynts pipeline --config {config}   # with export_dir: checkpoints/{PREDICTOR_PREFIX}{base}"


def find_predictor(
    model: str | os.PathLike | BaseModelFingerprint, search_dirs: Sequence[str | os.PathLike] | None = None
) -> Path:
    """The directory of a trained predictor for ``model`` (``predictor="auto"``), offline.

    Looked up, in order: ``dynts-predictor-<model basename>`` in ``search_dirs``, in the directories
    of ``$DYNTS_PREDICTOR_PATH`` (``os.pathsep``-separated) and in the shipped checkpoints
    (:func:`dynts.models.checkpoints_dir`); a hub repo ``<org>/dynts-predictor-<basename>`` in the
    local HF cache; then any predictor in those directories whose saved fingerprint names this
    model or (given a :class:`BaseModelFingerprint`) has its final-norm hash.

    Raises ``ValueError`` with the training command when none exists.
    """
    fingerprint = model if isinstance(model, BaseModelFingerprint) else BaseModelFingerprint(name_or_path=str(model))
    base = model_basename(fingerprint.name_or_path)
    dirs = _search_dirs(search_dirs)
    if base:
        named = [d / f"{PREDICTOR_PREFIX}{base}" for d in dirs] + _hub_snapshots(f"{PREDICTOR_PREFIX}{base}")
        for candidate in named:
            if (candidate / CONFIG_NAME).is_file():
                return candidate
    for directory in dirs:
        for candidate in sorted(directory.glob(f"*/{CONFIG_NAME}")):
            try:
                saved = json.loads(candidate.read_text()).get("base_model") or {}
            except (OSError, json.JSONDecodeError):
                continue
            same_hash = fingerprint.final_norm_sha256 and saved.get("final_norm_sha256") == fingerprint.final_norm_sha256
            same_name = base and model_basename(saved.get("name_or_path") or "").lower() == base.lower()
            if same_hash or same_name:
                return candidate.parent
    raise ValueError(
        f"predictor='auto' found no predictor for {base or fingerprint.describe()!r}: looked for "
        f"{PREDICTOR_PREFIX}{base} in {[str(d) for d in dirs]} (add directories with ${PREDICTOR_PATH_ENV} or "
        f"search_dirs=...) and in the HF cache {str(_hub_cache_dir())}. Train one: {_training_hint(base)}"
    )


def predictor_label(directory: str | os.PathLike) -> str:
    """The importance label a saved predictor learned: its config's ``label``; for a predictor saved before the config
    held it, the label its model card names (the card's ``Labels:`` line cites the ``dynts.importance`` module of its
    label: the package itself for ``answer``); ``""`` when neither says."""
    directory = Path(directory)
    label = json.loads((directory / CONFIG_NAME).read_text()).get("label")
    if label:
        return label
    card = directory / CARD_NAME
    found = re.search(r"^Labels: .*?\(`dynts\.importance(?:\.(\w+))?`\)", card.read_text() if card.is_file() else "",
                      re.MULTILINE)
    return "" if found is None else found.group(1) or "answer"


def load_predictor(
    predictor: ImportancePredictor | str | Path,
    model: torch.nn.Module | Any,
    *,
    strict: bool = True,
    final_norm_weight: torch.Tensor | None = None,
    name_or_path: str | None = None,
    search_dirs: Sequence[str | Path] | None = None,
) -> ImportancePredictor:
    """Load a predictor for ``model``, check it was trained on that model, and place it.

    Args:
        predictor: an :class:`ImportancePredictor`, its directory, or ``"auto"``
            (:func:`dynts.predictor.find_predictor`: ``dynts-predictor-<model basename>`` in
            ``search_dirs``, ``$DYNTS_PREDICTOR_PATH``, the shipped checkpoints or the HF cache).
        model: the Hugging Face model, or only its config (``PretrainedConfig``) where no model
            object exists (vLLM); then pass ``final_norm_weight`` too.
        strict: a predictor of another base model raises ``ValueError``; ``False`` warns instead.
        final_norm_weight: with a config: the final norm's weight ``[d]`` (its hash identifies
            the model; the predictor moves to its device).
        name_or_path: the model's name for messages and ``"auto"`` (default: the config's).
        search_dirs: extra directories for ``"auto"``.

    Returns the predictor in eval mode on the final norm's device (a sharded model's last stage).
    """
    if isinstance(model, torch.nn.Module):
        fingerprint = BaseModelFingerprint.from_model(model, name_or_path)
        param = next(final_norm(model).parameters(), None)
        device = param.device if param is not None else next(model.parameters()).device
    else:
        fingerprint = BaseModelFingerprint.from_config(model, final_norm_weight, name_or_path)
        device = final_norm_weight.device if final_norm_weight is not None else None
    if isinstance(predictor, str) and predictor == "auto":
        predictor = find_predictor(fingerprint, search_dirs)
    if isinstance(predictor, (str, Path)):
        path, predictor = predictor, ImportancePredictor.from_pretrained(predictor)
        if predictor.config.base_model is None:
            warnings.warn(
                f"predictor {str(path)!r} records no base model (its config has no base_model): only its hidden "
                "size is checked; add one with `python -m trainers.predictor_card --predictor DIR --backbone MODEL`",
                stacklevel=2,
            )
    if not isinstance(predictor, ImportancePredictor):
        raise ValueError(f"predictor must be an ImportancePredictor, a directory or 'auto', got {type(predictor).__name__}")
    predictor.check_base_model(fingerprint, strict=strict)
    return (predictor.to(device) if device is not None else predictor).eval()
