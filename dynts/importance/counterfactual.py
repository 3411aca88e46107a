"""Counterfactual importance: how much the continuation's loss rises when a token is evicted.

A token's key/value is removed from every row more than ``window`` tokens after it (the rows a bounded
cache serves after its local window has moved on; the rows inside the window still read it, as a cache's
local window does), and the loss of the tokens those rows predict is compared with the full cache's::

    l_t      = -log p(x_{t+1} | x_<=t)                      (full cache; row t predicts token t + 1)
    l_t^(-j) = the same with column j masked out of every row t > j + window
    cf[j]    = max(0, sum_{t > j + window, t < T - 1} (l_t^(-j) - l_t))

The rows include the answer's, so a token the answer needs counts as much as one a later step needs.
This is the ground truth the label diagnostic measures the other labels against
(``eval/analyses/label_diagnostic.py``).

Cost: one forward of the whole row per scored token (``copies`` of them batched per forward, each with
its own ``[T, T]`` boolean mask): ``O(T)`` forwards of length ``T``, ``O(copies * T^2)`` mask memory. On the
testbed, one CPU core: ~14 s for a 280-token trace of a chain LRM (4 layers x 256), ~2 s for 180 tokens of the
copy LRM (3 x 128), growing as ``T^2``. At 7B x 16k it is out of reach
(16k prefills of 16k tokens, ~2-3 hours per trace on an H100 even at full utilisation, and a
16k x 16k mask per copy): use it on small models, or on a sample of positions (``positions``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .answer import Importance, check_batch, decoder_body, final_hidden_states

__all__ = ["CounterfactualSettings", "counterfactual_importance", "token_losses"]


@dataclass(frozen=True)
class CounterfactualSettings:
    """Args:
        window: rows up to ``window`` tokens after the token still read it; only later rows' losses count.
        copies: masked copies of the row per forward (memory ``O(copies * T^2)`` for the masks).
        loss_chunk_rows: rows whose logits are formed at a time (``[copies, rows, vocab]``).
    """

    window: int = 16
    copies: int = 32
    loss_chunk_rows: int = 256

    def __post_init__(self) -> None:
        for name, low in (("window", 0), ("copies", 1), ("loss_chunk_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")


def token_losses(model: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """``[c, T - 1]`` float32 loss of token ``t + 1`` from final hidden states ``hidden [c, T, d]`` of rows
    ``ids [T]``; the logits are formed ``chunk_rows`` rows at a time (never ``[c, T, vocab]`` at once)."""
    head = model.get_output_embeddings()
    out = []
    for start in range(0, hidden.shape[1] - 1, chunk_rows):
        stop = min(hidden.shape[1] - 1, start + chunk_rows)
        logits = head(hidden[:, start:stop]).float().log_softmax(-1)
        target = ids[start + 1 : stop + 1].to(logits.device)
        out.append(-logits.gather(-1, target[None, :, None].expand(logits.shape[0], -1, 1))[..., 0])
    return torch.cat(out, dim=1)


@torch.no_grad()
def counterfactual_importance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    answer_start: torch.Tensor | list[int],
    attention_mask: torch.Tensor | None = None,
    *,
    positions: torch.Tensor | None = None,
    settings: CounterfactualSettings | None = None,
    return_hidden_states: bool = False,
) -> Importance:
    """``cf[j]`` of the module docstring for the scored tokens of every row.

    Args:
        model: a Hugging Face causal LM whose attention takes a 4-D boolean mask (sdpa, eager).
        input_ids: ``[b, T]``, LEFT-padded when ``b > 1`` (each row is scored on its real tokens alone).
        answer_start: ``[b]`` padded column of the first answer token; tokens from there on are not scored.
        attention_mask: ``[b, T]`` 1 for real tokens, 0 for left padding.
        positions: ``[b, T]`` bool, the tokens to score (default: every real token before the answer).
        settings: :class:`CounterfactualSettings`.

    Returns :class:`~dynts.importance.Importance` with ``scores [b, T]`` float32 (0 where not scored).
    """
    settings = settings or CounterfactualSettings()
    starts, attention_mask = check_batch(input_ids, answer_start, attention_mask)
    b, length = input_ids.shape
    device = input_ids.device
    columns = torch.arange(length, device=device)
    scored = (columns[None, :] < starts[:, None]) & attention_mask.bool()
    if positions is not None:
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids shape {tuple(input_ids.shape)}")
        scored &= positions.to(device).bool()
    decoder = decoder_body(model)
    scores = torch.zeros(b, length, dtype=torch.float32, device=device)
    for row in range(b):
        pad = int(attention_mask[row].long().argmax())
        ids = input_ids[row, pad:]
        n = ids.shape[0]
        pos = torch.arange(n, device=device)
        base_hidden = decoder(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state
        base = token_losses(model, base_hidden, ids, settings.loss_chunk_rows)[0]  # [n - 1]
        causal = pos[None, :] <= pos[:, None]  # [n, n] row attends column
        targets = (torch.nonzero(scored[row, pad:]).flatten()).tolist()
        for first in range(0, len(targets), settings.copies):
            chunk = torch.tensor(targets[first : first + settings.copies], device=device)
            c = chunk.numel()
            dropped = (pos[None, None, :] == chunk[:, None, None]) & (pos[None, :, None] > chunk[:, None, None] + settings.window)
            mask = (causal[None] & ~dropped)[:, None]  # [c, 1, n, n]
            hidden = decoder(input_ids=ids[None].expand(c, n), attention_mask=mask, position_ids=pos[None].expand(c, n),
                             use_cache=False).last_hidden_state
            rise = token_losses(model, hidden, ids, settings.loss_chunk_rows) - base[None]  # [c, n - 1]
            later = pos[None, : n - 1] > chunk[:, None] + settings.window
            scores[row, pad + chunk] = (rise * later).sum(1).clamp(min=0.0).to(scores.dtype)
    hidden = final_hidden_states(model, input_ids, attention_mask) if return_hidden_states else None
    return Importance(scores=scores, hidden_states=hidden)
