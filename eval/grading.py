"""Grading generated answers: math expressions (math-verify), multiple-choice letters (GPQA) and
the testbed's exact checker.

Every grader answers one question per sample: given the gold answer and the generated text, is it
correct, and what answer did we read from the text? The math grader reads the content of the LAST
``\\boxed{...}`` (the paper's instruction asks for it; DynTS paper 6.1 follows the DeepSeek-R1
protocol) and compares it with the gold answer through ``math_verify.parse`` + ``math_verify.verify``
(symbolic equality: ``27.0 == 27``, ``1/2 == 0.5``), both under math-verify's own timeout.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

__all__ = [
    "ChoiceGrader",
    "Grade",
    "Grader",
    "MathGrader",
    "TestbedGrader",
    "accuracy",
    "extract_choice",
    "last_boxed",
]


@dataclass(frozen=True)
class Grade:
    """One graded sample: ``correct``, the answer read from the text (``None`` when nothing could be
    read) and where it came from (``"boxed"``, ``"fallback"`` or ``None``)."""

    correct: bool
    extracted: str | None
    source: str | None


class Grader(Protocol):
    """Grades one generated text against one gold answer."""

    def grade(self, gold: Any, text: str) -> Grade: ...


_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced;
    ``\\boxed 5`` (no braces) yields ``"5"``. ``None`` when there is no complete box."""
    for match in reversed(list(_BOX.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i].strip()
            continue  # unbalanced (generation cut off inside the box): try an earlier one
        word = re.match(r"[^\s$]+", text[start:])
        if word and match.group(0).endswith(" "):
            return word.group(0)
    return None


def _timeout(seconds: int | None) -> int | None:
    # math-verify's timeout uses signal.alarm, which only works in the main thread.
    return seconds if threading.current_thread() is threading.main_thread() else None


@dataclass
class MathGrader:
    """math-verify grading of a final answer.

    Args:
        timeout_seconds: math-verify's ``parsing_timeout`` and ``timeout_seconds`` per call (run
            without timeout outside the main thread, where ``signal.alarm`` is unavailable).
        fallback: when the text has no ``\\boxed{}``, let math-verify look for an answer in the
            whole text (last LaTeX expression / number); off = such samples are wrong.
    """

    timeout_seconds: int = 5
    fallback: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_seconds, int) or self.timeout_seconds < 1:
            raise ValueError(f"timeout_seconds={self.timeout_seconds!r} must be an int >= 1")
        from math_verify import ExprExtractionConfig, LatexExtractionConfig

        self._config = [LatexExtractionConfig(), ExprExtractionConfig()]
        self._gold_cache: dict[str, list] = {}

    def _parse(self, text: str) -> list:
        from math_verify import parse

        return parse(text, self._config, parsing_timeout=_timeout(self.timeout_seconds))

    def parse_gold(self, gold: str) -> list:
        """The parsed gold answer (cached), read as the content of a ``\\boxed{}`` like the
        predictions (so ``\\$36`` and ``$145$`` parse); falls back to ``$gold$``."""
        if gold not in self._gold_cache:
            self._gold_cache[gold] = self._parse(f"\\boxed{{{gold}}}") or self._parse(f"${gold}$")
        return self._gold_cache[gold]

    def grade(self, gold: str, text: str) -> Grade:
        from math_verify import verify

        boxed = last_boxed(text)
        if boxed is not None:
            pred, source = self._parse(f"\\boxed{{{boxed}}}"), "boxed"
        elif self.fallback:
            pred, source = self._parse(text), "fallback"
        else:
            return Grade(False, None, None)
        if not pred:
            return Grade(False, boxed, source if boxed is not None else None)
        correct = bool(verify(self.parse_gold(gold), pred, timeout_seconds=_timeout(self.timeout_seconds)))
        extracted = boxed if boxed is not None else str(pred[-1])
        return Grade(correct, extracted, source)


LETTERS = "ABCDEFGHIJ"
_TEXT_WRAP = re.compile(r"\\text(?:bf|rm|tt)?\s*\{([^{}]*)\}")
_ANSWER_IS = re.compile(
    r"(?:answer|choice|option)\s*(?:is|:)?\s*[:=]?\s*(?:\*\*)?\s*[\(\[]?([A-J])[\)\]]?(?![A-Za-z])", re.IGNORECASE
)


def extract_choice(text: str, n_choices: int = 4) -> tuple[str | None, str | None]:
    """The chosen letter in ``text``: from the last ``\\boxed{}`` (``B``, ``(B)``, ``\\text{B}``,
    ``B) 42``), else from the last "answer is (B)" / "Answer: B" phrase. Returns ``(letter, source)``."""
    valid = LETTERS[:n_choices]
    boxed = last_boxed(text)
    if boxed is not None:
        inner = _TEXT_WRAP.sub(r"\1", boxed).strip().strip("$ ").lstrip("([").strip()
        if inner[:1].upper() in valid and (len(inner) == 1 or not inner[1].isalpha()):
            return inner[0].upper(), "boxed"
    hits = [m.group(1).upper() for m in _ANSWER_IS.finditer(text) if m.group(1).upper() in valid]
    if hits:
        return hits[-1], "fallback"
    return None, None


@dataclass
class ChoiceGrader:
    """Multiple choice (GPQA-Diamond): the gold answer is a letter; the text must pick it."""

    n_choices: int = 4

    def __post_init__(self) -> None:
        if not 2 <= self.n_choices <= len(LETTERS):
            raise ValueError(f"n_choices={self.n_choices} must lie in [2, {len(LETTERS)}]")

    def grade(self, gold: str, text: str) -> Grade:
        letter, source = extract_choice(text, self.n_choices)
        return Grade(letter is not None and letter == gold.strip().upper(), letter, source)


@dataclass
class TestbedGrader:
    """The testbed's exact checker (``data_pipeline.testbed.task.check_answer``): the answer after
    ``</think>`` must name the asked key and carry the value that key's step really has."""

    __test__ = False  # not a pytest class

    def grade(self, gold: Any, text: str) -> Grade:
        from data_pipeline.testbed import task

        parsed = task.parse_answer(text)
        extracted = None if parsed is None else f"r{parsed[0]}= {parsed[1]}"
        return Grade(task.check_answer(gold, text), extracted, None if parsed is None else "answer")


def accuracy(grader: Grader, golds: Sequence[Any], texts: Sequence[str]) -> float:
    """Fraction of ``texts`` graded correct against ``golds`` (pairwise)."""
    if len(golds) != len(texts):
        raise ValueError(f"{len(golds)} gold answers but {len(texts)} texts")
    if not texts:
        raise ValueError("nothing to grade: texts is empty")
    return sum(grader.grade(g, t).correct for g, t in zip(golds, texts)) / len(texts)
