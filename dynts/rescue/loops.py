"""Cross-step loop detection for base candidates (an extension of the KV-Rescue detector, paper Eq. 4-6).

The online detector (:mod:`dynts.rescue.detector`) looks inside one candidate step: its entropy and
the gzip ratio of its text. An evicted base that has lost its earlier steps loops through *whole*
steps instead -- each well formed, each scored as right by a PRM that does not check step order --
and neither within-step signal can see that. :class:`StepLoopDetector` compares a finished base
candidate with the steps already committed to its trajectory and screens it before PRM scoring:

* **repeated span** (``repeat_ngram = n``): the candidate shares a run of ``n`` consecutive tokens
  with one earlier committed step (the step delimiter excluded): "the candidate repeats a committed
  step", or a long piece of one. ``n`` must exceed what correct trajectories legitimately repeat:
  on the testbed a step's 6-token computation (``b 4 minus e 1 gives``) recurs under a new key in
  44 of 99 full-cache trajectories, so ``n = 8`` (the default) is the shortest span that never
  fired on them (``docs/rescue.md``).
* **step pattern** (vLLM's ``repetition_detection`` schema, applied to steps instead of tokens):
  the committed steps followed by the candidate end with a pattern of ``L`` steps,
  ``min_pattern_size <= L <= max_pattern_size``, repeated ``min_count`` times in a row. Steps are
  compared by their token ids with the delimiter and surrounding whitespace tokens dropped.

Set ``repeat_ngram=None`` or ``max_pattern_size=0`` to switch a rule off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["StepHistory", "StepLoopDetector"]


@dataclass
class StepLoopDetector:
    """Thresholds of the cross-step loop screen.

    Args:
        repeat_ngram: ``n``, consecutive tokens a candidate may share with an earlier committed step
            before it is screened; ``None`` disables the rule.
        min_pattern_size, max_pattern_size: lengths ``L`` (in steps) of the repeating step pattern;
            ``max_pattern_size = 0`` disables the rule.
        min_count: how many times in a row the pattern must occur (the candidate's occurrence included).
    """

    repeat_ngram: int | None = 8
    min_pattern_size: int = 1
    max_pattern_size: int = 4
    min_count: int = 2

    def __post_init__(self) -> None:
        if self.repeat_ngram is not None and (isinstance(self.repeat_ngram, bool) or not isinstance(self.repeat_ngram, int)
                                              or self.repeat_ngram < 1):
            raise ValueError(f"repeat_ngram={self.repeat_ngram!r} must be an int >= 1 tokens, or None to disable")
        for name in ("min_pattern_size", "max_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if self.max_pattern_size and self.min_pattern_size < 1:
            raise ValueError(f"min_pattern_size={self.min_pattern_size!r} must be >= 1 (steps per pattern)")
        if self.max_pattern_size and self.max_pattern_size < self.min_pattern_size:
            raise ValueError(f"max_pattern_size={self.max_pattern_size!r} must be >= min_pattern_size="
                             f"{self.min_pattern_size} (or 0 to disable the step-pattern rule)")
        if self.max_pattern_size and self.min_count < 2:
            raise ValueError(f"min_count={self.min_count!r} must be >= 2 (a pattern occurring once is no loop)")

    @property
    def enabled(self) -> bool:
        return self.repeat_ngram is not None or self.max_pattern_size > 0

    def history(self, ignore: frozenset[int] = frozenset()) -> "StepHistory":
        """A fresh per-problem record of committed steps; ``ignore``: token ids dropped from step
        contents (the step delimiter's tokens, whitespace)."""
        return StepHistory(self, ignore)


class StepHistory:
    """The committed steps of one trajectory as the loop screen sees them (updated by :meth:`commit`)."""

    def __init__(self, detector: StepLoopDetector, ignore: frozenset[int] = frozenset()):
        self.detector = detector
        self.ignore = ignore
        self.steps: list[tuple[int, ...]] = []
        self._ngrams: set[tuple[int, ...]] = set()

    def _content(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(t for t in tokens if t not in self.ignore)

    def commit(self, tokens: Sequence[int]) -> None:
        """Record a committed step (its token ids)."""
        step = self._content(tokens)
        self.steps.append(step)
        n = self.detector.repeat_ngram
        if n is not None:
            self._ngrams.update(step[i : i + n] for i in range(len(step) - n + 1))

    def check(self, tokens: Sequence[int]) -> str | None:
        """``"repeat"`` when the candidate ``tokens`` shares ``repeat_ngram`` tokens with a committed
        step, ``"pattern"`` when it closes a repeating step pattern, else ``None``."""
        d, step = self.detector, self._content(tokens)
        n = d.repeat_ngram
        if n is not None and any(step[i : i + n] in self._ngrams for i in range(len(step) - n + 1)):
            return "repeat"
        seq = self.steps + [step]
        for size in range(d.min_pattern_size, d.max_pattern_size + 1) if d.max_pattern_size else ():
            span = size * d.min_count
            if span > len(seq):
                break
            pattern = seq[-size:]
            if all(seq[len(seq) - (k + 1) * size : len(seq) - k * size] == pattern for k in range(1, d.min_count)):
                return "pattern"
        return None
