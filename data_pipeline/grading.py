"""Where the answer of a generated trace starts, and whether it is correct.

Answer rules (``answer_rule``), giving the index of the first answer token in the generated ids:

- ``delimiter`` (reasoning models): the first occurrence of the thinking delimiter (``</think>``)
  itself; the answer must hold at least one visible token after it.
- ``last_line`` (models without a delimiter, e.g. SmolLM2): the first token of the last non-empty
  line; at least one earlier line (the "thinking") must exist.
- ``boxed`` / ``gsm8k``: the first token of the line holding the last ``\\boxed{`` / ``####``.

Graders (``grader``), called as ``grade(question, text, answer_text) -> bool``:

- ``math``: math-verify of the answer text against the gold answer (``\\boxed`` or plain);
- ``testbed``: the testbed's exact checker (``data_pipeline.testbed.task.check_answer``);
- ``exact``: the answer text (after the delimiter / on the answer line), stripped, equals the gold;
- ``any``: accept every complete trace (smoke tests, models that rarely solve the task);
- ``"module:function"``: your own function with that signature.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from data_pipeline.questions import Question

__all__ = ["ANSWER_RULES", "GRADERS", "find_answer_start", "make_grader"]

ANSWER_RULES = ("delimiter", "last_line", "boxed", "gsm8k")
Grader = Callable[[Question, str, str], bool]


def _find_subsequence(ids: Sequence[int], pattern: Sequence[int]) -> int | None:
    n = len(pattern)
    if n == 0:
        return None
    for i in range(len(ids) - n + 1):
        if list(ids[i : i + n]) == list(pattern):
            return i
    return None


def _token_at_char(ids: Sequence[int], tokenizer, offset: int) -> int:
    """Index of the token whose decoded text covers character ``offset`` of ``decode(ids)``
    (binary search over prefix decodes: ``O(log n)`` decodes, fine for 16k-token traces)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(list(ids[: mid + 1]), skip_special_tokens=True)) > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_answer_start(
    generated: Sequence[int], tokenizer, rule: str = "delimiter", think_end: str = "</think>"
) -> tuple[int | None, str]:
    """``(index into generated, reason)``: the first answer token, or ``(None, reason)`` with
    ``reason`` one of ``no_delimiter`` / ``no_answer`` / ``no_thinking``.

    ``generated`` excludes the prompt and any trailing padding (it may end with EOS).
    """
    if rule not in ANSWER_RULES:
        raise ValueError(f"answer_rule={rule!r} must be one of {ANSWER_RULES}")
    if rule == "delimiter":
        pattern = tokenizer.encode(think_end, add_special_tokens=False)
        start = _find_subsequence(generated, pattern)
        if start is None:
            return None, "no_delimiter"
        if start == 0:
            return None, "no_thinking"
        rest = tokenizer.decode(list(generated[start + len(pattern) :]), skip_special_tokens=True)
        return (start, "ok") if rest.strip() else (None, "no_answer")
    text = tokenizer.decode(list(generated), skip_special_tokens=True)
    lines = text.rstrip().split("\n")
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    if rule == "last_line":
        candidates = [i for i, line in enumerate(lines) if line.strip()]
    else:
        marker = "\\boxed{" if rule == "boxed" else "####"
        candidates = [i for i, line in enumerate(lines) if marker in line]
    if not candidates:
        return None, "no_answer" if rule == "last_line" else "no_delimiter"
    line = candidates[-1]
    first_char = offsets[line] + len(lines[line]) - len(lines[line].lstrip())
    if not text[:first_char].strip():
        return None, "no_thinking"
    return _token_at_char(generated, tokenizer, first_char), "ok"


def _math(question: Question, text: str, answer_text: str) -> bool:
    from math_verify import parse, verify

    gold = question.gold if ("$" in question.gold or "\\boxed" in question.gold) else f"${question.gold}$"
    predicted = parse(answer_text)
    return bool(predicted) and bool(verify(parse(gold), predicted))


def _testbed(question: Question, text: str, answer_text: str) -> bool:
    from data_pipeline.testbed.task import check_answer

    return check_answer(question.content, text)


def _exact(question: Question, text: str, answer_text: str) -> bool:
    return answer_text.strip() == question.gold.strip()


def _any(question: Question, text: str, answer_text: str) -> bool:
    return True


GRADERS: dict[str, Grader] = {"math": _math, "testbed": _testbed, "exact": _exact, "any": _any}


def make_grader(name: str) -> Grader:
    """A grader by name (see the module docstring) or ``"module:function"``."""
    if name in GRADERS:
        return GRADERS[name]
    if ":" in name:
        module, func = name.split(":", 1)
        try:
            return getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"grader={name!r}: cannot import {func} from {module}: {err}") from None
    raise ValueError(f"grader={name!r} must be one of {sorted(GRADERS)} or 'module:function'")
