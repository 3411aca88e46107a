"""SnapKV, decode-time variant (Li et al., NeurIPS 2024, arXiv:2404.14469; the decode-time use as in
the DynTS paper 6.1 and the R-KV code base).

SnapKV votes with an *observation window*: the attention rows of the last ``w`` queries. A cached
token's score is the attention those queries paid it (summed over the window, and here over layers
and heads, since one selection serves all of them), smoothed along the sequence with a 1-D pooling
of ``kernel_size`` so that the neighbours of a hit survive with it (SnapKV's clustering). Prefill
SnapKV runs this once on the prompt; the decode-time variant runs it at every eviction event on the
last ``w`` decoded tokens. The local window ``W_l`` and ``n_keep`` are the ones every method shares
(DynTS paper C.3); the window's slots are not scored (as SnapKV slices its window off before pooling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import Evictor, TokenInfo, keep_top, local_and_question_mask, register
from .options import KeepsQuestion, SelectsPerHead, check_flag, check_pooling, check_window


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the slots, stride 1, ``kernel_size // 2`` zero padding on both sides.

    ``scores``: ``[b, m]`` (non-negative). ``"avg"`` divides by ``kernel_size`` at the edges too
    (``count_include_pad``), as ``F.avg_pool1d`` does in SnapKV. Returns ``[b, m]``.
    """
    if kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    x = scores.unsqueeze(1)
    pad = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(x, kernel_size, stride=1, padding=pad).squeeze(1)
    return F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=True).squeeze(1)


def pooled_outside_window(scores: torch.Tensor, info: TokenInfo, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool ``scores`` ``[b, n]`` over the slots before the local window (the window itself is left as is)."""
    m = max(0, info.shape[1] - info.local_window)
    out = scores.clone()
    out[:, :m] = pool_scores(scores[:, :m], kernel_size, pooling)
    return out


@register("snapkv")
@dataclass
class SnapKV(KeepsQuestion, SelectsPerHead, Evictor):
    """Keep the local window + the tokens the observation window attends to most (pooled).

    Args:
        observation_window: ``w``, the most recent queries that vote (the cache records this many
            attention rows; R-KV's decode setting: 8).
        kernel_size: odd pooling kernel along the sequence (default 7, as in the R-KV code base;
            SnapKV's prompt setting uses 5-7).
        pooling: ``"max"`` (default) or ``"avg"``.
        per_head: each KV head of each layer keeps its own top ``n_keep`` from its own statistics
            (the paper's granularity); ``False``: one set for all layers and heads.
        keep_question: also protect the prompt (off in SnapKV; an option for ablations).

    Uses ``info.window_attention`` ``[b, W, n]`` (the last ``W >= w`` query rows, summed over
    layers and heads).
    """

    requires: ClassVar[frozenset[str]] = frozenset({"window_attention"})

    observation_window: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    keep_question: bool = False
    per_head: bool = False

    def __post_init__(self) -> None:
        check_window(self.observation_window)
        check_pooling(self.kernel_size, self.pooling)
        check_flag("keep_question", self.keep_question)
        check_flag("per_head", self.per_head)

    def select(self, info: TokenInfo) -> torch.Tensor:
        if info.window_attention is None:
            raise RuntimeError("SnapKV needs window attention; the cache must record 'window_attention'")
        votes = info.window_attention[:, -self.observation_window :].float().sum(1)  # [b, n]
        priority = pooled_outside_window(votes, info, self.kernel_size, self.pooling)
        protected = local_and_question_mask(info, self.keep_question)
        return keep_top(priority.masked_fill(protected, float("inf")), info)
