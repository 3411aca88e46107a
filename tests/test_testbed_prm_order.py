"""Step-order negatives for the testbed PRM are wrong by the exact step check, and positives right."""

from __future__ import annotations

import random

import pytest

from data_pipeline.testbed import task
from eval.rescue.bench import testbed_step_verifier as exact_check
from trainers.testbed_prm_order import order_heldout, order_negative


def judged(row) -> float:
    toks, labels = row
    question = " ".join(toks[: task.QUESTION_TOKENS])
    thinking = " ".join(toks[task.QUESTION_TOKENS :]).split(f" {task.SEP}")
    steps = [s.strip() + f" {task.SEP}" for s in thinking if s.strip()]
    return exact_check(question, steps)


@pytest.mark.parametrize("kind", ["repeat", "skip"])
def test_order_negatives_are_wrong_and_positives_right(kind):
    problems = task.problem_set("test", 12, min_think=60, max_think=700)
    for i, p in enumerate(problems):
        for negative in (False, True):
            row = order_negative(p, random.Random(i), kind, negative)
            if row is None:
                continue
            toks, labels = row
            assert toks[-1] == task.SEP and labels[-1] == int(not negative)
            assert sum(label != -100 for label in labels) == 1
            assert judged(row) == float(not negative)
    rows = order_heldout("test", 10, kind)
    assert {labels[-1] for _, labels in rows} == {0, 1}
    with pytest.raises(ValueError, match="kind"):
        order_negative(problems[0], random.Random(0), "swap", True)
