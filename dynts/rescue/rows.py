"""A :class:`~dynts.cache.BoundedCache` whose rows are independent sequences (KV-Rescue forks).

KV-Rescue decodes many candidate steps at once: ``n_base`` forks of every problem in flight, each a
copy of that problem's evicted cache (paper, Appendix C: "forks N base candidates by physically
copying that sequence's live (post-eviction) KV slots"). The rows of one batch therefore hold
different numbers of real tokens, and each row must evict exactly when it would on its own.

:class:`RaggedCache` keeps the parent's storage (in-place K/V buffers, one slot table) and adds:

* per-row bookkeeping: one :class:`Row` per row (tokens seen = its next position id, prompt length,
  ``n_keep``, real tokens stored, eviction events), host integers;
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

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..cache import BoundedCache, incoming_tokens
from ..cache.layout import Layout
from ..cache.parts import CacheConfig, RowLabels
from ..core.slots import SlotTable
from ..evictors.base import Segment

__all__ = ["RaggedCache", "Row"]


@dataclass
class Row:
    """One row's state, kept on the host (Python ints: a decode step reads nothing back).

    Attributes:
        question: prompt tokens (its ``W_q``).
        keep: ``n_keep`` at its events (``None``: the full cache).
        seen: tokens it has seen = its next position id.
        real: real (non-padding) tokens it stores.
        evictions: its eviction events.
    """

    question: int
    keep: int | None
    seen: int = 0
    real: int = 0
    evictions: int = 0


class RaggedCache(BoundedCache):
    """Bounded cache with independent rows (see the module docstring).

    Constructed like :class:`BoundedCache`; the first forward (the prompt, usually one row) sets each
    row's question length and ``n_keep`` from its real (non-padding) prompt tokens.
    """

    def _assemble(self, config: CacheConfig, kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], *,
                  rows: list[Row] | None = None, **parts) -> None:
        """Set up the cache from its parts (:meth:`BoundedCache._assemble`) and its rows (``None``: made
        by the first forward)."""
        super()._assemble(config, kv, **parts)
        # per-row bookkeeping, kept on the host (Python ints): a decode step reads nothing back
        self.rows = rows
        self.incoming: list[int] | None = None  # real tokens per row of the next forward (set by the caller)
        self._new_counts: list[int] | None = None

    # ------------------------------------------------------------------ per-row views
    @property
    def batch_size(self) -> int:
        return self.batch_rows

    def real_counts(self) -> torch.Tensor:
        """``[b]`` real (non-padding) tokens stored per row, counted on the device (for checks; the
        cache itself uses the host counts ``Row.real``)."""
        return (self.row_view(self.segments)[:, : self.length] != Segment.PAD).sum(1)

    def position_ids(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids ``[b, q]`` of the next forward's tokens; ``valid`` ``[b, q]`` marks real ones
        (pads get the position of the next real token; they are masked anyway)."""
        seen = [r.seen for r in self.rows] if self.rows is not None else [0] * valid.shape[0]
        seen = torch.tensor(seen, dtype=torch.long).to(valid.device, non_blocking=True)
        return seen[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, input_ids, attention_mask, batch_size, query_length, device):
        q = query_length
        input_ids, new_valid = incoming_tokens(input_ids, attention_mask, batch_size, q, device)
        counts = self.incoming if self.incoming is not None else new_valid.sum(1).tolist()  # prefills may read
        self.incoming = None
        if self.positions is None:
            self._allocate(batch_size, q, device)
            self.rows = [Row(c, self.budget.n_keep(int(c)) if self.bounded else None) for c in counts]
            segments = torch.where(new_valid, int(Segment.QUESTION), int(Segment.PAD))
        else:
            if self.bounded:
                due = [self.budget.due(r.real, n, r.keep) for r, n in zip(self.rows, counts)]
                if any(due):
                    self.evict_rows(due)
            # padding never closes the thinking segment, whatever its id
            segments = self._generated_segments(input_ids.masked_fill(~new_valid, -1), new_valid)
        self._record_incoming(self.position_ids(new_valid), segments, input_ids)
        self._new_counts = list(counts)
        stored = self.length + q
        dense = all(r.real + n == stored for r, n in zip(self.rows, counts))
        return None if dense else self._slot_mask_4d(q)

    def _slot_mask_4d(self, q: int) -> torch.Tensor:
        """The ``[b, 1, q, length + q]`` boolean mask over the stored and pending slots (real ones,
        causal among the ``q`` new ones), built on the device. A 4-D mask reaches attention as it is,
        so the model never inspects it on the host (a 2-D one is checked with ``.all()``)."""
        n = self.length + q
        mask = (self.row_view(self.segments)[:, :n] != Segment.PAD)[:, None, None, :]
        causal = torch.arange(n, device=mask.device)[None, :] <= torch.arange(n - q, n, device=mask.device)[:, None]
        return mask & causal

    def end_forward(self) -> None:
        super().end_forward()
        for row, n in zip(self.rows, self._new_counts):
            row.seen += n
            row.real += n
        self.seen = max(self.seen, max(r.seen for r in self.rows))

    # ------------------------------------------------------------------ eviction
    def evict(self) -> None:
        """Run one eviction event now: every row holding more real tokens than its ``n_keep`` keeps ``n_keep``
        (the others keep all of theirs)."""
        if self.bounded and self.rows:
            due = [r.real > r.keep for r in self.rows]
            if any(due):
                self.evict_rows(due)

    def evict_overflow(self) -> list[bool]:
        """Evict every row holding more real tokens than the budget (e.g. after a multi-token forward)
        down to its ``n_keep``; returns the rows evicted (host list)."""
        if not self.bounded:
            return [False] * self.batch_size
        due = [self.budget.due(r.real, 0, r.keep) for r in self.rows]
        if any(due):
            self.evict_rows(due)
        return due

    def evict_rows(self, due: Sequence[bool]) -> None:
        """One eviction event for the rows where ``due`` (host bools) is True; other rows keep all real
        slots. Evicted rows end with exactly their ``n_keep`` real slots (pads go first, and a row is
        evicted only while it holds more real tokens than that). A score-based evictor always has
        scores here: :func:`dynts.attach` refuses it without a predictor."""
        picked = [(i, row.question, row.keep) for i, (row, d) in enumerate(zip(self.rows, due)) if d]
        selections = self.run_evictor(picked, check=False)
        keep = self.segments[:, : self.length] != Segment.PAD
        for sel in selections:
            chosen = torch.zeros(len(sel.members), keep.shape[1], dtype=torch.bool, device=sel.kept.device)
            keep[sel.rows] = chosen.scatter_(1, sel.kept, True)
        after = [row.keep if d else row.real for row, d in zip(self.rows, due)]
        self._squeeze(keep, max(after, default=0))
        self.stats.event(sum(r.real for r in self.rows) - sum(after), self.seen)
        for row, real, d in zip(self.rows, after, due):
            row.real = real
            row.evictions += int(d)

    def _squeeze(self, keep: torch.Tensor, width: int) -> None:
        """Compact every row to its ``keep`` ``[b, n]`` slots, right-aligned, fillers marked PAD.

        The ragged twin of :meth:`dynts.cache.BoundedCache.apply_kept`: there every row keeps the
        same ``k`` slots; here rows keep different counts, so each row's gather list is its
        non-kept slots (fillers, marked PAD) followed by its kept ones. That list is not ascending,
        so the K/V gather uses the torch reference :func:`dynts.kernels.compact_torch_` (the Triton
        kernel needs ascending indices to compact in place). ``keep`` has one row per table row
        (per layer and KV head with per-head selection).
        """
        n = self.length
        counts = keep.sum(1)  # [b * G] on the device; ``width`` (their max) comes from the host
        order = torch.sort(keep.long(), dim=1, stable=True).indices[:, n - width :]  # fillers, then kept (ascending)
        filler = torch.arange(width, device=keep.device)[None, :] < (width - counts)[:, None]
        self.compact_kv(order, n, ascending=False)
        self.table.compact(slice(None), order, filler)
        self.length = width

    # ------------------------------------------------------------------ rows
    def select(self, rows: Sequence[int]) -> "RaggedCache":
        """A new cache holding copies of ``rows`` (:meth:`stack` of this cache alone)."""
        return RaggedCache.stack([(self, rows)])

    @classmethod
    def stack(cls, parts: Sequence[tuple["RaggedCache", Sequence[int] | torch.Tensor]]) -> "RaggedCache":
        """A new cache holding, in order, the given rows of each part (repeats allowed).

        Only live real entries are copied (right-aligned to the longest selected row); statistics
        counters start fresh. Call between forwards only.
        """
        parts = [(c, [int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]) for c, rows in parts]
        parts = [(c, rows) for c, rows in parts if rows]
        if not parts:
            raise ValueError("stack() needs at least one row")
        first = parts[0][0]
        for c, rows in parts:
            if c.positions is None or c.pending:
                raise RuntimeError("stack() needs caches that have run a forward and have none in flight")
            if c.evictor is not first.evictor or c.budget != first.budget or len(c.layers) != len(first.layers):
                raise ValueError("stack() parts must share one evictor, budget and model")
            if min(rows) < 0 or max(rows) >= c.batch_size:
                raise ValueError(f"rows {rows} out of range for a cache of {c.batch_size} rows")
        device = first.positions.device
        counts = [[c.rows[r].real for r in rows] for c, rows in parts]
        width = max(max(cs) for cs in counts)
        hosts = parts
        parts = [(c, torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)) for c, rows in parts]
        total = sum(len(rows) for _, rows in parts)
        capacity = max(max(c.capacity for c, _ in parts), width + 1)

        groups = first.groups  # table rows per batch row (layers x KV heads with per-head selection)
        table = SlotTable(device, rows=total * groups, width=capacity, statistics=first.table.statistics,
                          window=first.table.window)
        kv = [None if not src.is_initialized else
              (src.keys.new_zeros(total, src.keys.shape[1], capacity, src.keys.shape[3]),
               src.values.new_zeros(total, src.values.shape[1], capacity, src.values.shape[3])) for src in first.layers]
        start = 0
        for (c, rows), count in zip(parts, counts):
            n, g = c.length, len(rows)
            w = min(width, n)
            table_rows = (rows[:, None] * groups + torch.arange(groups, device=device)).flatten()  # [g * G]
            valid = c.segments[table_rows, :n] != Segment.PAD
            order = torch.sort(valid.long(), dim=1, stable=True).indices[:, n - w :]  # [g * G, w]
            count = torch.tensor(count, dtype=torch.long).to(device, non_blocking=True).repeat_interleave(groups)
            filler = torch.arange(w, device=device)[None, :] < (w - count)[:, None]
            out = slice(start * groups, (start + g) * groups)
            for name, block in c.table.gathered(table_rows, order, filler):
                getattr(table, name)[out, ..., width - w : width] = block
            for index, (dst, src) in enumerate(zip(kv, c.layers)):
                if src.is_initialized:
                    heads = order.view(g, len(c.layers), -1, w)[:, index] if c.per_head else order[:, None]  # [g, h or 1, w]
                    for buffer, t in zip(dst, (src.keys[rows, :, :n], src.values[rows, :, :n])):
                        idx = heads[..., None].expand(g, t.shape[1], w, t.shape[3])
                        buffer[start : start + g, :, width - w : width] = t.gather(2, idx)
            start += g

        new_rows = [replace(c.rows[r]) for c, rows in hosts for r in rows]  # copies: a fork never changes its source
        config = CacheConfig(first.evictor, first.budget, first.think_end_token_id, first.observation_window, first.keys_layer,
                             kv_heads=first.kv_heads)
        labels = RowLabels.for_delimiter(first.think_end_token_id, torch.cat([c.in_answer[rows] for c, rows in parts]),
                                         torch.cat([c.think_match[rows] for c, rows in parts]))
        layout = Layout(length=width, seen=max(width, max(r.seen for r in new_rows)), capacity=capacity)
        return cls.from_parts(config, kv, layout=layout, table=table, labels=labels, n_keep=first.n_keep,
                              question_length=first.question_length, rows=new_rows)
