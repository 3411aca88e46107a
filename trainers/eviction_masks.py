"""Kept sets an evicting cache may show the testbed LRM, for training it to read them.

One trace row trained under eviction sees, from every query, the question, a kept set of earlier
thinking tokens and its own last ``W`` tokens (the local window). The kept set takes one of these
shapes, drawn per row with the config's weights (``data.evict_shapes``); each random choice uses one
keep probability ``p ~ U(0, keep_max)`` per row (``data.evict_keep``).

Five *drawn* shapes (:data:`FORCED_SHAPES`) give every later query the same kept set ``kept`` ``[T]``
and force-keep the asked key and its value:

- ``steps``: whole steps ``x xv op y yv gives rK= v ;`` (a step-level selector; the asked step always);
- ``tokens``: single thinking tokens, uniformly (a token-level scorer, or the ``random`` control);
- ``values``: step results only, ``rK= v`` pairs (what a selector that finds values keeps);
- ``windows``: 1-4 contiguous spans covering about ``p`` of the thinking (window/sink-like shapes);
- ``attention``: the top ``p`` of the thinking by the attention it receives in the model being
  trained (summed over layers, heads and queries of a full-context pass, as H2O accumulates it),
  ranked in the training step itself (:func:`add_attention_ranked`).

Forcing the answer's value favours a method that always keeps it (DynTS keeps a fixed set chosen at
write time). Three further shapes are made by a method's own mechanism (:data:`MECHANISM_SHAPES`,
:mod:`trainers.eviction_mechanisms`): per-query visibility ``[T, T]`` that evolves over time, with
permanent eviction, from the attention of the model being trained:

- ``h2o``: H2O's cache, token by token: ``C`` heavy hitters by causal accumulated attention + ``W``;
- ``snapkv``: SnapKV at decode: every ``data.evict_every`` tokens the top ``C`` by the attention of
  the last ``data.evict_observe`` queries survive + ``W``;
- ``rkv``: R-KV at decode: the events of ``snapkv``, the top ``C`` by ``lambda * importance - (1 -
  lambda) * redundancy`` (``lambda = data.evict_rkv_lambda``; redundancy from the keys of the model's
  last layer, ``dynts.evictors.rkv.key_redundancy``) survive + ``W``.

Their per-head forms ``h2o-head``, ``snapkv-head``, ``rkv-head`` run the same cache once per (layer,
KV head) on that pair's own attention (and keys), as the evictors with ``per_head=true`` do; a batch
holding such a row carries an ``attention_mask`` ``[B, L * h_kv, T, T]`` (one slice per pair, every
other row repeated over them) that :mod:`trainers.layer_head_masks` hands to each layer.

``C = ceil(p * L)`` (``L`` thinking tokens, ``p`` as above). They force nothing but the question.

``data.evict_lose_asked`` (default 0): with that probability a drawn-shape row does not force the
asked key and value (``steps`` then keeps the asked step with probability ``p`` like any other,
``attention`` may rank it in), so the model also learns what to do without the value. The mechanism
shapes never force it, whatever the option.

In a chain trace (``task`` family ``chain``) every drawn shape also keeps the key and value of each
result a later step reads (``task.read_values``; also in rows that lose the asked value): without
them that step's operand copy is a guess, as an operand would be without the question. That favours a
method that keeps read results, so ``data.evict_lose_reads`` (default 0) gives the probability that a
drawn-shape row forces none of them (they stay visible only if the shape keeps them on its own,
``keep_reads=False``). The mechanism shapes keep only what their scores keep. Copy traces read no results.

No shape is taken from a method under test's code (no predictor, no evictor call): the mechanism
shapes re-implement H2O's, SnapKV's and R-KV's rules on the training model's own attention (``rkv``
reuses R-KV's redundancy function, ``dynts.evictors.rkv.key_redundancy``, on the training model's keys). With
``evict_shapes = {steps: 1}`` (the default) and ``evict_lose_asked = 0`` the random stream is the one
of the original recipe, so older configs reproduce their checkpoints.
"""

from __future__ import annotations

import math
import random
from typing import Sequence, Union

import torch

from data_pipeline.testbed import task
from trainers.eviction_mechanisms import (
    MECHANISM_SHAPES,
    PER_HEAD_SHAPES,
    attention_and_keys_by_head,
    h2o_until,
    received_attention_and_keys,
    rkv_until,
    snapkv_until,
    token_level,
    until_visibility,
)

__all__ = [
    "FORCED_SHAPES", "MECHANISM_SHAPES", "SHAPES", "Visibility", "add_attention_ranked", "attention_mask", "check_shapes",
    "draw_kept_set", "draw_shape", "eviction_visibility", "needs_attention",
]

FORCED_SHAPES = ("steps", "tokens", "values", "windows", "attention")
SHAPES = FORCED_SHAPES + MECHANISM_SHAPES
KEY_OFFSET = task.KEY_INDEX  # rK= is the 7th of a step's STEP_TOKENS words: x xv op y yv gives rK= v ; (both families)

# One row's visibility: None (full causal), (kept [n], W) or a per-query [n, n] bool (query x key).
Visibility = Union[None, tuple[torch.Tensor, int], torch.Tensor]


def check_shapes(shapes: dict[str, float]) -> dict[str, float]:
    """Validate ``data.evict_shapes`` (shape -> weight) and return it as a plain dict."""
    shapes = dict(shapes)
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise ValueError(f"data.evict_shapes names unknown shapes {unknown}; choose from {list(SHAPES)}")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in shapes.values()) or sum(shapes.values()) <= 0:
        raise ValueError(f"data.evict_shapes={shapes!r}: give non-negative weights with a positive sum, e.g. {{steps: 0.4, tokens: 0.2}}")
    return shapes


def draw_shape(shapes: dict[str, float], rng: random.Random) -> str:
    """One shape by weight; a single shape draws nothing from ``rng``."""
    names = [s for s, w in shapes.items() if w > 0]
    if len(names) == 1:
        return names[0]
    return rng.choices(names, weights=[shapes[s] for s in names])[0]


def eviction_visibility(tokens: Sequence[str], rng: random.Random, window: tuple[int, int], keep_max: float) -> tuple[torch.Tensor, int]:
    """The ``steps`` shape's ``(kept, W)`` (see :func:`draw_kept_set`)."""
    kept, W, _ = draw_kept_set(tokens, rng, window, keep_max, "steps")
    return kept, W


def draw_kept_set(
    tokens: Sequence[str], rng: random.Random, window: tuple[int, int], keep_max: float, shape: str = "steps", keep_asked: bool = True,
    keep_reads: bool = True,
) -> tuple[torch.Tensor, int, float]:
    """What an evicting cache keeps of one trace: ``(kept, W, p)``.

    ``kept`` (bool, ``[len(tokens)]``) marks the keys visible to every later query (the question and
    the kept set of ``shape``); every other key is visible only to the ``W`` queries after it. ``p``
    is the row's keep probability; for ``attention`` the ranked part is added later by
    :func:`add_attention_ranked` (``kept`` then holds the question and the asked key and value), for
    a mechanism shape the whole kept set is (``kept`` holds the question only). ``keep_asked=False``
    (a row that loses the asked value) forces nothing of the asked step; ``keep_reads=False`` forces
    none of the results later chain steps read.
    """
    kept = torch.zeros(len(tokens), dtype=torch.bool)
    kept[: task.QUESTION_TOKENS] = True
    asked = f"r{task.parse_question(tokens[: task.QUESTION_TOKENS])[1]}=" if keep_asked else None
    end = tokens.index(task.END_THINK) if task.END_THINK in tokens else len(tokens)
    p_keep = rng.uniform(0.0, keep_max)
    if shape in MECHANISM_SHAPES:
        return kept, rng.randint(*window), p_keep
    start = task.QUESTION_TOKENS
    reads = task.read_values(tokens, "chain") if keep_reads and any(t in task.QUERY_KEYS for t in tokens[start:end]) else []
    for v in reads:  # chain: the results later steps read (key and value); none in a copy trace
        kept[v - 1 : v + 1] = True
    if shape == "steps":
        for i in range(start, end):
            if tokens[i] in task.RESULT_KEYS and (tokens[i] == asked or rng.random() < p_keep):
                first = i - KEY_OFFSET
                kept[max(start, first) : first + task.STEP_TOKENS] = True
        return kept, rng.randint(*window), p_keep
    for i in range(start, end):  # every other drawn shape keeps the asked key and its value
        if tokens[i] == asked:
            kept[i : i + 2] = True
    if shape == "tokens":
        draws = torch.tensor([rng.random() for _ in range(start, end)]) < p_keep
        kept[start:end] |= draws
    elif shape == "values":
        for i in range(start, end):
            if tokens[i] in task.RESULT_KEYS and rng.random() < p_keep:
                kept[i : i + 2] = True
    elif shape == "windows":
        spans, length = rng.randint(1, 4), end - start
        span = max(1, round(p_keep * length / spans))
        for _ in range(spans):
            first = start + rng.randrange(max(1, length - span + 1))
            kept[first : min(end, first + span)] = True
    elif shape != "attention":
        raise ValueError(f"shape={shape!r} must be one of {SHAPES}")
    return kept, rng.randint(*window), p_keep


def attention_mask(lengths: Sequence[int], T: int, visibility: Sequence[Visibility]) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]`` mask (True = attend): causal, narrowed to what an evicting cache
    shows for rows with a ``visibility``: ``(kept, W)`` (key ``k`` visible to query ``q`` iff
    ``kept[k]`` or ``q - k < W``) or a per-query ``[n, n]`` bool (its padded queries stay causal)."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    causal = k <= q
    masks = []
    for n, vis in zip(lengths, visibility):
        if vis is None:
            masks.append(causal)
        elif isinstance(vis, torch.Tensor):
            if vis.shape != (n, n) or vis.dtype != torch.bool:
                raise ValueError(f"a per-query visibility must be a bool [n, n] tensor for a row of n={n} tokens, got {tuple(vis.shape)} {vis.dtype}")
            mask = causal.clone()
            mask[:n, :n] &= vis
            masks.append(mask)
        else:
            kept, window = vis
            visible = torch.zeros(T, dtype=torch.bool)
            visible[:n] = kept
            masks.append(causal & (visible[None, :] | (q - k < window)))
    return torch.stack(masks)[:, None]


def needs_attention(batch: dict[str, torch.Tensor]) -> bool:
    """Whether ``batch`` has rows whose mask the training step finishes (:func:`add_attention_ranked`)."""
    return "rank_rows" in batch or "mech_rows" in batch


@torch.no_grad()
def add_attention_ranked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Finish, in place, the masks of the rows whose kept set comes from the model's own attention,
    from ONE eager full-context forward of those rows (:func:`received_attention`):

    - ``attention`` rows (``rank_rows`` ``[R]``, ``rank_keep`` ``[R]`` shares, ``rank_candidates``
      ``[R, T]`` bool): each also keeps the top ``rank_keep[r]`` share of its candidate thinking
      slots by the attention they receive (summed over queries);
    - mechanism rows (``mech_rows`` ``[M]``, ``mech_kind`` ``[M]`` index in ``MECHANISM_SHAPES``,
      ``mech_count`` ``[M]`` = C, ``mech_window`` ``[M]`` = W, scalars ``mech_every``,
      ``mech_observe``; with ``rkv`` rows also ``mech_lambda``): their mask becomes the simulated
      cache's per-query visibility (``rkv`` also reads the forward's last-layer keys); a per-head
      row (``h2o-head``, ...) gets one per (layer, KV head), and then the whole batch's mask becomes
      ``[B, L * h_kv, T, T]`` (``batch["attention_mask"]`` is replaced; train it under
      :func:`trainers.layer_head_masks.layer_head_masks`).

    ``batch`` also holds ``input_ids`` ``[B, T]``, ``attention_mask`` ``[B, 1, T, T]`` bool and
    ``lengths`` ``[B]``.
    """
    empty = torch.zeros(0, dtype=torch.long)
    rank, mech = batch.get("rank_rows", empty), batch.get("mech_rows", empty)
    rows = torch.cat([rank, mech])
    if not len(rows):
        return
    lengths = batch["lengths"][rows]
    kinds = [MECHANISM_SHAPES[k] for k in batch.get("mech_kind", empty).tolist()]
    ids = batch["input_ids"][rows]
    if any(kind in PER_HEAD_SHAPES for kind in kinds):
        # [R + M, L, h_kv, T, T] and every layer's keys [R + M, L, h_kv, T, d] when an rkv row needs them
        by_head, head_keys = attention_and_keys_by_head(model, ids, lengths, with_keys=bool({"rkv", "rkv-head"} & set(kinds)))
        attention, keys = token_level(by_head), None if head_keys is None else head_keys[:, -1]
        groups = by_head.shape[1] * by_head.shape[2]
        batch["attention_mask"] = batch["attention_mask"].expand(-1, groups, -1, -1).clone()  # one slice per (layer, head)
    else:
        # [R + M, T, T], and the last layer's keys [R + M, h, T, d] when an rkv row needs them
        attention, keys = received_attention_and_keys(model, ids, lengths, keys_layer=-1 if "rkv" in kinds else None)
        by_head = head_keys = None
    mask = batch["attention_mask"]
    T = mask.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    received = attention[: len(rank)].sum(1)  # [R, T]: attention each key received
    for r, row in enumerate(rank.tolist()):
        candidates = batch["rank_candidates"][r]
        count = math.ceil(float(batch["rank_keep"][r]) * int(candidates.sum()))
        if count == 0:
            continue
        top = received[r].masked_fill(~candidates, float("-inf")).topk(count).indices
        mask[row][:, :, top] = causal[:, top]
    if not len(mech):
        return
    attention, lengths = attention[len(rank) :], lengths[len(rank) :]
    keys = None if keys is None else keys[len(rank) :]
    for name in MECHANISM_SHAPES:
        of = torch.tensor([m for m, kind in enumerate(kinds) if kind == name], dtype=torch.long)
        if not len(of):
            continue
        window, count = batch["mech_window"][of], batch["mech_count"][of]
        if name in PER_HEAD_SHAPES:  # each (layer, head) pair's own cache: the token-level simulation on R * G rows
            G = by_head.shape[1] * by_head.shape[2]
            pair_attention = by_head[len(rank) :][of].flatten(0, 2)  # [n * G, T, T]
            pair_keys = None if head_keys is None else head_keys[len(rank) :][of].flatten(0, 2)[:, None]  # [n * G, 1, T, d]
            until = _simulate(name.removesuffix("-head"), pair_attention, pair_keys, lengths[of].repeat_interleave(G),
                              window.repeat_interleave(G), count.repeat_interleave(G), batch).view(len(of), G, T)
        else:
            until = _simulate(name, attention[of], None if keys is None else keys[of], lengths[of], window, count, batch)[:, None]
        for m, pairs in zip(of.tolist(), until):
            n, row = int(lengths[m]), int(mech[m])
            mask[row] = torch.stack([attention_mask([n], T, [until_visibility(u, n)])[0, 0] for u in pairs])


def _simulate(name: str, attention: torch.Tensor, keys: torch.Tensor | None, lengths: torch.Tensor, windows: torch.Tensor,
              counts: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``until`` ``[R, T]`` of the token-level cache ``name`` over ``attention`` ``[R, T, T]`` (``rkv``: and ``keys``)."""
    every, observe = int(batch["mech_every"]), int(batch["mech_observe"])
    if name == "h2o":
        return h2o_until(attention, lengths, windows, counts)
    if name == "rkv":
        return rkv_until(attention, keys, lengths, windows, counts, every=every, observe=observe, mix_lambda=float(batch["mech_lambda"]))
    return snapkv_until(attention, lengths, windows, counts, every=every, observe=observe)
