"""KV-Rescue: stepwise interleaving of an evicted base and a full-context helper (paper, Method and
Algorithm 1; Appendix C for the fork-based engine).

Per problem and step ``t``: ``n_base`` candidates are forked from the base's evicted cache (a copy
of its live kept entries, one row each) and ``n_helper`` from the helper's full cache; each is
decoded until the step delimiter, EOS or ``max_step_tokens``; base candidates the degeneration
detector flags are aborted mid-decode; the PRM scores the survivors and the best is committed.
If a base candidate wins, its fork *is* the next base state and the helper appends the step; if a
helper candidate wins, its fork is the next helper state and the base encodes the step in one
forward, then evicts. Nothing is ever re-prefilled. With ``n_helper = 0`` this is eviction-only
stepwise best-of-N (the paper's baseline).

Problems are decoded in rounds: all candidates of every problem in flight form one batch per model
(``max_rows`` rows at most); a finished problem's slot is refilled at the next round. Every
candidate samples from its own seeded generator, so results do not depend on the batching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..core.settings import EVICTION_FIELDS, EvictionSettings
from ..prompts import encode_prompts
from ..thinking import think_end_ids
from .config import RescueConfig
from .engine import Candidate, State, StepDecoder
from .loops import StepHistory
from .prm import StepRequest, StepScorer, load_prm
from .results import ProblemResult, RescueResult, Step, summarize
from .sampling import candidate_generator

__all__ = ["delimiter_token_ids", "rescue_generate"]


@dataclass
class _Problem:
    index: int
    question: str
    prompt_ids: list[int]
    base: State | None = None
    helper: State | None = None
    steps: list[Step] = field(default_factory=list)
    end: str | None = None
    history: StepHistory | None = None  # committed steps as the cross-step loop screen sees them
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))

    @property
    def output_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.steps)


_COUNTERS = (
    "base_tokens", "helper_tokens", "base_candidates", "helper_candidates", "early_exits", "exit_entropy",
    "exit_compression", "exit_repeat", "exit_pattern", "base_encoded_tokens", "helper_encoded_tokens", "scored_candidates",
)

_DELIMITERS: dict[tuple[int, str], frozenset[int]] = {}


def delimiter_token_ids(tokenizer: Any, delimiter: str) -> frozenset[int]:
    """Ids of every vocabulary token whose text contains ``delimiter`` (a step ends at the first one)."""
    key = (id(tokenizer), delimiter)
    if key not in _DELIMITERS:
        size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
        special = set(getattr(tokenizer, "all_special_ids", []))
        _DELIMITERS[key] = frozenset(i for i, t in enumerate(texts) if delimiter in t and i not in special)
    return _DELIMITERS[key]


def _question(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt[-1]["content"])


def rescue_generate(
    base: torch.nn.Module,
    helper: torch.nn.Module | None,
    prm: StepScorer | Callable | tuple | str | None,
    tokenizer: Any,
    prompts: str | Sequence[str] | Sequence[Sequence[dict]],
    *,
    config: RescueConfig | None = None,
    eviction: EvictionSettings | None = None,
    helper_tokenizer: Any = None,
    progress: Callable[[int, ProblemResult], None] | None = None,
    on_candidate: Callable[[Candidate], None] | None = None,
    **keywords: Any,
) -> RescueResult:
    """Decode ``prompts`` with KV-Rescue (or, with ``n_helper=0``, eviction-only stepwise best-of-N),
    as in the KV-Rescue paper (Method, Algorithm 1; the fork-based engine of Appendix C).

    Args:
        base: the evicted base model; helper: the full-context helper (``None`` iff ``n_helper=0``).
        prm: a :class:`StepScorer`, a ``(model, tokenizer)`` pair, ``"testbed-prm"``, a PRM directory or
            a callable ``fn(question, steps) -> float`` (see :func:`load_prm`); may be ``None`` only
            when each step has a single candidate.
        tokenizer: the base tokenizer; ``helper_tokenizer`` must have the same vocabulary (the two
            models extend one token trajectory).
        prompts: a string, strings, or chat message lists (the chat template is applied).
        config: the step search (:class:`RescueConfig`: candidates per model, step delimiter, caps,
            detector, sampling, seed, batch rows); its defaults when omitted.
        eviction: the base's eviction as an :class:`~dynts.core.EvictionSettings`, or instead
        **keywords: its keywords, as in :func:`dynts.generate`: ``method`` (default ``"dynts"``, which
            needs ``predictor``), ``budget``, ``local_window``, ``retention``, ``predictor``,
            ``think_end``, ``method_options``. ``budget`` is the physical bound ``B`` or a
            :class:`~dynts.core.budget.Budget`, e.g. the paper's
            ``Budget.from_paper(score_selected=64, headroom=128, local_window=16)`` (64 entries kept
            at each event, at most 192 held). The helper keeps its full cache.
        progress: called as ``progress(index, result)`` when a problem finishes.
        on_candidate: called with every decoded :class:`~dynts.rescue.engine.Candidate` after scoring
            (its tokens, status, PRM score and detector ``screen`` statistics: for calibration).

    Returns:
        :class:`RescueResult`. Per-problem ``stats``: ``committed_steps``, ``output_tokens``,
        ``base_tokens`` / ``helper_tokens`` (every token sampled by that model's candidates, losers
        and aborted ones included), ``base_candidates``, ``early_exits`` (aborted base candidates,
        split by signal into ``exit_entropy`` / ``exit_compression`` / ``exit_repeat`` / ``exit_pattern``,
        the last two from the cross-step loop screen ``detector.loop``), ``helper_steps``, ``helper_share``,
        ``base_encoded_tokens`` (helper steps the base absorbed), ``end``.
    """
    settings = EvictionSettings.resolve(eviction, keywords)
    if keywords:
        raise TypeError(f"rescue_generate() got unexpected keywords {sorted(keywords)}; " + _keyword_hint(keywords))
    config = RescueConfig() if config is None else config
    if not isinstance(config, RescueConfig):
        raise ValueError(f"config must be a RescueConfig, got {type(config).__name__}")
    run = _prepare(base, helper, prm, tokenizer, config, settings, helper_tokenizer, on_candidate)

    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    problems = []
    detector = config.detector
    for i, prompt in enumerate(prompts):
        ids, mask = encode_prompts(tokenizer, [prompt])
        prompt_ids = ids[0][mask[0].bool()].tolist()
        settings.check_prompt(len(prompt_ids))
        history = detector.loop.history(run.stop_ids) if detector is not None and detector.loop is not None and config.n_base else None
        problems.append(_Problem(i, _question(prompt), prompt_ids, history=history))
    in_flight = max(1, config.max_rows // config.width)

    start = time.perf_counter()
    pending = list(problems)
    active: list[_Problem] = []
    results: dict[int, ProblemResult] = {}
    while pending or active:
        while pending and len(active) < in_flight:
            p = pending.pop(0)
            p.base = run.base.prefill(p.prompt_ids) if config.n_base else None
            p.helper = run.helper.prefill(p.prompt_ids) if run.helper else None
            active.append(p)
        run.round(active)
        for p in [p for p in active if p.end]:
            active.remove(p)
            results[p.index] = _finish(p, tokenizer)
            if progress is not None:
                progress(p.index, results[p.index])
    seconds = time.perf_counter() - start
    ordered = [results[i] for i in range(len(problems))]
    stats = summarize(ordered)
    bounds = settings.bounds
    stats.update({"seconds": seconds, "n_base": config.n_base, "n_helper": config.n_helper,
                  "base_method": settings.evictor.name, "budget": bounds.budget if bounds else None,
                  "n_keep_sizing": bounds.sizing if bounds else None, "base_forwards": run.base.forwards,
                  "helper_forwards": run.helper.forwards if run.helper else 0})
    return RescueResult(ordered, stats)


def _keyword_hint(keywords: dict[str, Any]) -> str:
    """How to pass what ``keywords`` meant (step-search fields go in a :class:`RescueConfig`)."""
    config = sorted(set(keywords) & RescueConfig.field_names())
    if config:
        return f"pass config=RescueConfig({', '.join(f'{k}=...' for k in config)})"
    if "base_method" in keywords:
        return "the base's eviction method is method=..."
    return f"the eviction keywords are {list(EVICTION_FIELDS)}"


def _prepare(base, helper, prm, tokenizer, config: RescueConfig, settings: EvictionSettings, helper_tokenizer,
             on_candidate) -> "_Run":
    """Check the models against ``config`` and build the two policies, the scorer and the token sets."""
    n_base, n_helper = config.n_base, config.n_helper
    if n_helper and helper is None:
        raise ValueError(f"n_helper={n_helper} needs a helper model; pass helper=... or n_helper=0 (best-of-N)")
    if helper_tokenizer is not None and helper_tokenizer is not tokenizer:
        if helper_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "helper_tokenizer has a different vocabulary from the base tokenizer; KV-Rescue interleaves token "
                "steps, so base and helper must share one tokenizer (e.g. a smaller model of the same family)"
            )
    if prm is None and n_base + n_helper > 1:
        raise ValueError(f"{n_base + n_helper} candidates per step need a prm=... to choose between them")
    scorer = load_prm(prm, step_delimiter=config.step_delimiter) if prm is not None else None

    stop_ids = delimiter_token_ids(tokenizer, config.step_delimiter)
    if not stop_ids:
        raise ValueError(
            f"step_delimiter={config.step_delimiter!r} is not in any token of the tokenizer's vocabulary; pass the "
            "text the model writes between steps (e.g. '\\n\\n' for Qwen2.5-Math, ';' for the testbed)"
        )
    eos_ids = set()
    configs = [base] + ([helper] if n_helper else [])
    sources = [tokenizer.eos_token_id] + [c for m in configs for c in (m.generation_config.eos_token_id, m.config.eos_token_id)]
    for source in sources:
        eos_ids |= {source} if isinstance(source, int) else set(source or [])
    eos_ids = frozenset(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    think_id = think_end_ids(tokenizer, settings.think_end)
    if think_id is not None and tokenizer.pad_token_id in think_id:
        think_id = None  # the vocabulary has no such token (it encodes to padding)

    settings.evictor.bind(tokenizer)
    base_decoder = StepDecoder(base, settings, think_end_token_id=think_id, pad_token_id=pad_id)
    helper_decoder = StepDecoder(helper, think_end_token_id=think_id, pad_token_id=pad_id) if n_helper else None
    return _Run(config, tokenizer, base_decoder, helper_decoder, scorer, stop_ids, eos_ids, on_candidate)


@dataclass
class _Run:
    """What every round of one :func:`rescue_generate` call shares."""

    config: RescueConfig
    tokenizer: Any
    base: StepDecoder
    helper: StepDecoder | None
    scorer: StepScorer | None
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]
    on_candidate: Callable[[Candidate], None] | None = None

    def round(self, active: list[_Problem]) -> None:
        """One step for every active problem: fork, decode, screen, score, commit."""
        by_problem = self._decode(active)
        pool = {p.index: [c for c in by_problem[p.index] if c.complete] for p in active}
        self._score(active, pool)
        if self.on_candidate is not None:
            for p in active:
                for c in by_problem[p.index]:
                    self.on_candidate(c)
        self._commit(active, pool)

    def _decode(self, active: list[_Problem]) -> dict[int, list[Candidate]]:
        """Fork and decode every model's candidates for ``active``; the loop screen runs on finished base ones."""
        config, detector, tokenizer = self.config, self.config.detector, self.tokenizer
        decode_text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        by_problem: dict[int, list[Candidate]] = {p.index: [] for p in active}
        for decoder, source, copies in ((self.base, "base", config.n_base), (self.helper, "helper", config.n_helper)):
            if not copies:
                continue
            states = [p.base if source == "base" else p.helper for p in active]
            cache, logits = decoder.fork(states, copies)
            candidates = []
            for p in active:
                limit = min(config.max_step_tokens, config.max_tokens - p.output_tokens)
                context = tokenizer.decode(p.prompt_ids + [t for s in p.steps for t in s.tokens]) if (
                    detector is not None and detector.include_context and source == "base") else ""
                for j in range(copies):
                    screen = detector.screen(context) if (detector is not None and detector.enabled and source == "base") else None
                    gen = candidate_generator(config.seed, p.index, len(p.steps), source, j)
                    candidates.append(Candidate(p, source, j, gen, limit, screen))
            decoder.decode(cache, logits, candidates, config.sampler, stop_ids=self.stop_ids, eos_ids=self.eos_ids,
                          decode_text=decode_text)
            for c in candidates:
                by_problem[c.owner.index].append(c)
                counters = c.owner.counters
                counters[f"{source}_tokens"] += len(c.tokens)
                counters[f"{source}_candidates"] += 1
                if c.status in ("delimiter", "cap") and source == "base" and c.owner.history is not None:
                    reason = c.owner.history.check(c.tokens)  # cross-step loop screen, before PRM scoring
                    if reason:
                        c.status, c.abort_reason = "aborted", reason
                if c.status == "aborted":
                    counters["early_exits"] += 1
                    counters[f"exit_{c.abort_reason}"] += 1
        return by_problem

    def _score(self, active: list[_Problem], pool: dict[int, list[Candidate]]) -> None:
        """The PRM's score of every complete candidate, in one call."""
        if self.scorer is None:
            return
        requests, owners = [], []
        for p in active:
            for c in pool[p.index]:
                requests.append(StepRequest(p.question, p.prompt_ids, [s.tokens for s in p.steps], c.tokens, self.tokenizer))
                owners.append(c)
        if requests:
            for c, score in zip(owners, self.scorer.score(requests)):
                c.score = score
                c.owner.counters["scored_candidates"] += 1

    def _commit(self, active: list[_Problem], pool: dict[int, list[Candidate]]) -> None:
        """Commit each problem's best candidate; the other model encodes the step in one batched forward."""
        config = self.config
        base_appends: list[tuple[_Problem, list[int]]] = []
        helper_appends: list[tuple[_Problem, list[int]]] = []
        for p in active:
            options = pool[p.index]
            if not options:
                p.end = "degenerate"
                continue
            best = max(range(len(options)), key=lambda i: (options[i].score if options[i].score is not None else 0.0, -i))
            win = options[best]
            text = self.tokenizer.decode(win.tokens, skip_special_tokens=True)
            p.steps.append(Step(list(win.tokens), text, win.source, win.score, win.index))
            if p.history is not None:
                p.history.commit(win.tokens)
            if win.status == "eos":
                p.end = "eos"
            elif p.output_tokens >= config.max_tokens:
                p.end = "max_tokens"
            elif len(p.steps) >= config.max_steps:
                p.end = "max_steps"
            if p.end:
                continue
            if win.source == "base":
                p.base = win.state
                if self.helper is not None:
                    helper_appends.append((p, win.tokens))
            else:
                p.helper = win.state
                if config.n_base:
                    base_appends.append((p, win.tokens))
        if helper_appends:
            states = self.helper.append([p.helper for p, _ in helper_appends], [t for _, t in helper_appends])
            for (p, tokens), state in zip(helper_appends, states):
                p.helper = state
                p.counters["helper_encoded_tokens"] += len(tokens)
        if base_appends:
            states = self.base.append([p.base for p, _ in base_appends], [t for _, t in base_appends])
            for (p, tokens), state in zip(base_appends, states):
                p.base = state
                p.counters["base_encoded_tokens"] += len(tokens)


def _finish(p: _Problem, tokenizer: Any) -> ProblemResult:
    committed = len(p.steps)
    helper_steps = sum(s.source == "helper" for s in p.steps)
    stats = dict(p.counters)
    stats.update({
        "committed_steps": committed,
        "output_tokens": p.output_tokens,
        "helper_steps": helper_steps,
        "helper_share": helper_steps / committed if committed else 0.0,
        "end": p.end,
    })
    p.base = p.helper = None  # free the caches
    text = tokenizer.decode([t for s in p.steps for t in s.tokens], skip_special_tokens=True)
    return ProblemResult(text, p.steps, p.end, stats)
