"""Forks that share the committed prefix: one copy of a problem's KV cache, however many candidates.

The full-context helper forks ``n_helper`` candidates from each problem's whole committed context at
every step. Copying that context per candidate costs ``n * T`` entries per problem per step (a
1.5B-shaped helper at 4k context and N = 8: ~0.9 GB); here a fork is a *reference* to the problem's
:class:`PrefixKV` plus a private tail holding only the candidate's own step.

* :class:`PrefixKV` -- one problem's committed K/V, every layer ``[1, h_kv, capacity, d]``,
  append-only (grown by doubling). A state names it with a length ``L``: entries past ``L``
  belong to later commits and are never read by that state.
* :class:`ForkCache` -- a batch of rows, each ``(prefix, L)`` + a private tail ``[rows, h_kv, T, d]``
  per layer. Row ``i``'s real tail slots are ``[start_i, end_i)``: rows are left-padded by a
  multi-token forward and stop growing when their candidate finishes (host ints, no device read).
* attention (registered as ``"dynts_fork"``): for each group of rows sharing a prefix, the queries
  are folded into one matmul against the prefix keys (no copy of them), the tail part is a batched
  matmul, and one softmax runs over both (exact attention, float32 softmax).
* committing a row (:meth:`ForkCache.commit`) appends its real tail to the prefix in place (copy on
  write if the prefix has grown past the row's ``L`` meanwhile), so the next fork of that problem
  again references one copy.

Evicted (bounded) caches keep copying their live rows (:class:`~dynts.rescue.rows.RaggedCache`):
they hold at most ``B`` entries, and each row evicts on its own schedule inside a step, which breaks
any sharing at its first eviction (the paper, Appendix C, copies them too).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["FORK_ATTENTION", "ForkCache", "PrefixKV"]

FORK_ATTENTION = "dynts_fork"
_ACTIVE: ContextVar["ForkCache | None"] = ContextVar("dynts_fork_cache", default=None)


class PrefixKV:
    """One problem's committed K/V for every layer, append-only; ``length`` entries are filled."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``[h, n, d]`` after the filled entries of ``layer`` (call
        :meth:`advance` once all layers are written)."""
        n, end = keys.shape[1], self.length + keys.shape[1]
        k, v = self.keys[layer], self.values[layer]
        if k is None or k.shape[2] < end:
            cap = max(end, 64, 2 * (k.shape[2] if k is not None else 0))
            grown_k = keys.new_zeros(1, keys.shape[0], cap, keys.shape[2])
            grown_v = values.new_zeros(1, values.shape[0], cap, values.shape[2])
            if k is not None:
                grown_k[:, :, : self.length] = k[:, :, : self.length]
                grown_v[:, :, : self.length] = v[:, :, : self.length]
            self.keys[layer], self.values[layer] = k, v = grown_k, grown_v
        k[0, :, self.length : end] = keys
        v[0, :, self.length : end] = values

    def advance(self, n: int) -> None:
        self.length += n

    def truncated(self, length: int) -> "PrefixKV":
        """A new prefix holding a copy of the first ``length`` entries (copy on write)."""
        new = PrefixKV(len(self.keys))
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and length:
                new.append(i, k[0, :, :length], v[0, :, :length])
        new.length = length
        return new

    @property
    def bytes(self) -> int:
        """Bytes allocated for this prefix (capacity included)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class _ForkLayer(CacheLayerMixin):
    """One layer's private tails ``[rows, h_kv, T, d]``; returns them (the prefix is read by attention)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "ForkCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True
        self.keys = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[3])
        self.values = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[3])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, q = self.owner.tail, key_states.shape[2]
        if self.keys.shape[2] < t + q:  # amortised doubling
            cap = max(t + q, 2 * self.keys.shape[2], 16)
            keys = self.keys.new_zeros(*self.keys.shape[:2], cap, self.keys.shape[3])
            values = self.values.new_zeros(*self.values.shape[:2], cap, self.values.shape[3])
            keys[:, :, :t], values[:, :, :t] = self.keys[:, :, :t], self.values[:, :, :t]
            self.keys, self.values = keys, values
        self.keys[:, :, t : t + q] = key_states
        self.values[:, :, t : t + q] = value_states
        return self.keys[:, :, : t + q], self.values[:, :, : t + q]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.tail + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.tail

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False


class ForkCache(Cache):
    """Rows that each reference a ``(PrefixKV, length)`` and own a private tail (module docstring).

    Args:
        num_layers: decoder layers of the model.
        refs: ``(prefix, length)`` per row; rows sharing a prefix should be consecutive (one matmul
            per run of equal references).
    """

    def __init__(self, num_layers: int, refs: Sequence[tuple[PrefixKV, int]]):
        super().__init__(layers=[_ForkLayer(self, i) for i in range(num_layers)])
        self.num_layers = num_layers
        self.refs = list(refs)
        self.tail = 0  # tail slots stored (the same for every row)
        self.start = [0] * len(self.refs)  # first real tail slot per row (host)
        self.end = [0] * len(self.refs)  # one past the last real tail slot per row (host)
        self.tail_mask: torch.Tensor | None = None  # [rows, 1, q, tail + q] during a forward
        self._pending: list[int] | None = None
        self._committed: dict[int, tuple[PrefixKV, int]] = {}
        self.groups = self._groups()

    def _groups(self) -> list[tuple[PrefixKV, int, int, int]]:
        """Runs of consecutive rows with the same reference: ``(prefix, length, first, stop)``."""
        out: list[tuple[PrefixKV, int, int, int]] = []
        for i, (prefix, length) in enumerate(self.refs):
            if out and out[-1][0] is prefix and out[-1][1] == length:
                out[-1] = (prefix, length, out[-1][2], i + 1)
            else:
                out.append((prefix, length, i, i + 1))
        return out

    @property
    def batch_size(self) -> int:
        return len(self.refs)

    def row_lengths(self) -> list[int]:
        """Tokens each row has seen (prefix + real tail) = its next position id."""
        return [length + e - s for (_, length), s, e in zip(self.refs, self.start, self.end)]

    def position_ids(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids ``[rows, q]`` of the next forward (pads get the next real position)."""
        seen = torch.tensor(self.row_lengths(), dtype=torch.long).to(valid.device, non_blocking=True)
        return seen[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)

    def begin_forward(self, counts: Sequence[int], query_length: int, device: torch.device) -> torch.Tensor:
        """Register a forward of ``query_length`` tokens per row, the last ``counts[i]`` of row ``i``
        real (left padding); returns the tail mask ``[rows, 1, q, tail + q]`` (real, causal)."""
        q, t = query_length, self.tail
        for i, n in enumerate(counts):
            if n:
                if self.end[i] == self.start[i]:  # nothing real yet: the row starts here
                    self.start[i] = self.end[i] = t + q - n
                elif self.end[i] != t or n != q:
                    raise RuntimeError("ForkCache rows must stay contiguous: a live row gets every query slot")
        self._pending = [self.end[i] + n for i, n in enumerate(counts)]
        start = torch.tensor(self.start, dtype=torch.long).to(device, non_blocking=True)
        end = torch.tensor(self._pending, dtype=torch.long).to(device, non_blocking=True)
        slots = torch.arange(t + q, device=device)
        real = (slots[None, :] >= start[:, None]) & (slots[None, :] < end[:, None])  # [rows, t + q]
        causal = slots[None, :] <= torch.arange(t, t + q, device=device)[:, None]  # [q, t + q]
        self.tail_mask = real[:, None, None, :] & causal[None, None]
        return self.tail_mask

    def end_forward(self, query_length: int) -> None:
        self.tail += query_length
        self.end, self._pending, self.tail_mask = self._pending, None, None

    def commit(self, row: int) -> tuple[PrefixKV, int]:
        """Append row ``row``'s real tail to its prefix (once) and return the new ``(prefix, length)``."""
        if row in self._committed:
            return self._committed[row]
        prefix, length = self.refs[row]
        n = self.end[row] - self.start[row]
        if n:
            if prefix.length != length:  # the prefix grew past this row meanwhile: copy on write
                prefix = prefix.truncated(length)
            for i, layer in enumerate(self.layers):
                sl = slice(self.start[row], self.end[row])
                prefix.append(i, layer.keys[row, :, sl], layer.values[row, :, sl])
            prefix.advance(n)
        self._committed[row] = (prefix, length + n)
        return self._committed[row]

    def select(self, rows: Sequence[int]) -> "ForkCache":
        """A new cache with the given rows (references kept; private tails copied)."""
        rows = list(rows)
        new = ForkCache(self.num_layers, [self.refs[r] for r in rows])
        new.tail, new.start, new.end = self.tail, [self.start[r] for r in rows], [self.end[r] for r in rows]
        index = None
        for dst, src in zip(new.layers, self.layers):
            if src.is_initialized:
                if index is None:
                    index = torch.tensor(rows, dtype=torch.long).to(src.keys.device, non_blocking=True)
                dst.device, dst.dtype, dst.is_initialized = src.device, src.dtype, True
                dst.keys, dst.values = src.keys[index], src.values[index]
        return new

    def shared_bytes(self) -> int:
        """Bytes of the distinct prefixes the rows reference."""
        return sum(p.bytes for p in {id(p): p for p, _ in self.refs}.values())

    def tail_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values))


def _fork_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Exact attention of ``query`` ``[rows, h_q, q, d]`` over each row's prefix and its tail ``key``/
    ``value`` ``[rows, h_kv, T, d]`` (``attention_mask``: the tail mask). Returns ``([rows, q, h_q, d], None)``."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError("dynts_fork attention runs only inside ForkCache forwards (StepDecoder.forward)")
    layer = module.layer_idx
    b, hq, q, d = query.shape
    hk = key.shape[1]
    g = hq // hk
    scale = scaling if scaling is not None else d**-0.5
    qs = (query * scale).to(key.dtype)
    tail = torch.matmul(qs.reshape(b, hk, g * q, d), key.transpose(-1, -2)).view(b, hq, q, -1).float()
    tail = tail.masked_fill(~attention_mask, float("-inf"))
    out = value.new_empty(b, hq, q, value.shape[-1])
    for prefix, length, lo, hi in cache.groups:
        n = hi - lo
        if length:
            kp, vp = prefix.keys[layer][0, :, :length], prefix.values[layer][0, :, :length]  # views: no copy
            folded = qs[lo:hi].reshape(n, hk, g * q, d).transpose(0, 1).reshape(hk, n * g * q, d)
            head = torch.matmul(folded, kp.transpose(-1, -2)).view(hk, n, g * q, length).transpose(0, 1)
            scores = torch.cat([head.reshape(n, hq, q, length).float(), tail[lo:hi]], dim=-1)
        else:
            scores = tail[lo:hi]
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(value.dtype)
        part = torch.matmul(probs[..., length:].reshape(n, hk, g * q, -1), value[lo:hi]).view(n, hq, q, -1)
        if length:
            p = probs[..., :length].reshape(n, hk, g * q, length).transpose(0, 1).reshape(hk, n * g * q, length)
            part = part + torch.matmul(p, vp).view(hk, n, g * q, -1).transpose(0, 1).reshape(n, hq, q, -1)
        out[lo:hi] = part
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FORK_ATTENTION, _fork_attention)
AttentionMaskInterface.register(FORK_ATTENTION, sdpa_mask)


@torch.no_grad()
def fork_forward(model: torch.nn.Module, cache: ForkCache, ids: torch.Tensor, valid: torch.Tensor,
                 counts: Sequence[int], cache_keyword: str) -> torch.Tensor:
    """One forward of ``ids`` ``[rows, q]`` (left-padded; ``counts`` real tokens per row, host ints)
    through ``cache``; returns the logits ``[rows, V]`` at the last position."""
    positions = cache.position_ids(valid)
    mask = cache.begin_forward(counts, ids.shape[1], ids.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation(FORK_ATTENTION)
    token = _ACTIVE.set(cache)
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1, use_cache=True,
                    **{cache_keyword: cache})
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(previous)
    cache.end_forward(ids.shape[1])
    return out.logits[:, -1].float()
