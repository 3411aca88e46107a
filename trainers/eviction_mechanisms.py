"""Kept sets made by an evictor's own mechanism, for training the testbed LRM to read them.

The shapes of :mod:`trainers.eviction_masks` give every query of a row the same kept set (a key is
kept for good or seen only from the local window) and force-keep the asked key and value. The two
shapes here are simulated caches instead: what query ``t`` sees evolves with ``t`` and an evicted key
never comes back, exactly as in the evicting cache, and nothing is forced except the question
(``task.QUESTION_TOKENS``, visible to every query as in the other shapes; nor, in a chain trace, the
results later steps read). Both score keys by the attention of the model being trained, taken from
one eager full-context forward (:func:`received_attention`) that the ``attention`` shape shares.

Times: the cache seen by query ``t + 1`` is decided after query ``t`` ran, from the attention of
queries ``<= t``. Key ``j`` is in the local window of queries ``j .. j + W - 1``; it leaves the
window for query ``j + W``. A simulation returns ``until`` ``[R, T]``: the first query that no longer
sees key ``j`` (``T``: never evicted). Query ``q`` sees key ``k <= q`` iff ``k`` is in the question
or ``q < until[k]`` (:func:`until_visibility`); ``until[k] >= k + W`` always, so the window is kept.

- ``h2o`` (H2O's cache, per token): a key's score at time ``t`` is the attention queries ``<= t``
  paid it (summed over layers and heads). As key ``t + 1 - W`` leaves the window it joins the heavy
  set; while the heavy set holds more than ``C`` keys, its lowest-scored member (score at time ``t``,
  ties to the oldest) is evicted for good. Every query sees at most ``C + W`` non-question keys.
- ``snapkv`` (SnapKV at decode): eviction events after queries ``QUESTION_TOKENS - 1 + k * K``
  (``K = data.evict_every``). Between events a key that leaves the window stays cached; at an event
  the candidates (the kept set plus the keys that left the window since the last event) are scored
  by the attention the last ``w`` queries paid them (``w = data.evict_observe``, the observation
  window), the top ``C`` (ties to the oldest) are kept and the rest evicted for good. A query sees at
  most ``C + W + K - 1`` non-question keys. (No pooling along the sequence, unlike
  ``dynts.evictors.snapkv``'s kernel.)

Not simulated: a real cache scores with attention renormalised over what it kept, here every query
attends to the full context (one forward, not ``T``). ``C`` is drawn per row by the batch builder.
"""

from __future__ import annotations

import numpy as np
import torch

from data_pipeline.testbed import task

__all__ = ["MECHANISM_SHAPES", "h2o_until", "received_attention", "snapkv_until", "until_visibility"]

MECHANISM_SHAPES = ("h2o", "snapkv")


@torch.no_grad()
def received_attention(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[R, T(query), T(key)]``: the attention each real query of ``ids`` ``[R, T]`` pays each key,
    summed over layers and heads, from one eager full-context forward (padded queries are zero).
    The model's attention implementation is restored afterwards."""
    T = ids.shape[1]
    real = torch.arange(T)[None, :] < lengths[:, None]  # [R, T]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, attention_mask=real.long(), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return sum(a.float().sum(1) for a in out.attentions) * real[:, :, None]


def _rows(*values: torch.Tensor | int, R: int) -> list[np.ndarray]:
    return [np.broadcast_to(np.asarray(torch.as_tensor(v)), (R,)).astype(np.int64) for v in values]


def h2o_until(
    attention: torch.Tensor, lengths: torch.Tensor, windows: torch.Tensor, counts: torch.Tensor, question: int = task.QUESTION_TOKENS
) -> torch.Tensor:
    """H2O's cache over ``attention`` ``[R, T, T]`` (query x key; rows of ``lengths`` real tokens,
    local windows ``windows``, heavy-hitter counts ``counts``, each ``[R]``): ``until`` ``[R, T]``.

    One pass over time for all rows at once; each step adds one key to the heavy set and evicts at
    most one (an ``argmin`` over ``[R, T]``)."""
    R, T, _ = attention.shape
    if R == 0:
        return torch.full((0, T), T, dtype=torch.long)
    scores = attention.float().cumsum(1).numpy()  # [R, t, j]: attention queries <= t paid key j
    n, W, C = _rows(lengths, windows, counts, R=R)
    member = np.zeros((R, T), dtype=bool)
    until = np.full((R, T), T, dtype=np.int64)
    size = np.zeros(R, dtype=np.int64)
    rows = np.arange(R)
    last = min(T - 1, int(n.max()) - 1)
    for t in range(max(0, question + int(W.min()) - 1), last):  # decide the cache of query t + 1
        j = t + 1 - W  # the key leaving each row's window
        joins = (j >= question) & (j < n)
        member[rows[joins], j[joins]] = True
        size += joins
        over = np.flatnonzero(size > C)
        if over.size:
            worst = np.where(member[over], scores[over, t], np.inf).argmin(1)
            member[over, worst] = False
            until[over, worst] = t + 1
            size[over] -= 1
    return torch.from_numpy(until)


def snapkv_until(
    attention: torch.Tensor,
    lengths: torch.Tensor,
    windows: torch.Tensor,
    counts: torch.Tensor,
    every: int,
    observe: int,
    question: int = task.QUESTION_TOKENS,
) -> torch.Tensor:
    """SnapKV at decode over ``attention`` ``[R, T, T]`` (as :func:`h2o_until`): an event every
    ``every`` queries keeps the top ``counts`` candidates by the attention of the last ``observe``
    queries. Returns ``until`` ``[R, T]``; one top-``C`` per event for all rows at once."""
    R, T, _ = attention.shape
    attention = attention.float()
    until = torch.full((R, T), T, dtype=torch.long)
    pos = torch.arange(T)
    thinking = (pos >= question) & (pos < lengths[:, None])  # [R, T]
    last = min(T - 1, int(lengths.max()) - 1) if R else 0
    for e in range(question - 1 + every, last, every):  # the event after query e
        votes = attention[:, max(0, e - observe + 1) : e + 1].sum(1)  # [R, T]
        candidates = thinking & (pos <= (e + 1 - windows)[:, None]) & (until == T)
        order = votes.masked_fill(~candidates, float("-inf")).sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, pos.expand(R, T))
        until[candidates & (rank >= counts[:, None])] = e + 1
    return until


def until_visibility(until: torch.Tensor, n: int, question: int = task.QUESTION_TOKENS) -> torch.Tensor:
    """The ``[n, n]`` bool visibility (query x key) of one row's ``until`` ``[>= n]``."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    return (k <= q) & ((k < question) | (q < until[None, :n]))
