"""Labels, losses and metrics for training the DynTS importance predictor (paper 4.1, 6.4, Fig. 7).

Label normalisation
-------------------
Raw importance (attention summed over layers x heads x answer rows) spans orders of magnitude: a
few thinking tokens get tens of units, most get ~1e-3, and the scale of a whole trace grows with
its answer length and the model's depth. Selection only compares tokens *within* a trace, so the
labels are normalised per trace, over its thinking tokens (``label_transform``):

- ``none``: raw scores;
- ``mean``: ``s / mean(s)`` (1.0 = the trace's mean importance, the paper's Fig. 2 threshold);
- ``log1p-mean``: ``log1p(s / mean(s))``: scale-free and compresses the heavy tail;
- ``log1p-zscore`` (default): ``log1p(s / mean(s))`` standardised to mean 0, std 1 per trace;
- ``rank``: the within-trace rank scaled to ``[0, 1]`` (ties share their mean rank).

Every transform is strictly increasing within a trace, so rank metrics (Kendall, top-p% overlap)
are the same against raw or normalised labels; all but ``none`` are invariant to rescaling a trace.

Losses
------
``mse`` (the paper), ``weighted_mse`` (the tokens in the label's top ``top_percent`` % of a trace
weigh ``1 + top_weight``) and ``kendall``: a pairwise logistic ranking loss on random token pairs of
a trace, ``softplus(-sign(y_i - y_j) (p_i - p_j))``, a smooth surrogate of ``1 - tau``; it can also be
added to either MSE with ``pairwise_weight``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import kendalltau
from torchmetrics import Metric

__all__ = [
    "LABEL_TRANSFORMS",
    "LOSSES",
    "MeanKendallTau",
    "TopPercentOverlap",
    "importance_loss",
    "normalize_labels",
    "top_mask",
]

LABEL_TRANSFORMS = ("none", "mean", "log1p-mean", "log1p-zscore", "rank")
LOSSES = ("mse", "weighted_mse", "kendall")


def normalize_labels(scores: torch.Tensor, transform: str = "log1p-zscore") -> torch.Tensor:
    """Normalise the importance ``[n]`` of one trace's thinking tokens (see the module docstring)."""
    if transform not in LABEL_TRANSFORMS:
        raise ValueError(f"label_transform={transform!r} must be one of {LABEL_TRANSFORMS}")
    s = scores.float()
    if transform == "none" or s.numel() == 0:
        return s
    if (s < 0).any():
        raise ValueError("importance scores must be >= 0 (attention mass); got negative values")
    if transform == "rank":
        ranks = torch.from_numpy(_average_ranks(s.cpu().numpy())).to(s)
        return ranks / max(s.numel() - 1, 1)
    mean = s.mean().clamp_min(1e-12)
    if transform == "mean":
        return s / mean
    y = torch.log1p(s / mean)
    if transform == "log1p-mean":
        return y
    std = y.std(unbiased=False)
    return (y - y.mean()) / std if std > 1e-12 else y - y.mean()


def _average_ranks(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x, method="average") - 1.0


def top_mask(values: torch.Tensor, mask: torch.Tensor, percent: float) -> torch.Tensor:
    """``[b, T]`` True on each row's top ``percent`` % of the ``mask``-ed entries
    (``k = ceil(percent/100 * n)``, at least 1; ties broken by position)."""
    out = torch.zeros_like(mask)
    for row in range(values.shape[0]):
        idx = mask[row].nonzero().flatten()
        if idx.numel() == 0:
            continue
        k = max(1, math.ceil(percent / 100.0 * idx.numel()))
        top = values[row, idx].topk(k).indices
        out[row, idx[top]] = True
    return out


def importance_loss(
    preds: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    loss: str = "mse",
    *,
    top_percent: float = 30.0,
    top_weight: float = 4.0,
    pairwise_weight: float = 0.0,
    pairs_per_trace: int = 1024,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Training loss over the thinking tokens (``mask``) of a batch; ``preds``/``labels`` ``[b, T]``."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} must be one of {LOSSES}")
    m = mask.float()
    denom = m.sum().clamp_min(1.0)
    total = preds.new_zeros(())
    if loss == "mse":
        total = ((preds - labels) ** 2 * m).sum() / denom
    elif loss == "weighted_mse":
        w = (1.0 + top_weight * top_mask(labels, mask, top_percent).float()) * m
        total = ((preds - labels) ** 2 * w).sum() / w.sum().clamp_min(1.0)
    weight = 1.0 if loss == "kendall" else pairwise_weight
    if weight > 0:
        total = total + weight * pairwise_rank_loss(preds, labels, mask, pairs_per_trace, generator)
    return total


def pairwise_rank_loss(
    preds: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, pairs: int = 1024, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mean ``softplus(-sign(y_i - y_j) * (p_i - p_j))`` over ``pairs`` random pairs per trace
    (pairs with equal labels are skipped)."""
    losses = []
    for row in range(preds.shape[0]):
        idx = mask[row].nonzero().flatten()
        if idx.numel() < 2:
            continue
        i = idx[torch.randint(idx.numel(), (pairs,), generator=generator).to(idx.device)]
        j = idx[torch.randint(idx.numel(), (pairs,), generator=generator).to(idx.device)]
        sign = torch.sign(labels[row, i] - labels[row, j])
        keep = sign != 0
        if keep.any():
            diff = (preds[row, i] - preds[row, j])[keep]
            losses.append(F.softplus(-sign[keep] * diff).mean())
    return torch.stack(losses).mean() if losses else preds.sum() * 0.0


class MeanKendallTau(Metric):
    """Kendall tau-b between predicted and true importance, per trace, averaged over traces
    (the paper's Fig. 7 top). ``update(preds [b, T], target [b, T], mask [b, T])``.

    Each trace's tau-b is the statistic of ``torchmetrics.KendallRankCorrCoef(variant="b")``
    (tested equal), computed with scipy's ``O(n log n)`` algorithm because torchmetrics' pair loop is
    ``O(n^2)`` (~30 s for one 16k-token trace).
    """

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        p, t, m = preds.detach().float().cpu().numpy(), target.detach().float().cpu().numpy(), mask.cpu().numpy()
        for row in range(p.shape[0]):
            sel = m[row].astype(bool)
            if sel.sum() < 2:
                continue
            tau = kendalltau(p[row, sel], t[row, sel]).statistic
            if np.isfinite(tau):
                self.total += float(tau)
                self.count += 1

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp_min(1)).float()


class TopPercentOverlap(Metric):
    """Overlap rate of the critical tokens (paper Fig. 7 bottom): per trace, the fraction of the true
    top ``percent`` % thinking tokens that are also in the predicted top ``percent`` %, averaged over
    traces. ``update(preds [b, T], target [b, T], mask [b, T])``.
    """

    full_state_update = False

    def __init__(self, percent: float = 30.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 < percent <= 100:
            raise ValueError(f"percent={percent} must be in (0, 100]")
        self.percent = percent
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        pred_top = top_mask(preds.detach().float(), mask, self.percent)
        true_top = top_mask(target.detach().float(), mask, self.percent)
        for row in range(preds.shape[0]):
            k = int(true_top[row].sum())
            if k:
                self.total += float((pred_top[row] & true_top[row]).sum()) / k
                self.count += 1

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp_min(1)).float()
