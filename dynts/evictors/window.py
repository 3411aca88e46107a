"""Local window: keep only the most recent tokens (DynTS paper, Table 1 "Window")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Evictor, Segment, TokenInfo, keep_top, register


@register("window")
@dataclass
class LocalWindow(Evictor):
    """Keeps the ``n_keep`` most recent tokens.

    Args:
        keep_question: also protect the prompt (a "question + recent" policy); off for the plain
            sliding window of the paper's baseline.
    """

    keep_question: bool = False

    def protected_prefix(self, question_length: int) -> int:
        return question_length if self.keep_question else 0

    def select(self, info: TokenInfo) -> torch.Tensor:
        priority = torch.arange(info.shape[1], device=info.positions.device).float().expand(info.shape)
        if self.keep_question:
            priority = priority.masked_fill(info.segments == Segment.QUESTION, float("inf"))
        return keep_top(priority, info)
