"""StreamingLLM (Xiao et al., 2024): attention sinks + recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Evictor, TokenInfo, first_valid_mask, keep_top, register


@register("streamingllm")
@dataclass
class StreamingLLM(Evictor):
    """Keeps the first ``sink_size`` real tokens of each row and the most recent ones.

    Args:
        sink_size: number of initial "attention sink" tokens (paper default 4).
    """

    sink_size: int = 4

    def __post_init__(self) -> None:
        if self.sink_size < 0:
            raise ValueError(f"sink_size={self.sink_size} must be >= 0")

    def protected_prefix(self, question_length: int) -> int:
        return min(self.sink_size, question_length)

    def select(self, info: TokenInfo) -> torch.Tensor:
        priority = torch.arange(info.shape[1], device=info.positions.device).float().expand(info.shape)
        priority = priority.masked_fill(first_valid_mask(info, self.sink_size), float("inf"))
        return keep_top(priority, info)
