"""Decode cost model: FLOPs per token, KV bytes, break-even eviction volume, eviction crossover.

Two papers, one accounting (FLOPs of one decoded token, multiply-add = 2 FLOPs):

* dense part ``C_dense = 2P`` (all projections and the MLP; KV-Rescue App. D, Eq. 12);
* attention part ``C_attn(l) = 4 L d_q l`` over the ``l`` cached tokens (``QK^T`` and the value
  sum, each ``d_q l`` multiply-adds per layer; ``d_q = heads * head_dim``, ``= d`` for the
  papers' models);
* the DynTS importance predictor, an MLP ``d -> 2d -> d/2 -> 1`` on the new token's final hidden
  state: ``C_pred = 2 (2d^2 + d^2 + d/2) = 6 d^2 + d``;
* the eviction event (top-k over at most ``B`` slots + compaction), amortised over the ``K`` tokens
  between events.

DynTS section 5 (the equations were lost from our copy of the text and are reconstructed from the
prose and from the printed break-even value): with prefill ``M``, decode step ``i``, budget ``B`` and
eviction volume ``K``, the eviction count is ``n_i = max(0, floor((M + i - B) / K) + 1)`` and the
effective length ``S_i = M + i - n_i K``. Theorem 5.1: the full cache costs
``F_base(i) = 2P + 4Ld(M + i)`` and DynTS ``F_opt(i) = 2P + C_pred + 4Ld S_i``, so
``F_base - F_opt = 4 L d n_i K - C_pred``. Corollary 5.2 (break-even): DynTS saves compute once
``K >= C_pred / (4 L d n_i) ~= 1.5 d / (n_i L)`` -- ``K = 900 >= 192`` for R1-Qwen-7B
(``d = 3584``, ``L = 28``, ``n_i = 1``).

KV-Rescue appendix D: KV bytes per token ``m_kv = 2 L h_kv d_h b`` (Eq. 8: 56 KiB for
Qwen2.5-Math-7B, 28 KiB for 1.5B, 320 KiB for 72B in bf16); an evictor that re-scores every step
costs ``C_evict = 2P + (1 + alpha) 4 L d B'`` (Eq. 13, ``B' = B + w``, ``alpha`` in ``[1.5, 3]``),
cheaper than the full cache beyond the crossover ``l* = (1 + alpha) B'`` (Eq. 14, ~2500 tokens for
``B' = 640``, ``alpha = 2.9``); a full-context helper adds the fraction ``rho`` of Eq. 15.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "ModelShape",
    "break_even_volume",
    "crossover_length",
    "decode_flops",
    "dynts_decode_flops",
    "effective_length",
    "eviction_count",
    "evicted_decode_flops",
    "helper_fraction",
    "kvrescue_memory",
    "predictor_flops",
    "selection_flops",
]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "int8": 1}
KIB = 1024


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that its decode cost depends on.

    Args:
        num_layers: ``L``.
        hidden_size: ``d``.
        num_heads / num_kv_heads / head_dim: query heads, key-value heads ``h_kv``, ``d_h``.
        intermediate_size: MLP width (gated MLP: 3 matrices, as in Llama/Qwen/Mistral).
        vocab_size: embedding rows.
        tie_word_embeddings: LM head shares the embedding matrix.
        qkv_bias: biases on q/k/v (Qwen2).
        bytes_per_element: ``b`` of the KV cache (2 for bf16/fp16, 4 for fp32).
        num_parameters: ``P``; estimated from the shapes when ``None``.
        name: for printing.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bytes_per_element: int = 2
    num_parameters: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "bytes_per_element"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field_name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_parameters is not None and self.num_parameters <= 0:
            raise ValueError(f"num_parameters={self.num_parameters!r} must be positive or None (estimate)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, *, name: str = "", **overrides: Any) -> "ModelShape":
        """From a Hugging Face config (``config.json`` dict or a ``PretrainedConfig``).

        ``overrides`` replace fields (e.g. ``bytes_per_element=2`` for a bf16 cache of an fp32 checkpoint).
        """
        if not isinstance(config, Mapping):
            config = config.to_dict()
        if isinstance(config.get("text_config"), Mapping):  # multimodal wrappers
            config = {**config["text_config"], "torch_dtype": config.get("torch_dtype", config.get("dtype"))}
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"config lacks {missing}; pass a decoder-only causal LM config (Llama/Qwen/Mistral family)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
        fields = dict(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config.get("vocab_size") or 0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            bytes_per_element=DTYPE_BYTES.get(dtype, 2),
            name=name or str(config.get("_name_or_path") or config.get("model_type") or ""),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, **overrides: Any) -> "ModelShape":
        """From a ``config.json`` file, a directory holding one, or a :func:`dynts.load` model name."""
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            from .models import BUNDLED, resolve_path  # a bundled name (smollm2-135m converts once, ~30 s)

            if str(name_or_path) not in BUNDLED:
                raise ValueError(
                    f"{name_or_path!r} is neither a config.json, a directory with one, nor a bundled model {list(BUNDLED)}"
                )
            path = resolve_path(str(name_or_path)) / "config.json"
        return cls.from_config(json.loads(path.read_text()), name=overrides.pop("name", str(name_or_path)), **overrides)

    # ------------------------------------------------------------------ sizes
    @property
    def query_width(self) -> int:
        """``d_q = heads * head_dim`` (the width the attention matmuls run over)."""
        return self.num_heads * self.head_dim

    @property
    def parameters(self) -> int:
        """``P``: ``num_parameters`` if given, else counted from the shapes (gated MLP, RMSNorm)."""
        if self.num_parameters is not None:
            return self.num_parameters
        d, dq, dkv = self.hidden_size, self.query_width, self.num_kv_heads * self.head_dim
        per_layer = 2 * d * dq + 2 * d * dkv + 3 * d * self.intermediate_size + 2 * d
        if self.qkv_bias:
            per_layer += dq + 2 * dkv
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + d

    @property
    def kv_bytes_per_token(self) -> int:
        """``m_kv = 2 L h_kv d_h b``: bytes of K and V one token holds (KV-Rescue Eq. 8)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    # ------------------------------------------------------------------ FLOPs
    @property
    def dense_flops(self) -> int:
        """``C_dense = 2P`` FLOPs per decoded token."""
        return 2 * self.parameters

    def attention_flops(self, length: float) -> float:
        """``C_attn(l) = 4 L d_q l`` FLOPs of one token attending to ``length`` cached tokens."""
        return 4 * self.num_layers * self.query_width * length

    def kv_bytes(self, length: float) -> float:
        """KV bytes of ``length`` cached tokens (one sequence)."""
        return self.kv_bytes_per_token * length

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "parameters": self.parameters, "kv_bytes_per_token": self.kv_bytes_per_token}


# ---------------------------------------------------------------------- DynTS (section 5)
def predictor_flops(hidden_size: int) -> int:
    """FLOPs of the importance predictor ``d -> 2d -> d/2 -> 1`` on one token: ``6 d^2 + d``."""
    d = hidden_size
    return 2 * (d * 2 * d + 2 * d * (d // 2) + d // 2)


def eviction_count(step: int, prefill: int, budget: int, volume: int) -> int:
    """``n_i = max(0, floor((M + i - B) / K) + 1)``: eviction events by decode step ``i``."""
    _check_volume(budget, volume)
    return max(0, (prefill + step - budget) // volume + 1)


def effective_length(step: int, prefill: int, budget: int, volume: int) -> int:
    """``S_i = M + i - n_i K``: cache entries at decode step ``i`` under eviction."""
    return prefill + step - eviction_count(step, prefill, budget, volume) * volume


def decode_flops(shape: ModelShape, length: float) -> float:
    """Full-cache FLOPs of one decoded token with ``length`` cached tokens: ``2P + 4 L d l``."""
    return shape.dense_flops + shape.attention_flops(length)


def selection_flops(stored: int) -> float:
    """Rough cost of one selection (a sort of ``stored`` priorities): ``stored * log2(stored)`` ops."""
    return stored * math.log2(max(stored, 2))


def dynts_decode_flops(
    shape: ModelShape, step: int, prefill: int, budget: int, volume: int, *, predictor: bool = True
) -> float:
    """DynTS FLOPs at decode step ``i``: dense + attention over ``S_i`` + predictor + amortised selection."""
    cost = shape.dense_flops + shape.attention_flops(effective_length(step, prefill, budget, volume))
    if predictor:
        cost += predictor_flops(shape.hidden_size)
    if prefill + step >= budget:
        cost += selection_flops(budget) / volume
    return cost


def break_even_volume(shape: ModelShape, events: int = 1, *, exact: bool = False) -> float:
    """Corollary 5.2: the smallest eviction volume ``K`` with a net FLOPs gain after ``events`` events.

    ``1.5 d / (n_i L)`` (the paper's form, predictor ~= ``6 d^2``); ``exact=True`` uses
    ``(6 d^2 + d) / (4 L d_q n_i)`` (adds < 0.01 token for the papers' models).
    """
    if events < 1:
        raise ValueError(f"events={events} must be >= 1 (the gain appears after the first eviction)")
    if exact:
        return predictor_flops(shape.hidden_size) / (4 * shape.num_layers * shape.query_width * events)
    return 1.5 * shape.hidden_size / (events * shape.num_layers)


# ---------------------------------------------------------------------- KV-Rescue (appendix D)
def evicted_decode_flops(shape: ModelShape, physical_budget: int, alpha: float) -> float:
    """Eq. 13: ``2P + (1 + alpha) 4 L d B'`` for an evictor that re-scores every step."""
    _check_alpha(alpha)
    return shape.dense_flops + (1 + alpha) * shape.attention_flops(physical_budget)


def crossover_length(physical_budget: int, alpha: float) -> float:
    """Eq. 14: ``l* = (1 + alpha) B'``, the context beyond which evicted decode is cheaper."""
    _check_alpha(alpha)
    if physical_budget <= 0:
        raise ValueError(f"physical_budget={physical_budget} must be positive (B' = B + w)")
    return (1 + alpha) * physical_budget


def helper_fraction(helper: ModelShape, base: ModelShape, length: float, physical_budget: int, alpha: float) -> float:
    """Eq. 15: ``rho`` = per-token cost of a full-context helper / an evicted base token."""
    return decode_flops(helper, length) / evicted_decode_flops(base, physical_budget, alpha)


def kvrescue_memory(
    base: ModelShape, helper: ModelShape, length: float, physical_budget: int, candidates: int
) -> tuple[float, float]:
    """Eq. 11: KV bytes of ``N`` candidates, ``(full-KV best-of-N, KV-Rescue)``."""
    full = candidates * base.kv_bytes(length)
    rescue = candidates * (base.kv_bytes(physical_budget) + helper.kv_bytes(length))
    return full, rescue


def _check_volume(budget: int, volume: int) -> None:
    if volume < 1 or volume > budget:
        raise ValueError(f"eviction volume K={volume} must lie in [1, budget={budget}]")


def _check_alpha(alpha: float) -> None:
    if alpha < 0:
        raise ValueError(f"alpha={alpha} must be >= 0 (KV-Rescue uses 1.5-3)")
