"""Grading: gold answers score 100% on real GSM8K/MATH500 answers, shuffled ones ~0%; boxed and
letter extraction; the testbed's exact checker."""

from __future__ import annotations

import random

import pytest

from eval.harness.benchmarks import load_benchmark
from data_pipeline.grading import ChoiceGrader, MathGrader, TestbedGrader, accuracy, extract_choice, last_boxed


def _sample(name: str, n: int = 100):
    examples = load_benchmark(name).examples
    return random.Random(0).sample(examples, n)


@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_gold_scores_full_marks_and_shuffled_scores_near_zero(name):
    examples = _sample(name)
    golds = [e.answer for e in examples]
    grader = MathGrader()
    texts = [f"Let me think step by step.\nSo the final answer is $\\boxed{{{g}}}$." for g in golds]
    assert accuracy(grader, golds, texts) == 1.0
    perm = list(range(len(golds)))
    random.Random(1).shuffle(perm)
    shuffled = [texts[j] for j in perm]
    coincidences = sum(golds[i] == golds[j] for i, j in enumerate(perm))
    score = accuracy(grader, golds, shuffled)
    # small-integer answers (GSM8K) coincide now and then; beyond those, shuffled answers must fail
    assert score - coincidences / len(golds) <= 0.05
    assert score * len(golds) >= coincidences  # identical gold strings must still match


def test_math_grader_equivalences_and_failures():
    g = MathGrader()
    assert g.grade("27", "... so \\boxed{27.0}").correct  # amc23 stores 27.0
    assert g.grade("\\frac{1}{2}", "answer: \\boxed{0.5}").correct
    assert g.grade("\\$36", "\\boxed{36}").correct  # MATH500's dollar answers
    assert not g.grade("\\frac{14}{3}", "\\boxed{14/4}").correct
    # the LAST box counts, a cut-off (unbalanced) box is skipped
    assert g.grade("9", "first \\boxed{7}, corrected: \\boxed{9}").correct
    assert not g.grade("7", "first \\boxed{7}, corrected: \\boxed{9}").correct
    grade = g.grade("5", "no box here at all")
    assert grade.source in {None, "fallback"} and not grade.correct
    assert MathGrader(fallback=False).grade("5", "the answer is 5").extracted is None
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathGrader(timeout_seconds=0)


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{x^{2}} then \\boxed{oops") == "x^{2}"
    assert last_boxed("\\fbox{4}") == "4"
    assert last_boxed("\\boxed 5 .") == "5"
    assert last_boxed("nothing") is None


def test_choice_extraction_and_grader():
    assert extract_choice("so \\boxed{B}") == ("B", "boxed")
    assert extract_choice("so \\boxed{(c)}")[0] == "C"
    assert extract_choice("so \\boxed{\\text{D}}")[0] == "D"
    assert extract_choice("The answer is (A).") == ("A", "fallback")
    assert extract_choice("Answer: E", n_choices=4) == (None, None)  # out of range
    assert extract_choice("\\boxed{Because}")[0] is None
    grader = ChoiceGrader()
    assert grader.grade("C", "reasoning... \\boxed{C}").correct
    assert not grader.grade("C", "reasoning... \\boxed{A}").correct
    golds = list("ABCD") * 10
    texts = [f"\\boxed{{{g}}}" for g in golds]
    assert accuracy(grader, golds, texts) == 1.0
    assert accuracy(grader, golds, texts[1:] + texts[:1]) == 0.0


def test_testbed_grader_uses_the_exact_checker():
    bench = load_benchmark("testbed:n=5")
    grader = bench.grader
    assert isinstance(grader, TestbedGrader)
    for ex in bench.examples:
        reference = ex.answer.text.split("<think>", 1)[1]  # the reference trace after the prompt
        assert grader.grade(ex.answer, reference).correct
        wrong = reference.replace(f"r{ex.answer.asked}= {ex.answer.answer} <eos>", f"r{ex.answer.asked}= {(ex.answer.answer + 1) % 10} <eos>")
        assert not grader.grade(ex.answer, wrong).correct
