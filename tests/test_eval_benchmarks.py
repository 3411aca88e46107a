"""Benchmark loaders (every named benchmark, user JSONL, the testbed), prompts, method specs and
clear errors on bad input."""

from __future__ import annotations

import json

import pytest

from eval.harness.benchmarks import BUILTIN, JsonlFields, load_benchmark, load_jsonl
from eval.harness.cli import main as eval_main
from eval.harness.cli import parse_float_list, parse_int_list
from eval.harness.config import EvalConfig
from data_pipeline.grading import ChoiceGrader, MathGrader
from eval.harness.methods import ABLATIONS, parse_method, parse_methods, split_specs
from eval.harness.prompts import INSTRUCTION, user_message

SIZES = {"gsm8k": 1319, "math500": 500, "aime24": 30, "amc23": 40, "gaokao2023en": 383, "olympiadbench": 675}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_loaders(name):
    bench = load_benchmark(name)
    assert bench.name == name and len(bench) == SIZES[name]
    assert isinstance(bench.grader, MathGrader)
    assert all(e.question and e.answer for e in bench.examples)
    assert len({e.id for e in bench.examples}) == len(bench)
    assert bench.head(3).examples == bench.examples[:3]
    if name == "gaokao2023en":
        assert len(bench.skipped) == 2  # two rows ship without a gold answer
    message = user_message(bench.examples[0], bench)
    assert message.startswith(bench.examples[0].question) and message.endswith(INSTRUCTION)


def test_builtin_answers_are_normalised():
    assert load_benchmark("gsm8k").examples[0].answer == "18"  # "... #### 18"
    assert load_benchmark("amc23").examples[0].answer == "27"  # 27.0 in the file
    assert load_benchmark("math500").examples[0].answer.startswith("\\left( 3")


def test_testbed_benchmark():
    bench = load_benchmark("testbed:n=4,set=demo,max_think=300")
    assert len(bench) == 4 and bench.instruction is None and bench.max_new_tokens == 500
    assert [e.id for e in bench.examples] == [f"demo:{i}" for i in range(4)]
    assert user_message(bench.examples[0], bench) == bench.examples[0].question  # no English for the toy vocab
    assert load_benchmark("testbed:n=4,set=demo,max_think=300").examples == bench.examples  # deterministic
    with pytest.raises(ValueError, match="testbed option 'size'"):
        load_benchmark("testbed:size=3")
    with pytest.raises(ValueError, match="must be an integer"):
        load_benchmark("testbed:n=many")


def write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_user_jsonl_with_custom_fields(tmp_path):
    path = write(tmp_path / "aime25.jsonl", [{"problem": "1+1?", "solution": 2, "uid": "a"}, "", {"problem": "2+2?", "solution": 4.0, "uid": "b"}])
    bench = load_benchmark(str(path), JsonlFields(question="problem", answer="solution", id="uid"))
    assert bench.name == "aime25" and [e.id for e in bench.examples] == ["a", "b"]
    assert [e.answer for e in bench.examples] == ["2", "4"]
    assert bench.grader.grade("4", "\\boxed{4}").correct


def test_gpqa_style_multiple_choice(tmp_path):
    rows = [{"Question": f"q{i}", "Correct Answer": f"right{i}", "Incorrect Answer 1": "w1",
             "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(20)]
    path = write(tmp_path / "gpqa.jsonl", rows)
    fields = JsonlFields(question="Question", answer="Correct Answer",
                         choices=("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
                         shuffle_choices=True)
    bench = load_jsonl(path, fields)
    assert isinstance(bench.grader, ChoiceGrader)
    for i, e in enumerate(bench.examples):
        assert e.choices["ABCD".index(e.answer)] == f"right{i}"
    assert len({e.answer for e in bench.examples}) > 1  # shuffled: the right option moves
    message = user_message(bench.examples[0], bench)
    assert "(A) " in message and "(D) " in message and "letter" in message
    # a list field of options and a letter answer
    path = write(tmp_path / "mc.jsonl", [{"question": "pick", "options": ["x", "y", "z"], "answer": "(B)"}])
    bench = load_jsonl(path, JsonlFields(choices=("options",)))
    assert bench.examples[0].answer == "B" and bench.examples[0].choices == ("x", "y", "z")


def test_bad_benchmarks(tmp_path):
    with pytest.raises(ValueError, match="benchmark 'gsm9k' is unknown"):
        load_benchmark("gsm9k")
    path = write(tmp_path / "noanswer.jsonl", [{"question": "q", "answer": "1"}, {"question": "q2", "result": "2"}])
    with pytest.raises(ValueError, match=r"noanswer.jsonl:2: missing answer field 'answer'.*--answer-field"):
        load_benchmark(str(path))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_benchmark(str(tmp_path / "empty.jsonl"))
    path = write(tmp_path / "broken.jsonl", [{"question": "q", "answer": "1"}, {"question": "q", "answer": "2"}, '{"question": "q", "answer": '])
    with pytest.raises(ValueError, match=r"broken.jsonl:3: malformed JSON"):
        load_benchmark(str(path))
    path = write(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"list.jsonl:1: expected a JSON object"):
        load_benchmark(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_benchmark(str(tmp_path / "missing.jsonl"))
    path = write(tmp_path / "mc.jsonl", [{"question": "q", "options": ["a", "b"], "answer": "Q"}])
    with pytest.raises(ValueError, match="mc.jsonl:1: answer 'Q' is neither a letter"):
        load_jsonl(path, JsonlFields(choices=("options",)))


def test_bad_lists_and_settings():
    assert parse_int_list("512, 1024", "--budget") == [512, 1024]
    assert parse_float_list("0.2,0.4", "--retention") == [0.2, 0.4]
    with pytest.raises(ValueError, match=r"--budget: '1.5' is not an integer"):
        parse_int_list("512,1.5", "--budget")
    with pytest.raises(ValueError, match=r"--budget: 'abc' is not an integer"):
        parse_int_list("abc", "--budget")
    base = dict(model="smollm2-135m", benchmarks=["gsm8k"], methods=["full", "window"], budgets=[256])
    with pytest.raises(ValueError, match="k=0 must be an integer >= 1"):
        EvalConfig(**{**base, "k": 0})
    with pytest.raises(ValueError, match=r"method window --budget 12.5 .*budget=12.5 must be a positive int"):
        EvalConfig(**{**base, "budgets": [256, 12.5]})
    with pytest.raises(ValueError, match=r"bounded methods need budgets, e.g. budgets=\[1024\] .* or budget_fractions="):
        EvalConfig(**{**base, "budgets": []})
    with pytest.raises(ValueError, match=r"--retention 1.5: retention=1.5 must lie in \(0, 1\]"):
        EvalConfig(**{**base, "retentions": [1.5]})
    with pytest.raises(ValueError, match="greedy decoding with k=5"):
        EvalConfig(**{**base, "greedy": True})
    with pytest.raises(ValueError, match=r"method dynts .*method='dynts' needs predictor="):
        EvalConfig(**{**base, "methods": ["dynts"]})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "128,big"], "--budget: 'big' is not an integer"),
        (["--budget", "128", "--k", "0"], "k=0 must be an integer >= 1"),
        (["--budget", "128", "--benchmark", "gsm9k"], "benchmark 'gsm9k' is unknown"),
        (["--budget", "128", "--method", "nonsense"], "method 'nonsense' is unknown"),
        (["--budget", "128", "--method", "window:sink=3"], "bad options for method='window'"),
    ],
)
def test_cli_reports_bad_input(argv, message, capsys, tmp_path):
    code = eval_main(["--method", "full,window", "--run-dir", str(tmp_path), "--no-progress", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_method_specs_and_ablations():
    assert split_specs("full,window,dynts:selection=random,keep_local=false,streamingllm:sink_size=8") == [
        "full", "window", "dynts:selection=random,keep_local=false", "streamingllm:sink_size=8",
    ]
    spec = parse_method("dynts:selection=random,keep_local=false")
    assert spec.options == (("selection", "random"), ("keep_local", False))
    assert spec.label == "dynts:selection=random,keep_local=false"
    assert spec.evictor().selection == "random" and spec.evictor().keep_local is False
    assert parse_method("full").bounded is False and parse_method("window").bounded is True
    specs = parse_methods([",".join(ABLATIONS)])
    assert [s.label for s in specs] == list(ABLATIONS)
    assert [(s.name, dict(s.options)) for s in specs] == [
        ("dynts", {"keep_question": False}), ("window", {"keep_question": True}), ("dynts", {"keep_local": False}),
        ("dynts", {"selection": "random"}), ("dynts", {"selection": "bottom"}),
    ]
    assert len(parse_methods(["full,full", "full"])) == 1
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_method("dynts:selection")
    with pytest.raises(ValueError, match="selection='sideways'"):
        parse_method("dynts:selection=sideways")
    with pytest.raises(ValueError, match="starts with an option"):
        split_specs("selection=top,dynts")
