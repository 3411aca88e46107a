"""Sampling for step candidates: one random stream per candidate, independent of batching.

Warping (top-k, temperature, top-p) runs on the logits' device; only ``[rows, k]`` probabilities
and ids reach the host (:meth:`Sampler.draw`). Every candidate owns a host :class:`random.Random`
seeded from ``(seed, problem, step, source, index)`` (:func:`candidate_generator`), so a candidate draws the same tokens whether it is decoded
alone or in a batch with any other rows: the same seed gives the same trajectory for any batch
layout, and a hand-written loop can reproduce it exactly.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "candidate_generator", "entropy"]


def candidate_generator(seed: int, problem: int, step: int, source: str, index: int) -> random.Random:
    """The random stream of candidate ``index`` from ``source`` (``"base"``/``"helper"``) at ``step``:
    a host-side :class:`random.Random` (drawing from it reads no tensor)."""
    digest = hashlib.sha256(f"{seed}:{problem}:{step}:{source}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


@dataclass
class Sampler:
    """Temperature / top-k / top-p sampling (paper, Appendix C: 0.8 / 20 / 0.95); ``temperature=0``
    is greedy.

    The warping runs where the logits are: ``torch.topk`` keeps the ``k`` largest logits of each
    row, temperature and top-p act on those ``[rows, k]`` values, and only the ``[rows, k]``
    probabilities and token ids (packed with any per-row extras, one host copy) reach the host,
    where each row draws from its own generator. ``top_k = 0`` (off) makes ``k`` the vocabulary
    size, i.e. a ``[rows, V]`` copy. Top-p follows transformers' ``TopPLogitsWarper`` on the top-k
    distribution (the same cut, computed in descending instead of ascending order); ties at
    the k-th logit are broken by ``torch.topk``.
    """

    temperature: float = 0.8
    top_k: int = 20
    top_p: float = 0.95

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1]")

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, ids)``, both ``[r, k]`` on the logits' device: the renormalised sampling
        distribution over each row's top-k tokens (descending) after temperature and top-p."""
        k = min(self.top_k or logits.shape[-1], logits.shape[-1])
        values, ids = torch.topk(logits.float(), k, dim=-1)
        if self.temperature != 1.0:
            values = values / self.temperature
        probs = values.softmax(-1)
        if self.top_p < 1.0:
            # as TopPLogitsWarper: drop tokens whose mass, counted up from the least likely one
            # (the token included), stays <= 1 - top_p; the most likely token always stays
            below = probs.flip(-1).cumsum(-1).flip(-1)
            drop = below <= 1 - self.top_p
            drop[..., 0] = False
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs, ids

    def draw(self, logits: torch.Tensor, generators: list[random.Random],
             extras: torch.Tensor | None = None) -> tuple[list[int], list[list[float]]]:
        """One token per row of ``logits`` ``[r, V]``, row ``i`` drawn with ``generators[i]``, and the
        rows of ``extras`` ``[r, e]`` (e.g. entropies) -- all in ONE device-to-host read of
        ``[r, 2k + e]`` (``[r, 1 + e]`` when greedy). Row ``i`` takes the first token (in descending
        probability) whose cumulative probability exceeds ``generators[i].random()`` (one draw per
        token). Returns ``(tokens, extras_rows)``."""
        if logits.shape[-1] >= 2**24:
            raise ValueError(f"a vocabulary of {logits.shape[-1]} ids does not pack exactly into float32 (< 2**24)")
        parts = []
        if self.temperature == 0:
            parts.append(logits.argmax(-1, keepdim=True).float())
        else:
            probs, ids = self.candidates(logits)
            parts += [probs, ids.float()]
        if extras is not None:
            parts.append(extras.float().reshape(logits.shape[0], -1))
        host = torch.cat(parts, -1).tolist()  # the single device-to-host read
        if self.temperature == 0:
            return [int(row[0]) for row in host], [row[1:] for row in host]
        k = parts[0].shape[-1]
        tokens = []
        for row, g in zip(host, generators):
            cdf = list(itertools.accumulate(row[:k]))
            j = min(bisect.bisect_right(cdf, g.random() * cdf[-1]), k - 1)
            while row[j] == 0.0 and j > 0:  # never a token top-p removed (float rounding at the end)
                j -= 1
            tokens.append(int(row[k + j]))
        return tokens, [row[2 * k :] for row in host]

    def __call__(self, logits: torch.Tensor, generators: list[random.Random]) -> torch.Tensor:
        """One token per row of ``logits`` ``[r, V]``, row ``i`` drawn with ``generators[i]``; ``[r]`` long."""
        tokens, _ = self.draw(logits, generators)
        return torch.tensor(tokens, dtype=torch.long, device=logits.device)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Predictive entropy in nats of each row of ``logits`` ``[..., V]`` (the model's own distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
