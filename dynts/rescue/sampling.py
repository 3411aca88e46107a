"""Sampling for step candidates: one random stream per candidate, independent of batching.

Every candidate owns a :class:`torch.Generator` seeded from ``(seed, problem, step, source,
index)`` (:func:`candidate_generator`), so a candidate draws the same tokens whether it is decoded
alone or in a batch with any other rows: the same seed gives the same trajectory for any batch
layout, and a hand-written loop can reproduce it exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["Sampler", "candidate_generator", "entropy"]


def candidate_generator(seed: int, problem: int, step: int, source: str, index: int) -> torch.Generator:
    """The random stream of candidate ``index`` from ``source`` (``"base"``/``"helper"``) at ``step``."""
    digest = hashlib.sha256(f"{seed}:{problem}:{step}:{source}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass
class Sampler:
    """Temperature / top-k / top-p sampling (paper, Appendix C: 0.8 / 20 / 0.95); ``temperature=0``
    is greedy. Settings are validated here; warping reuses transformers' logits warpers."""

    temperature: float = 0.8
    top_k: int = 20
    top_p: float = 0.95

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1]")
        warpers = []
        if self.temperature > 0:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                warpers.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
        self._warpers = LogitsProcessorList(warpers)

    def __call__(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """One token per row of ``logits`` ``[r, V]``, row ``i`` drawn with ``generators[i]``; ``[r]`` long."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = self._warpers(None, logits.float()).softmax(-1).cpu()
        return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)]).to(logits.device)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Predictive entropy in nats of each row of ``logits`` ``[..., V]`` (the model's own distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
