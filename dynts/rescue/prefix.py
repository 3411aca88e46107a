"""Prefix reuse for causal PRMs: a trajectory's committed context is encoded once and extended by
one step per round, and the candidates of a step are scored as continuations of it.

A PRM scores candidate ``s`` of step ``t`` on ``context_t + s``. Without reuse every candidate of
every step re-encodes the whole trajectory (``O(T)`` tokens per candidate, ``O(T^2)`` per
problem); with it each round costs the new committed step plus the candidates' own tokens. This
is only valid for causal backbones (Qwen2.5-Math-PRM and the testbed PRM are causal decoders);
:class:`PrefixScorer` checks it once against a full forward and switches itself off otherwise.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Sequence

import torch
from transformers import DynamicCache

from ..hf_compat import cache_keyword

__all__ = ["PrefixScorer", "reuse_tolerance"]


def reuse_tolerance(dtype: torch.dtype) -> float:
    """Largest label-probability difference between reuse and a full forward that :meth:`PrefixScorer.check`
    accepts for a PRM computing in ``dtype``: ``max(1e-4, 4 * eps)`` (fp32 1e-4, fp16 3.9e-3, bf16
    3.1e-2). A cache built by another forward sums in another order; in bf16 that alone moves the
    probabilities by ~1e-3 on a tiny model (more on deep ones), while a non-causal backbone changes
    them by far more (and is also refused by its ``config.is_causal``)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(1e-4, 4 * eps)


class PrefixScorer:
    """Scores rows of token ids at given positions, reusing encoded prefixes.

    Args:
        model: a token-classification model whose backbone takes a cache (``cache=`` on transformers 5.24,
            ``past_key_values=`` before: :func:`dynts.hf_compat.cache_keyword`).
        pad_id: id used to right-pad candidate suffixes.
        max_entries: prefixes kept (least recently used dropped first).
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, max_entries: int = 256):
        self.model, self.pad_id, self.max_entries = model, pad_id, max_entries
        self._cache_kw = cache_keyword(model)  # `past_key_values` before transformers 5.24 (a `cache=` is dropped)
        self.store: OrderedDict[tuple[int, ...], DynamicCache] = OrderedDict()
        self.verified: bool | None = None  # None: not checked yet
        self.prefix_tokens = 0  # tokens encoded as prefixes (for cost accounting)
        self.suffix_tokens = 0

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache | None) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=cache is not None, **{self._cache_kw: cache})
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out[0]

    def _prefix(self, prefix: tuple[int, ...]) -> DynamicCache:
        """The cache of ``prefix``, extending the longest stored prefix of it (which it replaces)."""
        best = None
        for key in self.store:
            if len(key) <= len(prefix) and (best is None or len(key) > len(best)) and prefix[: len(key)] == key:
                best = key
        cache = self.store.pop(best) if best is not None else DynamicCache()
        new = prefix[len(best) :] if best is not None else prefix
        if new:
            self._logits(torch.tensor([list(new)], device=self._device()), None, cache)
            self.prefix_tokens += len(new)
        self.store[prefix] = cache
        while len(self.store) > self.max_entries:
            self.store.popitem(last=False)
        return cache

    @torch.no_grad()
    def score_group(self, rows: Sequence[list[int]], positions: Sequence[int]) -> torch.Tensor:
        """Label probabilities ``[len(rows), labels]`` at ``positions`` for rows that share a prefix
        (the candidates of one step of one problem)."""
        shared = min(positions)
        first = rows[0]
        for row in rows[1:]:
            n = 0
            while n < shared and row[n] == first[n]:
                n += 1
            shared = n
        cache = self._prefix(tuple(first[:shared]))
        suffixes = [row[shared:] for row in rows]
        width = max(len(s) for s in suffixes)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), shared + width, dtype=torch.long)
        mask[:, :shared] = 1
        for i, s in enumerate(suffixes):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, shared : shared + len(s)] = 1
        batch = copy.deepcopy(cache)
        if len(rows) > 1:
            batch.batch_repeat_interleave(len(rows))
        device = self._device()
        logits = self._logits(ids.to(device), mask.to(device), batch)
        self.suffix_tokens += sum(len(s) for s in suffixes)
        at = torch.tensor([p - shared for p in positions], device=logits.device)
        return logits[torch.arange(len(rows), device=logits.device), at].float().softmax(-1)

    @torch.no_grad()
    def check(self, rows: Sequence[list[int]], positions: Sequence[int], atol: float | None = None) -> bool:
        """Compare reuse with full forwards once; reuse stays on only for causal backbones.

        ``atol``: accepted label-probability difference; default :func:`reuse_tolerance` of the
        model's dtype."""
        if self.verified is None:
            if atol is None:
                atol = reuse_tolerance(next(self.model.parameters()).dtype)
            if getattr(self.model.config, "is_causal", True) is False:
                self.verified = False
                self.store.clear()
                return False
            try:
                reused = self.score_group(rows, positions)
                device = self._device()
                full = torch.stack([
                    self._logits(torch.tensor([row], device=device), None, None)[0, p].float().softmax(-1)
                    for row, p in zip(rows, positions)
                ])
                self.verified = bool(torch.allclose(reused, full, atol=atol))
            except (TypeError, ValueError, RuntimeError, AttributeError):
                self.verified = False
            if not self.verified:
                self.store.clear()
        return self.verified
