"""DynTS dual-window selection (DynTS paper, section 4.2, Fig. 4).

Budget ``B = W_q + W_s + W_l``: the question window (the prompt, importance ``+inf``) is never
evicted, the local window (the last ``W_l`` tokens) is always kept, and when the cache reaches ``B``
the selection window keeps its top-k tokens by the importance the predictor assigned to each token
(``k = retention * W_s``; the cache turns retention into ``n_keep``). Answer tokens after the thinking
delimiter are kept too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Evictor, Segment, TokenInfo, keep_top, recent_mask, register

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
        keep_answer: protect tokens after the thinking delimiter.
        seed: seed of the ``"random"`` selection.

    Uses ``info.scores`` ``[b, n]`` (predictor output per token).
    """

    requires: ClassVar[frozenset[str]] = frozenset({"scores"})

    selection: str = "top"
    keep_question: bool = True
    keep_local: bool = True
    keep_answer: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} must be one of {SELECTIONS}")
        self._generator: torch.Generator | None = None

    def select(self, info: TokenInfo) -> torch.Tensor:
        assert info.scores is not None, "DynTS needs predictor scores"
        if self.selection == "top":
            priority = info.scores.float().nan_to_num(nan=float("-inf"))
        elif self.selection == "bottom":
            priority = -info.scores.float().nan_to_num(nan=float("inf"))
        else:
            if self._generator is None:
                self._generator = torch.Generator().manual_seed(self.seed)
            priority = torch.rand(info.shape, generator=self._generator).to(info.positions.device)
        protected = torch.zeros_like(info.valid)
        if self.keep_question:
            protected |= info.segments == Segment.QUESTION
        if self.keep_answer:
            protected |= info.segments == Segment.ANSWER
        if self.keep_local:
            protected |= recent_mask(info, info.local_window)
        return keep_top(priority.masked_fill(protected, float("inf")), info)
