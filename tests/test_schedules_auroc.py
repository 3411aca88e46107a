"""The one cosine schedule (trainers.schedules) and the PRM's AUROC on torchmetrics:
the same numbers as the hand-written versions they replace."""

from __future__ import annotations

import math
import random

import pytest

from trainers.schedules import cosine, linear_warmup, warmup_cosine
from trainers.testbed_prm import auroc


def former_predictor_schedule(step: int, warmup: int, total: int, floor: float) -> float:
    """trainers/predictor.py before the merge."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def former_stage_lr(step: int, warmup: int, stages: list[tuple[int, float, float]]) -> float:
    """trainers/testbed_lm.py ``lr_at`` before the merge (stages: steps, lr, lr_end)."""
    scale = min(1.0, (step + 1) / max(1, warmup))
    for steps, lr, lr_end in stages:
        if step < steps:
            frac = step / max(1, steps)
            return scale * (lr_end + 0.5 * (lr - lr_end) * (1 + math.cos(math.pi * frac)))
        step -= steps
    return stages[-1][2]


def test_cosine_and_warmup_endpoints():
    assert cosine(0.0) == 1.0 and cosine(1.0) == 0.0 and cosine(0.5, 2.0, 1.0) == pytest.approx(1.5)
    assert linear_warmup(0, 4) == 0.25 and linear_warmup(3, 4) == 1.0 and linear_warmup(10, 4) == 1.0
    assert linear_warmup(0, 0) == 1.0


def test_predictor_schedule_is_unchanged():
    for warmup, total, floor in [(10, 100, 0.1), (1, 7, 0.0), (5, 5, 0.05), (0, 9, 0.2)]:
        for step in range(total + 3):
            assert warmup_cosine(step, warmup, total, floor) == former_predictor_schedule(step, warmup, total, floor)


def test_testbed_lm_schedule_is_unchanged():
    from trainers.testbed_lm import LMConfig, Stage, lr_at

    cfg = LMConfig(stages=[Stage(300, 1e-3, 1e-4, 0.2), Stage(170, 5e-4, 3e-5, 0.5)], warmup=50)
    stages = [(s.steps, s.lr, s.lr_end) for s in cfg.stages]
    total = sum(s for s, _, _ in stages)
    for step in list(range(0, total + 5, max(1, total // 97))) + [cfg.warmup - 1, cfg.warmup, total - 1, total]:
        assert lr_at(cfg, step) == former_stage_lr(step, cfg.warmup, stages)


def mann_whitney(scores, labels) -> float:
    """The hand-written AUROC torchmetrics replaced (average ranks for ties)."""
    pairs = sorted(zip(scores, labels))
    ranks, i = [0.0] * len(pairs), 0
    while i < len(pairs):
        j = i
        while j + 1 < len(pairs) and pairs[j + 1][0] == pairs[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(1 for _, y in pairs if y == 1)
    neg = len(pairs) - pos
    return (sum(r for r, (_, y) in zip(ranks, pairs) if y == 1) - pos * (pos + 1) / 2) / (pos * neg)


@pytest.mark.parametrize("scores,labels,expected", [
    ([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1], 1.0),
    ([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1], 0.0),
    ([0.5, 0.5], [0, 1], 0.5),                        # one tie: half
    ([0.3, 0.5, 0.5, 0.9], [0, 1, 0, 1], 0.875),       # a tie across classes counts half
    ([0.2, 0.2, 0.2, 0.7, 0.7], [1, 0, 0, 1, 0], 3.5 / 6),
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),
])
def test_auroc_hand_cases(scores, labels, expected):
    assert mann_whitney(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert auroc(scores, labels) == pytest.approx(expected, abs=1e-6)  # torchmetrics sums in float32
    if expected * 8 == int(expected * 8):  # eighths are exact in float32: the same number to the bit
        assert auroc(scores, labels) == expected


def test_auroc_matches_the_rank_formula_on_random_scores_with_ties():
    rng = random.Random(0)
    for trial in range(50):
        n = rng.randint(2, 80)
        scores = [rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]) if trial % 2 else rng.random() for _ in range(n)]
        labels = [0, 1] + [rng.randint(0, 1) for _ in range(n - 2)]
        assert auroc(scores, labels) == pytest.approx(mann_whitney(scores, labels), abs=1e-6)  # float32 inside


def test_auroc_is_nan_with_one_class_and_checks_lengths():
    assert math.isnan(auroc([0.1, 0.2], [1, 1])) and math.isnan(auroc([0.1, 0.2], [0, 0]))
    with pytest.raises(ValueError, match="one label per score"):
        auroc([0.1, 0.2], [1])
