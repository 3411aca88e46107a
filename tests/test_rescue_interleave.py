"""KV-Rescue interleaving: exact against a hand-written stepwise best-of-N loop, exact against a fresh
re-encode of the committed trajectory, independent of batching, and strict about bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import dynts
from dynts.core import EvictionSettings
from dynts.rescue import DegenerationDetector, RescueConfig, Sampler, StepRequest, candidate_generator, load_prm, rescue_generate
from rescue_tiny import DELIMITER, DELIMITER_ID, step_model, tiny_prm, word_tokenizer

EOS = 2
PROMPTS = ["<bos> w5 w9 w20 w33", "<bos> w7 w8 w9 w10 w11 w12", "<bos> w40 w41"]
CAPS = dict(max_steps=6, max_step_tokens=10, max_tokens=36)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer()
    prm = load_prm((tiny_prm(), tok), kind="token", separator=DELIMITER)
    return step_model(0), step_model(1), prm, tok


def forward(model, cache, ids, predictor=None) -> torch.Tensor:
    """Plain batch-1 forward through a plain BoundedCache (HF computes the positions)."""
    with torch.no_grad(), dynts.attach(model, cache, predictor):
        return model(input_ids=torch.tensor([list(ids)]), cache=cache).logits[0, -1].float()


def plain_cache(model, method, budget, local_window=4):
    evictor = dynts.make_evictor(method)
    bounds = dynts.Budget(budget, local_window, 0.4) if method != "full" else None
    return dynts.build_cache(model, evictor, bounds)


def hand_written_best_of_n(model, prm, tok, prompt, index, *, method, budget, n, seed, predictor,
                           max_steps, max_step_tokens, max_tokens):
    """Stepwise best-of-N, one candidate at a time, each on a deep copy of the committed cache."""
    sampler = Sampler(0.8, 20, 0.95)
    prompt_ids = tok(prompt)["input_ids"]
    cache = plain_cache(model, method, budget)
    logits = forward(model, cache, prompt_ids, predictor)
    steps = []
    while True:
        limit = min(max_step_tokens, max_tokens - sum(map(len, steps)))
        candidates = []
        for j in range(n):
            fork, lg, gen, toks = copy.deepcopy(cache), logits, candidate_generator(seed, index, len(steps), "base", j), []
            while True:
                t = int(sampler(lg[None], [gen])[0])
                toks.append(t)
                if t == EOS:
                    status = "eos"
                    break
                lg = forward(model, fork, [t], predictor)
                if t == DELIMITER_ID or len(toks) >= limit:
                    status = "step"
                    break
            candidates.append((toks, status, fork, lg))
        scores = prm.score([StepRequest(prompt, prompt_ids, steps, c[0], tok) for c in candidates])
        best = max(range(n), key=lambda j: (scores[j], -j))
        toks, status, cache, logits = candidates[best]
        steps.append(toks)
        if status == "eos" or sum(map(len, steps)) >= max_tokens or len(steps) >= max_steps:
            return steps


@pytest.mark.parametrize("method", ["window", "dynts", "streamingllm"])
def test_best_of_n_matches_hand_written_loop(setup, method):
    base, _, prm, tok = setup
    predictor = dynts.ImportancePredictor(base.config.hidden_size)
    budget, n, seed = 16, 3, 7
    out = rescue_generate(base, None, prm, tok, PROMPTS, method=method, budget=budget, local_window=4,
                          predictor=predictor, think_end=None,
                          config=RescueConfig(n_base=n, n_helper=0, step_delimiter=DELIMITER, detector=None, seed=seed, **CAPS))
    evicted = 0
    for i, (prompt, result) in enumerate(zip(PROMPTS, out.problems)):
        expected = hand_written_best_of_n(base, prm, tok, prompt, i, method=method, budget=budget, n=n, seed=seed,
                                          predictor=predictor, **CAPS)
        assert [s.tokens for s in result.steps] == expected
        assert result.sources == ["base"] * len(expected)
        evicted += len(tok(prompt)["input_ids"]) + len(result.tokens) > budget
    assert evicted >= 2  # the budget really binds
    assert out.stats["helper_tokens"] == 0 and out.stats["helper_share"] == 0.0


def replay(model, method, budget, prompt_ids, steps, me, seed, index, predictor=None):
    """Re-encode the committed trajectory from scratch for one model: its own steps are re-sampled
    (with the winning candidate's generator) token by token, the other model's steps are encoded
    in one forward and then evicted. Returns the re-sampled steps."""
    sampler = Sampler(0.8, 20, 0.95)
    cache = plain_cache(model, method, budget)
    logits = forward(model, cache, prompt_ids, predictor)
    resampled = []
    for t, step in enumerate(steps):
        if step.source == me:
            gen, toks = candidate_generator(seed, index, t, me, step.candidate), []
            for _ in step.tokens:
                toks.append(int(sampler(logits[None], [gen])[0]))
                if toks[-1] == EOS:
                    break
                logits = forward(model, cache, toks[-1:], predictor)
            resampled.append(toks)
        else:
            logits = forward(model, cache, step.tokens, predictor)
            if cache.bounded and cache.length > budget:
                cache.evict()
            resampled.append(step.tokens)
    return resampled


@pytest.mark.parametrize("method", ["window", "dynts"])
def test_committed_states_equal_fresh_re_encode(setup, method):
    """Forks are independent: every committed step is reproduced by re-encoding the trajectory from
    scratch, so no sibling candidate ever touched the state a winner was forked from."""
    base, helper, prm, tok = setup
    predictor = dynts.ImportancePredictor(base.config.hidden_size)
    budget, seed = 14, 3
    out = rescue_generate(base, helper, prm, tok, PROMPTS, method=method, budget=budget, local_window=4,
                          predictor=predictor, think_end=None,
                          config=RescueConfig(n_base=3, n_helper=2, step_delimiter=DELIMITER, detector=None, seed=seed, **CAPS))
    sources = [s for p in out.problems for s in p.sources]
    assert "base" in sources and "helper" in sources  # both kinds of commit are exercised
    for i, (prompt, result) in enumerate(zip(PROMPTS, out.problems)):
        ids = tok(prompt)["input_ids"]
        committed = [s.tokens for s in result.steps]
        assert replay(base, method, budget, ids, result.steps, "base", seed, i, predictor) == committed
        assert replay(helper, "full", None, ids, result.steps, "helper", seed, i) == committed
        assert result.stats["helper_steps"] == result.sources.count("helper")
        assert result.stats["base_encoded_tokens"] == sum(len(s.tokens) for s in result.steps[:-1] if s.source == "helper")


def test_batching_does_not_change_results(setup):
    base, helper, prm, tok = setup
    kw = dict(method="window", budget=16, local_window=4, think_end=None)
    step = dict(n_base=3, n_helper=2, step_delimiter=DELIMITER, detector=None, seed=1, **CAPS)
    wide = rescue_generate(base, helper, prm, tok, PROMPTS, config=RescueConfig(max_rows=64, **step), **kw)
    narrow = rescue_generate(base, helper, prm, tok, PROMPTS, config=RescueConfig(max_rows=3, **step), **kw)  # one problem in flight
    assert [p.tokens for p in wide.problems] == [p.tokens for p in narrow.problems]
    assert [p.sources for p in wide.problems] == [p.sources for p in narrow.problems]


def test_detector_aborts_base_candidates(setup):
    base, helper, prm, tok = setup
    always = DegenerationDetector(entropy_threshold=0.01, entropy_window=1, guard=1, compress_threshold=None)
    kw = dict(method="window", budget=16, local_window=4, think_end=None)
    step = dict(step_delimiter=DELIMITER, seed=2, detector=always, **CAPS)
    out = rescue_generate(base, helper, prm, tok, PROMPTS, config=RescueConfig(n_base=3, n_helper=2, **step), **kw)
    for p in out.problems:
        assert p.sources == ["helper"] * len(p.steps)  # every base candidate was aborted at its first token
        s = p.stats
        assert s["early_exits"] == s["base_candidates"] == s["base_tokens"] == 3 * len(p.steps) == s["exit_entropy"]
    assert out.stats["early_exit_fraction"] == 1.0 and out.stats["helper_share"] == 1.0
    alone = rescue_generate(base, None, prm, tok, PROMPTS[:1], config=RescueConfig(n_base=3, n_helper=0, **step), **kw)
    assert alone.problems[0].end == "degenerate" and alone.problems[0].steps == []


def test_bad_input(setup):
    base, helper, prm, tok = setup
    kw = dict(method="window", budget=16, local_window=4, config=RescueConfig(step_delimiter=DELIMITER))
    with pytest.raises(ValueError, match="n_base \\+ n_helper"):
        rescue_generate(base, helper, prm, tok, PROMPTS, **{**kw, "config": RescueConfig(n_base=0, n_helper=0)})
    other = word_tokenizer(extra=("<extra_0>",))
    with pytest.raises(ValueError, match="helper_tokenizer"):
        rescue_generate(base, helper, prm, tok, PROMPTS, helper_tokenizer=other, **kw)
    with pytest.raises(ValueError, match="step_delimiter"):
        rescue_generate(base, helper, prm, tok, PROMPTS, **{**kw, "config": RescueConfig(step_delimiter="\n\n")})
    with pytest.raises(ValueError, match="predictor"):
        rescue_generate(base, helper, prm, tok, PROMPTS, **{**kw, "method": "dynts"})
    with pytest.raises(ValueError, match="budget"):
        rescue_generate(base, helper, prm, tok, ["<bos> " + "w5 " * 30], **kw)
    with pytest.raises(ValueError, match="helper"):
        rescue_generate(base, None, prm, tok, PROMPTS, **{**kw, "config": RescueConfig(n_helper=2, step_delimiter=DELIMITER)})
    with pytest.raises(ValueError, match="prm"):
        rescue_generate(base, helper, None, tok, PROMPTS, **kw)
    with pytest.raises(ValueError, match="max_step_tokens"):
        RescueConfig(max_step_tokens=0)
    with pytest.raises(TypeError, match=r"config=RescueConfig\(n_base=\.\.\.\)"):
        rescue_generate(base, helper, prm, tok, PROMPTS, n_base=3, **kw)  # a step-search field as a keyword
    with pytest.raises(TypeError, match="method="):
        rescue_generate(base, helper, prm, tok, PROMPTS, base_method="window", **kw)
    with pytest.raises(ValueError, match="not both"):
        rescue_generate(base, helper, prm, tok, PROMPTS, eviction=EvictionSettings("window", 16, 4), **kw)
