"""A :class:`~dynts.cache.BoundedCache` whose rows are independent sequences (KV-Rescue forks).

KV-Rescue decodes many candidate steps at once: ``n_base`` forks of every problem in flight, each a
copy of that problem's evicted cache (paper, Appendix C: "forks N base candidates by physically
copying that sequence's live (post-eviction) KV slots"). The rows of one batch therefore hold
different numbers of real tokens, and each row must evict exactly when it would on its own.

:class:`RaggedCache` keeps the parent's storage (in-place K/V buffers, one slot table) and adds:

* per-row bookkeeping: ``row_seen`` (tokens the row has seen = its next position id),
  ``row_question`` and ``row_keep`` (its prompt length and ``n_keep``);
* per-row eviction: a row evicts when *its own* real tokens would overflow the budget, and the
  evictor sees only the evicting rows (grouped by ``n_keep``), so a row's kept set never depends on
  the other rows of the batch;
* :meth:`stack`: a new cache made of chosen rows of one or more caches (repeats allowed: forking
  ``n`` candidates is ``stack([(cache, [row] * n)])``), copying only live entries. The result shares
  no storage with its sources, so decoding a fork never changes the state it was forked from.

Layout invariant: within a row, real slots are in arrival order and right-aligned after
:meth:`stack` and after every eviction (left fillers are marked :attr:`Segment.PAD`, so attention
masks them and evictors drop them first, exactly as they treat left padding). Tokens fed as padding
(``attention_mask`` 0: a finished candidate riding along in the batch) leave PAD slots that are
squeezed out at the next eviction or :meth:`stack`.

The model must be called with ``position_ids = cache.position_ids(valid)`` (rows sit at different
positions); everything else goes through :func:`dynts.attach` as usual.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..cache import BoundedCache, CacheStats, incoming_tokens
from ..evictors.base import Segment, TokenInfo
from ..kernels import compact_torch_

__all__ = ["RaggedCache"]

_TABLES = ("positions", "segments", "token_ids", "scores", "attention")
_FILL = {"positions": 0, "segments": int(Segment.PAD), "token_ids": 0, "scores": float("nan"), "attention": 0.0}


class RaggedCache(BoundedCache):
    """Bounded cache with independent rows (see the module docstring).

    Constructed like :class:`BoundedCache`; the first forward (the prompt, usually one row) sets each
    row's question length and ``n_keep`` from its real (non-padding) prompt tokens.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_seen: torch.Tensor | None = None  # [b] tokens seen per row = next position id
        self.row_question: torch.Tensor | None = None  # [b] prompt tokens per row
        self.row_keep: torch.Tensor | None = None  # [b] n_keep per row (bounded caches)
        self._new_counts: torch.Tensor | None = None
        self.row_evictions: torch.Tensor | None = None  # [b] eviction events per row

    # ------------------------------------------------------------------ per-row views
    @property
    def batch_size(self) -> int:
        return 0 if self.positions is None else self.positions.shape[0]

    def real_counts(self) -> torch.Tensor:
        """``[b]`` real (non-padding) tokens stored per row."""
        return (self.segments[:, : self.length] != Segment.PAD).sum(1)

    def position_ids(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids ``[b, q]`` of the next forward's tokens; ``valid`` ``[b, q]`` marks real ones
        (pads get the position of the next real token; they are masked anyway)."""
        seen = self.row_seen if self.row_seen is not None else torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        return seen[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, input_ids, attention_mask, batch_size, query_length, device):
        q = query_length
        input_ids, new_valid = incoming_tokens(input_ids, attention_mask, batch_size, q, device)
        if self.positions is None:
            self._allocate(batch_size, q, device)
            counts = new_valid.sum(1)
            self.row_question = counts
            self.row_seen = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.row_evictions = torch.zeros(batch_size, dtype=torch.long, device=device)
            if self.bounded:
                keep = [self.budget.n_keep(int(c)) for c in counts.tolist()]
                self.row_keep = torch.tensor(keep, dtype=torch.long, device=device)
            segments = torch.where(new_valid, int(Segment.QUESTION), int(Segment.PAD))
        else:
            if self.bounded:
                real = self.real_counts()
                due = (real + new_valid.sum(1) > self.budget.budget) & (real > self.row_keep)
                if bool(due.any()):
                    self.evict_rows(due)
            # padding never closes the thinking segment, whatever its id
            segments = self._generated_segments(input_ids.masked_fill(~new_valid, -1), new_valid)
        self._record_incoming(self.position_ids(new_valid), segments, input_ids)
        self._new_counts = new_valid.sum(1)
        mask = self._slot_mask()
        return None if bool(mask.all()) else mask

    def end_forward(self) -> None:
        super().end_forward()
        self.row_seen = self.row_seen + self._new_counts
        self.seen = max(self.seen, int(self.row_seen.max()))

    # ------------------------------------------------------------------ eviction
    def evict(self) -> torch.Tensor:
        """Evict every row holding more real tokens than the budget (e.g. after a multi-token forward)
        down to its ``n_keep``; returns ``[b]`` bool, the rows evicted."""
        if not self.bounded:
            return torch.zeros(self.batch_size, dtype=torch.bool)
        due = self.real_counts() > self.budget.budget
        if bool(due.any()):
            self.evict_rows(due)
        return due

    def evict_rows(self, due: torch.Tensor) -> None:
        """One eviction event for the rows where ``due`` ``[b]`` is True; other rows keep all real slots."""
        info = self.token_info()
        rows = due.nonzero().flatten()
        if "scores" in self.requires:
            stale = info.scores[rows].isnan() & (info.segments[rows] == Segment.THINKING)
            if bool(stale.any()):
                raise RuntimeError(
                    f"method={self.evictor.name!r} needs predictor scores but some thinking tokens have none; "
                    "pass predictor=..."
                )
        keep = info.valid.clone()
        groups = torch.stack([self.row_keep[rows], self.row_question[rows]], 1)
        for n_keep, question in torch.unique(groups, dim=0).tolist():
            members = rows[(groups[:, 0] == n_keep) & (groups[:, 1] == question)]
            kept = self.evictor(_subset(info, members, n_keep, question))
            row_keep = torch.zeros(len(members), info.shape[1], dtype=torch.bool, device=kept.device)
            keep[members] = row_keep.scatter_(1, kept, True)
        before = self.real_counts()
        self._squeeze(keep)
        self.stats.evictions += 1
        self.stats.evicted_tokens += int((before - self.real_counts()).sum())
        self.stats.event_steps.append(self.seen)
        self.row_evictions = self.row_evictions + due.long()

    def _squeeze(self, keep: torch.Tensor) -> None:
        """Compact every row to its ``keep`` ``[b, n]`` slots, right-aligned, fillers marked PAD.

        The ragged twin of :meth:`dynts.cache.BoundedCache.apply_kept`: there every row keeps the
        same ``k`` slots; here rows keep different counts, so each row's gather list is its
        non-kept slots (fillers, marked PAD) followed by its kept ones. That list is not ascending,
        so the K/V gather uses the torch reference :func:`dynts.kernels.compact_torch_` (the Triton
        kernel needs ascending indices to compact in place).
        """
        n = self.length
        counts = keep.sum(1)
        width = int(counts.max()) if keep.numel() else 0
        order = torch.sort(keep.long(), dim=1, stable=True).indices[:, n - width :]  # fillers, then kept (ascending)
        filler = torch.arange(width, device=keep.device)[None, :] < (width - counts)[:, None]
        compact_torch_([t for layer in self.layers if layer.is_initialized for t in (layer.keys, layer.values)], order, n)
        for name in _TABLES:
            t = getattr(self, name)
            if t is not None:
                t[:, :width] = t[:, :n].gather(1, order)
                t[:, :width].masked_fill_(filler, _FILL[name])
        if self.window_attention is not None:
            w = self.window_attention.shape[1]
            idx = order[:, None, :].expand(-1, w, -1)
            self.window_attention[:, :, :width] = self.window_attention[:, :, :n].gather(2, idx)
            self.window_attention[:, :, :width].masked_fill_(filler[:, None, :], 0.0)
        self.length = width

    # ------------------------------------------------------------------ rows
    @classmethod
    def stack(cls, parts: Sequence[tuple["RaggedCache", Sequence[int] | torch.Tensor]]) -> "RaggedCache":
        """A new cache holding, in order, the given rows of each part (repeats allowed).

        Only live real entries are copied (right-aligned to the longest selected row); statistics
        counters start fresh. Call between forwards only.
        """
        parts = [(c, torch.as_tensor(rows, dtype=torch.long).flatten()) for c, rows in parts]
        parts = [(c, rows) for c, rows in parts if rows.numel()]
        if not parts:
            raise ValueError("stack() needs at least one row")
        first = parts[0][0]
        for c, rows in parts:
            if c.positions is None or c.pending:
                raise RuntimeError("stack() needs caches that have run a forward and have none in flight")
            if c.evictor is not first.evictor or c.budget != first.budget or len(c.layers) != len(first.layers):
                raise ValueError("stack() parts must share one evictor, budget and model")
            if int(rows.min()) < 0 or int(rows.max()) >= c.batch_size:
                raise ValueError(f"rows {rows.tolist()} out of range for a cache of {c.batch_size} rows")
        device = first.positions.device
        parts = [(c, rows.to(device)) for c, rows in parts]
        counts = [c.real_counts()[rows] for c, rows in parts]
        width = int(torch.cat(counts).max())
        total = sum(len(rows) for _, rows in parts)
        capacity = max(max(c.capacity for c, _ in parts), width + 1)

        new = cls(
            len(first.layers), first.evictor, first.budget, think_end_token_id=first.think_end_token_id,
            observation_window=first.observation_window, keys_layer=first.keys_layer,
        )
        new.capacity, new.length = capacity, width
        new.n_keep, new.question_length, new._window_fresh = first.n_keep, first.question_length, True
        for name in _TABLES:
            if getattr(first, name) is not None:
                src = getattr(first, name)
                setattr(new, name, torch.full((total, capacity), _FILL[name], dtype=src.dtype, device=device))
        if first.window_attention is not None:
            new.window_attention = torch.zeros(total, first.window_attention.shape[1], capacity, device=device)
        for dst, src in zip(new.layers, first.layers):
            if src.is_initialized:
                dst.device, dst.dtype, dst.is_initialized = src.device, src.dtype, True
                dst.keys = src.keys.new_zeros(total, src.keys.shape[1], capacity, src.keys.shape[3])
                dst.values = src.values.new_zeros(total, src.values.shape[1], capacity, src.values.shape[3])

        start = 0
        for (c, rows), count in zip(parts, counts):
            n, g = c.length, len(rows)
            w = min(width, n)
            valid = c.segments[rows, :n] != Segment.PAD
            order = torch.sort(valid.long(), dim=1, stable=True).indices[:, n - w :]  # [g, w]
            filler = torch.arange(w, device=device)[None, :] < (w - count)[:, None]
            out = slice(start, start + g)
            for name in _TABLES:
                src = getattr(c, name)
                if src is not None:
                    block = src[rows, :n].gather(1, order).masked_fill(filler, _FILL[name])
                    getattr(new, name)[out, width - w : width] = block
            if c.window_attention is not None:
                wa = c.window_attention[rows][:, :, :n]
                block = wa.gather(2, order[:, None, :].expand(-1, wa.shape[1], -1)).masked_fill(filler[:, None, :], 0.0)
                new.window_attention[out, :, width - w : width] = block
            for dst, src in zip(new.layers, c.layers):
                if src.is_initialized:
                    for name in ("keys", "values"):
                        t = getattr(src, name)[rows, :, :n]
                        idx = order[:, None, :, None].expand(g, t.shape[1], w, t.shape[3])
                        getattr(dst, name)[out, :, width - w : width] = t.gather(2, idx)
            start += g

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(c, name) for c, _ in parts]
            return None if values[0] is None else torch.cat([v[rows] for v, (_, rows) in zip(values, parts)])

        new.row_seen, new.row_question, new.row_keep = cat("row_seen"), cat("row_question"), cat("row_keep")
        new.row_evictions = cat("row_evictions")
        new.in_answer, new.think_match = cat("in_answer"), cat("think_match")
        new.seen = max(width, int(new.row_seen.max()))
        new.stats = CacheStats()
        return new


def _subset(info: TokenInfo, rows: torch.Tensor, n_keep: int, question_length: int) -> TokenInfo:
    """The :class:`TokenInfo` of ``rows`` only, with their own ``n_keep`` and question length."""
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return TokenInfo(
        positions=info.positions[rows],
        segments=info.segments[rows],
        token_ids=info.token_ids[rows],
        n_keep=int(n_keep),
        local_window=info.local_window,
        question_length=int(question_length),
        scores=pick(info.scores),
        attention=pick(info.attention),
        window_attention=pick(info.window_attention),
        keys=pick(info.keys),
    )
