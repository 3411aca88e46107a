"""Fixed set: keep exactly a given set of absolute positions per row (oracle and Pareto experiments).

The DynTS paper's Pareto experiment (section 3.2, appendix B.1) keeps the question and the top /
bottom / random p% of thinking tokens by answer-to-thinking importance, then lets the model answer.
Running it through this evictor means the retained context is built by the same
:class:`~dynts.cache.BoundedCache` compaction users run, not by a copy of it.

Every bounded cache keeps the same ``n_keep`` slots per row at an event (paper C.3), so a set must
fit that count: :func:`dynts.core.budget.fixed_budget` returns the :class:`~dynts.core.budget.Budget` under which
``n_keep`` equals the set size. Rows whose set is smaller than ``n_keep`` (batches of unequal sets)
fill the gap with padding slots, which stay masked; if a row lacks padding to fill it, the event
raises rather than keep a token outside the set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .base import Evictor, TokenInfo, register

__all__ = ["FixedPositions"]


@register("fixed")
@dataclass
class FixedPositions(Evictor):
    """Keep the slots whose absolute position is in ``keep[row]``; evict every other slot.

    Args:
        keep: per row, the absolute positions to keep (indices into the padded sequence, as in
            ``TokenInfo.positions``). A single row applies to every row of the batch. Positions not
            stored (never seen, or evicted earlier) are ignored.

    Shapes: ``info.*`` are ``[b, n]``; returns ``[b, n_keep]`` ascending slot indices: the stored
    slots of the set, then padding slots when the set is smaller than ``n_keep``.
    """

    keep: Sequence[Sequence[int]]

    def __post_init__(self) -> None:
        if isinstance(self.keep, torch.Tensor):
            self.keep = self.keep.tolist()
        rows = list(self.keep)
        if not rows or any(isinstance(r, (int, float)) for r in rows):
            raise ValueError(
                "keep must be a non-empty list of rows, each a list of absolute positions "
                "(e.g. keep=[[0, 1, 2, 7]]; wrap a single row in a list)"
            )
        clean = []
        for i, row in enumerate(rows):
            row = [int(p) for p in row]
            if any(p < 0 for p in row):
                raise ValueError(f"keep[{i}] holds negative positions; positions are absolute indices >= 0")
            clean.append(sorted(set(row)))
        self.keep = clean

    def constants(self) -> dict[str, tuple[int, ...]]:
        return {f"keep{r}": tuple(row) for r, row in enumerate(self.keep)}

    def members(self, info: TokenInfo) -> torch.Tensor:
        """``[b, n]`` True on stored real slots whose position is in the set of their row."""
        b = info.shape[0]
        if len(self.keep) not in (1, b):
            raise ValueError(f"keep has {len(self.keep)} rows but the batch has {b}; pass one row or one per row")
        device = info.positions.device
        out = torch.zeros(info.shape, dtype=torch.bool, device=device)
        for r in range(b):
            out[r] = torch.isin(info.positions[r], self.constant(f"keep{r if len(self.keep) > 1 else 0}", device))
        return out & info.valid

    def select(self, info: TokenInfo) -> torch.Tensor:
        member = self.members(info)
        count = member.sum(-1)
        pads = (~info.valid).sum(-1)
        for r in range(info.shape[0]):
            c, free = int(count[r]), int(pads[r])
            if c > info.n_keep or c + free < info.n_keep:
                raise ValueError(
                    f"row {r} stores {c} positions of keep (+{free} padding slots) but the cache keeps "
                    f"n_keep={info.n_keep} per row; build the cache with "
                    f"dynts.core.budget.fixed_budget(kept={c}, ...) so n_keep equals the set size"
                )
        # members first, then padding fillers (still masked after the event), then nothing else
        priority = member.long() * 2 + (~info.valid).long()
        order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
        return order[:, : info.n_keep].sort(dim=-1).values
