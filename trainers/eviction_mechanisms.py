"""Kept sets made by an evictor's own mechanism, for training the testbed LRM to read them.

The shapes of :mod:`trainers.eviction_masks` give every query of a row the same kept set (a key is
kept for good or seen only from the local window) and force-keep the asked key and value. The three
shapes here are simulated caches instead: what query ``t`` sees evolves with ``t`` and an evicted key
never comes back, exactly as in the evicting cache, and nothing is forced except the question
(``task.QUESTION_TOKENS``, visible to every query as in the other shapes; nor, in a chain trace, the
results later steps read). All score keys by the attention of the model being trained, taken from
one eager full-context forward (:func:`received_attention`) that the ``attention`` shape shares
(``rkv`` also reads that forward's keys of one layer).

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
- ``rkv`` (R-KV at decode, Cai et al. 2025; ``dynts.evictors.rkv``): the events and candidates of
  ``snapkv``, scored by ``lambda * importance - (1 - lambda) * redundancy`` (``lambda`` =
  ``data.evict_rkv_lambda``, default 0.1 as the evictor's). Importance: the mean over the last ``w``
  queries of each query's attention row restricted to the keys cached at the event and normalised to
  sum to 1 there (``dynts.evictors.rkv.window_importance`` on those rows). Redundancy: R-KV's
  :func:`dynts.evictors.rkv.key_redundancy` (cosine > 0.5, the most recent similar copy spared, a
  softmax over the cached keys, mean over KV heads) over the keys cached at the event (question,
  kept set, keys that left the window since the last event, the window of query ``e``), from the
  post-RoPE keys of one reference layer (the last) of the same forward, as a real cache records them.
  The top ``C`` candidates (ties to the oldest; the evictor breaks ties toward the more recent slot)
  are kept. A query sees at most ``C + W + K - 1``
  non-question keys. Given the same attention rows and keys, an event keeps exactly what
  ``RKV(kernel_size=1, keep_question=True)`` keeps with ``local_window = W - 1`` and ``n_keep =
  QUESTION_TOKENS + C + W - 1`` (``tests/test_eviction_mechanisms.py`` checks it event by event).
  No max pooling along the sequence (the evictor's ``kernel_size`` 7), as for ``snapkv``.

``h2o-head``, ``snapkv-head``, ``rkv-head`` (the evictors with ``per_head=true``): the same three caches
run once per (layer, KV head) pair on that pair's own statistics, as a per-head evictor keeps its own
slots there: the attention of the pair's KV group (its query heads summed) and, for ``rkv-head``, the
pair's own keys (redundancy over one head). Every pair keeps ``C`` of its candidates with the same
question, window and events, so ``until`` is ``[R, L * h_kv, T]`` and the training mask one ``[T, T]``
per pair (:mod:`trainers.layer_head_masks`). Given a pair's attention and keys, a pair's cache is the
token-level simulation of that one pair, run by the same functions on the ``R * L * h_kv`` rows.

Not simulated: a real cache scores with attention renormalised over what it kept, here every query
attends to the full context (one forward, not ``T``; ``rkv`` renormalises the summed rows over the
cached keys, which is exact for one layer and head only). ``C`` is drawn per row by the batch builder.

Cost of ``rkv`` (2026-12-04, this machine, one thread under the CPU lock with other jobs on the 2 cores,
the fair chain LRM's shape at init: 4 layers x 256, 8 KV heads, head dim 32): 16 rkv rows of ~970 tokens
take 4.2-6.2 s to simulate against 15-18 s for their shared eager forward (attention and keys) and
8-10 s for a training forward + backward of the same rows; one row 0.2 s (~710 tokens: 0.06-0.09 s).
h2o and snapkv take 0.01-0.1 s for the same 16 rows. In the mixture (``rkv`` 0.16 of the evicted rows)
a batch holds 0-4 rkv rows: over 16 steps spread across ``chain-lrm-fair-s1.yaml``'s schedule the rkv
simulation took 0.4 % of the step time (0.8 % for ``lrm-fair-scratch-s1.yaml``). The cost is the
redundancy at each event, ``O(h * m^2 * d)`` for the ``m`` cached keys (bounded by the cache, not ``T``).
"""

from __future__ import annotations

import numpy as np
import torch

from data_pipeline.testbed import task
from dynts.evictors.rkv import key_redundancy

__all__ = [
    "MECHANISM_SHAPES", "PER_HEAD_SHAPES", "RKV_THRESHOLD", "attention_and_keys_by_head", "h2o_until", "received_attention",
    "received_attention_and_keys", "rkv_until", "snapkv_until", "token_level", "until_visibility",
]

MECHANISM_SHAPES = ("h2o", "snapkv", "rkv", "h2o-head", "snapkv-head", "rkv-head")  # appended only: indices are in batches
PER_HEAD_SHAPES = MECHANISM_SHAPES[3:]  # one simulated cache per (layer, KV head), as the evictors' per_head=true
RKV_THRESHOLD = 0.5  # R-KV's cosine threshold for two keys to count as copies (dynts.evictors.rkv's default)


@torch.no_grad()
def received_attention(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[R, T(query), T(key)]``: the attention each real query of ``ids`` ``[R, T]`` pays each key,
    summed over layers and heads, from one eager full-context forward (padded queries are zero).
    The model's attention implementation is restored afterwards."""
    return received_attention_and_keys(model, ids, lengths, keys_layer=None)[0]


@torch.no_grad()
def received_attention_and_keys(
    model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, keys_layer: int | None = -1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`received_attention` and, from the same forward, the key states ``[R, h_kv, T, d]`` of
    layer ``keys_layer`` as the model's cache holds them (after RoPE; ``None``: no keys, no cache)."""
    out, real = _eager_forward(model, ids, lengths, with_cache=keys_layer is not None)
    attention = sum(a.float().sum(1) for a in out.attentions) * real[:, :, None]
    if keys_layer is None:
        return attention, None
    return attention, _cache(out).layers[keys_layer].keys.float()


@torch.no_grad()
def attention_and_keys_by_head(
    model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, with_keys: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-head form of :func:`received_attention_and_keys`, from one eager forward: the attention
    ``[R, L, h_kv, T, T]`` each real query of each layer's KV group pays each key (the group's query
    heads summed, as ``record_attention`` sums them for a per-head evictor) and, with ``with_keys``,
    every layer's keys ``[R, L, h_kv, T, d]`` as the cache holds them."""
    out, real = _eager_forward(model, ids, lengths, with_cache=with_keys)
    R, T = ids.shape
    h_kv = model.config.num_key_value_heads
    attention = torch.stack([a.float().view(R, h_kv, -1, T, T).sum(2) for a in out.attentions], 1) * real[:, None, None, :, None]
    if not with_keys:
        return attention, None
    return attention, torch.stack([layer.keys.float() for layer in _cache(out).layers], 1)


def token_level(by_head: torch.Tensor) -> torch.Tensor:
    """``[R, T, T]``: attention ``[R, L, h_kv, T, T]`` summed over layers and heads (an H2O-style total)."""
    return by_head.sum((1, 2))


def _eager_forward(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, with_cache: bool):
    """One full-context forward with attention weights (eager), and the real-token mask ``[R, T]``.
    The model's attention implementation is restored afterwards."""
    T = ids.shape[1]
    real = torch.arange(T)[None, :] < lengths[:, None]  # [R, T]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        if with_cache:
            out = model(input_ids=ids, attention_mask=real.long(), output_attentions=True, use_cache=True)
        else:
            out = model(input_ids=ids, attention_mask=real.long(), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return out, real


def _cache(out):
    return out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.2x


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


def rkv_until(
    attention: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    windows: torch.Tensor,
    counts: torch.Tensor,
    every: int,
    observe: int,
    mix_lambda: float = 0.1,
    question: int = task.QUESTION_TOKENS,
    threshold: float = RKV_THRESHOLD,
) -> torch.Tensor:
    """R-KV at decode over ``attention`` ``[R, T, T]`` and one layer's ``keys`` ``[R, h, T, d]`` (the
    rest as :func:`snapkv_until`): at the events of ``snapkv_until`` the top ``counts`` candidates by
    ``mix_lambda * importance - (1 - mix_lambda) * redundancy`` are kept. Returns ``until`` ``[R, T]``.

    Each event scores only the rows with more candidates than ``C``; redundancy runs on the cached
    keys gathered to the front (in arrival order, as a real cache stores them), so its cost follows
    the cache, not ``T``."""
    R, T, _ = attention.shape
    attention = attention.float()
    until = torch.full((R, T), T, dtype=torch.long)
    pos = torch.arange(T)
    real = pos < lengths[:, None]
    thinking = (pos >= question) & real  # [R, T]
    last = min(T - 1, int(lengths.max()) - 1) if R else 0
    for e in range(question - 1 + every, last, every):  # the event after query e
        alive = until == T
        candidates = thinking & (pos <= (e + 1 - windows)[:, None]) & alive
        rows = (candidates.sum(1) > counts).nonzero().flatten()
        if not len(rows):
            continue
        cached = (real & (pos <= e) & alive)[rows]  # [r, T]: the cache after query e
        observed = attention[rows, max(0, e - observe + 1) : e + 1] * cached[:, None]  # [r, w, T]
        mass = observed.sum(-1, keepdim=True)
        filled = (mass > 0).float()
        importance = (observed / mass.clamp(min=1e-30) * filled).sum(1) / filled.sum(1).clamp(min=1.0)
        m = int(cached.sum(1).max())
        slots = torch.sort((~cached).to(torch.int8), dim=1, stable=True).indices[:, :m]  # cached keys first, in order
        valid = cached.gather(1, slots)  # [r, m]
        k = keys[rows]
        gathered = k.gather(2, slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3]))  # [r, h, m, d]
        redundancy = torch.zeros(len(rows), T).scatter_(1, slots, key_redundancy(gathered, valid, threshold) * valid)
        score = mix_lambda * importance - (1.0 - mix_lambda) * redundancy
        cand = candidates[rows]
        order = score.masked_fill(~cand, float("-inf")).sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, pos.expand(len(rows), T))
        evict = cand & (rank >= counts[rows][:, None])
        sub = until[rows]
        sub[evict] = e + 1
        until[rows] = sub
    return until
