"""A bounded KV cache for transformers 5.x that asks an :class:`~dynts.evictors.Evictor` what to keep.

Layout: every layer stores K/V in a preallocated buffer ``[b, h_kv, capacity, d]`` written in place;
the cache keeps one table of per-slot metadata (absolute position, segment, token id, predictor
score, attention statistics) shared by all layers. An eviction event picks one ``[b, n_keep]`` index
tensor and compacts every layer's buffers and the table with it, in place.

Per-head selection (a ``per_head`` evictor, ``kv_heads`` given): the table holds one row per (batch row,
layer, KV head) -- ``G = layers x kv_heads`` rows per batch row, row ``r * G + l * kv_heads + h`` -- the
attention statistics are gathered per head (summed over the query heads of its group), and an event
compacts each head of each layer with its own ``n_keep`` slots. Every head keeps the same count, the
question and local window at the same slots and padding first, so slot ``j`` is valid for every head
at once and one mask serves all heads; the batch-row views (mask, labels) read each row's first head.

Positions stay absolute and keys are never re-rotated: ``get_seq_length()`` is the number of tokens
seen, and ``get_mask_sizes(q)`` is ``(stored + q, seen - stored)`` so the kept entries sit right before
the query in the causal mask. Padding and evicted gaps are handled by a per-slot validity mask that
:meth:`BoundedCache.begin_forward` hands to the model as its 2-D ``attention_mask``.

Static layout (``static=True``, what ``dynts.generate(..., compile=True)`` uses): the buffers have a
fixed capacity (``B``, or ``max_length`` for the full cache), allocated once. A single-token forward
(a decode step) then writes its K/V with ``index_copy_`` at a device index, returns the WHOLE buffers
``[b, h_kv, capacity, d]`` and gets a 4-D boolean mask ``[b, 1, 1, capacity]`` (the persistent
per-slot validity, unfilled and evicted slots False), so every decode step has the same shapes and
reads no host integer inside the model: it can be captured by ``torch.compile`` / CUDA graphs once.
Eviction events, the slot table's bookkeeping and multi-token forwards (prefill) run eagerly outside
the captured step, in :meth:`BoundedCache.begin_forward`. Layers keep ``is_compileable = False``: the
mask is always explicit, so transformers' own auto-compile (which would trace ``dynts.attach``'s
hooks) and its 4-D mask building in ``generate`` stay off.

The model must be driven through :func:`dynts.attach` (``dynts.generate`` does it), which calls
:meth:`begin_forward` / :meth:`end_forward` around each forward.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Self, Sequence

import torch
from transformers.cache_utils import Cache

from ..core.budget import Budget
from ..core.slots import EvictorCall, Selection, SlotTable, build_token_info, select_kept
from ..evictors.base import Evictor, Segment, TokenInfo
from ..kernels import compact_, compact_torch_
from .layers import BoundedLayer, StaticBoundedLayer, incoming_tokens, mark_static
from .layout import Layout
from .parts import CacheConfig, CacheStats, Part, RowLabels
from .scores import PredictorScores

__all__ = ["BoundedCache", "CacheStats"]


class BoundedCache(Cache):
    """KV cache bounded to a :class:`~dynts.core.budget.Budget`, evicting with ``evictor``.

    Args:
        num_layers: decoder layers of the model.
        evictor: the method; ``bounded = False`` evictors (``full``) ignore the budget.
        budget: the :class:`Budget`; ``None`` only for the full cache.
        think_end_token_id: token id, or sequence of ids, of the delimiter that closes the thinking
            segment (``</think>``, see :func:`dynts.thinking.think_end_ids`); the delimiter and the
            tokens after it are :attr:`Segment.ANSWER`. ``None``: every generated token is thinking.
        observation_window: number of recent query rows kept for ``window_attention`` (SnapKV);
            default: the evictor's ``observation_window`` field if it has one, else 8.
        keys_layer: layer whose keys feed ``TokenInfo.keys`` (R-KV); default the last one.
        static: fixed-capacity buffers and static-shape decode steps (see the module docstring).
        defer_scores: keep the final hidden states of eager decode steps (``[b, K, d]``, K the
            eviction volume) and score them in one batched predictor call at the next eviction event
            (or when :attr:`scores` is read through :meth:`flush_scores`), instead of a predictor
            call per step: the same scores from the same hidden states, without the per-step MLP.
        max_length: capacity of a static full (unbounded) cache: prompt + new tokens.
        kv_heads: the model's KV heads per layer (``num_key_value_heads``); needed by a ``per_head``
            evictor (:func:`dynts.build_cache` passes it).

    The cache is made of parts (each field of a part reads as an attribute of the cache): ``layout`` (its
    :class:`~dynts.cache.layout.Layout`, shared with its layers: ``length``, ``seen``, ``pending``,
    ``capacity``, ...), ``config`` (its :class:`~dynts.cache.parts.CacheConfig`: ``evictor``, ``budget``,
    ``bounded``, ``requires``, ...), ``table`` (its :class:`~dynts.core.SlotTable`, one row per batch row:
    ``positions``, ``segments``, ``token_ids``, ``scores``, ``attention``, ``window_attention``), ``labels``
    (:class:`~dynts.cache.parts.RowLabels`: ``in_answer``, ``think_match``), ``scorer`` and ``stats``.
    """

    def __init__(
        self,
        num_layers: int,
        evictor: Evictor,
        budget: Budget | None = None,
        *,
        think_end_token_id: int | Sequence[int] | None = None,
        observation_window: int | None = None,
        keys_layer: int = -1,
        static: bool = False,
        max_length: int | None = None,
        defer_scores: bool = False,
        kv_heads: int | None = None,
    ):
        if observation_window is None:
            observation_window = getattr(evictor, "observation_window", 8)
        config = CacheConfig(evictor, budget, think_end_token_id, observation_window, keys_layer % num_layers,
                             bool(static), max_length, bool(defer_scores), kv_heads)
        self._assemble(config, [None] * num_layers)

    @classmethod
    def from_parts(cls, config: CacheConfig, kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], **parts) -> Self:
        """A cache made of given parts: ``kv`` holds each layer's K/V buffers ``[b, h_kv, capacity, d]``
        (``None``: a layer not yet written); ``parts`` are the keywords of :meth:`_assemble`."""
        cache = cls.__new__(cls)
        cache._assemble(config, kv, **parts)
        return cache

    def _assemble(self, config: CacheConfig, kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], *,
                  layout: Layout | None = None, table: SlotTable | None = None, labels: RowLabels | None = None,
                  n_keep: int | None = None, question_length: int = 0) -> None:
        """Set up the cache from its parts (fresh ones where not given)."""
        self.config = config
        layer = StaticBoundedLayer if config.static else BoundedLayer
        self.layout = layout if layout is not None else Layout()  # the counters every layer reads, shared by reference
        super().__init__(layers=[layer(self.layout, i, buffers) for i, buffers in enumerate(kv)])
        self.labels = labels if labels is not None else RowLabels.for_delimiter(config.think_end_token_id)
        self.table = table  # per-slot metadata, allocated at the first forward
        self.scorer: PredictorScores | None = None  # set by dynts.attach with a predictor
        self.stats = CacheStats()
        self.n_keep = n_keep
        self.question_length = question_length

    # ------------------------------------------------------------------ forward protocol
    def begin_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      batch_size: int, query_length: int, device: torch.device) -> torch.Tensor | None:
        """Evict if the new tokens would overflow the budget, record their metadata, return the mask.

        Returns the 2-D ``attention_mask`` the model must use (``[b, seen + q]``), or ``None`` when
        every stored slot is a real token. Whether pads are held is a host flag, so a decode step
        never reads the device (no per-step sync on CUDA): the mask of a forward is read back once
        for prefills / multi-token forwards and on CPU; a single-token CUDA forward's mask entry is
        taken as 1, as ``generate`` always passes (send padding in multi-token forwards).
        """
        q = query_length
        input_ids, new_valid = incoming_tokens(input_ids, attention_mask, batch_size, q, device)
        if attention_mask is not None and (self.positions is None or q > 1 or new_valid.device.type == "cpu"):
            self.holds_pads = self.holds_pads or not bool(new_valid.all())
        if self.positions is None:
            self._allocate(batch_size, q, device)
            segments = torch.where(new_valid, int(Segment.QUESTION), int(Segment.PAD))
        else:
            if self.bounded and self.budget.due(self.length, q, self.n_keep):
                self.evict()
            segments = self._generated_segments(input_ids, new_valid)
        self._record_incoming(torch.arange(self.seen, self.seen + q, device=device), segments, input_ids)
        if self.static:
            self.slot_mask[:, self.length : self.length + q] = new_valid
            self.static_step = q == 1 and self.length + 1 <= self.capacity
            if self.static_step:
                self.write_index.fill_(self.length)
                self.seen_tensor.fill_(self.seen)
                return self.slot_mask[:, None, None, :]
        return self._slot_mask() if self.holds_pads else None

    def _record_incoming(self, positions: torch.Tensor, segments: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Write the metadata of a forward's ``q`` new tokens (``[b, q]`` or broadcastable) into the
        slots after ``length``; they become pending until :meth:`end_forward`."""
        b, q = input_ids.shape
        self._ensure_capacity(self.length + q)
        sl = slice(self.length, self.length + q)
        for name, value in (("positions", positions), ("segments", segments), ("token_ids", input_ids)):
            self.head_rows(getattr(self, name))[:, :, sl] = value.expand(b, q)[:, None]
        self.scores[:, sl] = float("nan")
        if self.attention is not None:
            self.attention[:, sl] = 0.0
        if self.window_attention is not None:
            self.window_attention[:, :, sl] = 0.0  # columns left stale by a compaction
            self._advance_window(q)
        self.pending = q
        self.stats.peak_cache_tokens = max(self.stats.peak_cache_tokens, self.length + q)

    def _slot_mask(self) -> torch.Tensor:
        """The 2-D ``[b, seen + pending]`` attention mask of the stored and pending slots: ones for the
        evicted prefix (those keys are gone; the model only sees ``length + pending`` of them), the
        slots' validity after it."""
        n = self.length + self.pending
        valid = self.row_view(self.segments)[:, :n] != Segment.PAD
        mask = torch.ones(valid.shape[0], self.seen + self.pending, dtype=torch.bool, device=valid.device)
        mask[:, self.seen - self.length :] = valid
        return mask

    def end_forward(self) -> None:
        """Commit the tokens of the forward that just ran."""
        self.length += self.pending
        self.seen += self.pending
        self.pending = 0
        self.static_step = False
        if not self.stats.kv_bytes_per_token:
            self.stats.kv_bytes_per_token = self.kv_bytes_per_token

    def write_scores(self, scores: torch.Tensor) -> None:
        """Store predictor scores ``[b, q]`` for the tokens of the forward in flight."""
        scores = scores.to(self.scores.device, torch.float32)
        if self.static_step:
            self.scores.index_copy_(1, self.write_index, scores.reshape(-1, 1))
            return
        self.scores[:, self.length : self.length + self.pending] = scores

    def score_hidden(self, hidden: torch.Tensor) -> None:
        """Predictor scores for the forward in flight from its final hidden states ``[b, q, d]``: now, or
        deferred to the next :meth:`flush_scores` (:class:`~dynts.cache.scores.PredictorScores`)."""
        if self.pending and self.scorer is not None:
            now = self.scorer.score(hidden, self.layout, self.scores, self.n_keep)
            if now is not None:
                self.write_scores(now)

    def flush_scores(self) -> None:
        """Score the decode steps whose hidden states were kept (one batched predictor call)."""
        if self.scorer is not None:
            self.scorer.flush(self.scores)

    # ------------------------------------------------------------------ statistics
    def record_attention(self, probs: torch.Tensor, first_row: int = 0, layer: int = 0) -> None:
        """Add the attention ``[b, heads, c, stored + q]`` of layer ``layer`` for the in-flight query rows
        ``first_row .. first_row + c`` (of the forward's ``q``; all of them by default;
        ``[b, heads, 1, capacity]`` in a static decode step: masked slots carry probability 0).

        The rows are reduced on the layer's device and only the sums (``[b, n]`` / ``[b, rows, n]``,
        per KV head with a ``per_head`` evictor) move to the table's device (layers of a sharded model
        live on several devices)."""
        probs = self._by_kv_head(probs)  # [b, H, group, c, n]: H = kv_heads per head, else 1
        if self.static_step:
            self._record_static_step(probs, layer)
            return
        n = self.length + self.pending
        device = self.positions.device
        if self.attention is not None:
            self._layer_rows(self.attention, layer)[..., :n] += probs.sum(dim=(2, 3)).to(device, torch.float32)
        if self.window_attention is not None:
            w, q = self.window_attention.shape[1], self.pending
            lo, hi = max(first_row, q - w), first_row + probs.shape[3]  # forward rows inside the window
            if lo < hi:
                rows = probs[:, :, :, lo - first_row : hi - first_row].sum(dim=2).to(device, torch.float32)
                self._add_window_rows(self._layer_rows(self.window_attention, layer), w - (q - lo), rows, n)

    def _record_static_step(self, probs: torch.Tensor, layer: int) -> None:
        """:meth:`record_attention` of a decode step over the whole buffer (no host integer read);
        ``probs`` ``[b, H, group, 1, capacity]``."""
        device = self.positions.device
        if self.attention is not None:
            self._layer_rows(self.attention, layer).add_(probs.sum(dim=(2, 3)).to(device, torch.float32))
        if self.window_attention is not None:  # the newest ring row, zeroed by begin_forward
            rows = probs.sum(dim=2).to(device, torch.float32)  # [b, H, 1, capacity]
            self._layer_rows(self.window_attention, layer).index_add_(2, self.window_row, rows)

    # ------------------------------------------------------------------ observation window (a ring)
    def _advance_window(self, q: int) -> None:
        """Make room for a forward's ``q`` query rows: the ``min(q, w)`` oldest ring rows become the
        newest, zeroed (eagerly, before the forward; the static decode step then adds to ``window_row``)."""
        w = self.window_attention.shape[1]
        s, head = min(q, w), self.window_head
        self.window_attention[:, head : head + s] = 0.0
        self.window_attention[:, : max(0, head + s - w)] = 0.0
        self.window_head = (head + s) % w
        if self.window_row is not None:
            self.window_row.fill_((self.window_head - 1) % w)

    def _add_window_rows(self, table: torch.Tensor, first: int, rows: torch.Tensor, n: int) -> None:
        """Add ``rows`` ``[b, H, c, n]`` to the window rows ``first .. first + c`` in time order (0 the
        oldest) of ``table`` ``[b, H, w, capacity]``, a ring starting at :attr:`window_head`."""
        w, c = table.shape[2], rows.shape[2]
        start = (self.window_head + first) % w
        wrap = max(0, start + c - w)
        table[:, :, start : start + c - wrap, :n] += rows[:, :, : c - wrap]
        if wrap:
            table[:, :, :wrap, :n] += rows[:, :, c - wrap :]

    def ordered_window_attention(self) -> torch.Tensor | None:
        """``window_attention`` ``[b * G, w, capacity]`` with its rows in time order (the oldest query
        row first), as evictors read it: the ring is rotated in place once, at an eviction event."""
        t = self.window_attention
        if t is not None and self.window_head:
            t.copy_(t.roll(-self.window_head, dims=1))
            self.window_head = 0
            if self.window_row is not None:
                self.window_row.fill_(t.shape[1] - 1)
        return t

    # ------------------------------------------------------------------ per-head rows
    @property
    def groups(self) -> int:
        """Table rows per batch row: ``layers x kv_heads`` with a ``per_head`` evictor, else 1."""
        return len(self.layers) * self.kv_heads if self.per_head else 1

    @property
    def batch_rows(self) -> int:
        """Batch rows the cache holds (``0`` before the first forward)."""
        return 0 if self.table is None else self.table.rows // self.groups

    def head_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A table column ``[b * G, ...]`` viewed as ``[b, G, ...]`` (``G`` = :attr:`groups`)."""
        return t.unflatten(0, (-1, self.groups))

    def row_view(self, t: torch.Tensor) -> torch.Tensor:
        """A table column ``[b * G, ...]`` at each batch row's first table row, ``[b, ...]``: the slot
        metadata every head shares (validity, labels; ``t`` itself without per-head selection)."""
        return t[:: self.groups]

    def _layer_rows(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """The table rows layer ``layer``'s attention feeds, ``[b, H, ...]`` (``H`` = KV heads, or 1)."""
        if not self.per_head:
            return t[:, None]
        return t.unflatten(0, (-1, len(self.layers), self.kv_heads))[:, layer]

    def _by_kv_head(self, probs: torch.Tensor) -> torch.Tensor:
        """``[b, h_q, c, n]`` -> ``[b, H, h_q / H, c, n]``: query heads grouped by the KV head they read
        (transformers' ``repeat_kv`` order), ``H = kv_heads`` with per-head selection, else 1."""
        heads = self.kv_heads if self.per_head else 1
        return probs.unflatten(1, (heads, probs.shape[1] // heads))

    # ------------------------------------------------------------------ eviction
    def token_info(self) -> TokenInfo:
        """Metadata of the stored slots as an evictor sees it."""
        self.flush_scores()
        self.ordered_window_attention()
        n = self.length
        keys = None
        if "keys" in self.requires and self.per_head:
            keys = self.reference_keys(torch.arange(self.table.rows, device=self.positions.device), n)
        elif "keys" in self.requires:
            keys = self.layers[self.keys_layer].keys[:, :, :n].to(self.positions.device)
        return build_token_info(self.table, n, self.n_keep, self.budget.local_window, self.question_length, keys=keys)

    def reference_keys(self, rows: torch.Tensor, stored: int) -> torch.Tensor:
        """The keys of table ``rows`` ``[g]`` on the table's device (R-KV): the reference layer's
        ``[g, h_kv, stored, d]``, or with per-head selection each row's own layer and head, ``[g, 1, stored, d]``.

        Per head, ``rows`` come in whole blocks of ``G`` (every layer and KV head of one batch row, in
        table order), as :meth:`run_evictor` and :meth:`token_info` pass them: only those batch rows'
        keys are copied, so a partial event (a ragged cache's few rows) moves only its own."""
        if not self.per_head:
            keys = self.layers[self.keys_layer].keys
            return keys[rows.to(keys.device), :, :stored].to(self.positions.device)
        if rows.numel() % self.groups:
            raise ValueError(f"per-head reference keys take whole batch rows: {rows.numel()} table rows is not a multiple of {self.groups}")
        device, batch_rows = self.positions.device, rows.view(-1, self.groups)[:, 0] // self.groups
        every = [layer.keys[batch_rows.to(layer.keys.device), :, :stored].to(device) for layer in self.layers]
        return torch.stack(every, 1).flatten(0, 2)[:, None]  # [g / G, L, h, n, d] -> [g, 1, n, d]

    def run_evictor(self, due: Sequence[tuple[int, int, int]], check: bool = True) -> list[Selection]:
        """The kept slots of the rows due: ``(row, question_length, n_keep)`` each, storing ``length`` slots
        (:func:`dynts.core.slots.select_kept`, one evictor call per group; pending scores flushed first)."""
        self.flush_scores()
        self.ordered_window_attention()
        evictor, window, n, groups = self.evictor, self.budget.local_window, self.length, self.groups
        calls = [(row, row * groups + g, EvictorCall(evictor, window, question, n, keep))
                 for row, question, keep in due for g in range(groups)]
        return select_kept(self.table, calls, self.reference_keys if "keys" in self.requires else None, check)

    def evict(self) -> None:
        """Run one eviction event now: every row keeps its ``n_keep`` slots."""
        (selection,) = self.run_evictor([(row, self.question_length, self.n_keep) for row in range(self.batch_rows)])
        self.apply_kept(selection.kept)

    def compact_kv(self, kept: torch.Tensor, length: int, ascending: bool = True) -> None:
        """Gather the ``kept`` slots ``[b * G, k]`` (one row per table row) of every layer's K/V buffers to
        their front. ``ascending=False``: a gather list that is not ascending (the ragged cache's), which
        only the torch reference path moves correctly in place."""
        buffers, layers = [], []
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                buffers += [layer.keys, layer.values]
                layers += [i, i]
        if self.per_head:
            kept = kept.view(-1, len(self.layers), self.kv_heads, kept.shape[1])
        (compact_ if ascending else compact_torch_)(buffers, kept, length, layers if self.per_head else None)

    def apply_kept(self, kept: torch.Tensor) -> None:
        """Compact every layer's buffers and the slot table to ``kept`` ``[b * G, k]`` (ascending; one row per
        table row, :attr:`groups`)."""
        self.flush_scores()
        k = kept.shape[1]
        self.compact_kv(kept, self.length)
        self.table.compact(slice(None), kept)
        valid = self.row_view(self.segments)[:, :k] != Segment.PAD
        if self.slot_mask is not None:
            self.slot_mask[:, :k] = valid
            self.slot_mask[:, k:] = False
        if self.holds_pads:  # pads are evicted first; re-check once per event, not per step
            self.holds_pads = not bool(valid.all())
        self.stats.event(self.length - k, self.seen)
        self.length = k

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only batch rows ``indices`` ``[r]`` (of the rows held now, in that order): every layer's
        buffers, the slot table's rows, the delimiter state and the scores awaiting the predictor. The
        rows left decode exactly as in the whole batch (every row evicts on its own, at the shared
        events); :class:`~dynts.cache.retire.RowRetirement` drops finished rows with it. Not in the static
        layout (its buffers keep fixed addresses)."""
        if self.static:
            raise ValueError("a static-layout cache keeps its batch rows (fixed buffer addresses for CUDA graphs)")
        indices = indices.to(self.positions.device)
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self.table.keep_rows((indices[:, None] * self.groups + torch.arange(self.groups, device=indices.device)).flatten())
        self.labels.keep_rows(indices)
        if self.scorer is not None:
            self.scorer.keep_rows(indices)

    # ------------------------------------------------------------------ helpers
    def _allocate(self, batch_size: int, question_length: int, device: torch.device) -> None:
        self.question_length = question_length
        if self.bounded:
            self.budget.check_question(question_length)
            self.n_keep = self.budget.n_keep(question_length)
        cap = max(self.budget.budget if self.bounded else 0, question_length + 1, 64)
        if self.static and not self.bounded:
            if self.max_length is None:
                raise ValueError("a static full cache needs max_length=... (prompt + new tokens) to size its buffers")
            cap = max(cap, self.max_length)
        self.capacity = cap
        b = batch_size
        if self.static:
            self.write_index = torch.zeros(1, dtype=torch.long, device=device)
            self.seen_tensor = torch.zeros((), dtype=torch.long, device=device)
            self.slot_mask = torch.zeros(b, cap, dtype=torch.bool, device=device)
        self.table = SlotTable(device, rows=b * self.groups, width=cap, statistics=self.requires & {"attention", "window_attention"},
                               window=self.observation_window)
        self.labels.allocate(b, device)
        self.window_head = 0
        if self.static and self.window_attention is not None:
            self.window_row = torch.full((1,), self.observation_window - 1, dtype=torch.long, device=device)
        if self.static:
            mark_static(self.write_index, self.seen_tensor, self.slot_mask, self.scores, self.attention, self.window_attention)

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self.table.ensure_width(needed)  # doubles: max(needed, 2 * capacity)
        cap = self.table.width
        if self.slot_mask is not None:
            grown = self.slot_mask.new_zeros(self.slot_mask.shape[0], cap)
            grown[:, : self.length] = self.slot_mask[:, : self.length]
            self.slot_mask = grown
        self.capacity = cap

    def _generated_segments(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Segments of generated tokens by the one rule (:func:`dynts.core.segments.label_rows`)."""
        n = self.length
        segments = self.labels.label(input_ids, valid, self.row_view(self.segments)[:, :n], self.row_view(self.token_ids)[:, :n])
        if self.per_head and self.labels.delimiter is not None and n:  # a relabelled delimiter: every head's slots
            tail = self.head_rows(self.segments)[:, :, max(0, n - self.labels.delimiter.length) : n]
            tail[:, 1:] = tail[:, :1]
        return segments

    # ------------------------------------------------------------------ info
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per cached token across all layers and rows."""
        return sum(
            (layer.keys.shape[0] * layer.keys.shape[1] * (layer.keys.shape[3] + layer.values.shape[3]))
            * layer.keys.element_size()
            for layer in self.layers
            if layer.is_initialized
        )

    @property
    def allocated_kv_bytes(self) -> int:
        """Bytes of all K/V buffers as allocated (capacity included)."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in self.layers
            if layer.is_initialized
        )

    def kept_positions(self, row: int = 0, layer: int = 0, kv_head: int = 0) -> torch.Tensor:
        """Absolute positions of the real tokens stored for ``row`` (after the last forward); with per-head
        selection those of ``layer``'s KV head ``kv_head``."""
        n = self.length
        index = row * self.groups + (layer * self.kv_heads + kv_head if self.per_head else 0)
        valid = self.segments[index, :n] != Segment.PAD
        return self.positions[index, :n][valid]


for _part, _names in (("layout", [f.name for f in fields(Layout)]), ("table", list(SlotTable.FILL)),
                      ("config", [f.name for f in fields(CacheConfig)] + ["bounded", "requires", "per_head"]),
                      ("labels", ["delimiter", "in_answer", "think_match"])):
    for _name in _names:
        setattr(BoundedCache, _name, Part(_part, _name))
