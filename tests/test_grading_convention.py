"""One grading module for the pipeline and eval: reasoning traces are graded on the text after the
thinking delimiter (``--grade-on answer``), an unclosed thinking is unanswered, ``full`` reads the
whole text; one ``last_boxed`` with its two behaviours; benchmark specs with comma options."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data_pipeline.grading import (
    MathGrader,
    TestbedGrader,
    answer_after_delimiter,
    grade_text,
    last_boxed,
    make_grader,
    resolve_grade_on,
    split_answer,
)
from data_pipeline.questions import Question, load_questions
from data_pipeline.testbed.tokenizer import build_tokenizer
from data_pipeline.traces import TraceConfig, make_record
from eval.harness.benchmarks import load_benchmark, split_benchmark_specs

BOX_IN_THINKING = "<think> try 6*7: \\boxed{42}? let me check again </think> I could not decide."
NEVER_CLOSED = "<think> so the result is \\boxed{42} and then I keep thinking and thinking"
ANSWERED = "<think> 6*7 = 42 </think> The answer is \\boxed{42}."


def char_tokenizer(special_think: bool = False) -> PreTrainedTokenizerFast:
    """One printable character = one token (``</think>`` is 8 of them, or one special token)."""
    chars = ["<pad>", "<eos>", "<unk>"] + list(string.printable)
    core = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if special_think:
        tok.add_special_tokens({"additional_special_tokens": ["</think>"]})
    return tok


def test_last_boxed_lenient_and_strict():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{4}") == last_boxed("\\boxed 4 .") == "4"
    # a generation cut off inside its last box: the lenient default reads the previous complete box
    assert last_boxed("\\boxed{x^{2}} then \\boxed{oops") == "x^{2}"
    # a gold solution must not yield an intermediate box when its last one is malformed
    assert last_boxed("\\boxed{x^{2}} then \\boxed{oops", skip_unclosed=False) is None
    assert last_boxed("so \\boxed{ 12 }", skip_unclosed=False) == "12"
    assert last_boxed("nothing") is None


def test_gold_answers_use_the_strict_box(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"problem": "p", "solution": "first \\boxed{3} then \\boxed{7}"}) + "\n")
    assert load_questions(str(path))[0].gold == "7"
    path.write_text(json.dumps({"problem": "p", "solution": "first \\boxed{3} then \\boxed{7"}) + "\n")
    with pytest.raises(ValueError, match="gold answer"):
        load_questions(str(path))


@pytest.mark.parametrize("text, answer_mode, full_mode", [
    (BOX_IN_THINKING, (False, None), (True, "42")),  # a box only inside the thinking: wrong under answer
    (NEVER_CLOSED, (False, None), (True, "42")),  # never closed: unanswered (not parsed) under answer
    (ANSWERED, (True, "42"), (True, "42")),
])
def test_grade_on_answer_and_full(text, answer_mode, full_mode):
    grader = MathGrader()
    answer = split_answer(text, "</think>")
    got = grade_text(grader, "42", text, answer, "answer")
    assert (got.correct, got.extracted) == answer_mode
    got = grade_text(grader, "42", text, answer, "full")
    assert (got.correct, got.extracted) == full_mode
    with pytest.raises(ValueError, match="grade_on"):
        grade_text(grader, "42", text, answer, "thinking")


def test_testbed_grader_reads_its_thinking_but_needs_the_delimiter():
    bench = load_benchmark("testbed:n=2")
    for ex in bench.examples:
        trace = ex.answer.text.split("<think>", 1)[1]
        assert grade_text(TestbedGrader(), ex.answer, trace, split_answer(trace, "</think>"), "answer").correct
        cut = trace.split("</think>")[0]
        assert not grade_text(TestbedGrader(), ex.answer, cut, split_answer(cut, "</think>"), "answer").correct


@pytest.mark.parametrize("special", [False, True], ids=["split-delimiter", "special-delimiter"])
def test_answer_after_delimiter_by_token_sequence(special):
    tok = char_tokenizer(special)
    ids = tok.encode(ANSWERED, add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
    assert answer_after_delimiter(ids, tok, "</think>").strip() == "The answer is \\boxed{42}."
    assert answer_after_delimiter(tok.encode(NEVER_CLOSED, add_special_tokens=False), tok, "</think>") is None
    assert answer_after_delimiter(ids, tok, None) is None


def test_resolve_grade_on():
    assert resolve_grade_on("auto", build_tokenizer(), "</think>") == "answer"  # the testbed: one token
    assert resolve_grade_on("auto", char_tokenizer(), "</think>") == "full"  # no thinking segment known
    assert resolve_grade_on("auto", char_tokenizer(special_think=True), "</think>") == "answer"
    templated = char_tokenizer()
    templated.chat_template = "{{ messages[0]['content'].split('</think>')[-1] }}"
    assert resolve_grade_on("auto", templated, "</think>") == "answer"
    assert resolve_grade_on("full", build_tokenizer(), "</think>") == "full"
    assert resolve_grade_on("auto", build_tokenizer(), None) == "full"
    with pytest.raises(ValueError, match="grade_on"):
        resolve_grade_on("answers", None, "</think>")


@pytest.mark.parametrize("grade_on, credited", [("answer", False), ("full", True)])
def test_pipeline_grades_the_answer_by_default(grade_on, credited):
    tok = char_tokenizer()
    question = Question("q1", "What is 6*7?", "42")
    config = TraceConfig(model="x", grader="math", grade_on=grade_on, require_correct=False, require_eos=False)
    generated = tok.encode(BOX_IN_THINKING, add_special_tokens=False)
    record, status = make_record(question, 0, [5, 6], generated, tok, config, make_grader("math"))
    assert status == "kept" and record["correct"] is credited
    with pytest.raises(ValueError, match="grade_on"):
        TraceConfig(grade_on="thinking")


def test_split_benchmark_specs():
    assert split_benchmark_specs("gsm8k,testbed:n=200,set=dev") == ["gsm8k", "testbed:n=200,set=dev"]
    assert split_benchmark_specs("testbed:n=5, set=dev ,math500,x.jsonl") == ["testbed:n=5,set=dev", "math500", "x.jsonl"]
    assert split_benchmark_specs("testbed,n=3") == ["testbed:n=3"]
    with pytest.raises(ValueError, match="starts with an option"):
        split_benchmark_specs("n=3,testbed")


def test_eval_cli_testbed_options_with_commas(tmp_path, capsys):
    """``dynts eval --benchmark testbed:n=50,set=dev`` runs end to end (tiny random testbed model)."""
    from eval.harness.cli import main
    from pipeline_utils import tiny_eval_testbed

    tiny_eval_testbed(tmp_path / "model")
    code = main(["--model", str(tmp_path / "model"), "--benchmark", "testbed:n=50,set=dev", "--method", "full",
                 "--k", "1", "--max-new-tokens", "4", "--batch-size", "50", "--run-dir", str(tmp_path / "run"),
                 "--no-progress", "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    (result,) = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["benchmark"] == "testbed:n=50,set=dev" and result["questions"] == 50
    samples = [json.loads(line) for line in next((tmp_path / "run" / "samples").glob("*.jsonl")).read_text().splitlines()]
    assert len(samples) == 50 and {s["grade_on"] for s in samples} == {"answer"}
    assert all(s["extracted"] is None for s in samples if not s["answered"])  # unanswered = not parsed
