"""Batched step decoding over :class:`~dynts.rescue.rows.RaggedCache` rows.

A :class:`StepDecoder` wraps one model (the evicted base or the full-context helper) and knows how to
prefill a prompt, append committed tokens in one forward (then evict), and decode a batch of
candidate steps until each hits the step delimiter, EOS, its token cap, or the degeneration
detector. Candidates of every problem in flight share one batch; a finished candidate stays in the
batch as a padded row (its cache untouched) until the batch is squeezed.

A :class:`State` is a committed model state: one row of a cache plus the logits that row predicts
for its next token. Forking a state is :meth:`RaggedCache.stack` with that row repeated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..attention import recording_attention  # noqa: F401  (registers the "dynts_sdpa" attention)
from ..cache import attach
from ..core.settings import EvictionSettings
from ..hf_compat import cache_keyword
from ..prompts import pad_rows
from .detector import CandidateScreen
from .detok import TextTail
from .rows import RaggedCache
from .sampling import Sampler, entropy
from .shared import ForkCache, PrefixKV, fork_forward

__all__ = ["Candidate", "State", "StepDecoder"]


@dataclass
class State:
    """A committed state: row ``row`` of ``cache`` and its next-token ``logits`` ``[V]``."""

    cache: RaggedCache | ForkCache
    row: int
    logits: torch.Tensor


@dataclass
class Candidate:
    """One candidate step being decoded (or done).

    ``status``: ``live`` while decoding; then ``delimiter`` / ``eos`` / ``cap`` (complete) or
    ``aborted`` (the detector fired; ``abort_reason`` says which test).
    """

    owner: Any
    source: str
    index: int
    generator: random.Random
    limit: int
    screen: CandidateScreen | None = None
    tokens: list[int] = field(default_factory=list)
    status: str = "live"
    abort_reason: str | None = None
    state: State | None = None
    score: float | None = None
    tail: TextTail | None = None  # the last compress_window characters (for the gzip test)

    @property
    def complete(self) -> bool:
        return self.status in ("delimiter", "eos", "cap")


class StepDecoder:
    """One model driven through :func:`dynts.attach` with ragged rows.

    Args:
        model: a Hugging Face causal LM.
        eviction: the model's :class:`~dynts.core.EvictionSettings` (evictor, budget, predictor);
            ``None``: the full cache (the helper).
        think_end_token_id: closes the thinking segment (answer tokens are protected by DynTS).
        pad_token_id: token fed to rows that sit out a forward.
    """

    def __init__(self, model: torch.nn.Module, eviction: EvictionSettings | None = None, *,
                 think_end_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0):
        self.model = model
        eviction = eviction if eviction is not None else EvictionSettings("full", think_end=None)
        self.evictor = eviction.evictor
        self.bounded = eviction.bounded
        self.budget = eviction.bounds
        self.predictor = eviction.load_predictor(model)  # None unless the method reads scores
        self.think_end_token_id = think_end_token_id
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self._cache_kw = cache_keyword(model)
        self.forwards = 0
        self.decode_steps = 0  # iterations of the decode loop (one sampled token per live row)

    @property
    def shared(self) -> bool:
        """Full-context policies fork by reference (:mod:`dynts.rescue.shared`); evicted ones copy rows."""
        return not self.bounded

    def new_cache(self) -> RaggedCache:
        return RaggedCache(self.num_layers, self.evictor, self.budget, think_end_token_id=self.think_end_token_id,
                           kv_heads=self.kv_heads)

    @torch.no_grad()
    def forward(self, cache: RaggedCache, ids: torch.Tensor, valid: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        """Feed ``ids`` ``[r, q]`` (``valid`` marks real tokens; others are padding; ``counts``: real
        tokens per row, host ints, default read from ``valid`` on the host) and return the logits
        ``[r, V]`` at the last position."""
        counts = list(counts) if counts is not None else valid.sum(1).tolist()
        ids, valid = ids.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
        if isinstance(cache, ForkCache):
            self.forwards += 1
            return fork_forward(self.model, cache, ids, valid, counts, self._cache_kw)
        cache.incoming = counts
        positions = cache.position_ids(valid)
        with attach(self.model, cache, self.predictor):
            out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions,
                             logits_to_keep=1, use_cache=True, **{self._cache_kw: cache})
        self.forwards += 1
        return out.logits[:, -1].float()

    def prefill(self, prompt_ids: Sequence[int]) -> State:
        """Encode one prompt into a fresh one-row cache."""
        cache = ForkCache(self.num_layers, [(PrefixKV(self.num_layers), 0)]) if self.shared else self.new_cache()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        logits = self.forward(cache, ids, torch.ones_like(ids, dtype=torch.bool))
        return State(cache, 0, logits[0])

    def fork(self, states: Sequence[State], copies: int) -> tuple[RaggedCache, torch.Tensor]:
        """One batch holding ``copies`` rows of each state, in order, and their logits ``[r, V]``:
        references to each state's committed prefix (full context) or copies of its row (evicted)."""
        logits = torch.stack([s.logits for s in states for _ in range(copies)])
        if self.shared:
            refs = [s.cache.commit(s.row) for s in states]
            return ForkCache(self.num_layers, [r for r in refs for _ in range(copies)]), logits
        parts = _group_rows([(s.cache, s.row) for s in states for _ in range(copies)])
        return RaggedCache.stack(parts), logits

    def append(self, states: Sequence[State], tokens: Sequence[Sequence[int]]) -> list[State]:
        """Encode ``tokens[i]`` after ``states[i]`` in ONE batched forward (left-padded), then apply
        the evictor to every row over budget; no history is re-encoded. Returns the new states."""
        ids, valid = pad_rows(tokens, self.pad_token_id)
        if self.shared:  # the tokens become the rows' tails; the next fork commits them to the prefix
            cache = ForkCache(self.num_layers, [s.cache.commit(s.row) for s in states])
            logits = self.forward(cache, ids, valid.bool(), [len(t) for t in tokens])
            return [State(cache, i, logits[i] if len(t) else s.logits) for i, (s, t) in enumerate(zip(states, tokens))]
        cache = RaggedCache.stack(_group_rows([(s.cache, s.row) for s in states]))
        logits = self.forward(cache, ids, valid.bool(), [len(t) for t in tokens])
        if self.bounded:
            cache.evict_overflow()  # rows over n_keep after the step are evicted now (paper: "then applies eviction")
        cache = RaggedCache.stack([(cache, range(len(states)))])  # squeeze the padding out of each row
        return [State(cache, i, logits[i] if len(t) else s.logits) for i, (s, t) in enumerate(zip(states, tokens))]

    def decode(self, cache: RaggedCache, logits: torch.Tensor, candidates: Sequence[Candidate], sampler: Sampler,
               *, stop_ids: frozenset[int], eos_ids: frozenset[int], decode_text, squeeze_below: float = 0.5) -> int:
        """Decode every candidate (row ``i`` of ``cache`` is ``candidates[i]``) to completion.

        Each candidate samples from its own generator (one host read per step: the sampler's
        ``[rows, k]`` draw, entropies packed in); a token in ``eos_ids`` ends it unfed, a token
        in ``stop_ids`` (the step delimiter) or reaching ``limit`` ends it after feeding the token (so
        its state holds the whole step); a detector firing aborts it. Completed candidates get their
        :class:`State`. When fewer than ``squeeze_below`` of the rows are live, finished rows are
        moved out of the batch. Returns the number of tokens sampled.
        """
        batch = list(candidates)  # batch[r]: candidate in row r
        sampled = 0
        device = logits.device
        while True:
            live = [r for r, c in enumerate(batch) if c is not None and c.status == "live"]
            if not live:
                break
            self.decode_steps += 1
            row_logits = logits[torch.tensor(live).to(device, non_blocking=True)]
            screened = any(batch[r].screen is not None for r in live)
            # the step's one host read: [live, k] probabilities and ids, plus entropies if screened
            tokens, extras = sampler.draw(row_logits, [batch[r].generator for r in live],
                                          entropy(row_logits)[:, None] if screened else None)
            feed = []
            for r, tok, extra in zip(live, tokens, extras):
                c = batch[r]
                c.tokens.append(tok)
                sampled += 1
                if c.screen is not None:
                    text = None
                    if c.screen.detector.needs_text:
                        if c.tail is None:
                            c.tail = TextTail(decode_text, c.screen.detector.compress_window)
                        text = c.tail.push(c.tokens)
                    reason = c.screen.update(extra[0], text)
                    if reason:
                        c.status, c.abort_reason = "aborted", reason
                        continue
                if tok in eos_ids:
                    c.status = "eos"  # the trajectory ends with this step: no next state needed
                    continue
                if tok in stop_ids:
                    c.status = "delimiter"
                elif len(c.tokens) >= c.limit:
                    c.status = "cap"
                feed.append(r)
            if not feed:
                break
            fed = set(feed)
            ids = torch.tensor([[batch[r].tokens[-1] if r in fed else self.pad_token_id] for r in range(len(batch))])
            valid = torch.tensor([[r in fed] for r in range(len(batch))])
            new_logits = self.forward(cache, ids, valid, [int(r in fed) for r in range(len(batch))])
            index = torch.tensor(feed).to(device, non_blocking=True)
            logits[index] = new_logits[index]
            for r in feed:
                if batch[r].status != "live":
                    batch[r].state = State(cache, r, logits[r].clone())
            still = [r for r, c in enumerate(batch) if c is not None and c.status == "live"]
            if still and len(batch) > 8 and len(still) < squeeze_below * len(batch):
                cache, logits, batch = self._squeeze(cache, logits, batch, still)
        return sampled

    @staticmethod
    def _squeeze(cache: RaggedCache, logits: torch.Tensor, batch: list, live: list[int]):
        """Move finished rows into their own cache and keep only ``live`` rows in the batch."""
        done = [r for r, c in enumerate(batch) if c is not None and c.status != "live" and c.state is not None]
        if done:
            parked = cache.select(done)
            for i, r in enumerate(done):
                batch[r].state = State(parked, i, batch[r].state.logits)
        new_cache = cache.select(live)
        return new_cache, logits[torch.tensor(live).to(logits.device)], [batch[r] for r in live]


def _group_rows(rows: Sequence[tuple[RaggedCache, int]]) -> list[tuple[RaggedCache, list[int]]]:
    """Consecutive rows of the same cache as one ``stack`` part (keeps the order)."""
    parts: list[tuple[RaggedCache, list[int]]] = []
    for cache, row in rows:
        if parts and parts[-1][0] is cache:
            parts[-1][1].append(row)
        else:
            parts.append((cache, [row]))
    return parts
