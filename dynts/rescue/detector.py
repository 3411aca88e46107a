"""Online degeneration detector for base candidates (KV-Rescue paper, "Online Degeneration Detection",
Eq. 4-6, and Appendix C).

Two signals, both by-products of decoding (the logits of each step and the text decoded so far):

* **incoherent generation** -- the moving average of the predictive entropy over the last
  ``entropy_window`` generated positions, ``H̄_e = mean(H_r, r in W_e)`` with
  ``H_r = -sum_v p_r(v) log p_r(v)`` (nats), exceeds ``entropy_threshold`` (paper: 7.0, window 12,
  not before ``guard`` = 24 generated tokens);
* **repetition loop** -- the gzip ratio ``rho_e = |gzip(z_e)| / |z_e|`` of the last
  ``compress_window`` characters of the candidate text (paper: 800) falls *below*
  ``compress_threshold`` (paper: 0.18; lower = more repetitive). It is eligible once the window is
  full.

``deg_e = [H̄_e > tau_ent] or [rho_e < tau_cmp]``; the detector fires at the first eligible position
where either holds, and the candidate is aborted there. Set a threshold to ``None`` to disable
that test. Both thresholds depend on the vocabulary and on how text looks: the paper's values are
for Qwen2.5-Math (152k tokens, natural-language math); recalibrate for other models (``ln V`` caps
the entropy: a 75-word vocabulary never reaches 7 nats).

``loop`` (an extension, off in the paper) adds the cross-step loop screen of
:mod:`dynts.rescue.loops`: a finished base candidate that repeats a committed step (or closes a
repeating pattern of steps) is screened before PRM scoring.

``include_context=True`` (an extension, off in the paper) lets the gzip window reach back into the
committed trajectory before the candidate, for tasks whose steps are shorter than the window.
"""

from __future__ import annotations

import gzip
from collections import deque
from dataclasses import dataclass
from typing import TypeVar

from .loops import StepLoopDetector

__all__ = ["CandidateScreen", "DegenerationDetector", "gzip_ratio", "resolve_option"]

T = TypeVar("T")


def resolve_option(name: str, value: T | dict | bool | None, cls: type[T]) -> T | None:
    """An optional component given as itself, a dict of its fields, ``True`` (its defaults) or
    ``None``/``False`` (off)."""
    if value is True:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if value is None or value is False:
        return None
    if not isinstance(value, cls):
        raise ValueError(f"{name}={value!r} must be a {cls.__name__}, a dict of its fields, True, or None/False (off)")
    return value


def gzip_ratio(text: str) -> float:
    """``|gzip(text)| / |text|`` in bytes (UTF-8); deterministic (``mtime=0``)."""
    raw = text.encode("utf-8")
    if not raw:
        return 1.0
    return len(gzip.compress(raw, compresslevel=9, mtime=0)) / len(raw)


@dataclass
class DegenerationDetector:
    """Thresholds and windows of the detector (defaults: the paper's Appendix C).

    Args:
        entropy_threshold: ``tau_ent`` in nats; ``None`` disables the entropy test.
        entropy_window: ``|W_e|``, positions in the moving average.
        guard: generated tokens before the entropy test may fire.
        compress_threshold: ``tau_cmp``; ``None`` disables the gzip test.
        compress_window: ``w_cmp``, characters in the gzip window.
        include_context: let the gzip window include committed text before the candidate.
        loop: the cross-step loop screen: a :class:`~dynts.rescue.loops.StepLoopDetector`, a dict of
            its fields, ``True`` (its defaults) or ``None`` (off, as in the paper).
    """

    entropy_threshold: float | None = 7.0
    entropy_window: int = 12
    guard: int = 24
    compress_threshold: float | None = 0.18
    compress_window: int = 800
    include_context: bool = False
    loop: StepLoopDetector | dict | bool | None = None

    def __post_init__(self) -> None:
        self.loop = resolve_option("loop", self.loop, StepLoopDetector)
        if self.loop is not None and not self.loop.enabled:
            self.loop = None
        if self.entropy_threshold is not None and not self.entropy_threshold > 0:
            raise ValueError(f"entropy_threshold={self.entropy_threshold!r} must be > 0 nats, or None to disable")
        if not isinstance(self.entropy_window, int) or self.entropy_window < 1:
            raise ValueError(f"entropy_window={self.entropy_window!r} must be an int >= 1")
        if not isinstance(self.guard, int) or self.guard < 0:
            raise ValueError(f"guard={self.guard!r} must be an int >= 0")
        if self.compress_threshold is not None and not 0 < self.compress_threshold < 1:
            raise ValueError(f"compress_threshold={self.compress_threshold!r} must lie in (0, 1), or None to disable")
        if not isinstance(self.compress_window, int) or self.compress_window < 16:
            raise ValueError(f"compress_window={self.compress_window!r} must be an int >= 16 characters")

    @property
    def enabled(self) -> bool:
        """Whether the within-step tests (entropy, gzip) run (the loop screen is :attr:`loop`)."""
        return self.entropy_threshold is not None or self.compress_threshold is not None

    @property
    def needs_text(self) -> bool:
        return self.compress_threshold is not None

    def screen(self, context: str = "") -> "CandidateScreen":
        """A fresh per-candidate state; ``context`` is the committed text (used with ``include_context``)."""
        return CandidateScreen(self, context[-self.compress_window :] if self.include_context else "")

    def first_firing(self, entropies, texts) -> tuple[int, str] | None:
        """Offline check: ``(position, reason)`` where a candidate with per-token ``entropies`` and
        text-so-far ``texts`` (one string per position) would be aborted, else ``None``."""
        screen = self.screen()
        for position, (h, text) in enumerate(zip(entropies, texts), start=1):
            reason = screen.update(float(h), text)
            if reason:
                return position, reason
        return None


class CandidateScreen:
    """Detector state of one candidate. Call :meth:`update` once per generated token."""

    def __init__(self, detector: DegenerationDetector, context: str = ""):
        self.detector = detector
        self.context = context
        self.tokens = 0
        self._window: deque[float] = deque(maxlen=detector.entropy_window)
        self.max_mean_entropy = float("-inf")  # for calibration plots (paper Fig. 3b)
        self.min_ratio = float("inf")  # rho* (paper Fig. 3d)
        self.fired: str | None = None

    def update(self, entropy: float, text: str | None = None) -> str | None:
        """Add one position (its entropy and the candidate text so far -- its last ``compress_window``
        characters suffice, :class:`~dynts.rescue.detok.TextTail`); return ``"entropy"`` or
        ``"compression"`` the first time the detector fires, else ``None``."""
        d = self.detector
        self.tokens += 1
        self._window.append(entropy)
        if self.fired:
            return None
        if d.entropy_threshold is not None and self.tokens >= max(d.guard, d.entropy_window):
            mean = sum(self._window) / len(self._window)
            self.max_mean_entropy = max(self.max_mean_entropy, mean)
            if mean > d.entropy_threshold:
                self.fired = "entropy"
                return self.fired
        if d.compress_threshold is not None and text is not None:
            full = self.context + text if self.context else text
            if len(full) >= d.compress_window:
                ratio = gzip_ratio(full[-d.compress_window :])
                self.min_ratio = min(self.min_ratio, ratio)
                if ratio < d.compress_threshold:
                    self.fired = "compression"
                    return self.fired
        return None
