"""Attention rows without TxT matrices.

A custom attention function (registered with transformers as ``"dynts_sdpa"``) runs SDPA as usual
and, when a recorder is active, also computes ``softmax(q k^T)`` for the query rows of the current
forward only: ``[b, heads, q, n]``, i.e. one row per decoded token, never the full ``T x T`` matrix.
Eviction statistics (H2O, SnapKV, R-KV) and answer-to-thinking importance both come from here.

Memory: a prefill of ``M`` tokens has ``M`` query rows, and ``[b, h_q, M, M]`` fp32 probabilities are
~14 GiB per layer for a 4k prompt at batch 8 with 28 heads. With ``chunk_rows`` the rows are computed
and handed to the recorder ``chunk_rows`` at a time (:func:`attention_row_chunks`), so the peak is
``O(b * h_q * chunk_rows * n)`` and the recorder reduces each chunk before the next one exists.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "RECORD_CHUNK_ROWS", "attention_row_chunks", "attention_rows", "recording_attention"]

ATTN_IMPLEMENTATION = "dynts_sdpa"
RECORD_CHUNK_ROWS = 64  # query rows per chunk when a cache records statistics (dynts.attach)
Recorder = Callable[..., None]  # (module, probs) or, with chunk_rows, (module, probs, first_row)
_RECORDER: ContextVar[Recorder | None] = ContextVar("dynts_attention_recorder", default=None)
_LAST_ROWS: ContextVar[int | None] = ContextVar("dynts_attention_last_rows", default=None)
_CHUNK_ROWS: ContextVar[int | None] = ContextVar("dynts_attention_chunk_rows", default=None)
# the same three values for a torch.compile'd step (dynamo cannot trace ContextVar.get: a graph break per layer)
_COMPILED_VIEW: list = [None, None, None]


def attention_rows(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Attention probabilities of the given query rows.

    Args:
        query: ``[b, h_q, q, d]``; key: ``[b, h_kv, n, d]`` (grouped-query heads share their KV head).
        attention_mask: bool ``[b, 1, q, n]`` (True = attend) / additive float, or ``None`` for a
            plain causal mask aligned to the last ``q`` keys.
        scaling: softmax scale, default ``d ** -0.5``.

    Returns ``[b, h_q, q, n]`` float32.

    Precision (as kvpress): ``q k^T`` runs in the model's dtype, reading the key cache where it is
    (no float32 copy of every layer's keys at every step); the logits are then cast to float32 for
    the mask, the softmax and everything the caller accumulates. In float32 models nothing changes;
    in bfloat16 the logits carry bfloat16 rounding (relative ~4e-3), as in the peers' own code.
    """
    b, hq, q, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    # Query head i reads KV head i // (hq // hk) (transformers' repeat_kv order): fold each group's
    # heads into the query rows of its KV head instead of copying the keys once per query head.
    grouped = (query.to(key.dtype) * scale).reshape(b, hk, (hq // hk) * q, d)
    logits = torch.matmul(grouped, key.transpose(-1, -2)).view(b, hq, q, n).float()
    del grouped
    if attention_mask is None:
        if q == 1:  # a single new row attends to every stored key
            return torch.softmax(logits, dim=-1)
        rows = torch.arange(n - q, n, device=query.device)[:, None]
        logits.masked_fill_(torch.arange(n, device=query.device)[None, :] > rows, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits.masked_fill_(~attention_mask[..., -n:], float("-inf"))
    else:
        logits.add_(attention_mask[..., -n:])
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)


def attention_row_chunks(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
    chunk_rows: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """:func:`attention_rows` computed ``chunk_rows`` query rows at a time.

    Yields ``(first_row, probs)`` with ``probs`` ``[b, h_q, c, n]`` float32 equal to
    ``attention_rows(...)[:, :, first_row : first_row + c]`` (``c <= chunk_rows``), in row order.
    Only one chunk (and its logits) is alive at a time: peak ``O(b * h_q * chunk_rows * n)``.
    """
    q, n = query.shape[2], key.shape[2]
    for start in range(0, q, chunk_rows):
        stop = min(q, start + chunk_rows)
        mask = attention_mask
        if mask is None:
            if q > 1:  # causal: row i of the forward is key column n - q + i
                col = torch.arange(n, device=query.device)
                row = torch.arange(n - q + start, n - q + stop, device=query.device)
                mask = (col[None, :] <= row[:, None])[None, None]
        elif mask.shape[-2] > 1:
            mask = mask[..., start:stop, :]
        yield start, attention_rows(query[:, :, start:stop], key, mask, scaling)


def _recording_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    out = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )
    compiling = torch.compiler.is_compiling()
    recorder = _COMPILED_VIEW[0] if compiling else _RECORDER.get()
    if recorder is not None:
        first = 0
        rows = _COMPILED_VIEW[1] if compiling else _LAST_ROWS.get()
        if rows is not None and rows < query.shape[2]:  # only the last `rows` queries (answer rows)
            first = query.shape[2] - rows
            query = query[:, :, -rows:]
            if attention_mask is not None and attention_mask.shape[-2] > 1:
                attention_mask = attention_mask[..., -rows:, :]
        scale = scaling if scaling is not None else module.scaling
        chunk = _COMPILED_VIEW[2] if compiling else _CHUNK_ROWS.get()
        if chunk is None:
            recorder(module, attention_rows(query, key, attention_mask, scale))
        else:
            for start, probs in attention_row_chunks(query, key, attention_mask, scale, chunk):
                recorder(module, probs, first + start)
                del probs
    return out


AttentionInterface.register(ATTN_IMPLEMENTATION, _recording_sdpa)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@contextmanager
def recording_attention(
    model: torch.nn.Module, recorder: Recorder, last_rows: int | None = None, chunk_rows: int | None = None
) -> Iterator[None]:
    """Within the block, every attention layer of ``model`` calls ``recorder(module, probs)``.

    ``last_rows``: compute ``probs`` only for the last ``last_rows`` query rows of each forward
    (``[b, heads, last_rows, n]``), e.g. the answer rows of a full-sequence forward; default: all rows.
    ``chunk_rows``: compute the rows ``chunk_rows`` at a time and call
    ``recorder(module, probs, first_row)`` once per chunk, ``first_row`` being the index of the
    chunk's first row among the forward's query rows (peak memory ``O(b * h * chunk_rows * n)``
    instead of ``O(b * h * q * n)``); default: one call with all rows.
    """
    if last_rows is not None and (not isinstance(last_rows, int) or last_rows < 1):
        raise ValueError(f"last_rows={last_rows!r} must be a positive int or None (all query rows)")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int or None (all rows at once)")
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    token = _RECORDER.set(recorder)
    rows_token = _LAST_ROWS.set(last_rows)
    chunk_token = _CHUNK_ROWS.set(chunk_rows)
    outer = list(_COMPILED_VIEW)
    _COMPILED_VIEW[:] = [recorder, last_rows, chunk_rows]
    try:
        yield
    finally:
        _COMPILED_VIEW[:] = outer
        _CHUNK_ROWS.reset(chunk_token)
        _LAST_ROWS.reset(rows_token)
        _RECORDER.reset(token)
        model.set_attn_implementation(previous)
