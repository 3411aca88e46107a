"""The cache budget shared by every method: ``B = W_q + W_s + W_l`` (DynTS paper, 4.2 and C.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """How many KV entries a bounded cache may hold and how many survive an eviction event.

    Args:
        budget: ``B``, the most entries the cache holds (the token being decoded included).
        local_window: ``W_l``, the most recent tokens that windowed methods always keep.
        retention: fraction of the selection window ``W_s = B - W_q - W_l`` kept at an event.

    At each event every method keeps ``n_keep = W_q + floor(retention * W_s) + W_l`` entries, so the
    eviction volume is ``K = B - n_keep`` (at least 1) and events fire every ``K`` decoded tokens.
    """

    budget: int
    local_window: int
    retention: float = 0.4

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise ValueError(f"budget={self.budget!r} must be a positive int (e.g. budget=1024)")
        if not isinstance(self.local_window, int) or self.local_window < 0:
            raise ValueError(f"local_window={self.local_window!r} must be an int >= 0 (e.g. local_window=128)")
        if not (0.0 < float(self.retention) <= 1.0):
            raise ValueError(f"retention={self.retention!r} must lie in (0, 1] (e.g. retention=0.4)")

    def check_question(self, question_length: int) -> None:
        """Raise unless the prompt, the local window and at least one selection slot fit in ``B``."""
        need = question_length + self.local_window + 1
        if self.budget < need:
            raise ValueError(
                f"budget={self.budget} is smaller than question ({question_length} tokens) + local_window "
                f"({self.local_window}) + 1; raise budget to at least {need} or shrink local_window"
            )

    def selection_window(self, question_length: int) -> int:
        """``W_s``: slots between the question window and the local window."""
        self.check_question(question_length)
        return self.budget - question_length - self.local_window

    def n_keep(self, question_length: int) -> int:
        """Entries kept by every method at an eviction event."""
        ws = self.selection_window(question_length)
        kept = math.floor(self.retention * ws)
        return self.budget - max(1, ws - kept)

    def eviction_volume(self, question_length: int) -> int:
        """``K``: entries dropped per event."""
        return self.budget - self.n_keep(question_length)
