"""Full cache: the no-eviction reference (plain ``transformers`` decoding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Evictor, TokenInfo, register


@register("full")
@dataclass
class FullCache(Evictor):
    """Keeps every token; the cache ignores the budget for this method."""

    bounded: ClassVar[bool] = False

    def select(self, info: TokenInfo) -> torch.Tensor:
        raise RuntimeError("the full cache never evicts; the cache must not ask it to select")
