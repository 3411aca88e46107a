"""Per-request eviction state and the evictor's view of stored slots, shared by every cache and engine.

* :class:`RequestBudget` -- a paged engine's per-request record on the scheduler side (budget, ``n_keep``,
  shift, reservation, statistics) with the event test (:meth:`RequestBudget.due`, i.e. :meth:`dynts.Budget.due`),
  and :class:`RequestRow`, the worker side's (table row, labelling state);
* :func:`build_token_info` -- the one :class:`~dynts.evictors.TokenInfo` builder (dense cache, ragged
  KV-Rescue cache, paged slot table) and :func:`check_scored`, the stale-score check;
* :func:`select_kept` -- the one evictor-call loop: rows due for an event, grouped by what their evictor
  call shares (evictor, local window, prompt length, stored count, ``n_keep``), one call per group;
* :class:`SlotTable` -- the per-slot metadata of every cache; in the paged engines one row per request in
  flight, one column per stored slot. Column ``j`` of a request's row describes the ``j``-th KV entry the request stores,
  i.e. the entry the engine reads at logical index ``j`` through the request's block table. An eviction
  event gathers the kept columns to the front of the row, exactly as the K/V rows are gathered to the
  front of the request's pages, so the table and the cache always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Sequence

import torch

from ..evictors.base import Evictor, Segment, TokenInfo
from .segments import AnswerState
from .upload import upload

if TYPE_CHECKING:
    from .settings import EvictionSettings

__all__ = ["EvictorCall", "RequestBudget", "RequestRow", "Selection", "SlotTable", "build_token_info", "check_scored", "select_kept",
           "stale_rows"]


@dataclass
class RequestBudget:
    """The scheduler's per-request record (:class:`~dynts.core.policy.EvictionPolicy`), host-side: budget,
    reservation, shift, event test (:meth:`due`, i.e. :meth:`dynts.Budget.due`) and statistics.

    Attributes:
        settings: the request's :class:`~dynts.core.settings.EvictionSettings` (method, budget, ...).
        question_length: ``W_q``, the prompt length.
        n_keep: slots kept at an eviction event (``None`` without a budget); each event carries it to the worker.
        reserved_blocks: blocks the request may hold at most (admission reserves them).
        protected: leading slots its method keeps at every event (they never move; prefix caching may share them).
        may_evict: False when its length limit keeps it within the budget (:meth:`EvictionSettings.may_evict`):
            no event can come, the per-round event check skips it.
        shift: tokens evicted so far; absolute position = stored index + ``shift`` for new tokens.
        peak_slots / evictions / evicted_tokens / freed_blocks / peak_blocks: statistics.
    """

    settings: "EvictionSettings"
    question_length: int
    n_keep: int | None
    reserved_blocks: int = 0
    protected: int = 0
    may_evict: bool = True
    shift: int = 0
    peak_slots: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    freed_blocks: int = 0
    peak_blocks: int = 0

    def due(self, stored: int, incoming: int = 1) -> bool:
        """True when ``incoming`` tokens on top of ``stored`` would overflow the budget (:meth:`Budget.due`)."""
        return self.may_evict and self.n_keep is not None and self.settings.bounds.due(stored, incoming, self.n_keep)

    def evicted(self, stored: int) -> None:
        """Count one event that kept ``n_keep`` of ``stored`` slots; later tokens shift by the evicted ones."""
        self.shift += stored - self.n_keep
        self.evictions += 1
        self.evicted_tokens += stored - self.n_keep

    def stats(self) -> dict[str, int]:
        return {
            "peak_slots": self.peak_slots,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "freed_blocks": self.freed_blocks,
            "peak_blocks": self.peak_blocks,
            "reserved_blocks": self.reserved_blocks,
        }


@dataclass
class RequestRow:
    """The worker's per-request record (:class:`~dynts.core.tracker.SlotTracker`): its :class:`SlotTable` row
    and labelling state. An event brings the ``stored`` and ``n_keep`` the scheduler decided.

    Attributes:
        settings: the request's :class:`~dynts.core.settings.EvictionSettings` (its evictor).
        question_length: ``W_q``, the prompt length.
        row: the request's row in the table (``-1`` once released).
        answer: the labelling state (:class:`~dynts.core.segments.AnswerState`).
    """

    settings: "EvictionSettings"
    question_length: int
    row: int = -1
    answer: AnswerState = field(default_factory=AnswerState)

    @property
    def in_answer(self) -> bool:
        """The request has emitted the whole thinking delimiter."""
        return self.answer.in_answer


def build_token_info(
    table: Any,
    length: int,
    n_keep: int,
    local_window: int,
    question_length: int,
    rows: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> TokenInfo:
    """The one :class:`TokenInfo` builder: what an evictor sees of the first ``length`` slots of ``rows``
    (all rows by default) of ``table``, any object with per-slot ``positions`` / ``segments`` /
    ``token_ids`` / ``scores`` ``[b, n]`` tensors and optional ``attention`` ``[b, n]`` and
    ``window_attention`` ``[b, w, n]`` (the dense and ragged caches, the paged :class:`SlotTable`).
    ``keys`` ``[g, h_kv, length, d]``: the reference layer's keys of those rows (R-KV), if gathered."""
    index = slice(None) if rows is None else rows

    def pick(name: str) -> torch.Tensor | None:
        t = getattr(table, name, None)
        return None if t is None else t[index, ..., :length]

    return TokenInfo(
        positions=pick("positions"),
        segments=pick("segments"),
        token_ids=pick("token_ids"),
        n_keep=int(n_keep),
        local_window=local_window,
        question_length=int(question_length),
        scores=pick("scores"),
        attention=pick("attention"),
        window_attention=pick("window_attention"),
        keys=keys,
    )


def stale_rows(info: TokenInfo, evictor: Evictor) -> torch.Tensor | None:
    """``[b]`` device flags: the row has a thinking token without a predictor score (``None`` for an evictor
    that reads no scores). The scores of a forward are written after it runs; an event between would rank NaNs."""
    if "scores" not in evictor.requires:
        return None
    return (info.scores.isnan() & (info.segments == Segment.THINKING)).any(-1)


def stale_scores(info: TokenInfo, evictor: Evictor) -> torch.Tensor | None:
    """A device flag: some row has a thinking token without a predictor score (:func:`stale_rows`, any row)."""
    rows = stale_rows(info, evictor)
    return None if rows is None else rows.any()


def _refuse_stale(evictor: Evictor) -> None:
    raise RuntimeError(
        f"method={evictor.name!r} needs predictor scores but some thinking tokens have none; "
        "pass predictor=... to dynts.generate / dynts.attach"
    )


def check_scored(info: TokenInfo, evictor: Evictor) -> None:
    """The stale-score check of one evictor call (one host read of a flag)."""
    stale = stale_scores(info, evictor)
    if stale is not None and bool(stale):
        _refuse_stale(evictor)


@dataclass(frozen=True, eq=False)
class EvictorCall:
    """What the rows of one evictor call share; rows due with equal calls (:meth:`key`) are selected together.

    Attributes:
        evictor: the method (compared by identity).
        local_window: ``W_l``.
        question_length: ``W_q``, the prompt length the rows share.
        stored: slots each row stores (the evictor sees columns ``0 .. stored - 1``).
        n_keep: slots each row keeps.
        owner: an extra identity the grouping respects (e.g. a request's settings object), or ``None``.
    """

    evictor: Evictor
    local_window: int
    question_length: int
    stored: int
    n_keep: int
    owner: Any = None

    def key(self) -> tuple:
        return (id(self.owner), id(self.evictor), self.local_window, self.question_length, self.stored, self.n_keep)


@dataclass
class Selection:
    """One evictor call's result.

    Attributes:
        call: the :class:`EvictorCall` its rows shared.
        members: the caller's objects of its rows, in the order of ``kept``'s rows.
        rows: ``[g]`` their table rows (on the table's device).
        kept: ``[g, n_keep]`` ascending slots kept.
    """

    call: EvictorCall
    members: list[Any]
    rows: torch.Tensor
    kept: torch.Tensor
    stale: torch.Tensor | None = None


def select_kept(
    table: Any,
    due: Iterable[tuple[Any, int, EvictorCall]],
    keys: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    check: bool | str = True,
) -> list[Selection]:
    """The one evictor-call loop of every cache: ``due`` holds ``(member, row, call)`` for every row due for an
    event; rows with equal calls go to the evictor together (groups in first-seen order, rows in order).
    ``keys(rows, stored)``: the reference layer's keys ``[g, h_kv, stored, d]`` of those rows (R-KV).
    The caller compacts its table and K/V with each ``kept``.

    ``check``: the stale-score check (:func:`stale_rows`). ``True``: the flags of the whole round are read on the
    host at once (one sync) and a stale row raises before any caller compacts (the dense caches, KV-Rescue);
    ``"defer"``: nothing is read, each :attr:`Selection.stale` holds the ``[g]`` device flags of its rows for the
    caller to read later without waiting (the paged engines: a stale row fails its request, the engine goes on);
    ``False``: no check."""
    if check not in (True, False, "defer"):
        raise ValueError(f"check={check!r} must be True, False or 'defer'")
    groups: dict[tuple, tuple[EvictorCall, list[Any], list[int]]] = {}
    for member, row, call in due:
        _, members, rows = groups.setdefault(call.key(), (call, [], []))
        members.append(member)
        rows.append(row)
    out, stale = [], []
    for call, members, rows in groups.values():
        (index,) = upload((rows,), table.positions.device)
        info = build_token_info(table, call.stored, call.n_keep, call.local_window, call.question_length, rows=index,
                                keys=None if keys is None else keys(index, call.stored))
        flags = stale_rows(info, call.evictor) if check else None
        if flags is not None and check is True:
            stale.append((flags.any(), call.evictor))
        out.append(Selection(call, members, index, call.evictor(info), flags if check == "defer" else None))
    if stale:  # one host read for the whole round, before any caller compacts
        flags = torch.stack([flag for flag, _ in stale]).tolist()
        for hit, (_, evictor) in zip(flags, stale):
            if hit:
                _refuse_stale(evictor)
    return out


@lru_cache(maxsize=4)
def _nans(device: torch.device, n: int) -> torch.Tensor:
    """``n`` NaNs on ``device`` (an unscored slot's score), made once per length (a plain tensor)."""
    with torch.inference_mode(False):
        return torch.full((n,), float("nan"), device=device)


@dataclass
class SlotTable:
    """Device tensors ``[rows, width]`` of slot metadata (positions, segments, token ids, scores), and the
    attention statistics the evictor needs: ``attention`` ``[rows, width]`` and ``window_attention``
    ``[rows, window, width]`` (``statistics`` names them; absent by default).

    The one slot-table schema (:data:`SlotTable.FILL`: each column's value on an empty slot) and the one
    compaction (:meth:`compact`) of every cache: the paged engines (one row per request in flight, rows
    recycled when requests finish), the dense cache (one row per batch row) and the ragged KV-Rescue cache.
    Rows and width grow by doubling (never per step); a ``fixed`` table (vLLM's, reserved at start-up inside vLLM's
    memory profile) never reallocates: running out of rows or width is a broken invariant and raises.
    """

    device: torch.device
    rows: int = 8
    width: int = 256
    statistics: frozenset[str] = frozenset()
    window: int = 8
    fixed: bool = False
    positions: torch.Tensor = field(init=False)
    segments: torch.Tensor = field(init=False)
    token_ids: torch.Tensor = field(init=False)
    scores: torch.Tensor = field(init=False)
    attention: torch.Tensor | None = field(init=False, default=None)
    window_attention: torch.Tensor | None = field(init=False, default=None)
    free_rows: list[int] = field(init=False)

    FILL: ClassVar[dict[str, Any]] = {"positions": 0, "segments": int(Segment.PAD), "token_ids": 0,
                                      "scores": float("nan"), "attention": 0.0, "window_attention": 0.0}
    _DTYPES: ClassVar[dict[str, torch.dtype]] = {"positions": torch.long, "segments": torch.long,
                                                 "token_ids": torch.long}

    def __post_init__(self) -> None:
        for name in self.FILL:
            if name in ("attention", "window_attention") and name not in self.statistics:
                continue
            setattr(self, name, self._new(name, self.rows, self.width))
        self.free_rows = list(range(self.rows - 1, -1, -1))

    def _new(self, name: str, rows: int, width: int) -> torch.Tensor:
        shape = (rows, self.window, width) if name == "window_attention" else (rows, width)
        return torch.full(shape, self.FILL[name], dtype=self._DTYPES.get(name, torch.float32), device=self.device)

    def columns(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every column the table holds (slots on the last dimension)."""
        for name in self.FILL:
            t = getattr(self, name)
            if t is not None:
                yield name, t

    def _resize(self, rows: int, width: int) -> None:
        if self.fixed:
            raise RuntimeError(
                f"the slot table was reserved for {self.rows} rows of {self.width} slots and may not grow to {rows} x "
                f"{width} (a request stores more slots than its budget allows, or more requests run than max_num_seqs)")
        for name, old in list(self.columns()):
            new = self._new(name, rows, width)
            new[: old.shape[0], ..., : old.shape[-1]] = old
            setattr(self, name, new)
        self.free_rows = list(range(rows - 1, self.rows - 1, -1)) + self.free_rows
        self.rows, self.width = rows, width

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only table rows ``rows`` ``[r]`` (in that order) of every column; no row is free after."""
        rows = rows.to(self.device)
        for name, t in list(self.columns()):
            setattr(self, name, t.index_select(0, rows))
        self.rows, self.free_rows = rows.numel(), []

    def acquire_row(self) -> int:
        if not self.free_rows:
            self._resize(2 * self.rows, self.width)
        return self.free_rows.pop()

    def release_row(self, row: int) -> None:
        self.free_rows.append(row)

    def ensure_width(self, needed: int) -> None:
        if needed > self.width:
            self._resize(self.rows, max(needed, 2 * self.width))

    def write(self, rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
              token_ids: torch.Tensor, keep_scores: bool = False) -> None:
        """Record the ``T`` new tokens of a forward: ``rows``/``slots``/... are ``[T]`` tensors. Their scores are
        cleared (NaN until the forward's output scores them) unless ``keep_scores`` (tokens scored already)."""
        self.positions[rows, slots] = positions
        self.segments[rows, slots] = segments
        self.token_ids[rows, slots] = token_ids
        if not keep_scores:
            self.scores[rows, slots] = float("nan")

    def put(self, index: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor, token_ids: torch.Tensor,
            keep_scores: bool = False) -> None:
        """:meth:`write` through flat indices ``index`` ``[T]`` (``row * width + slot`` at the table's width now): one
        ``put_`` per column, the cheapest indexed write (a decode step's, every step)."""
        self.positions.put_(index, positions)
        self.segments.put_(index, segments)
        self.token_ids.put_(index, token_ids)
        if not keep_scores:
            self.scores.put_(index, _nans(self.device, index.numel()))

    def relabel_answer(self, row: int, end: int, pieces: Sequence[int] | torch.Tensor) -> None:
        """Mark as answer the thinking slots among the last ``len(pieces)`` before column ``end`` of
        ``row`` that hold ``pieces`` in order (the delimiter's first ids, stored by earlier forwards);
        a piece lost to an eviction is simply not found, as in :class:`dynts.BoundedCache`. ``pieces``: host ids
        (uploaded without blocking) or a long tensor on the table's device (cached by the caller)."""
        lo = max(0, end - len(pieces))
        if lo >= end:
            return
        want = pieces[len(pieces) - (end - lo):]
        if not isinstance(want, torch.Tensor):
            (want,) = upload((list(want),), self.device)
        segments = self.segments[row, lo:end]
        hit = (segments == Segment.THINKING) & (self.token_ids[row, lo:end] == want)
        segments.masked_fill_(hit, int(Segment.ANSWER))

    def token_info(self, rows: torch.Tensor, length: int, n_keep: int, local_window: int,
                   question_length: int) -> TokenInfo:
        """The :class:`TokenInfo` of ``rows`` (``[g]``), each storing ``length`` slots."""
        return build_token_info(self, length, n_keep, local_window, question_length, rows=rows)

    def gathered(self, rows: torch.Tensor | slice, slots: torch.Tensor,
                 filler: torch.Tensor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, block)`` of every column: the ``slots`` ``[g, k]`` of ``rows`` (``g`` of them, or a slice),
        with the column's :data:`FILL` where ``filler`` ``[g, k]`` is True."""
        for name, t in self.columns():
            src = t[rows]
            if t.dim() == 3:
                block = src.gather(2, slots[:, None, :].expand(-1, t.shape[1], -1))
                mask = None if filler is None else filler[:, None, :]
            else:
                block, mask = src.gather(1, slots), filler
            yield name, block if mask is None else block.masked_fill(mask, self.FILL[name])

    def compact(self, rows: torch.Tensor | slice, kept: torch.Tensor, filler: torch.Tensor | None = None) -> None:
        """Gather the ``kept`` columns (``[g, k]``) of ``rows`` (or a slice of rows) to the front of each row;
        ``filler`` ``[g, k]``: positions that become empty slots (the ragged cache's right alignment)."""
        k = kept.shape[1]
        for name, block in list(self.gathered(rows, kept, filler)):
            getattr(self, name)[rows, ..., :k] = block
