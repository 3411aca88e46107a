"""A stand-in model forward on the V2 stand-in runner (:class:`.vllm_v2_standin.StandInV2Runner`) that reads only
the runner's persistent buffers, so it can be captured in a CUDA graph and replayed as vLLM replays its FULL
decode graphs; and the capture.

:class:`StandInForward` ``(num_tokens, num_reqs)``, per layer: every token's K/V (:func:`.vllm_standin.kv_content`
of its logical position from ``input_buffers.positions`` and its batch row from ``query_start_loc``) written at
its slot from ``block_tables.slot_mappings`` (a padding slot ``-1`` writes into the null block 0, never read);
then, on a uniform decode batch (one token per request), attention of each token over its request's stored
slots: slots ``0 .. seq_lens[row] - 1`` read through ``input_block_tables`` (what the hooks lowered ``seq_lens``
to and gathered the tables for), causal inside the query, float32. The outputs ``[layers, T, kv_heads, head]``
land in the persistent ``out``; the final-norm hidden states returned are the runner's persistent random ones.
Nothing in it reads a value back to the host.

:class:`GraphedForward` captures ``StandInForward`` for one batch shape (``num_reqs`` requests of one token) with
``torch.cuda.graph`` when the runner is built -- before any request, on dummy buffers (slot mappings all padding,
block tables zero), as vLLM captures -- and from then on replays it for every batch of that shape; other shapes
(multi-token refills) run eagerly. :func:`reference_attention` is the same attention for one row from the K/V
the row should hold.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .vllm_standin import blocks_per_row, kv_content, kv_views, query_content

__all__ = ["GraphedForward", "StandInForward", "reference_attention"]


class StandInForward:
    """The forward (see the module docstring); ``attend``: attention on uniform decode batches too."""

    def __init__(self, runner: Any, attend: bool = True) -> None:
        shape = runner.shape
        self.runner, self.attend = runner, attend
        self.heads, self.head, self.block = shape["kv_heads"], shape["head"], shape["block"]
        self.width = blocks_per_row(shape) * self.block  # stored slots a row may hold
        self.views = kv_views(runner.kv_caches, self.head)
        self.out = torch.zeros(len(self.views), runner.max_num_reqs, self.heads, self.head, dtype=torch.float32,
                               device=runner.device)

    def __call__(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        runner, bs = self.runner, self.block
        buffers = runner.input_buffers
        positions = buffers.positions[:num_tokens]
        starts = buffers.query_start_loc[:num_reqs].to(torch.int64)
        ends = buffers.query_start_loc[1 : num_reqs + 1].to(torch.int64)
        token = torch.arange(num_tokens, device=positions.device)
        row = torch.searchsorted(ends, token, right=True).clamp_(max=num_reqs - 1)
        slots = runner.block_tables.slot_mappings[0, :num_tokens].clamp(min=0)  # padding -> the null block
        block, offset = torch.div(slots, bs, rounding_mode="floor"), slots % bs
        for layer, (key, value) in enumerate(self.views):
            k, v = kv_content(positions, row, self.heads, self.head, layer, key.dtype)
            key[block, offset] = k
            value[block, offset] = v
        if self.attend and num_tokens == num_reqs:  # a uniform decode batch
            self._attend(positions, row, token - starts[row], ends[row] - starts[row], num_reqs)
        return runner.hidden[:num_tokens]

    def _attend(self, positions: torch.Tensor, row: torch.Tensor, index: torch.Tensor, length: torch.Tensor,
                num_reqs: int) -> None:
        """Attention of each token ``[T]`` over its row's stored slots (``index``: its place in the row's query of
        ``length`` tokens, the last ``length`` stored slots)."""
        bs, runner = self.block, self.runner
        seq_lens = runner.input_buffers.seq_lens[:num_reqs].to(torch.int64)
        tables = runner.block_tables.input_block_tables[0][:num_reqs, : self.width // bs].to(torch.int64)
        j = torch.arange(self.width, device=positions.device)
        blocks = tables[row][:, j // bs]  # [T, width]
        offsets = (j % bs).expand_as(blocks)
        stored_at = seq_lens[row] - length + index  # the token's own stored slot
        hidden = (j[None, :] > stored_at[:, None])[:, None, :]  # [T, 1, width]: not yet stored, or another query's
        q = query_content(positions, row, self.heads, self.head)  # [T, heads, head]
        unread = hidden[:, 0, :, None, None]  # [T, width, 1, 1]: slots an attention kernel never loads
        for layer, (key, value) in enumerate(self.views):
            # [T, width, heads, head]; what was never written may hold NaN, and 0 * NaN is NaN
            k = key[blocks, offsets].float().masked_fill(unread, 0.0)
            v = value[blocks, offsets].float().masked_fill(unread, 0.0)
            scores = torch.einsum("thd,twhd->thw", q, k) / math.sqrt(self.head)
            p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
            self.out[layer, : positions.shape[0]] = torch.einsum("thw,twhd->thd", p, v)


def reference_attention(positions: list[int], row: int, heads: int, head: int, layers: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """``[layers, heads, head]``: attention of a row's last stored token over the K/V of its stored
    ``positions`` (logical, in slot order), computed directly from :func:`.vllm_standin.kv_content`."""
    pos = torch.tensor(positions, device=device)
    rows = torch.full_like(pos, row)
    q = query_content(pos[-1:], rows[-1:], heads, head)[0]  # [heads, head]
    out = []
    for layer in range(layers):
        k, v = kv_content(pos, rows, heads, head, layer, dtype)
        scores = torch.einsum("hd,whd->hw", q, k.float()) / math.sqrt(head)
        out.append(torch.einsum("hw,whd->hd", torch.softmax(scores, dim=-1), v.float()))
    return torch.stack(out)


class GraphedForward:
    """:class:`StandInForward` captured in a CUDA graph for ``num_reqs`` one-token requests (see the module
    docstring); ``replays`` counts the replays."""

    def __init__(self, forward: StandInForward, num_reqs: int, warmup: int = 2) -> None:
        runner = forward.runner
        self.forward, self.num_reqs, self.replays = forward, num_reqs, 0
        buffers, tables = runner.input_buffers, runner.block_tables
        buffers.query_start_loc.copy_(torch.arange(runner.max_num_reqs + 1, device=runner.device).clamp_(max=num_reqs))
        buffers.seq_lens.fill_(1)
        buffers.positions.zero_()
        tables.slot_mappings.fill_(-1)
        tables.input_block_tables[0].zero_()
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                forward(num_reqs, num_reqs)
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.hidden = forward(num_reqs, num_reqs)

    def __call__(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        if num_tokens == num_reqs == self.num_reqs:
            self.graph.replay()
            self.replays += 1
            return self.hidden
        return self.forward(num_tokens, num_reqs)
