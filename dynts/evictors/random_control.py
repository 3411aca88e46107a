"""Random control: question + local window + thinking tokens kept at random.

The control every learned or attention-based selection must beat (Random Attention, arXiv
2609.03430: keeping the prompt and evicting at random matched the strongest scorer on four models).
It protects exactly what DynTS protects (the question window and the local window) and fills the
rest of ``n_keep`` at random, so a table comparing the two isolates what the predictor adds.

Each token draws one uniform priority from a counter-based hash of ``(seed, row, position)`` when
it is first seen, and keeps it: at every event the kept set is the top of those priorities, i.e. a
uniform sample of the thinking that has left the local window (redrawing at every event, as the
paper's T-Random ablation ``dynts:selection=random`` does, would favour recent tokens: a token must
survive every draw since it arrived). The row is identified by its question tokens and positions
are counted from its first question token, so a row's kept set does not depend on which other rows
share its batch, on left padding, or on the engine (``generate``, transformers serving, vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Evictor, Segment, TokenInfo, keep_top, recent_mask, register

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """MurmurHash3's 32-bit finalizer on int64 tensors (or host ints) holding 32-bit values (bijective, well
    mixed; a tensor's wrapped products keep the same low 32 bits as the exact host ints)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def row_keys(info: TokenInfo) -> torch.Tensor:
    """``[b]`` 32-bit key of each row from its question tokens (order-sensitive)."""
    question = info.segments == Segment.QUESTION
    rank = question.long().cumsum(-1)  # 1-based position inside the question
    per_token = mix32(info.token_ids.long() * 0x9E3779B1 + rank)
    return (per_token * question).sum(-1) & MASK32


def uniform_priority(info: TokenInfo, seed: int) -> torch.Tensor:
    """``[b, n]`` float in [0, 1): a fixed uniform draw per (seed, row, position from the question start)."""
    question = info.segments == Segment.QUESTION
    big = torch.iinfo(torch.long).max
    start = info.positions.masked_fill(~question, big).amin(-1, keepdim=True)
    start = torch.where(start == big, torch.zeros_like(start), start)  # a row without question: absolute positions
    offset = (info.positions - start).clamp_min(0)
    salt = mix32(seed + 0x632BE5AB)  # a host int: the same 32 bits as on a tensor, nothing uploaded
    h = mix32(mix32(offset + salt) ^ row_keys(info)[:, None])
    return h.float() / 2.0**32


@register("random")
@dataclass
class RandomControl(Evictor):
    """Keep the question window, the local window and a uniform random sample of the rest.

    Args:
        seed: seed of the draw; the same seed gives the same kept set for the same row.

    Needs no statistics. Shapes: ``info.*`` are ``[b, n]``; returns ``[b, n_keep]`` ascending slot
    indices.
    """

    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative int (e.g. 0)")

    def select(self, info: TokenInfo) -> torch.Tensor:
        protected = (info.segments == Segment.QUESTION) | recent_mask(info, info.local_window)
        return keep_top(uniform_priority(info, self.seed).masked_fill(protected, float("inf")), info)

    def protected_prefix(self, question_length: int) -> int:
        return question_length
