"""Golden-eviction importance: replay a bounded cache's events on a trace and keep what the future reads.

After ForesightKV's "golden eviction" (arXiv 2602.03203): the trace is replayed through the cache every
method shares (:class:`dynts.Budget`: ``B`` entries, the question window ``W_q`` and the local window
``W_l`` protected, ``n_keep`` entries kept at an event, events whenever the next token would overflow
``B``). At each event ``e`` (at position ``p_e``) an oracle that sees the rest of the trace keeps the
``S = n_keep - W_q - W_l`` candidates (cached thinking tokens older than the local window) that the
future reads most::

    F_e[j]     = future[j] over the rows i >= p_e only (thinking and answer rows; dynts.importance.future)
    kept_e     = top-S of { F_e[j] : j cached at p_e, W_q <= j < p_e - W_l }     (the others are evicted)
    golden[j]  = #{e : j in kept_e} / #{e : j a candidate at e}  +  1e-3 * F_0[j] / max_j F_0[j]

An extra event at the answer's first token (whether or not the budget forces one there) asks what the
answer needs, so every token older than the answer's local window faces at least one decision. The small
second term only orders tokens that survive the same share of their events (and the last ``W_l`` tokens,
which face none). ``B`` is ``budget`` or ``budget_fraction`` of the row's question + thinking length.

Memory: one forward with chunked attention rows (:func:`dynts.importance.future.far_attention`) whose
row groups are the intervals between events: ``[b, G, T]`` float32 (``G`` = events, ``~(T - B) / K + 1``
with ``K = B - n_keep``), and for ``reduce="max"`` one layer's ``[b, heads, G + 1, T]``. Cost at 7B x 16k:
the future label's (a few seconds per trace on an H100, estimated), plus ``G`` top-k selections over at
most ``B`` candidates; at ``B = 4k`` (25 %) and retention 0.4, ``G ~ 6``; at ``B = 1k``, ``G ~ 26`` and the
per-layer maxima take 28 x 27 x 16k x 4 B ~ 48 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.budget import Budget
from .answer import Importance, check_batch
from .future import FutureSettings, far_attention

__all__ = ["GoldenSettings", "event_positions", "golden_importance"]

TIE_BREAK = 1e-3


@dataclass(frozen=True)
class GoldenSettings:
    """The cache replayed by :func:`golden_importance`.

    Args:
        budget_fraction: ``B`` as a share of the row's question + thinking length (used when ``budget`` is None).
        budget: a fixed ``B`` in entries instead.
        local_window: ``W_l``.
        retention: share of the selection window kept at an event (:class:`dynts.Budget`).
        future: how the future's reads are counted (:class:`~dynts.importance.future.FutureSettings`).
    """

    budget_fraction: float = 0.25
    budget: int | None = None
    local_window: int = 16
    retention: float = 0.4
    future: FutureSettings = field(default_factory=FutureSettings)

    def __post_init__(self) -> None:
        if not 0.0 < float(self.budget_fraction) <= 1.0:
            raise ValueError(f"budget_fraction={self.budget_fraction!r} must lie in (0, 1] (e.g. 0.25)")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 2):
            raise ValueError(f"budget={self.budget!r} must be an int >= 2 or None (then budget_fraction sizes it)")
        if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or self.local_window < 0:
            raise ValueError(f"local_window={self.local_window!r} must be an int >= 0")
        if not 0.0 < float(self.retention) <= 1.0:
            raise ValueError(f"retention={self.retention!r} must lie in (0, 1]")
        if isinstance(self.future, dict):
            object.__setattr__(self, "future", FutureSettings(**self.future))

    def cache(self, prompt_length: int, answer_start: int) -> Budget:
        """The :class:`dynts.Budget` of a row (``B`` at least question + local window + 2)."""
        budget = self.budget if self.budget is not None else round(self.budget_fraction * answer_start)
        return Budget(max(budget, prompt_length + self.local_window + 2), self.local_window, float(self.retention))


def event_positions(cache: Budget, prompt_length: int, answer_start: int) -> list[int]:
    """Positions (real-token indices) of the events a row lives through while its thinking is decoded one
    token at a time under :meth:`dynts.Budget.due`, then the answer's first token (always an event here)."""
    n_keep = cache.n_keep(prompt_length)
    stored, events = prompt_length, []
    for position in range(prompt_length, answer_start):
        if cache.due(stored, 1, n_keep):
            events.append(position)
            stored = n_keep
        stored += 1
    return events + [answer_start]


@torch.no_grad()
def golden_importance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    answer_start: torch.Tensor | list[int],
    prompt_length: torch.Tensor | list[int],
    attention_mask: torch.Tensor | None = None,
    *,
    settings: GoldenSettings | None = None,
    return_hidden_states: bool = False,
) -> Importance:
    """``golden[j]`` of the module docstring for every token, from one forward pass.

    Args:
        model: a Hugging Face causal LM.
        input_ids: ``[b, T]`` question + thinking + answer, LEFT-padded when ``b > 1``.
        answer_start: ``[b]`` padded column of the first answer token (``T`` allowed: no answer).
        prompt_length: ``[b]`` real tokens of each row's question (the protected window ``W_q``).
        attention_mask: ``[b, T]`` 1 for real tokens, 0 for left padding.
        settings: :class:`GoldenSettings`.

    Returns :class:`~dynts.importance.Importance` with ``scores [b, T]`` float32 in ``[0, 1 + 1e-3]``:
    1 + tie-break on the question (always kept), 0 on padding and the answer.
    """
    settings = settings or GoldenSettings()
    starts, attention_mask = check_batch(input_ids, answer_start, attention_mask)
    b, length = input_ids.shape
    device = input_ids.device
    pads = attention_mask.long().argmax(dim=1).tolist()
    prompts = torch.as_tensor(prompt_length, dtype=torch.long).reshape(-1).tolist()
    if len(prompts) != b:
        raise ValueError(f"prompt_length has {len(prompts)} entries but input_ids has {b} rows; give one per row")
    events: list[list[int]] = []  # padded columns
    for row in range(b):
        real_start = int(starts[row]) - pads[row]
        if not 0 < prompts[row] < real_start:
            raise ValueError(f"prompt_length[{row}]={prompts[row]} must lie in (0, answer_start) = (0, {real_start}) "
                             "in the row's real tokens")
        cache = settings.cache(prompts[row], real_start)
        events.append([pads[row] + p for p in event_positions(cache, prompts[row], real_start)])
    groups = max(len(e) for e in events)
    columns = torch.arange(length, device=device)
    row_group = torch.full((b, length), groups, dtype=torch.long, device=device)
    for row, positions in enumerate(events):
        bounds = torch.tensor(positions, device=device)
        after = torch.bucketize(columns, bounds, right=True) - 1  # index of the last event at or before the row
        row_group[row] = torch.where(after >= 0, after, groups)
    reads, last_hidden = far_attention(model, input_ids, attention_mask, row_group, groups, settings.future)
    scores = torch.zeros(b, length, dtype=torch.float32, device=device)
    for row, positions in enumerate(events):
        pad, prompt = pads[row], prompts[row]
        cache = settings.cache(prompt, int(starts[row]) - pad)
        keep = cache.n_keep(prompt) - prompt - settings.local_window
        cached = torch.zeros(length, dtype=torch.bool, device=device)
        faced = torch.zeros(length, device=device)
        kept = torch.zeros(length, device=device)
        previous = pad + prompt
        for g, position in enumerate(positions):
            cached[previous:position] = True  # the tokens decoded since the last event
            previous = position
            candidates = cached.clone()
            candidates[max(position - settings.local_window, 0):] = False
            n = int(candidates.sum())
            if n == 0:
                continue
            future = reads[row, g].masked_fill(~candidates, float("-inf"))
            chosen = torch.topk(future, min(max(keep, 0), n)).indices
            survivors = torch.zeros_like(candidates)
            survivors[chosen] = True
            faced += candidates.float()
            kept += survivors.float()
            cached &= ~(candidates & ~survivors)  # evicted for good
        first = reads[row, 0]
        tie = TIE_BREAK * first / first.max().clamp(min=torch.finfo(first.dtype).tiny)
        scores[row] = kept / faced.clamp(min=1.0) + tie
        scores[row, pad : pad + prompt] = 1.0 + tie[pad : pad + prompt]
    answer = columns[None, :] >= starts[:, None]
    scores.masked_fill_(answer | attention_mask.eq(0), 0.0)
    return Importance(scores=scores, hidden_states=last_hidden if return_hidden_states else None)
