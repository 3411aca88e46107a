"""Step-order negatives for the testbed PRM are wrong by the exact step check, and positives right."""

from __future__ import annotations

import random

import pytest

from data_pipeline.testbed import task
from eval.rescue.verifiers import testbed_step_verifier as exact_check
from trainers.testbed_prm_order import ORDER_KINDS, order_heldout, order_negative, order_row


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


def test_training_rows_cut_at_a_labelled_order_step():
    """``order_row``: the trace is cut after step ``k``; a negative (repeat / skip / rekey) is wrong by
    the exact step check and labelled 0 at its ``;`` and its key; a positive keeps the trace's label;
    only that step is labelled."""
    from trainers.testbed_prm import IGNORE, corrupt

    seen = set()
    for i, p in enumerate(task.problem_set("ci-order-rows", 40, min_think=60, max_think=700)):
        toks, labels = corrupt(p, random.Random(i), 0.0, digit_labels=True)
        for negative in (False, True):
            rng = random.Random(f"{i}:{negative}")
            row = order_row(toks, labels, rng, negative, key_labels=True)
            if row is None:
                continue
            cut, lab = row
            assert cut[-1] == task.SEP and len(cut) == len(lab) <= len(toks)
            assert lab[-1] == int(not negative) and judged((cut, lab)) == float(not negative)
            labelled = [j for j, y in enumerate(lab) if y != IGNORE]
            assert labelled[0] >= len(cut) - task.STEP_TOKENS  # the last step only
            assert lab[len(cut) - 3] == int(not negative)  # its key: "this is the next key"
            seen.add(negative)
    assert seen == {False, True}


def test_order_options_are_validated():
    from trainers.testbed_prm import PRMConfig

    with pytest.raises(ValueError, match="order_prob"):
        PRMConfig.from_dict({"order_prob": 1.5})
    with pytest.raises(ValueError, match="init_prm_from"):
        PRMConfig.from_dict({"init_from": "testbed", "init_prm_from": "testbed-prm"})
    with pytest.raises(ValueError, match="expect_weight"):
        PRMConfig.from_dict({"init_prm_from": "testbed-prm", "expect_weight": 1.0})


def test_shipped_order_prm_sees_repeated_steps():
    """The step-order-aware PRM (configs/testbed/prm-order.yaml) scores a repeated step low on
    held-out traces, where the shipped PRM it was fine-tuned from is at chance, and still separates
    wrong digits and operands. (Skipped steps it does not learn: AUROC ~0.5, docs/rescue.md.)"""
    from dynts.models import load
    from trainers.testbed_prm import PRMConfig, auroc, heldout, step_scores

    ordered, _ = load("testbed-prm-order")
    blind, _ = load("testbed-prm")
    rows = order_heldout("ci-order", 60, "repeat")
    assert auroc(*step_scores(ordered, rows)) > 0.85 > 0.7 > auroc(*step_scores(blind, rows))
    cfg = PRMConfig.from_dict({"corrupt_prob": 0.5, "data": {"min_think": 60, "max_think": 400}})
    assert auroc(*step_scores(ordered, heldout("ci", 12, cfg))) > 0.95
