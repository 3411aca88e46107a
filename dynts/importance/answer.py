"""Answer-to-thinking importance (DynTS paper 3.1, Eq. 6 and appendix B.1) without ``T x T`` attention.

One forward pass over ``question + thinking + answer``; the attention of every answer token to every
earlier token, summed over all layers, all heads and all answer rows, gives one score per token::

    importance[j] = sum_layers sum_heads sum_{i >= answer_start} softmax(q_i k^T / sqrt(d))[j]

Only the answer rows ``[b, heads, N_answer, T]`` are ever computed (through
:func:`dynts.attention.recording_attention` with ``last_rows``), one layer at a time, and summed
into a ``[b, T]`` accumulator at once: memory stays linear in ``T`` (``scripts/bench_importance.py``).
Question tokens are scored too (the paper's Fig. 2, left); answer positions get 0.

Cost at 7B x 16k tokens: one forward (~2.3e14 FLOPs, well under a second of H100 compute) plus the
answer rows, ``28 x 28 x N_answer x 16k`` probabilities (~4e7 for a 100-token answer): linear in ``T`` for
a fixed answer length, memory ``O(b * heads * N_answer * T)``.

The final hidden states of the same forward (the input of the LM head, what the
:class:`~dynts.ImportancePredictor` reads) can be returned alongside, for predictor training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..attention import recording_attention

__all__ = ["Importance", "answer_importance", "check_batch", "decoder_body", "final_hidden_states"]


@dataclass
class Importance:
    """Output of :func:`answer_importance`.

    Attributes:
        scores: ``[b, T]`` float32 importance per token; 0 on answer positions and padding.
        hidden_states: ``[b, T, d]`` final (post-norm) hidden states, or ``None``.
    """

    scores: torch.Tensor
    hidden_states: torch.Tensor | None = None


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body without the LM head (skips ``T x vocab`` logits)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def check_batch(input_ids: torch.Tensor, answer_start, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(answer_start [b], attention_mask [b, T])`` on ``input_ids``' device, checked: 2-D ids, LEFT padding,
    one answer start per row after the row's first real token."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    b, length = input_ids.shape
    device = input_ids.device
    starts = torch.as_tensor(answer_start, dtype=torch.long, device=device).reshape(-1)
    if starts.numel() != b:
        raise ValueError(f"answer_start has {starts.numel()} entries but input_ids has {b} rows; give one per row")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    attention_mask = attention_mask.to(device)
    if attention_mask[:, -1].eq(0).any():
        raise ValueError("input_ids must be LEFT-padded (answers end every row); pad on the left")
    first_real = attention_mask.long().argmax(dim=1)
    if (starts <= first_real).any() or (starts > length).any():
        raise ValueError(f"answer_start={starts.tolist()} must lie after the first real token and at most at the end "
                         f"(length {length})")
    return starts, attention_mask


@torch.no_grad()
def final_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, S, d]`` post-norm final hidden states of left-padded ``input_ids`` ``[b, S]`` (no LM head).

    One forward of the decoder body with position ids counted over real tokens only (a left-padded
    row gets the positions it would have alone). Inputs move to the embedding's device.
    """
    device = model.get_input_embeddings().weight.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = decoder_body(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


@torch.no_grad()
def answer_importance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    answer_start: torch.Tensor | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    *,
    return_hidden_states: bool = False,
) -> Importance:
    """Importance of every token for the answer, from one forward pass.

    Args:
        model: a Hugging Face causal LM (any family whose attention goes through
            ``ALL_ATTENTION_FUNCTIONS``: Llama, Qwen2, Qwen3, Mistral, ...).
        input_ids: ``[b, T]`` question + thinking + answer, LEFT-padded when ``b > 1``.
        answer_start: ``[b]`` column (in the padded row) of the first answer token, e.g. the
            ``</think>`` delimiter; every column from there to ``T - 1`` is an answer row.
        attention_mask: ``[b, T]`` 1 for real tokens, 0 for left padding (default: all ones).
        return_hidden_states: also return the final hidden states ``[b, T, d]``.

    Returns:
        :class:`Importance` with ``scores [b, T]`` (float32, sum over layers, heads and answer rows).
    """
    starts, attention_mask = check_batch(input_ids, answer_start, attention_mask)
    b, length = input_ids.shape
    device = input_ids.device
    if (starts >= length).any():
        raise ValueError(f"answer_start={starts.tolist()} must lie before the end (length {length}): the answer "
                         "needs at least one row")
    rows = int(length - starts.min())
    # row r of the recorded block is column length - rows + r; it is an answer row of sequence b
    # when that column is >= answer_start[b]
    columns = torch.arange(length - rows, length, device=device)
    row_weight = (columns[None, :] >= starts[:, None]).float()  # [b, rows]
    scores = torch.zeros(b, length, dtype=torch.float32, device=device)

    def record(module: torch.nn.Module, probs: torch.Tensor) -> None:
        # probs: [b, heads, rows, T]; sum over heads and answer rows
        # a sharded model (device_map) runs each layer on its own device
        scores.add_(torch.einsum("bhrt,br->bt", probs, row_weight.to(probs.device)).to(scores.device))

    with recording_attention(model, record, last_rows=rows):
        last_hidden = final_hidden_states(model, input_ids, attention_mask)
    answer = torch.arange(length, device=device)[None, :] >= starts[:, None]
    scores.masked_fill_(answer | attention_mask.eq(0), 0.0)
    hidden = last_hidden if return_hidden_states else None
    return Importance(scores=scores, hidden_states=hidden)
