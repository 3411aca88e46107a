"""Kept sets an evicting cache may show the testbed LRM, for training it to read them.

One trace row trained under eviction sees, from every query, the question, a kept set of earlier
thinking tokens and its own last ``W`` tokens (the local window). The kept set takes one of these
shapes, drawn per row with the config's weights (``data.evict_shapes``); every shape keeps the
asked key and its value, each other choice is random with one keep probability ``p ~ U(0, keep_max)``
per row:

- ``steps``: whole steps ``x xv op y yv gives rK= v ;`` (a step-level selector; the asked step always);
- ``tokens``: single thinking tokens, uniformly (a token-level scorer, or the ``random`` control);
- ``values``: step results only, ``rK= v`` pairs (what a selector that finds values keeps);
- ``windows``: 1-4 contiguous spans covering about ``p`` of the thinking (window/sink-like shapes);
- ``attention``: the top ``p`` of the thinking by the attention it receives in the model being
  trained (summed over layers, heads and queries of a full-context pass, as H2O accumulates it),
  ranked in the training step itself (:func:`add_attention_ranked`).

In a chain trace (``task`` family ``chain``) every shape also keeps the key and value of each result
a later step reads (``task.read_values``): without them that step's operand copy is a guess, as an
operand would be without the question. Copy traces read no results, so their masks are unchanged.

No shape is taken from a method under test (no predictor, no evictor call): they are shapes, not
kept sets of DynTS or of a baseline. With ``evict_shapes = {steps: 1}`` (the default) the random
stream is the one of the original recipe, so older configs reproduce their checkpoints.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from data_pipeline.testbed import task

__all__ = ["SHAPES", "add_attention_ranked", "check_shapes", "draw_kept_set", "draw_shape", "eviction_visibility"]

SHAPES = ("steps", "tokens", "values", "windows", "attention")
KEY_OFFSET = task.KEY_INDEX  # rK= is the 7th of a step's STEP_TOKENS words: x xv op y yv gives rK= v ; (both families)


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
    tokens: Sequence[str], rng: random.Random, window: tuple[int, int], keep_max: float, shape: str = "steps"
) -> tuple[torch.Tensor, int, float]:
    """What an evicting cache keeps of one trace: ``(kept, W, p)``.

    ``kept`` (bool, ``[len(tokens)]``) marks the keys visible to every later query (the question and
    the kept set of ``shape``); every other key is visible only to the ``W`` queries after it. ``p``
    is the row's keep probability; for ``attention`` the ranked part is added later by
    :func:`add_attention_ranked` (``kept`` then holds the question and the asked key and value).
    """
    kept = torch.zeros(len(tokens), dtype=torch.bool)
    kept[: task.QUESTION_TOKENS] = True
    asked = f"r{task.parse_question(tokens[: task.QUESTION_TOKENS])[1]}="
    end = tokens.index(task.END_THINK) if task.END_THINK in tokens else len(tokens)
    p_keep = rng.uniform(0.0, keep_max)
    start = task.QUESTION_TOKENS
    reads = task.read_values(tokens, "chain") if any(t in task.QUERY_KEYS for t in tokens[start:end]) else []
    for v in reads:  # chain: the results later steps read (key and value); none in a copy trace
        kept[v - 1 : v + 1] = True
    if shape == "steps":
        for i in range(start, end):
            if tokens[i] in task.RESULT_KEYS and (tokens[i] == asked or rng.random() < p_keep):
                first = i - KEY_OFFSET
                kept[max(start, first) : first + task.STEP_TOKENS] = True
        return kept, rng.randint(*window), p_keep
    for i in range(start, end):  # every other shape keeps the asked key and its value
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


@torch.no_grad()
def add_attention_ranked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Widen the masks of the ``attention``-shaped rows of ``batch`` in place: each keeps the top
    ``rank_keep[r]`` share of its candidate thinking slots by the attention they receive.

    ``batch``: ``input_ids`` ``[B, T]``, ``attention_mask`` ``[B, 1, T, T]`` bool, ``rank_rows``
    ``[R]`` row indices, ``rank_keep`` ``[R]`` shares, ``rank_candidates`` ``[R, T]`` bool, ``lengths``
    ``[B]``. One eager, full-context forward of those rows gives ``[R, heads, T, T]`` per layer.
    """
    rows = batch["rank_rows"]
    ids = batch["input_ids"][rows]
    T = ids.shape[1]
    real = torch.arange(T)[None, :] < batch["lengths"][rows][:, None]  # [R, T]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, attention_mask=real.long(), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    received = sum(a.float().sum(1) for a in out.attentions)  # [R, T(query), T(key)]
    received = (received * real[:, :, None]).sum(1)  # [R, T]: attention each key received
    mask = batch["attention_mask"]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for r, row in enumerate(rows.tolist()):
        candidates = batch["rank_candidates"][r]
        count = math.ceil(float(batch["rank_keep"][r]) * int(candidates.sum()))
        if count == 0:
            continue
        top = received[r].masked_fill(~candidates, float("-inf")).topk(count).indices
        mask[row, 0][:, top] = causal[:, top]
