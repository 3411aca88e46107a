"""Future-attention importance: what later rows read from a token from outside the local window.

The answer label (:mod:`dynts.importance.answer`) sees only what the answer reads. This label scores a
token by the attention the *later thinking rows* pay it from more than ``window`` tokens away, the reads
a bounded cache must serve after the local window has moved on::

    C(i)      = { j : first_real + sinks <= j < i - window }            # row i's far, non-sink keys
    a_lh(i,j) = p_lh(i,j)                              normalize="none"
              = p_lh(i,j) / sum_{j' in C(i)} p_lh(i,j')  normalize="row"   (each row's far mass sums to 1)
    future[j] = sum_layers sum_heads  reduce_{i : j in C(i), i < answer_start}  a_lh(i,j)

``reduce="sum"`` adds the rows up (a token read a little by many rows scores like one read hard once);
``reduce="max"`` keeps, per layer and head, the strongest single read (a lookup scores ~1, a broadly
attended word stays low). ``sinks`` leading real tokens (the attention sink, e.g. ``<bos>``) are neither
scored nor counted in a row's far mass. Each head's softmax already sums to 1 over all keys (``"none"``);
``"row"`` renormalises it over the far keys, which lifts heads that barely look past the window.

Defaults (``normalize="none"``, ``reduce="max"``, ``sinks=1``, ``window=16``) were chosen on the testbed's dev
traces (``python -m eval.analyses.label_diagnostic --variants``, docs/testbed.md, "Which tokens the labels
pick"): recall of the counterfactual's top 24 tokens, mean of seeds 1-3, chain / copy: ``none``+``max`` 47 /
60 %, ``row``+``max`` 36 / 51 %, ``none``+``sum`` 35 / 47 %, ``row``+``sum`` 30 / 39 %. ``sinks`` changed
nothing there (the sink is inside the question, and it only enters a row's far mass under ``"row"``); it
stays 1 for models whose sink is not a question token.

Memory: the rows go through :func:`dynts.attention.recording_attention` ``chunk_rows`` at a time, so the
peak is ``O(b * heads * chunk_rows * T)`` plus the accumulator (``[b, T]`` for ``sum``; ``[b, heads, G, T]``
for one layer with ``max``, ``G`` row groups, 1 here). Never a ``T x T`` matrix.

Cost at 7B (28 layers, 28 query heads, head dim 128) x 16k tokens: one forward (~2.3e14 FLOPs) plus every
attention row recomputed once in fp32 (28 x 28 x 16k^2 ~ 2.1e11 probabilities, ~1.3e13 FLOPs for
``q k^T``, memory-bound softmax and masking): a few seconds per trace on an H100 (estimated from the
counts, not measured), quadratic in ``T`` like the prefill's attention. Peak extra memory at
``chunk_rows=64``: 28 x 64 x 16k fp32 ~ 117 MiB per live chunk tensor (a few at once), plus
``[28, 16k]`` per-layer maxima.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import recording_attention
from .answer import Importance, check_batch, final_hidden_states

__all__ = ["FutureSettings", "far_attention", "future_importance"]

NORMALIZE = ("none", "row")
REDUCE = ("sum", "max")


@dataclass(frozen=True)
class FutureSettings:
    """How far reads are counted (:func:`future_importance`, and the golden label's future).

    Args:
        window: ``W``: reads from at most ``W`` tokens back are left out (the local window keeps those).
        sinks: leading real tokens neither scored nor counted in a row's far mass (attention sinks).
        normalize: ``"none"`` (each head's softmax as it is) or ``"row"`` (each row's far attention, per layer
            and head, renormalised to sum to 1).
        reduce: ``"max"`` (the strongest read per layer and head) or ``"sum"`` (all reads added).
        chunk_rows: attention rows computed at a time (peak memory ``O(b * heads * chunk_rows * T)``).
    """

    window: int = 16
    sinks: int = 1
    normalize: str = "none"
    reduce: str = "max"
    chunk_rows: int = 64

    def __post_init__(self) -> None:
        for name in ("window", "sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int) or self.chunk_rows < 1:
            raise ValueError(f"chunk_rows={self.chunk_rows!r} must be a positive int (e.g. 64)")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize={self.normalize!r} must be one of {NORMALIZE}")
        if self.reduce not in REDUCE:
            raise ValueError(f"reduce={self.reduce!r} must be one of {REDUCE}")


@torch.no_grad()
def far_attention(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_group: torch.Tensor,
    groups: int,
    settings: FutureSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Far reads summed over layers and heads, per group of rows and every later group.

    Args:
        input_ids, attention_mask: ``[b, T]``, left-padded.
        row_group: ``[b, T]`` long: the group ``0 .. groups - 1`` of each query row; ``groups`` (or more)
            leaves the row out.
        groups: ``G``.

    Returns ``(reads [b, G, T] float32, last_hidden [b, T, d])``: ``reads[:, g, j]`` is ``future[j]`` of the
    module docstring over the rows of groups ``>= g`` only (for ``reduce="max"`` the max runs over those rows
    per layer and head before the heads and layers are summed).
    """
    b, length = input_ids.shape
    device = input_ids.device
    trash = groups  # one extra group collects the rows left out
    row_group = row_group.to(device).clamp(max=trash)
    first = attention_mask.long().argmax(dim=1) + settings.sinks  # [b] first scored column
    cols = torch.arange(length, device=device)
    total = torch.zeros(b, groups + 1, length, dtype=torch.float32, device=device)
    layer_max: dict[int, torch.Tensor] = {}  # id(module) -> [b, heads, G + 1, T]; one layer alive at a time

    def flush() -> None:
        for state in layer_max.values():  # suffix max over groups per head, then the heads added
            kept = state[:, :, :groups]  # the left-out rows' group is not anyone's future
            total[:, :groups].add_(kept.flip(2).cummax(dim=2).values.flip(2).sum(1).to(total.device))
        layer_max.clear()

    def record(module: torch.nn.Module, probs: torch.Tensor, first_row: int) -> None:
        # probs: [b, h, c, T] for query rows first_row .. first_row + c - 1 (the forward's rows are its columns)
        dev = probs.device
        c = probs.shape[2]
        rows = torch.arange(first_row, first_row + c, device=dev)
        group = row_group.to(dev)[:, first_row : first_row + c]  # [b, c]
        far = (cols.to(dev)[None, None, :] < rows[None, :, None] - settings.window) & (
            cols.to(dev)[None, None, :] >= first.to(dev)[:, None, None]) & (group < trash)[:, :, None]
        reads = probs * far[:, None]  # [b, h, c, T]
        if settings.normalize == "row":
            reads = reads / reads.sum(-1, keepdim=True).clamp(min=torch.finfo(reads.dtype).tiny)
        if settings.reduce == "sum":
            index = (torch.arange(b, device=dev)[:, None] * (groups + 1) + group).reshape(-1)  # [b * c]
            summed = reads.sum(1).reshape(b * c, length)
            total.view(b * (groups + 1), length).index_add_(0, index.to(total.device), summed.to(total.device))
            return
        key = id(module)
        if key not in layer_max:
            flush()  # a new layer: the previous one is complete
            layer_max[key] = torch.zeros(b, probs.shape[1], groups + 1, length, dtype=torch.float32, device=dev)
        state = layer_max[key]
        h = probs.shape[1]
        index = ((torch.arange(b, device=dev)[:, None, None] * h + torch.arange(h, device=dev)[None, :, None])
                 * (groups + 1) + group[:, None, :])  # [b, h, c]
        state.view(b * h * (groups + 1), length).index_reduce_(
            0, index.reshape(-1), reads.reshape(b * h * c, length), "amax", include_self=True)

    with recording_attention(model, record, chunk_rows=settings.chunk_rows):
        last_hidden = final_hidden_states(model, input_ids, attention_mask)
    flush()
    total = total[:, :groups]
    if settings.reduce == "sum":  # rows of groups >= g
        total = total.flip(1).cumsum(dim=1).flip(1)
    return total, last_hidden


@torch.no_grad()
def future_importance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    answer_start: torch.Tensor | list[int],
    attention_mask: torch.Tensor | None = None,
    *,
    settings: FutureSettings | None = None,
    return_hidden_states: bool = False,
) -> Importance:
    """``future[j]`` of the module docstring for every token, from one forward pass.

    Args:
        model: a Hugging Face causal LM (attention through ``ALL_ATTENTION_FUNCTIONS``).
        input_ids: ``[b, T]`` question + thinking (+ answer), LEFT-padded when ``b > 1``.
        answer_start: ``[b]`` padded column of the first answer token; rows from there on are not
            counted (the answer label covers them) and answer positions score 0. ``T`` when there is no answer.
        attention_mask: ``[b, T]`` 1 for real tokens, 0 for left padding (default: all ones).
        settings: :class:`FutureSettings` (default: the dev choice).
        return_hidden_states: also return the final hidden states ``[b, T, d]``.

    Returns :class:`~dynts.importance.Importance` with ``scores [b, T]`` float32 (0 on padding, sinks, answer).
    """
    settings = settings or FutureSettings()
    starts, attention_mask = check_batch(input_ids, answer_start, attention_mask)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
    thinking_rows = (columns < starts[:, None]) & attention_mask.bool()
    row_group = torch.where(thinking_rows, 0, 1)
    reads, last_hidden = far_attention(model, input_ids, attention_mask, row_group, 1, settings)
    scores = reads[:, 0].masked_fill(~thinking_rows, 0.0)
    return Importance(scores=scores, hidden_states=last_hidden if return_hidden_states else None)
