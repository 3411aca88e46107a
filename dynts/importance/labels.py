"""One entry point for every importance label, and batching of unpadded traces.

:data:`LABELS` (each module's docstring has its equation and its cost at 7B x 16k tokens):

- ``answer``: the attention the answer rows pay each token (the DynTS paper's Eq. 6; :mod:`.answer`);
- ``future``: the strongest far read later thinking rows make of it, per layer and head, sinks left out
  (:mod:`.future`);
- ``golden``: the share of a replayed bounded cache's events at which an oracle reading the future keeps
  it (ForesightKV's golden eviction; :mod:`.golden`);
- ``counterfactual``: the rise in the continuation's loss when it is evicted (:mod:`.counterfactual`;
  ``O(T)`` forwards: small models only).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..prompts import pad_rows
from .answer import Importance, answer_importance
from .counterfactual import CounterfactualSettings, counterfactual_importance
from .future import FutureSettings, future_importance
from .golden import GoldenSettings, golden_importance

__all__ = ["LABELS", "label_settings", "sequence_importance", "token_importance"]

LABELS = ("answer", "future", "golden", "counterfactual")
SETTINGS = {"future": FutureSettings, "golden": GoldenSettings, "counterfactual": CounterfactualSettings}


def label_settings(label: str, values: dict[str, Any] | None = None) -> Any:
    """The settings object of ``label`` built from ``values`` (``None`` for ``answer``, which has none)."""
    if label not in LABELS:
        raise ValueError(f"label={label!r} must be one of {LABELS}")
    values = dict(values or {})
    if label == "answer":
        if values:
            raise ValueError(f"the answer label takes no settings, got {sorted(values)}")
        return None
    from dataclasses import fields

    known = {f.name for f in fields(SETTINGS[label])}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {label} label settings {unknown}; valid: {sorted(known)}")
    return SETTINGS[label](**values)


@torch.no_grad()
def token_importance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    answer_start: torch.Tensor | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    *,
    label: str = "answer",
    prompt_length: torch.Tensor | Sequence[int] | None = None,
    settings: Any = None,
    return_hidden_states: bool = False,
) -> Importance:
    """``label``'s scores ``[b, T]`` float32 for left-padded ``input_ids [b, T]``.

    ``prompt_length [b]`` (real question tokens per row) is needed by ``golden`` (the protected window) and
    ``counterfactual`` (only thinking tokens are scored when given). ``settings``: the label's settings
    object or a dict of its fields (:func:`label_settings`).
    """
    if settings is None or isinstance(settings, dict):
        settings = label_settings(label, settings)
    common = dict(attention_mask=attention_mask, return_hidden_states=return_hidden_states)
    if label == "answer":
        return answer_importance(model, input_ids, answer_start, **common)
    if label == "future":
        return future_importance(model, input_ids, answer_start, settings=settings, **common)
    if prompt_length is None and label == "golden":
        raise ValueError("label='golden' needs prompt_length (the question's tokens per row, kept by every cache)")
    if label == "golden":
        return golden_importance(model, input_ids, answer_start, prompt_length, settings=settings, **common)
    positions = None
    if prompt_length is not None:  # score the thinking only
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        pads = mask.long().argmax(dim=1)
        starts = pads + torch.as_tensor(prompt_length, dtype=torch.long, device=pads.device).reshape(-1)
        positions = torch.arange(input_ids.shape[1], device=pads.device)[None, :] >= starts[:, None]
    return counterfactual_importance(model, input_ids, answer_start, positions=positions, settings=settings, **common)


def sequence_importance(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    answer_starts: Sequence[int],
    *,
    label: str = "answer",
    prompt_lengths: Sequence[int] | None = None,
    settings: Any = None,
    max_batch_tokens: int = 16384,
    return_hidden_states: bool = False,
    pad_token_id: int = 0,
) -> list[Importance]:
    """:func:`token_importance` for unpadded sequences of different lengths.

    Sequences are grouped (by length) into left-padded batches of at most ``max_batch_tokens`` padded
    tokens (one sequence per batch when it alone is longer). ``answer_starts[i]`` (and ``prompt_lengths[i]``)
    index ``sequences[i]``. Returns one :class:`Importance` per sequence, in input order, with
    ``scores [T_i]`` and ``hidden_states [T_i, d]`` (or ``None``).
    """
    if len(sequences) != len(answer_starts):
        raise ValueError(f"got {len(sequences)} sequences but {len(answer_starts)} answer_starts; give one per sequence")
    if prompt_lengths is not None and len(prompt_lengths) != len(sequences):
        raise ValueError(f"got {len(sequences)} sequences but {len(prompt_lengths)} prompt_lengths; give one per sequence")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} must be >= 1")
    if settings is None or isinstance(settings, dict):
        settings = label_settings(label, settings)
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    results: list[Importance | None] = [None] * len(sequences)
    batch: list[int] = []

    def flush() -> None:
        ids, mask = pad_rows([sequences[i] for i in batch], pad_token_id)
        width = ids.shape[1]
        starts = [width - len(sequences[i]) + int(answer_starts[i]) for i in batch]
        prompts = [int(prompt_lengths[i]) for i in batch] if prompt_lengths is not None else None
        out = token_importance(model, ids.to(device), starts, mask.to(device), label=label, prompt_length=prompts,
                               settings=settings, return_hidden_states=return_hidden_states)
        for row, i in enumerate(batch):
            n = len(sequences[i])
            hidden = out.hidden_states[row, width - n :] if out.hidden_states is not None else None
            results[i] = Importance(scores=out.scores[row, width - n :], hidden_states=hidden)
        batch.clear()

    for i in order:
        if not sequences[i]:
            raise ValueError(f"sequences[{i}] is empty")
        if batch and len(sequences[i]) * (len(batch) + 1) > max_batch_tokens:
            flush()
        batch.append(i)
    if batch:
        flush()
    return results  # type: ignore[return-value]
