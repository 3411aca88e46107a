"""The cross-step loop screen: a base candidate that repeats a committed step (or closes a repeating
pattern of steps) is screened before PRM scoring; one that does not is kept."""

from __future__ import annotations

import pytest

from dynts.rescue import DegenerationDetector, RescueConfig, StepLoopDetector, load_prm, rescue_generate
from rescue_tiny import DELIMITER, DELIMITER_ID, step_model, tiny_prm, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
IGNORE = frozenset({DELIMITER_ID})
A, B, C = [10, 11, 12, 13, 3], [20, 21, 22, 23, 3], [30, 31, 32, 33, 3]


def history(*steps, **fields):
    h = StepLoopDetector(**fields).history(IGNORE)
    for s in steps:
        h.commit(s)
    return h


def test_a_repeated_committed_step_is_screened():
    h = history(A, B, repeat_ngram=4)
    assert h.check(A) == "repeat"  # the same step again (delimiter ignored)
    assert h.check([7, *A[:-1]]) == "repeat"  # inside a longer step
    assert h.check(C) is None
    assert h.check([10, 11, 20, 21, 3]) is None  # two short pieces of two steps: no 4-token run
    assert history(A, repeat_ngram=3).check([5, 11, 12, 13, 9, 3]) == "repeat"  # a step redone under a new label
    assert history(A, repeat_ngram=5, max_pattern_size=0).check(A) is None  # the 4-token step is shorter than the n-gram


def test_step_patterns_follow_vllms_schema():
    rule = dict(repeat_ngram=None, min_pattern_size=1, max_pattern_size=2, min_count=2)
    assert history(A, B, A, **rule).check(B) == "pattern"  # (A B) twice
    assert history(A, B, C, **rule).check(A) is None  # A repeats, but not as a trailing pattern
    assert history(A, B, **rule).check(B) == "pattern"  # B B
    three = {**rule, "min_count": 3}
    assert history(A, B, **three).check(B) is None
    assert history(B, B, **three).check(B) == "pattern"
    assert history(A, B, A, **{**rule, "min_pattern_size": 2, "max_pattern_size": 0}).check(B) is None  # off


@pytest.mark.parametrize("bad, name", [
    (dict(repeat_ngram=0), "repeat_ngram"), (dict(repeat_ngram=True), "repeat_ngram"),
    (dict(min_pattern_size=0), "min_pattern_size"), (dict(max_pattern_size=-1), "max_pattern_size"),
    (dict(min_pattern_size=3, max_pattern_size=2), "max_pattern_size"), (dict(min_count=1), "min_count"),
])
def test_bad_settings(bad, name):
    with pytest.raises(ValueError, match=name):
        StepLoopDetector(**bad)
    with pytest.raises(ValueError, match=name):
        DegenerationDetector(loop=bad)
    with pytest.raises(ValueError, match="loop="):
        DegenerationDetector(loop="on")


def test_rescue_generate_screens_repeating_base_candidates():
    """Every base candidate is screened exactly when it shares a 2-token run with a step committed
    before it; screened candidates are never scored, and helper candidates are never screened."""
    tok = word_tokenizer()
    prm = load_prm((tiny_prm(), tok), kind="token", separator=DELIMITER)
    seen = []

    def record(c):
        committed = [s.tokens for s in c.owner.steps]
        seen.append((c.source, c.status, c.abort_reason, c.score, list(c.tokens), committed))

    detector = DegenerationDetector(entropy_threshold=None, compress_threshold=None, loop=dict(repeat_ngram=2, max_pattern_size=0))
    out = rescue_generate(step_model(0), step_model(1), prm, tok, ["<bos> w5 w9 w20 w33", "<bos> w40 w41"],
                          method="window", budget=16, local_window=4, think_end=None, on_candidate=record,
                          config=RescueConfig(n_base=3, n_helper=2, step_delimiter=DELIMITER, detector=detector,
                                              temperature=1.5, top_k=6, seed=3, max_steps=10, max_step_tokens=8,
                                              max_tokens=60))
    screened = kept = 0
    for source, status, reason, score, tokens, committed in seen:
        grams = {tuple(s[i : i + 2]) for s in committed for s in [[t for t in s if t != DELIMITER_ID]] for i in range(len(s) - 1)}
        content = [t for t in tokens if t != DELIMITER_ID]
        repeats = any(tuple(content[i : i + 2]) in grams for i in range(len(content) - 1))
        if source == "helper" or status == "eos":
            assert reason is None
            continue
        assert (reason == "repeat") == repeats
        if repeats:
            screened += 1
            assert status == "aborted" and score is None
        else:
            kept += 1
            assert status != "aborted" and score is not None
    assert screened and kept
    total = sum(p.stats["exit_repeat"] for p in out.problems)
    assert total == screened == sum(p.stats["early_exits"] for p in out.problems)
    assert out.stats["exit_fraction_by_signal"]["repeat"] == pytest.approx(screened / sum(p.stats["base_candidates"] for p in out.problems))
