"""The DynTS importance predictor (paper 4.1): an MLP ``d -> 2d -> d/2 -> 1`` on the final hidden state."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from .io import write_atomic

__all__ = ["ImportancePredictor", "PredictorConfig", "final_norm"]

CONFIG_NAME = "predictor_config.json"
WEIGHTS_NAME = "predictor.safetensors"
ACTIVATIONS = {"softplus": nn.Softplus, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module producing ``model``'s final hidden state (the LM head's input), which the predictor reads."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for name in ("norm", "final_layernorm", "ln_f"):
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    raise ValueError(f"cannot find the final norm of {type(model).__name__}; DynTS needs it to score tokens")


@dataclass
class PredictorConfig:
    """Everything needed to rebuild a predictor.

    Args:
        hidden_size: ``d``, the backbone's final hidden size.
        activation: one of ``softplus`` (the authors' code), ``relu``, ``gelu``, ``silu``, ``tanh``.
        backbone: name or path of the backbone the predictor was trained on.
        label_transform: how training labels were normalised (see ``trainers``), for the record.
        extra: free-form training hyperparameters, saved for provenance.
    """

    hidden_size: int
    activation: str = "softplus"
    backbone: str = ""
    label_transform: str = "log1p-zscore"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_size, int) or self.hidden_size < 2:
            raise ValueError(f"hidden_size={self.hidden_size!r} must be an int >= 2 (the backbone's hidden size)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} must be one of {sorted(ACTIVATIONS)}")


class ImportancePredictor(nn.Module):
    """Predicts one importance score per token from the backbone's final hidden state.

    Input ``[..., d]`` hidden states, output ``[...]`` scores (float32).
    """

    def __init__(self, config: PredictorConfig | int, **kwargs):
        super().__init__()
        if isinstance(config, int):
            config = PredictorConfig(hidden_size=config, **kwargs)
        self.config = config
        d, act = config.hidden_size, ACTIVATIONS[config.activation]
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), act(), nn.Linear(2 * d, d // 2), act(), nn.Linear(d // 2, 1))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

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
