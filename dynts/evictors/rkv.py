"""R-KV, redundancy-aware KV compression for reasoning models (Cai et al., NeurIPS 2025,
arXiv:2505.24133), with the settings of KV-Rescue's appendix C (``../shared/papers/kv-rescue.txt``:
mix weight ``lambda = 0.1``, a protected recent window, a headroom buffer between events).

Score of cached slot ``j`` at an eviction event (``V`` = the row's real slots)::

    importance  I_j = pool_k( mean_{q in window} A_qj / sum_j' A_qj' )
    similarity  S^h_ij = cos(k^h_i, k^h_j) for i != j,  S^h_ii = 0          (per KV head h)
                for every i: the most recent j with S^h_ij > threshold gets S^h_ij := 0
    redundancy  R^h_j = softmax_{j in V}( mean_{i in V} S^h_ij ),   R_j = mean_h R^h_j
    score       Z_j = lambda * I_j - (1 - lambda) * R_j

``A`` is the observation window's attention (``TokenInfo.window_attention``, the last ``w`` query rows,
summed over layers and heads: each row is normalised to a distribution, i.e. averaged over layers and
heads), ``pool_k`` the max pooling of R-KV's code (kernel 7) over the slots before the local window,
and the keys are those of one reference layer (``TokenInfo.keys``, the last layer by default). The
redundancy term is R-KV's ``cal_similarity`` (threshold 0.5, ``retain_direction="last"``: of a set of
similar keys the most recent copy is spared). A token scores high when the window attends to it and
few other cached keys repeat it. The local window ``W_l`` is always kept and ``n_keep`` is shared by
every method (DynTS paper C.3); R-KV's "buffer" is the eviction volume ``K = B - n_keep``.

R-KV selects per layer and per KV head with that layer's attention and keys: ``per_head=True`` does
the same (each row is one layer's KV head, ``keys`` ``[g, 1, n, d]`` its own). With ``per_head=False``
one selection serves all layers and heads (as in the DynTS reference code): importance is averaged over
layers and heads and redundancy over the KV heads of one reference layer. Rows
with no similar key do not zero their similarity to slot 0 (an artefact of R-KV's ``argmax``).
R-KV's code softmaxes the window's attention logits over the keys before the window only; ours
normalises over all keys (the distribution the model attended with). ``normalize="non_window"``
renormalises the recorded rows over the non-window slots instead: exact for one layer and head,
and for the layer/head sum a renormalisation of that sum (the per-head softmaxes are not recorded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Evictor, TokenInfo, keep_top, local_and_question_mask, register
from .options import KeepsQuestion, SelectsPerHead, check_flag, check_pooling, check_window
from .snapkv import pooled_outside_window

NORMALIZATIONS = ("all", "non_window")
REDUNDANCY_CHUNK_ROWS = 128  # similarity rows per step of key_redundancy


def window_importance(window_attention: torch.Tensor, exclude_recent: int = 0) -> torch.Tensor:
    """``[b, w, n]`` summed attention rows -> ``[b, n]`` mean attention distribution of the window.

    Each query row is normalised to sum to 1 (averaging over layers and heads); rows never filled
    (fewer than ``w`` queries seen) are skipped. ``exclude_recent > 0`` normalises each row over the
    slots before the last ``exclude_recent`` only (those get 0), as R-KV's code softmaxes the window's
    logits over the non-window keys.
    """
    rows = window_attention.float()
    if exclude_recent > 0:
        keep = torch.arange(rows.shape[-1], device=rows.device) < rows.shape[-1] - exclude_recent
        rows = rows * keep
    mass = rows.sum(-1, keepdim=True)
    filled = (mass > 0).float()
    return (rows / mass.clamp(min=1e-30) * filled).sum(1) / filled.sum(1).clamp(min=1.0)


def key_redundancy(
    keys: torch.Tensor, valid: torch.Tensor, threshold: float, chunk_rows: int = REDUNDANCY_CHUNK_ROWS
) -> torch.Tensor:
    """R-KV's redundancy ``[b, n]`` of keys ``[b, h, n, d]`` (mean over heads; 0 on invalid slots).

    The similarity ``S^h_ij`` is built ``chunk_rows`` rows ``i`` at a time for all heads at once: every
    step of the formula (the spared most recent similar copy, the column mean) is per row ``i`` or a
    sum over rows, so the peak is ``O(b * h * chunk_rows * n)``, never the ``[b, h, n, n]`` matrix.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int")
    b, h, n, _ = keys.shape
    unit = keys.float()
    unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)  # [b, h, n, d]
    col = torch.arange(n, device=keys.device)
    col32 = col.to(torch.int32)
    count = valid.sum(-1).clamp(min=1).float()[:, None, None]  # [b, 1, 1]
    column_sum = torch.zeros(b, h, n, device=keys.device)
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        row = col[start:stop]
        # both slots real and i != j: [b, 1, c, n]
        pair = (valid[:, start:stop, None] & valid[:, None, :] & (row[:, None] != col[None, :]))[:, None]
        sim = unit[:, :, start:stop] @ unit.transpose(-1, -2)  # [b, h, c, n]
        sim.masked_fill_(~pair, 0.0)
        similar = (sim > threshold) & pair
        last = torch.where(similar, col32, -1).amax(-1, keepdim=True)  # most recent similar slot, -1 if none
        sim.masked_fill_(similar & (col32 == last), 0.0)
        column_sum += sim.sum(2)
        del sim, similar, last, pair
    mean = column_sum / count  # mean over rows i -> score of column j, per head
    redundancy = torch.softmax(mean.masked_fill_(~valid[:, None], float("-inf")), dim=-1).nan_to_num_(0.0)
    return redundancy.sum(1) / h


@register("rkv")
@dataclass
class RKV(KeepsQuestion, SelectsPerHead, Evictor):
    """Keep the local window + the slots of highest ``lambda * importance - (1 - lambda) * redundancy``.

    Args:
        mix_lambda: ``lambda`` in [0, 1] (KV-Rescue: 0.1; R-KV's code: 0.07).
        observation_window: queries whose attention gives the importance (R-KV: 8).
        kernel_size: odd pooling kernel of the importance (R-KV: 7).
        pooling: ``"max"`` (R-KV) or ``"avg"``.
        similarity_threshold: cosine above which two keys count as copies (R-KV: 0.5), in [-1, 1].
        per_head: each KV head of each layer keeps its own top ``n_keep`` from its own statistics
            (the paper's granularity); ``False``: one set for all layers and heads.
        keep_question: also protect the prompt (off in R-KV; an option for ablations).
        normalize: the keys each window query's attention is normalised over: ``"all"`` (default:
            the distribution the model used) or ``"non_window"`` (R-KV's code: the softmax over the
            keys before the observation window, which then get importance 0).

    Uses ``info.window_attention`` ``[b, W, n]`` and ``info.keys`` ``[b, h_kv, n, d]``.
    """

    requires: ClassVar[frozenset[str]] = frozenset({"window_attention", "keys"})

    mix_lambda: float = 0.1
    observation_window: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    similarity_threshold: float = 0.5
    keep_question: bool = False
    per_head: bool = False
    normalize: str = "all"

    def __post_init__(self) -> None:
        if isinstance(self.mix_lambda, bool) or not isinstance(self.mix_lambda, (int, float)) or not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda!r} must lie in [0, 1] (KV-Rescue uses 0.1)")
        check_window(self.observation_window)
        check_pooling(self.kernel_size, self.pooling)
        t = self.similarity_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not -1.0 <= t <= 1.0:
            raise ValueError(f"similarity_threshold={t!r} must lie in [-1, 1] (R-KV uses 0.5)")
        check_flag("keep_question", self.keep_question)
        check_flag("per_head", self.per_head)
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize={self.normalize!r} must be one of {NORMALIZATIONS} ('non_window' = R-KV's code)")

    def scores(self, info: TokenInfo) -> torch.Tensor:
        """``[b, n]`` R-KV score ``Z`` of every slot (before protection)."""
        if info.window_attention is None or info.keys is None:
            raise RuntimeError("R-KV needs window attention and keys; the cache must record both")
        exclude = self.observation_window if self.normalize == "non_window" else 0
        importance = window_importance(info.window_attention[:, -self.observation_window :], exclude)
        importance = pooled_outside_window(importance, info, self.kernel_size, self.pooling)
        redundancy = key_redundancy(info.keys, info.valid, float(self.similarity_threshold))
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy

    def select(self, info: TokenInfo) -> torch.Tensor:
        protected = local_and_question_mask(info, self.keep_question)
        return keep_top(self.scores(info).masked_fill(protected, float("inf")), info)
