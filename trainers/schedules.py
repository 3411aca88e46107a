"""Learning-rate schedule pieces shared by the training jobs (the one cosine, the one warmup).

Both return plain floats for :class:`torch.optim.lr_scheduler.LambdaLR`: the importance predictor
(:mod:`trainers.predictor`) warms up then decays one cosine to a floor; the testbed LM
(:mod:`trainers.testbed_lm`) runs one cosine per curriculum stage.
"""

from __future__ import annotations

import math

__all__ = ["cosine", "linear_warmup", "warmup_cosine"]


def cosine(progress: float, start: float = 1.0, end: float = 0.0) -> float:
    """Half a cosine from ``start`` (``progress = 0``) to ``end`` (``progress = 1``)."""
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))


def linear_warmup(step: int, warmup: int) -> float:
    """``(step + 1) / warmup`` up to 1 (1 from the start when ``warmup <= 1``)."""
    return min(1.0, (step + 1) / max(1, warmup))


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.0) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then one cosine from 1 to ``floor`` at
    step ``total`` (and ``floor`` after it)."""
    if step < warmup:
        return linear_warmup(step, warmup)
    return cosine(min(1.0, (step - warmup) / max(1, total - warmup)), 1.0, floor)
