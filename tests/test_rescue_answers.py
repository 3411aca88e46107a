"""eval.rescue.answers: answer steps as the search would score them, and their AUROC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.testbed import task
from eval.rescue.answers import answer_requests_from_samples, gate_answer_requests, grouped_auroc, score_verifiers, split_steps


@pytest.fixture(scope="module")
def tokenizer():
    from data_pipeline.testbed.tokenizer import build_tokenizer

    return build_tokenizer()


def test_split_steps_cuts_after_each_delimiter():
    steps, tail = split_steps([1, 2, 9, 3, 9, 4, 5], lambda t: t == 9)
    assert steps == [[1, 2, 9], [3, 9]] and tail == [4, 5]


def _run_dir(tmp_path, problems, texts, spec):
    key = "cell-0"
    (tmp_path / "samples").mkdir()
    (tmp_path / "results.json").write_text(json.dumps([{"key": key, "benchmark": spec}]))
    lines = [json.dumps({"id": p.name, "sample": 0, "text": t, "correct": task.check_answer(p, t)}) for p, t in zip(problems, texts)]
    (tmp_path / "samples" / f"{key}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_sample_answers_are_the_graders_and_the_exact_verifier_reads_them_all(tmp_path, tokenizer):
    spec = "testbed:n=4,family=chain,set=dev"
    problems = task.problem_set("dev", 4, family="chain")
    texts = []
    for i, p in enumerate(problems):
        words = list(p.tokens[task.QUESTION_TOKENS : -1])  # thinking, </think> rK= v (no <eos>)
        if i % 2:  # a wrong answer value
            words[-1] = str((int(words[-1]) + 1) % 10)
        texts.append(" ".join(words))
    texts.append(" ".join(problems[0].tokens[task.QUESTION_TOKENS : task.QUESTION_TOKENS + 20]))  # never answers
    run = _run_dir(tmp_path, [*problems, problems[0]], texts, spec)
    requests, labels, groups, info = answer_requests_from_samples(run, tokenizer)
    assert labels == [1, 0, 1, 0] and groups == [p.name for p in problems]
    assert info["no_answer_step"] == 1 and info["grader_disagrees_with_sample"] == 0
    for r, p in zip(requests, problems):
        assert r.candidate[-1] == tokenizer.eos_token_id
        assert tokenizer.convert_ids_to_tokens(r.candidate[-4:-2]) == [task.END_THINK, f"r{p.asked}="]
        assert all(tokenizer.convert_ids_to_tokens(s[-1]) == task.SEP for s in r.steps)
        assert len(r.steps) == len(p.steps)
    scores = score_verifiers(["testbed-verifier:chain"], requests, log=lambda *_: None)["testbed-verifier:chain"]
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert grouped_auroc(scores, labels, groups, resamples=20)["auroc"] == 1.0


def test_gate_answers_carry_the_gates_labels(tokenizer):
    from trainers.testbed_prm import IGNORE

    requests, labels, groups, info = gate_answer_requests("configs/testbed/chain-fair-prm.yaml", 6, tokenizer)
    assert len(requests) == info["answers"] and set(labels) <= {0, 1} and IGNORE not in labels
    for r in requests:
        assert r.candidate[-1] == tokenizer.eos_token_id and len(r.prompt_ids) == task.QUESTION_TOKENS
        assert tokenizer.convert_ids_to_tokens(r.candidate[-4]) == task.END_THINK


def test_a_product_is_the_product_of_its_factors(tmp_path, tokenizer):
    requests, _, _, _ = gate_answer_requests("configs/testbed/chain-fair-prm.yaml", 3, tokenizer)
    scores = score_verifiers(["testbed-verifier:chain", "testbed-verifier:chain*testbed-verifier:copy"], requests,
                             log=lambda *_: None)
    from eval.rescue.verifiers import load_eval_prm

    product = load_eval_prm("testbed-verifier:chain*testbed-verifier:copy", ";").score(requests)
    assert scores["testbed-verifier:chain*testbed-verifier:copy"] == product


def test_the_verifier_rule_takes_the_first_group_at_the_bar_else_the_second(tmp_path, capsys):
    from eval.rescue.answers import choose_verifier, main

    doc = json.loads((Path(__file__).resolve().parents[1] / "reports" / "prm-chain-fair-answers.json").read_text())
    prm, helper = "checkpoints/testbed-chain-fair-prm", "likelihood:checkpoints/testbed-chain-fair-helper"
    product, extra = f"{prm}*{helper}", "testbed-chain-prm"
    assert choose_verifier(doc, [prm, helper, product], [extra]) == product  # 0.808: the fair models' own, over the bar
    assert choose_verifier(doc, [prm, helper], [extra]) == extra  # 0.579, 0.792: none reaches 0.8, so the extra (0.906)
    with pytest.raises(ValueError, match=r"AUROC >= 0.95: the best is 'testbed-chain-prm' at 0.906"):
        choose_verifier(doc, [prm, helper, product], [extra], bar=0.95)
    with pytest.raises(ValueError, match="'likelihood:nothing' was not scored"):
        choose_verifier(doc, ["likelihood:nothing"])
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(doc))
    assert main(["choose", str(path), "--first", prm, "--first", product, "--then", extra]) == 0
    assert capsys.readouterr().out.strip() == product
    assert main(["choose", str(tmp_path / "none.json"), "--first", prm]) == 2
    assert "does not exist" in capsys.readouterr().err
