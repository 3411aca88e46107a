"""H2O, the heavy-hitter oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048).

A token's importance is the attention mass it has received so far: the cache adds, for every
decoded (and prefilled) query, its attention row to the per-slot accumulator, summed over layers and
heads (``TokenInfo.attention``; gathered from the new query rows only, see :mod:`dynts.attention`).
At an eviction event H2O keeps the local window (the most recent ``W_l`` tokens, H2O's "recent"
part) and fills the rest of ``n_keep`` with the heaviest hitters. As in the DynTS comparison (paper
C.3) the local window and ``n_keep`` are the ones every method shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Evictor, TokenInfo, keep_top, local_and_question_mask, register
from .options import KeepsQuestion, SelectsPerHead, check_flag


@register("h2o")
@dataclass
class H2O(KeepsQuestion, SelectsPerHead, Evictor):
    """Keep the local window + the tokens with the largest accumulated attention.

    Args:
        per_head: each KV head of each layer keeps its own top ``n_keep`` from its own statistics
            (the paper's granularity); ``False``: one set for all layers and heads.
        keep_question: also protect the prompt (off in H2O; an option for ablations).

    Uses ``info.attention`` ``[b, n]``: attention received by each slot, summed over layers, heads
    and every query since the slot entered the cache.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"attention"})

    keep_question: bool = False
    per_head: bool = False

    def __post_init__(self) -> None:
        check_flag("keep_question", self.keep_question)
        check_flag("per_head", self.per_head)

    def select(self, info: TokenInfo) -> torch.Tensor:
        if info.attention is None:
            raise RuntimeError("H2O needs accumulated attention; the cache must record 'attention'")
        protected = local_and_question_mask(info, self.keep_question)
        return keep_top(info.attention.float().masked_fill(protected, float("inf")), info)
