"""The step-scorer interface shared by every process reward model (:mod:`dynts.rescue.prm`,
:mod:`dynts.rescue.likelihood`): a :class:`StepRequest` in, ``R(c_t, s)`` in ``[0, 1]`` out, plus the
batching helpers the model-backed scorers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..prompts import pad_rows

__all__ = ["CallablePRM", "ProductPRM", "StepRequest", "StepScorer", "padded_batches", "shares_vocab"]


@dataclass
class StepRequest:
    """One candidate step in its committed context.

    Attributes:
        question: the question as a user would read it (a chat's last user message, or the prompt).
        prompt_ids: the rendered prompt as the policy saw it (chat template applied).
        steps: committed steps, token ids of the policy tokenizer.
        candidate: the candidate step's token ids.
        tokenizer: the policy tokenizer (to decode ids).
    """

    question: str
    prompt_ids: list[int]
    steps: list[list[int]]
    candidate: list[int]
    tokenizer: Any = field(repr=False, default=None)

    def step_texts(self) -> list[str]:
        """Committed steps and then the candidate, decoded (special tokens skipped)."""
        return [self.tokenizer.decode(s, skip_special_tokens=True) for s in (*self.steps, self.candidate)]


class StepScorer(ABC):
    """Scores candidate steps; subclasses batch as they see fit."""

    @abstractmethod
    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        """``R(c_t, s)`` for each request, in order."""

    def __call__(self, requests: Sequence[StepRequest]) -> list[float]:
        return self.score(requests)


class CallablePRM(StepScorer):
    """Wraps ``fn(question: str, steps: list[str]) -> float`` (score of the last step)."""

    def __init__(self, fn: Callable[[str, list[str]], float]):
        if not callable(fn):
            raise ValueError(f"prm={fn!r} is not callable")
        self.fn = fn

    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        return [float(self.fn(r.question, r.step_texts())) for r in requests]


class ProductPRM(StepScorer):
    """``R(c_t, s) = prod_j R_j(c_t, s)``: a step passes only when every scorer passes it -- e.g. a
    trained PRM that checks values and order, times the full-context helper's likelihood, which
    catches what the PRM misses (and the other way round). Each scorer sees the same requests."""

    def __init__(self, scorers: Sequence[StepScorer]):
        if len(scorers) < 2 or not all(isinstance(s, StepScorer) for s in scorers):
            raise ValueError(f"scorers={scorers!r}: give two or more StepScorer s to multiply")
        self.scorers = list(scorers)

    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        out = [1.0] * len(requests)
        for scorer in self.scorers:
            out = [a * float(b) for a, b in zip(out, scorer.score(requests))]
        return out


def padded_batches(rows: Sequence[list[int]], batch_size: int, pad_id: int, device: torch.device | str):
    """Yield ``(indices, input_ids, attention_mask)``: ``rows`` sorted by length, in batches of
    ``batch_size``, right-padded (``[b, T]`` long tensors on ``device``)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = pad_rows([rows[i] for i in chunk], pad_id, side="right")
        yield chunk, ids.to(device), mask.to(device)


def shares_vocab(cache: dict[int, bool], mine: Any, policy_tokenizer: Any) -> bool:
    """Whether ``policy_tokenizer`` has the vocabulary of ``mine`` (then ids can be used as they
    are); memoised per tokenizer object in ``cache``."""
    key = id(policy_tokenizer)
    if key not in cache:
        cache[key] = policy_tokenizer is mine or policy_tokenizer.get_vocab() == mine.get_vocab()
    return cache[key]
