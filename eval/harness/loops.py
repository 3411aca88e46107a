"""Did a generated trace loop? One rule per benchmark, reported as ``loop %`` in every eval table.

- Any benchmark (:func:`tail_repeats`): the trace ends in one pattern of ``1..max_pattern`` tokens
  repeated back to back over at least ``min_span`` tokens (and at least ``min_count`` times) -- the
  shape vLLM's ``repetition_detection`` (``min_pattern_size`` / ``max_pattern_size`` /
  ``min_count``) stops generation on. A model that loops after an eviction runs to the token limit in
  such a tail.
- The testbed (:func:`testbed_loops`): the thinking writes a step key it already wrote (it restarted
  or repeats itself), the ``loops`` class of ``eval.harness.testbed_errors``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["StepKeyRepeats", "tail_repeats", "testbed_loops", "token_tail_loops"]


def tail_repeats(ids: Sequence[int], max_pattern: int = 256, min_count: int = 3, min_span: int = 64) -> bool:
    """True if ``ids`` ends in ``p`` tokens repeated over ``max(min_count * p, min_span)`` tokens, for
    some period ``1 <= p <= max_pattern``."""
    ids = list(ids)
    n = len(ids)
    for p in range(1, max_pattern + 1):
        span = max(min_count * p, min_span)
        if span > n:
            break
        tail = ids[n - span :]
        if tail[p:] == tail[:-p]:
            return True
    return False


def testbed_loops(text: str, family: str = "copy") -> bool:
    """True if the testbed trace ``text`` writes some step key twice (``family``: the task family
    whose steps are parsed, ``data_pipeline.testbed.task.FAMILIES``)."""
    from data_pipeline.testbed import task

    keys = [k for *_, k, _v in task.parse_steps(text, family)]
    return len(set(keys)) < len(keys)


# ``Benchmark.loops`` checks, ``(text, generated ids) -> bool``: module-level (picklable), so a benchmark can be handed
# to another process (``dynts eval --workers``)


def token_tail_loops(text: str, ids: Sequence[int]) -> bool:
    """A text benchmark's check: the generated ids end in a repeated pattern (:func:`tail_repeats`)."""
    return tail_repeats(ids)


@dataclass(frozen=True)
class StepKeyRepeats:
    """A testbed benchmark's check: the trace writes some step key of ``family`` twice (:func:`testbed_loops`)."""

    family: str = "copy"

    def __call__(self, text: str, ids: Sequence[int]) -> bool:
        return testbed_loops(text, self.family)
