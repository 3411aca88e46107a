"""The step PRM's answer rows (trainers.testbed_prm_answers): the LRM's kinds of answer and the answer's loss weight."""

from __future__ import annotations

import random

import pytest
import torch

from data_pipeline.testbed import task
from trainers.testbed_prm_answers import LRM_ANSWER_KINDS, answer_positions, lrm_answer, weighted_label_loss
from trainers.testbed_prm_order import IGNORE


def _problems(n: int = 60) -> list[task.Problem]:
    return [task.make_problem(f"train:prm-answers-test:{i}", min_think=60, max_think=600, family="chain") for i in range(n)]


def _keys(tokens: list[str]) -> list[int]:
    return [s[5] for s in task.parse_steps(tokens[task.QUESTION_TOKENS : tokens.index(task.END_THINK)], "chain")]


def test_lrm_answers_are_right_premature_or_skipped_and_labelled_by_the_oracle():
    rng = random.Random(0)
    for p in _problems():
        for kind in LRM_ANSWER_KINDS:
            tokens, labels = lrm_answer(p, rng, kind)
            assert tokens[: task.QUESTION_TOKENS] == list(p.tokens[: task.QUESTION_TOKENS])
            assert tokens[-4:-2] == [task.END_THINK, f"r{p.asked}="] and tokens[-1] == task.SEP
            keys = _keys(tokens)
            assert labels[-1] == int(kind == "right")
            text = " ".join(tokens[task.QUESTION_TOKENS : -1])
            assert labels[-1] == int(task.check_answer(p.question, text, "chain"))
            if kind == "right":
                assert keys == list(range(1, len(keys) + 1)) and len(keys) >= p.asked
                assert all(label == 1 for label in labels if label != IGNORE)
            elif kind == "premature":
                assert keys == list(range(1, len(keys) + 1)) and p.asked - 4 <= len(keys) < p.asked
            else:
                assert p.asked not in keys and keys[: p.asked - 1] == list(range(1, p.asked))
    with pytest.raises(ValueError, match="kind"):
        lrm_answer(_problems(1)[0], rng, "late")


def test_lrm_answer_kinds_are_drawn_with_their_shares():
    rng = random.Random(1)
    p = _problems(1)[0]
    right = sum(lrm_answer(p, rng)[1][-1] for _ in range(400))
    assert abs(right / 400 - LRM_ANSWER_KINDS["right"]) < 0.08


def test_answer_weight_weighs_the_answer_label_only():
    from trainers.testbed_lm import TOKEN_ID
    from trainers.testbed_prm import collate

    p = _problems(1)[0]
    batch = collate([lrm_answer(p, random.Random(2), "right"), lrm_answer(p, random.Random(3), "premature")])
    ids, labels = batch["input_ids"], batch["labels"]
    mask = answer_positions(ids, labels, TOKEN_ID[task.END_THINK], TOKEN_ID[task.SEP])
    assert mask.sum(1).tolist() == [1, 1]
    for b in range(2):
        last = int((labels[b] != IGNORE).nonzero().max())
        assert mask[b].nonzero().flatten().tolist() == [last]
    logits = torch.randn(*ids.shape, 2)
    plain = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE)
    assert torch.allclose(weighted_label_loss(logits, labels, torch.ones(ids.shape)), plain)
    heavy = weighted_label_loss(logits, labels, 1.0 + 99.0 * mask.float())
    per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    assert torch.allclose(heavy, per[mask].mean(), atol=0.05 * float(per[mask].mean()) + 0.05)


def test_prm_config_checks_the_answer_fields():
    from trainers.testbed_lm import TOKEN_ID
    from trainers.testbed_prm import CorruptStream, PRMConfig

    for bad in ({"lrm_answer_prob": 1.5}, {"answer_weight": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PRMConfig.from_dict(bad)
    cfg = PRMConfig.from_dict({"data": {"family": "chain", "long_batch": 4, "min_think": 60, "max_think": 300},
                               "lrm_answer_prob": 1.0})
    batch = CorruptStream(cfg, 0).batch(0)
    assert (batch["input_ids"] == TOKEN_ID[task.END_THINK]).sum(1).tolist() == [1] * 4  # every row an LRM-kind answer
