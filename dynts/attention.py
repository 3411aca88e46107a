"""Attention rows without TxT matrices.

A custom attention function (registered with transformers as ``"dynts_sdpa"``) runs SDPA as usual
and, when a recorder is active, also computes ``softmax(q k^T)`` for the query rows of the current
forward only: ``[b, heads, q, n]``, i.e. one row per decoded token, never the full ``T x T`` matrix.
Eviction statistics (H2O, SnapKV, R-KV) and answer-to-thinking importance both come from here.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "attention_rows", "recording_attention"]

ATTN_IMPLEMENTATION = "dynts_sdpa"
Recorder = Callable[[torch.nn.Module, torch.Tensor], None]
_RECORDER: ContextVar[Recorder | None] = ContextVar("dynts_attention_recorder", default=None)
_LAST_ROWS: ContextVar[int | None] = ContextVar("dynts_attention_last_rows", default=None)
# the same two values for a torch.compile'd step (dynamo cannot trace ContextVar.get: a graph break per layer)
_COMPILED_VIEW: list = [None, None]


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
    """
    b, hq, q, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    # Query head i reads KV head i // (hq // hk) (transformers' repeat_kv order): fold each group's
    # heads into the query rows of its KV head instead of copying the keys once per query head.
    grouped = (query.float() * scale).reshape(b, hk, (hq // hk) * q, d)
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)).view(b, hq, q, n)
    if attention_mask is None:
        if q == 1:  # a single new row attends to every stored key
            return torch.softmax(logits, dim=-1)
        rows = torch.arange(n - q, n, device=query.device)[:, None]
        logits = logits.masked_fill(torch.arange(n, device=query.device)[None, :] > rows, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask[..., -n:], float("-inf"))
    else:
        logits = logits + attention_mask[..., -n:].float()
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def _recording_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    out = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )
    compiling = torch.compiler.is_compiling()
    recorder = _COMPILED_VIEW[0] if compiling else _RECORDER.get()
    if recorder is not None:
        rows = _COMPILED_VIEW[1] if compiling else _LAST_ROWS.get()
        if rows is not None and rows < query.shape[2]:  # only the last `rows` queries (answer rows)
            query = query[:, :, -rows:]
            if attention_mask is not None and attention_mask.shape[-2] > 1:
                attention_mask = attention_mask[..., -rows:, :]
        recorder(module, attention_rows(query, key, attention_mask, scaling if scaling is not None else module.scaling))
    return out


AttentionInterface.register(ATTN_IMPLEMENTATION, _recording_sdpa)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@contextmanager
def recording_attention(model: torch.nn.Module, recorder: Recorder, last_rows: int | None = None) -> Iterator[None]:
    """Within the block, every attention layer of ``model`` calls ``recorder(module, probs)``.

    ``last_rows``: compute ``probs`` only for the last ``last_rows`` query rows of each forward
    (``[b, heads, last_rows, n]``), e.g. the answer rows of a full-sequence forward; default: all rows.
    """
    if last_rows is not None and (not isinstance(last_rows, int) or last_rows < 1):
        raise ValueError(f"last_rows={last_rows!r} must be a positive int or None (all query rows)")
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    token = _RECORDER.set(recorder)
    rows_token = _LAST_ROWS.set(last_rows)
    outer = list(_COMPILED_VIEW)
    _COMPILED_VIEW[:] = [recorder, last_rows]
    try:
        yield
    finally:
        _COMPILED_VIEW[:] = outer
        _LAST_ROWS.reset(rows_token)
        _RECORDER.reset(token)
        model.set_attn_implementation(previous)
