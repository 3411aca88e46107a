"""Per-request sampling inside continuous batching: every request decodes with its own parameters.

The stock engine samples a whole batch with one ``do_sample`` flag taken from the generation config
it was built with, so a server would sample every request the way its first one asked. Here each
request carries a :class:`SamplingParams` (greedy at ``temperature=0``; ``top_p``, ``top_k``,
``seed``, ``frequency_penalty``, ``presence_penalty``), and :class:`PerRequestSampler` replaces the
engine's sampling step: one vectorised pass over the batch's logits rows ``[N, V]`` (penalties,
temperature, top-k, top-p), argmax for greedy rows, one multinomial draw for unseeded rows and one
draw per seeded row from that request's own ``torch.Generator`` (the same seed gives the same text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["SamplingParams", "PerRequestSampler", "neutral_generation_config"]

# GenerationConfig fields that would make the engine's own logits processors warp every request alike.
WARPER_FIELDS = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "typical_p": None,
                 "repetition_penalty": None, "do_sample": False}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token (OpenAI semantics).

    Args:
        temperature: ``0`` decodes greedily; ``(0, 2]`` samples from ``softmax(logits / T)``.
        top_p: nucleus mass kept, ``(0, 1]``.
        top_k: most-likely tokens kept, ``0`` or ``-1`` for all.
        seed: seeds this request's own generator (same seed and prompt -> same text).
        frequency_penalty: subtracted ``count(token) * penalty`` from generated tokens' logits, ``[-2, 2]``.
        presence_penalty: subtracted once from every generated token's logit, ``[-2, 2]``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature, 0.0, 2.0, "0 for greedy, up to 2"),
            ("top_p", self.top_p, 0.0, 1.0, "in (0, 1]"),
            ("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]"),
            ("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]"),
        )
        for name, value, low, high, hint in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low <= value <= high or (name == "top_p" and value == 0):
                raise ValueError(f"{name}={value!r} is out of range ({hint})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1 (or 0 / -1 for all tokens)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @classmethod
    def from_request(cls, fields: Mapping[str, Any], default: "SamplingParams") -> "SamplingParams":
        """Fields of an OpenAI request body over ``default`` (a field sent as ``null`` keeps the default)."""
        given = {k: fields[k] for k in ("temperature", "top_p", "top_k", "seed", "frequency_penalty",
                                       "presence_penalty") if fields.get(k) is not None}
        if "temperature" not in given and not default.greedy:
            given.setdefault("temperature", default.temperature)
        return cls(**{**default.__dict__, **given})

    @classmethod
    def from_generation_config(cls, config) -> "SamplingParams":
        """The model's own defaults (``generation_config``): greedy unless it sets ``do_sample``."""
        if not getattr(config, "do_sample", False):
            return cls()
        return cls(temperature=float(config.temperature if config.temperature is not None else 1.0),
                   top_p=float(config.top_p if config.top_p is not None else 1.0),
                   top_k=int(config.top_k or 0))


def neutral_generation_config(config):
    """A copy of ``config`` without sampling warpers, so only :class:`PerRequestSampler` shapes the logits."""
    import copy

    config = copy.deepcopy(config)
    for name, value in WARPER_FIELDS.items():
        setattr(config, name, value)
    return config


class PerRequestSampler:
    """The engine's sampling step, per request.

    Args:
        params_of: request id -> its :class:`SamplingParams` (``None``: ``default``).
        default: used for requests sent without parameters.
    """

    def __init__(self, params_of: Callable[[str], SamplingParams | None], default: SamplingParams) -> None:
        self.params_of, self.default = params_of, default
        self.generators: dict[str, torch.Generator] = {}
        self.rows: list[tuple[str, SamplingParams, list[int]]] = []

    def prepare(self, requests_in_batch) -> None:
        """Record, for the forward about to run, the request behind every logits row (the engine orders
        logits rows as the requests of the batch that get a new token)."""
        self.rows = []
        for future in requests_in_batch:
            if not future.has_new_token:
                continue
            state = future.state
            params = self.params_of(state.request_id) or self.default
            generated: list[int] = []
            if params.penalised:  # after a soft reset the generated tokens sit at the end of initial_tokens
                start = getattr(state, "_true_initial_tokens", 0)
                generated = (state.initial_tokens[start:] if start else []) + list(state.generated_tokens)
            self.rows.append((state.request_id, params, generated))

    def forget(self, live: set[str]) -> None:
        """Drop the generators of requests that left the engine."""
        for rid in [r for r in self.generators if r not in live]:
            del self.generators[rid]

    def __call__(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """Sample the next token of the ``N`` requests with a new token (the first ``N`` rows of ``scores``
        ``[1, >=N, V]``) into ``output_ids[0, :N]``."""
        # the engine slices one logits row per request of the batch; the rows of requests still prefilling
        # (no new token) are trailing filler it never reads
        n = len(self.rows)
        if scores.shape[1] < n:
            raise RuntimeError(f"per-request sampling: {scores.shape[1]} logits rows for {n} requests")
        logits = scores[0, :n].float()  # [N, V]
        if any(p.penalised for _, p, _ in self.rows):
            logits = logits.clone()
            for i, (_, p, generated) in enumerate(self.rows):
                if p.penalised and generated:
                    counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[1])
                    counts = counts[: logits.shape[1]].to(logits.dtype)
                    logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        sampled = [i for i, (_, p, _) in enumerate(self.rows) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs = self._probs(logits.index_select(0, index), [self.rows[i][1] for i in sampled])
            plain = [j for j, i in enumerate(sampled) if self.rows[i][1].seed is None]
            if plain:
                j = torch.tensor(plain, device=logits.device)
                tokens[index[j]] = torch.multinomial(probs.index_select(0, j), 1).squeeze(-1)
            for j, i in enumerate(sampled):
                rid, p, _ = self.rows[i]
                if p.seed is not None:
                    tokens[i] = torch.multinomial(probs[j : j + 1], 1, generator=self._generator(rid, p.seed, probs.device))[0, 0]
        output_ids[0, :n].copy_(tokens)

    def _generator(self, rid: str, seed: int, device: torch.device) -> torch.Generator:
        g = self.generators.get(rid)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(seed % 2**64)
            self.generators[rid] = g
        return g

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k and top-p per row of ``logits`` ``[m, V]``; returns probabilities ``[m, V]``."""
        device, vocab = logits.device, logits.shape[1]
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        tops = [p.top_p for p in params]
        if min(ks) < vocab or min(tops) < 1:
            ordered, order = logits.sort(dim=-1, descending=True)  # [m, V]
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            drop = ranks >= torch.tensor(ks, device=device).unsqueeze(1)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass strictly above
            drop |= mass >= torch.tensor(tops, device=device, dtype=logits.dtype).unsqueeze(1)
            drop[:, 0] = False  # the most likely token always stays
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return logits.softmax(dim=-1)
