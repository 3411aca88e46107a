"""The answer rows of the testbed PRM's training: synthetic answers and the answer's share of the loss.

Two kinds of answer are appended to reference traces (:class:`trainers.testbed_prm.CorruptStream`):

* :func:`with_answer` (``PRMConfig.answer_prob``): the asked key and the value the trace wrote after it,
  corrupted to another digit or another written key. Every such trace wrote the asked step, so none of
  these answers is premature.
* :func:`lrm_answer` (``PRMConfig.lrm_answer_prob``): the LRM's own kinds of answer, labelled by the same
  oracle as the policy traces (:func:`trainers.testbed_prm_traces.process_labels`): the trace cut after the
  asked step and answered with its value (right), cut one to four steps *before* the asked step (a premature
  answer: the fair chain LRM's wrong answers at full cache are 88 of 133 of this kind on ``dev``), or with the
  asked step left out and later steps kept (a skipped key, 45 of 133); the wrong ones carry a random digit.

:func:`answer_positions` marks each row's answer label, which ``PRMConfig.answer_weight`` weights in the loss:
a trace holds about ten step labels and one answer label, so the answer is otherwise a small share of it.
"""

from __future__ import annotations

import random
import torch

from data_pipeline.testbed import task
from trainers.testbed_prm_order import IGNORE
from trainers.testbed_prm_traces import process_labels

__all__ = ["LRM_ANSWER_KINDS", "answer_positions", "lrm_answer", "weighted_label_loss", "with_answer"]

# The kinds of :func:`lrm_answer` with their probabilities: half right, half wrong as the LRM is wrong.
LRM_ANSWER_KINDS: dict[str, float] = {"right": 0.5, "premature": 0.3, "skip": 0.2}
MAX_PREMATURE_GAP = 4  # a premature answer is cut 1..4 steps before the asked one (the LRM's gaps at full cache)


def with_answer(problem: task.Problem, toks: list[str], labels: list[int], rng: random.Random, prob: float,
                digit_labels: bool = False) -> tuple[list[str], list[int]]:
    """Append the answer step ``</think> rK= v ;`` to a (possibly corrupted) thinking trace, labelled
    at its ``;``: right iff ``rK=`` is the asked key and ``v`` is the value the trace wrote after it.
    With probability ``prob`` it is corrupted: another digit, or another written key (with that key's
    value: a consistent but wrong lookup). ``digit_labels`` also labels the key and the value."""
    written = {toks[i - 2]: toks[i - 1] for i, t in enumerate(toks) if t == task.SEP}  # key -> last value written
    key = f"r{problem.asked}="
    if key not in written:  # the trace never wrote the asked step: no answer to check
        return toks, labels
    value = written[key]
    if rng.random() < prob:
        others = [k for k in written if k != key]
        if others and rng.random() < 0.5:
            key = rng.choice(others)
            value = written[key]
        else:
            value = str((int(value) + rng.randint(1, 9)) % 10)
    key_ok = key == f"r{problem.asked}="
    value_ok = value == written[f"r{problem.asked}="]
    toks = toks + [task.END_THINK, key, value, task.SEP]
    value_local = value == written[key]  # the lookup itself, whichever key was asked
    labels = labels + [IGNORE, int(key_ok) if digit_labels else IGNORE, int(value_local) if digit_labels else IGNORE,
                       int(key_ok and value_ok)]
    return toks, labels


def lrm_answer(problem: task.Problem, rng: random.Random, kind: str | None = None) -> tuple[list[str], list[int]]:
    """The problem's reference trace answered as the LRM answers (module docstring), ``kind`` drawn from
    :data:`LRM_ANSWER_KINDS` unless given; every step and the answer labelled by the policy traces' oracle.
    A trace is cut at the start of a step, so the filler before ``</think>`` is the filler the trace wrote."""
    if kind is None:
        kind = rng.choices(list(LRM_ANSWER_KINDS), weights=list(LRM_ANSWER_KINDS.values()))[0]
    if kind not in LRM_ANSWER_KINDS:
        raise ValueError(f"kind={kind!r}: use one of {list(LRM_ANSWER_KINDS)}")
    thinking = list(problem.tokens[task.QUESTION_TOKENS : problem.tokens.index(task.END_THINK)])
    ends = [i + 1 for i, t in enumerate(thinking) if t == task.SEP]  # step k (1-based) is thinking[ends[k-1]-9 : ends[k-1]]
    starts = [e - task.STEP_TOKENS for e in ends] + [len(thinking)]  # starts[k]: where step k + 1 starts (or the end)
    asked, n = problem.asked, len(ends)
    value = thinking[ends[asked - 1] - 2]
    if kind == "right":
        words = thinking[: starts[rng.randint(asked, n)]]
    elif kind == "premature":
        words = thinking[: starts[rng.randint(max(0, asked - MAX_PREMATURE_GAP), asked - 1)]]
    else:  # skip: the asked step left out, the trace cut after a later step (or at its end)
        cut = starts[rng.randint(asked, n)]
        words = thinking[: starts[asked - 1]] + thinking[ends[asked - 1] : cut]
    if kind != "right":
        value = str(rng.randrange(10))
    return process_labels(problem.question, [*words, task.END_THINK, f"r{asked}=", value], problem.family)


def answer_positions(input_ids: torch.Tensor, labels: torch.Tensor, end_think: int, sep: int) -> torch.Tensor:
    """``[B, T]`` bool: the labelled ``;`` after a row's ``</think>`` (its answer label)."""
    closed = torch.cumsum((input_ids == end_think).long(), dim=1) > 0
    return closed & (input_ids == sep) & (labels != IGNORE)


def weighted_label_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the labelled positions, each weighted (``weights`` ``[B, T]``): the weighted mean, which is
    the plain mean over labelled positions when every weight is 1."""
    per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    w = weights * (labels != IGNORE)
    return (per * w).sum() / w.sum().clamp_min(1e-8)

