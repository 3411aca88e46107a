"""DynTS dual-window selection (DynTS paper, section 4.2, Fig. 4).

Budget ``B = W_q + W_s + W_l``: the question window (the prompt, importance ``+inf``) is never
evicted, the local window (the last ``W_l`` tokens) is always kept, and when the cache reaches ``B``
the selection window keeps its top-k tokens by the importance the predictor assigned to each token
(``k = retention * W_s``; the cache turns retention into ``n_keep``).

Answer tokens (the thinking delimiter and what follows it) are protected up to a share of the
selection capacity ``C = n_keep - W_q - W_l``: the ``floor(answer_share * C)`` most recent answer
tokens outside the local window are kept like the question; older answer tokens compete with the
thinking tokens by their predictor score. Since ``W_q + W_l + floor(answer_share * C) <= n_keep``,
the protected slots always fit and the question window survives answers of any length (protecting
every answer token, as a plain ``+inf``, would let a long answer push the question out through
``keep_top``'s tie rule, which prefers recent slots). The paper does not say how answers are treated
(R1 answers run to hundreds of tokens); this bound is our policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Evictor, Segment, TokenInfo, keep_top, recent_mask, register
from .options import check_flag

SELECTIONS = ("top", "bottom", "random")


@register("dynts")
@dataclass
class DynTS(Evictor):
    """Keep question + local window + top-scoring thinking tokens.

    Args:
        selection: ``"top"`` (DynTS), or the ablations ``"bottom"`` (T-Bottom) and ``"random"``
            (T-Random) from the paper's Table 2.
        keep_question: protect the question window (ablation: ``False``).
        keep_local: protect the local window (ablation: ``False``).
        keep_answer: protect answer tokens (the delimiter and what follows), up to ``answer_share``.
        answer_share: fraction in [0, 1] of the selection capacity ``n_keep - W_q - W_l`` that the
            most recent answer tokens outside the local window may hold protected; the rest of the
            answer competes as thinking tokens do. ``0`` = answers are never protected beyond the
            local window.
        seed: seed of the ``"random"`` selection.

    Uses ``info.scores`` ``[b, n]`` (predictor output per token).
    """

    requires: ClassVar[frozenset[str]] = frozenset({"scores"})

    selection: str = "top"
    keep_question: bool = True
    keep_local: bool = True
    keep_answer: bool = True
    answer_share: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} must be one of {SELECTIONS}")
        for name in ("keep_question", "keep_local", "keep_answer"):
            check_flag(name, getattr(self, name))
        share = self.answer_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"answer_share={share!r} must lie in [0, 1] (e.g. 0.5 of the selection capacity)")
        self._generator: torch.Generator | None = None

    def select(self, info: TokenInfo) -> torch.Tensor:
        assert info.scores is not None, "DynTS needs predictor scores"
        if self.selection == "top":
            priority = info.scores.float().nan_to_num(nan=float("-inf"))
        elif self.selection == "bottom":
            priority = -info.scores.float().nan_to_num(nan=float("inf"))
        else:
            device = info.positions.device
            if self._generator is None or self._generator.device != device:  # drawn where the scores live
                self._generator = torch.Generator(device).manual_seed(self.seed)
            priority = torch.rand(info.shape, generator=self._generator, device=device)
        protected = torch.zeros_like(info.valid)
        if self.keep_question:
            protected |= info.segments == Segment.QUESTION
        if self.keep_local:
            protected |= recent_mask(info, info.local_window)
        if self.keep_answer:
            protected |= self.protected_answer(info, protected)
        return keep_top(priority.masked_fill(protected, float("inf")), info)

    def protected_prefix(self, question_length: int) -> int:
        return question_length if self.keep_question else 0

    def answer_capacity(self, info: TokenInfo) -> int:
        """Answer tokens protected beyond the windows: ``floor(answer_share * (n_keep - W_q - W_l))``."""
        return math.floor(self.answer_share * max(0, info.n_keep - info.question_length - info.local_window))

    def protected_answer(self, info: TokenInfo, protected: torch.Tensor) -> torch.Tensor:
        """``[b, n]`` True on the most recent :meth:`answer_capacity` answer slots not already
        ``protected`` (the question and local windows)."""
        answer = (info.segments == Segment.ANSWER) & ~protected
        newest_first = answer.flip(-1).long().cumsum(-1).flip(-1)  # 1 on the most recent answer slot
        return answer & (newest_first <= self.answer_capacity(info))
