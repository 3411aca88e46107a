"""DynTS scores for a :class:`~dynts.cache.BoundedCache`: the predictor on each forward's final hidden states.

A prefill, a static decode step or (without deferral) any forward is scored at once. Eager decode steps
are deferred: their hidden states ``[b, 1, d]`` are kept in a ``[b, K, d]`` buffer (``K`` the eviction
volume) and scored in one batched predictor call at the next eviction event or when the scores are read
(:meth:`PredictorScores.flush`) -- the same scores from the same hidden states, without a per-step MLP.
"""

from __future__ import annotations

import torch

from .layout import Layout

__all__ = ["PredictorScores"]


class PredictorScores:
    """Predictor scores for a cache's slot table (set by :func:`dynts.attach`).

    Args:
        predictor: maps hidden states ``[b, q, d]`` to scores ``[b, q]``.
        defer: keep eager decode steps' hidden states for one batched call (see the module docstring).
    """

    def __init__(self, predictor: torch.nn.Module, defer: bool) -> None:
        self.predictor = predictor
        self.device = next(predictor.parameters()).device
        self.defer = defer
        self.hidden: torch.Tensor | None = None  # [b, slots, d] hidden states awaiting scores
        self.count = 0  # how many, for slots base ... base + count - 1
        self.base = 0
        self.rows: torch.Tensor | None = None  # [r] the rows of ``hidden`` the cache still holds (None: all)

    def score(self, hidden: torch.Tensor, layout: Layout, scores: torch.Tensor, n_keep: int | None) -> torch.Tensor | None:
        """Scores ``[b, q]`` of the forward in flight (``layout``) from its final hidden states ``[b, q, d]``, to
        write now; ``None`` when they are kept for :meth:`flush` into ``scores`` ``[b, n]`` (the slot table's)."""
        hidden = hidden.to(self.device)  # the final norm may sit on another device (sharded models)
        b, q, d = hidden.shape
        if layout.static_step or not self.defer or q != 1:
            self.flush(scores)
            with torch.no_grad():
                return self.predictor(hidden)
        if self.hidden is None or (self.rows is None and self.hidden.shape[0] != b) or self.hidden.shape[2] != d:
            slots = max(1, layout.capacity - (n_keep or 0))
            self.hidden, self.rows = hidden.new_empty(b, slots, d), None
        if self.count and (self.base + self.count != layout.length or self.count == self.hidden.shape[1]):
            self.flush(scores)
        if not self.count:
            self.base = layout.length
        if self.rows is None:
            self.hidden[:, self.count] = hidden[:, 0]
        else:
            self.hidden[:, self.count].index_copy_(0, self.rows, hidden[:, 0])
        self.count += 1
        return None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """The cache keeps only its rows ``rows`` ``[r]``. The buffer keeps every row it was made with, so
        a flush scores the same ``[b, K, d]`` block as before (a matmul's rounding may depend on its row
        count) and writes the rows kept."""
        if self.hidden is not None:
            rows = rows.to(self.hidden.device)
            self.rows = rows if self.rows is None else self.rows.index_select(0, rows)

    def flush(self, scores: torch.Tensor) -> None:
        """Score the kept decode steps into ``scores`` ``[b, n]`` (one batched predictor call)."""
        if not self.count:
            return
        n, start = self.count, self.base
        self.count = 0
        with torch.no_grad():
            out = self.predictor(self.hidden[:, :n])
        if self.rows is not None:
            out = out.index_select(0, self.rows)
        scores[:, start : start + n] = out.to(scores.device, torch.float32)
