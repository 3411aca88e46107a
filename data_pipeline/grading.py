"""Grading generated answers, one module for the trace pipeline and for ``dynts eval``.

Where the answer is. Reasoning models close their thinking with a delimiter (``</think>``) and then
answer; a ``\\boxed{}`` written while thinking is a draft, not an answer. ``grade_on`` (``--grade-on``
of ``dynts eval``, ``grade_on:`` of the pipeline's trace stage) says what a grader reads:

- ``answer`` (reasoning models): the text after the first delimiter; a trace that never closes its
  thinking (cut by ``max_new_tokens``, or looping after an eviction) is unanswered: wrong and not
  parsed, whatever boxes its thinking holds;
- ``full``: the whole generated text (models without a thinking segment).

``dynts eval`` resolves ``auto`` (its default) with :func:`resolve_grade_on`: ``answer`` when the
tokenizer knows the delimiter (one vocabulary token, or named in its chat template), else ``full``.

Graders (:class:`Grader`: ``grade(gold, text) -> Grade``):

- :class:`MathGrader`: math-verify on the content of the LAST ``\\boxed{...}`` (the paper's
  instruction asks for it; DynTS paper 6.1 follows the DeepSeek-R1 protocol): ``parse`` + ``verify``
  (symbolic equality: ``27.0 == 27``, ``1/2 == 0.5``) under math-verify's own timeout;
- :class:`ChoiceGrader`: multiple-choice letters (GPQA-Diamond);
- :class:`TestbedGrader`: the testbed's exact checker (it reads the thinking too, to know the value
  the asked step holds, and the answer after ``</think>`` in both modes).

The trace pipeline finds the first answer token with an answer rule (:data:`ANSWER_RULES`) and calls
a named grader (:func:`make_grader`): ``math`` / ``testbed`` / ``testbed-chain`` / ``exact`` / ``any`` /
``"module:function"``, each ``grade(question, text, answer_text) -> bool``, built on the graders above.
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from data_pipeline.questions import Question

__all__ = [
    "ANSWER_RULES",
    "GRADERS",
    "GRADE_ON",
    "ChoiceGrader",
    "Grade",
    "Grader",
    "MathGrader",
    "TestbedGrader",
    "accuracy",
    "answer_after_delimiter",
    "extract_choice",
    "find_answer_start",
    "grade_text",
    "last_boxed",
    "make_grader",
    "resolve_grade_on",
    "split_answer",
]

GRADE_ON = ("answer", "full")
ANSWER_RULES = ("delimiter", "last_line", "boxed", "gsm8k")

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str, *, skip_unclosed: bool = True) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced and
    stripped; ``\\boxed 5`` (no braces) yields ``"5"``; ``None`` when there is no box.

    Args:
        skip_unclosed: when the last box is never closed, read the previous complete one (a
            generation cut off inside its box, default); ``False`` returns ``None`` instead (a gold
            solution whose last box is malformed must not yield an earlier, intermediate box).
    """
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
            if not skip_unclosed:
                return None
            continue  # unbalanced (generation cut off inside the box): try an earlier one
        word = re.match(r"[^\s$]+", text[start:])
        if word and match.group(0).endswith(" "):
            return word.group(0)
    return None


# ------------------------------------------------------------------ where the answer is


def split_answer(text: str, think_end: str | None) -> str | None:
    """The text after the first ``think_end`` in ``text``; ``None`` when it never occurs (or
    ``think_end`` is empty/``None``)."""
    if not think_end or think_end not in text:
        return None
    return text.split(think_end, 1)[1]


def answer_after_delimiter(ids: Sequence[int], tokenizer: Any, think_end: str | None) -> str | None:
    """The decoded text (special tokens skipped) after the first ``think_end`` in the generated
    ``ids``; ``None`` when the thinking never closed.

    The delimiter is searched as its token sequence (so a special ``</think>`` that decoding would
    skip is found), then, if absent (a BPE that tokenises it differently in context), as text in the
    decode that keeps special tokens.
    """
    if not think_end:
        return None
    ids = [int(i) for i in ids]
    pattern = tokenizer.encode(think_end, add_special_tokens=False)
    start = _find_subsequence(ids, pattern)
    if start is not None:
        return tokenizer.decode(ids[start + len(pattern) :], skip_special_tokens=True)
    rest = split_answer(tokenizer.decode(ids, skip_special_tokens=False), think_end)
    if rest is None:
        return None
    for special in getattr(tokenizer, "all_special_tokens", ()):
        rest = rest.replace(special, "")
    return rest


def resolve_grade_on(grade_on: str, tokenizer: Any, think_end: str | None) -> str:
    """``answer`` / ``full`` as given; ``auto``: ``answer`` when the tokenizer knows ``think_end`` (one
    vocabulary token, or named in its chat template: a reasoning model), else ``full``."""
    if grade_on in GRADE_ON:
        return grade_on
    if grade_on != "auto":
        raise ValueError(f"grade_on={grade_on!r} must be 'auto' or one of {GRADE_ON}")
    if not think_end or tokenizer is None:
        return "full"
    one_token = len(tokenizer.encode(think_end, add_special_tokens=False)) == 1
    template = getattr(tokenizer, "chat_template", None)
    in_template = isinstance(template, str) and think_end in template
    return "answer" if one_token or in_template else "full"


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
    reads_thinking = True  # the checker needs the trace's own steps; it reads the answer after </think>
    family: str = "copy"  # the task family of question-text golds (a Problem carries its own)

    def __post_init__(self) -> None:
        from data_pipeline.testbed import task

        task.check_family(self.family)

    def grade(self, gold: Any, text: str) -> Grade:
        """``gold``: the testbed ``Problem`` or its question text (read as ``family``)."""
        from data_pipeline.testbed import task

        parsed = task.parse_answer(text)
        extracted = None if parsed is None else f"r{parsed[0]}= {parsed[1]}"
        family = None if isinstance(gold, task.Problem) else self.family
        return Grade(task.check_answer(gold, text, family), extracted, None if parsed is None else "answer")


def grade_text(grader: Grader, gold: Any, text: str, answer: str | None, grade_on: str = "answer") -> Grade:
    """Grade one generation under ``grade_on`` (see the module docstring).

    Args:
        text: the whole generated text.
        answer: the text after the thinking delimiter (:func:`answer_after_delimiter` /
            :func:`split_answer`), ``None`` when the thinking never closed.
    """
    if grade_on not in GRADE_ON:
        raise ValueError(f"grade_on={grade_on!r} must be one of {GRADE_ON}")
    if grade_on == "full":
        return grader.grade(gold, text)
    if answer is None:
        return Grade(False, None, None)  # unanswered: the thinking never closed
    return grader.grade(gold, text if getattr(grader, "reads_thinking", False) else answer)


def accuracy(grader: Grader, golds: Sequence[Any], texts: Sequence[str]) -> float:
    """Fraction of ``texts`` graded correct against ``golds`` (pairwise)."""
    if len(golds) != len(texts):
        raise ValueError(f"{len(golds)} gold answers but {len(texts)} texts")
    if not texts:
        raise ValueError("nothing to grade: texts is empty")
    return sum(grader.grade(g, t).correct for g, t in zip(golds, texts)) / len(texts)


# ------------------------------------------------------------------ the trace pipeline

PipelineGrader = Callable[["Question", str, str], bool]


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


_MATH: list[MathGrader] = []  # one shared grader (it caches parsed gold answers)


def _math(question: Question, text: str, answer_text: str) -> bool:
    if not _MATH:
        _MATH.append(MathGrader())
    return _MATH[0].grade(question.gold, answer_text).correct


def _testbed(question: Question, text: str, answer_text: str) -> bool:
    return TestbedGrader().grade(question.content, text).correct


def _testbed_chain(question: Question, text: str, answer_text: str) -> bool:
    return TestbedGrader(family="chain").grade(question.content, text).correct


def _exact(question: Question, text: str, answer_text: str) -> bool:
    return answer_text.strip() == question.gold.strip()


def _any(question: Question, text: str, answer_text: str) -> bool:
    return True


GRADERS: dict[str, PipelineGrader] = {"math": _math, "testbed": _testbed, "testbed-chain": _testbed_chain, "exact": _exact, "any": _any}


def make_grader(name: str) -> PipelineGrader:
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
