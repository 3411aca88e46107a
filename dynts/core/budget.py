"""The cache budget shared by every method: ``B = W_q + W_s + W_l`` (DynTS paper, 4.2 and C.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SIZINGS", "Budget", "fixed_budget"]

SIZINGS = ("paper", "official", "headroom")


@dataclass(frozen=True)
class Budget:
    """How many KV entries a bounded cache may hold and how many survive an eviction event.

    Args:
        budget: ``B``, the most entries the cache holds (the token being decoded included).
        local_window: ``W_l``, the most recent tokens that windowed methods always keep.
        retention: fraction of the selection window ``W_s = B - W_q - W_l`` kept at an event.
        sizing: how ``n_keep`` follows from the other three (every method keeps the same count):

            - ``"paper"`` (default, as the DynTS paper words it, 4.2): the question window plus
              ``floor(retention * W_s)`` selected tokens plus the local window,
              ``n_keep = W_q + floor(retention * W_s) + W_l``;
            - ``"official"`` (the DynTS reference code): ``n_keep = int(retention * (B - W_l)) + W_l``,
              the question counted inside the ``int(retention * (B - W_l))`` kept non-local tokens
              (it needs ``W_q <= int(retention * (B - W_l))``).

            - ``"headroom"`` (the KV-Rescue paper, Appendix C, after R-KV): ``keep`` score-selected
              entries (question and local window included) survive an event and the cache may grow
              by a headroom buffer before the next one, so ``budget = keep + headroom`` is the
              physical bound; build it with :meth:`from_paper`.

            Either way the eviction volume is ``K = B - n_keep`` (at least 1) and events fire every
            ``K`` decoded tokens.
        keep: ``n_keep`` of the ``"headroom"`` sizing (unused otherwise).
    """

    budget: int
    local_window: int
    retention: float = 0.4
    sizing: str = "paper"
    keep: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ValueError(f"budget={self.budget!r} must be a positive int (e.g. budget=1024)")
        if not isinstance(self.local_window, int) or self.local_window < 0:
            raise ValueError(f"local_window={self.local_window!r} must be an int >= 0 (e.g. local_window=128)")
        if not (0.0 < float(self.retention) <= 1.0):
            raise ValueError(f"retention={self.retention!r} must lie in (0, 1] (e.g. retention=0.4)")
        if self.sizing not in SIZINGS:
            raise ValueError(f"sizing={self.sizing!r} must be one of {SIZINGS} (the paper's formula or the reference code's)")
        if self.sizing == "headroom":
            if isinstance(self.keep, bool) or not isinstance(self.keep, int) or not self.local_window < self.keep < self.budget:
                raise ValueError(f"keep={self.keep!r} must be an int with local_window ({self.local_window}) < keep < budget "
                                 f"({self.budget}) for sizing='headroom'; use Budget.from_paper(score_selected=B, headroom=128)")
        elif self.keep is not None:
            raise ValueError(f"keep={self.keep!r} is only used with sizing='headroom'")

    @classmethod
    def from_paper(cls, score_selected: int, headroom: int = 128, local_window: int = 0) -> "Budget":
        """The KV-Rescue paper's budget (Appendix C): ``B = score_selected`` entries kept at every
        event, a ``headroom`` buffer ``w`` on top, so the physical cache holds at most ``B' = B + w``
        entries; the evictor re-selects ``B`` every ``w`` tokens. ``local_window`` recent tokens are
        protected inside the ``B``."""
        for name, value, low in (("score_selected", score_selected, 1), ("headroom", headroom, 1), ("local_window", local_window, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        return cls(score_selected + headroom, local_window, sizing="headroom", keep=score_selected)

    def check_question(self, question_length: int) -> None:
        """Raise unless the prompt, the local window and at least one selection slot fit in ``B``."""
        need = question_length + self.local_window + 1
        if self.budget < need:
            raise ValueError(
                f"budget={self.budget} is smaller than question ({question_length} tokens) + local_window "
                f"({self.local_window}) + 1; raise budget to at least {need} or shrink local_window"
            )
        if self.sizing == "headroom" and question_length + self.local_window + 1 > self.keep:
            need = question_length + self.local_window + 1
            raise ValueError(
                f"the paper budget keeps {self.keep} entries, fewer than question ({question_length} tokens) + "
                f"local_window ({self.local_window}) + 1; raise score_selected to at least {need}"
            )
        if self.sizing == "official" and question_length > self._official_kept():
            need = math.ceil(question_length / float(self.retention)) + self.local_window
            raise ValueError(
                f"sizing='official' keeps int(retention * (budget - local_window)) = {self._official_kept()} "
                f"non-local tokens, fewer than the question ({question_length} tokens); raise budget to at "
                f"least {need}, raise retention, or use sizing='paper'"
            )

    def _official_kept(self) -> int:
        return int(float(self.retention) * (self.budget - self.local_window))

    def selection_window(self, question_length: int) -> int:
        """``W_s``: slots between the question window and the local window."""
        self.check_question(question_length)
        return self.budget - question_length - self.local_window

    def n_keep(self, question_length: int) -> int:
        """Entries kept by every method at an eviction event (see ``sizing``)."""
        ws = self.selection_window(question_length)
        if self.sizing == "headroom":
            return self.keep
        if self.sizing == "official":
            return min(self._official_kept() + self.local_window, self.budget - 1)
        kept = math.floor(self.retention * ws)
        return self.budget - max(1, ws - kept)

    def eviction_volume(self, question_length: int) -> int:
        """``K``: entries dropped per event."""
        return self.budget - self.n_keep(question_length)

    def due(self, stored: int, incoming: int, n_keep: int) -> bool:
        """The event rule every cache and engine applies before a forward: a request storing ``stored``
        entries evicts down to ``n_keep`` when its ``incoming`` tokens would overflow ``B`` (and it holds
        more than it would keep). After the event it holds ``n_keep`` entries, so the decoded token never
        pushes the cache past ``B``."""
        return stored + incoming > self.budget and stored > n_keep

    def events(self, question_length: int, generated: int) -> int:
        """Eviction events a request with a ``question_length`` prompt lives through while generating
        ``generated`` tokens one at a time under :meth:`due`: it stores ``question_length + generated``
        entries, never more than ``B``, and each event drops ``K`` (:meth:`eviction_volume`)."""
        over = question_length + generated - self.budget
        return max(0, -(-over // self.eviction_volume(question_length)))


def fixed_budget(kept: int, question_length: int, capacity: int) -> Budget:
    """A :class:`Budget` whose events keep exactly ``kept`` slots per row (the ``fixed`` evictor's sets:
    :class:`dynts.evictors.fixed.FixedPositions`).

    Args:
        kept: slots each row keeps at the event (the set size); at least ``question_length``,
            because every bounded cache keeps its question window (``n_keep >= W_q``).
        question_length: width of the first forward (the cache's ``W_q``).
        capacity: ``B``; no event fires on its own until a row would hold more than ``capacity``
            tokens, so a caller that evicts once explicitly (``cache.evict()``) and then decodes
            passes the stored length plus every token still to come.

    ``local_window`` is 0 and ``retention`` is chosen so ``floor(retention * W_s) = kept - W_q``.
    """
    if not question_length <= kept < capacity:
        raise ValueError(
            f"kept={kept} must satisfy question_length ({question_length}) <= kept < capacity ({capacity}); "
            "keep every question token and give the cache room for the tokens that follow"
        )
    selection = capacity - question_length
    retention = (kept - question_length + 0.5) / selection
    budget = Budget(capacity, 0, min(1.0, retention))
    if budget.n_keep(question_length) != kept:  # pragma: no cover - floor arithmetic guard
        raise RuntimeError(f"could not size a budget keeping {kept} of {capacity} slots")
    return budget
