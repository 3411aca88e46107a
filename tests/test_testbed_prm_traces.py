"""Process labels of policy traces (trainers.testbed_prm_traces) and the step PRM trained on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.testbed import task
from eval.rescue.prm_traces import generate_traces
from trainers.testbed_prm_traces import IGNORE, TraceConfig, TracePolicy, load_trace_rows, process_labels

ROOT = Path(__file__).parents[1]
STEP_PRM = ROOT / "checkpoints" / "testbed-chain-fair-step-prm"


def _problem(family: str = "chain") -> task.Problem:
    for i in range(200):  # a problem whose asked step is not the first, with a step naming an earlier result
        p = task.make_problem(f"prm-traces-test:{i}", min_think=60, max_think=300, family=family)
        if p.asked >= 3 and any(s.x.startswith("r") or s.y.startswith("r") for s in p.steps[: p.asked]):
            return p
    raise AssertionError("no suitable problem")


def _generated(p: task.Problem) -> list[str]:
    return list(p.tokens[task.QUESTION_TOKENS :])


def _seps(tokens: list[str]) -> list[int]:
    return [i for i, t in enumerate(tokens) if t == task.SEP]


def _labels(tokens: list[str], labels: list[int]) -> list[int]:
    assert [i for i, lab in enumerate(labels) if lab != IGNORE] == _seps(tokens)  # labelled exactly at the ";"s
    return [labels[i] for i in _seps(tokens)]


def test_reference_trace_is_right_at_every_step_and_at_the_answer():
    p = _problem()
    tokens, labels = process_labels(p.question, _generated(p), "chain")
    assert tokens[: task.QUESTION_TOKENS] == list(p.tokens[: task.QUESTION_TOKENS])  # the prompt as the PRM reads it
    assert tokens[-4:-1] == [task.END_THINK, f"r{p.asked}=", str(p.answer)] and tokens[-1] == task.SEP
    assert set(_labels(tokens, labels)) == {1}


def test_a_wrong_value_is_wrong_and_a_later_copy_of_it_is_judged_by_the_committed_trace():
    p = _problem()
    gen = _generated(p)
    first = _seps(gen)[0]
    gen[first - 1] = str((int(gen[first - 1]) + 3) % 10)  # step 1's value miscomputed
    tokens, labels = process_labels(p.question, gen, "chain")
    steps = _labels(tokens, labels)
    assert steps[0] == 0
    # the answer: right only if the grader, which recomputes every value, accepts the trace
    assert steps[-1] == int(task.check_answer(p.question, " ".join(gen), "chain"))


def test_a_repeated_step_is_wrong():
    p = _problem()
    gen = _generated(p)
    seps = _seps(gen)
    step2 = gen[seps[0] + 1 : seps[1] + 1]
    looped = gen[: seps[1] + 1] + step2 + gen[seps[1] + 1 :]  # step 2 written twice (its key again)
    tokens, labels = process_labels(p.question, looped, "chain")
    assert _labels(tokens, labels)[:3] == [1, 1, 0]


def test_a_premature_answer_is_wrong_and_a_wrong_value_is_wrong():
    p = _problem()
    gen = _generated(p)
    seps = _seps(gen)
    asked_end = seps[p.asked - 1]
    premature = gen[: seps[p.asked - 2] + 1] + [task.END_THINK, f"r{p.asked}=", str(p.answer), task.EOS]
    tokens, labels = process_labels(p.question, premature, "chain")
    assert _labels(tokens, labels)[-1] == 0 and set(_labels(tokens, labels)[:-1]) == {1}
    assert task.EOS not in tokens and tokens[-1] == task.SEP
    wrong = gen[: asked_end + 1] + [task.END_THINK, f"r{p.asked}=", str((p.answer + 1) % 10)]
    tokens, labels = process_labels(p.question, wrong, "chain")
    assert _labels(tokens, labels)[-1] == 0
    right = gen[: asked_end + 1] + ["so", task.END_THINK, f"r{p.asked}=", str(p.answer), task.EOS, task.PAD]
    tokens, labels = process_labels(p.question, right, "chain")
    assert _labels(tokens, labels)[-1] == 1 and tokens[-5:] == ["so", task.END_THINK, f"r{p.asked}=", str(p.answer), task.SEP]


def test_an_unclosed_trace_has_no_answer_and_ends_at_its_last_step():
    p = _problem()
    gen = _generated(p)
    cut = gen[: _seps(gen)[2] + 4]  # three steps and the start of a fourth, never closed
    tokens, labels = process_labels(p.question, cut, "chain")
    assert tokens[-1] == task.SEP and task.END_THINK not in tokens and _labels(tokens, labels) == [1, 1, 1]


def test_trace_config_refuses_final_sets_and_dynts_without_predictor():
    kw = {"out_dir": "x", "base": "b", "helper": "h", "methods": ["window"]}
    with pytest.raises(ValueError, match="namespace"):
        TraceConfig(**kw, namespace="final")
    with pytest.raises(ValueError, match="predictor"):
        TraceConfig(**{**kw, "methods": ["dynts"]})
    with pytest.raises(ValueError, match="shard_problems"):
        TraceConfig(**kw, shard_problems=0)
    cfg = TraceConfig(**kw, budgets=[72, 119], shards=1, full_shards=2, helper_shards=3)
    assert [(p.name, n) for p, n in cfg.policies()] == [("base-full", 2), ("helper-full", 3), ("base-window-B72", 1),
                                                         ("base-window-B119", 1)]
    assert all(q.name.startswith("train:prm-traces:chain:base-full:1:") for q in cfg.problems(TracePolicy("base"), 1))
    dev = TraceConfig(**kw, namespace="dev", shard_problems=3, budgets=[72])  # policies: base full, helper full, window B72
    names = [q.name for q in task.problem_set("dev", 9, family="chain")]
    assert [[q.name for q in dev.problems(p, 0)] for p, _ in dev.policies()] == [names[:3], names[3:6], names[6:]]


def test_shards_are_written_once_and_resumed(tmp_path, monkeypatch):
    """generate_traces writes each shard atomically, skips shards on disk, and stops at max_seconds."""
    import eval.rescue.prm_traces as prm_traces

    calls = []

    def fake_run_policy(model, tokenizer, problems, method, options=None, k=1, **kw):
        calls.append((method, kw.get("budget")))
        return [" ".join(_generated(p)) for p in problems for _ in range(k)], {"accuracy": 1.0}

    monkeypatch.setattr(prm_traces, "run_policy", fake_run_policy)
    monkeypatch.setattr(prm_traces.dynts, "load", lambda name: (name, None))
    cfg = TraceConfig(out_dir=str(tmp_path), base="b", helper="h", methods=["window"], budgets=[72], shard_problems=2, k=2,
                      min_think=60, max_think=200)
    first = generate_traces(cfg, max_seconds=0.0, log=lambda *_: None)  # the first shard starts, then time is up
    assert first["shards_made"] == 1 and first["shards_left"] == 2
    second = generate_traces(cfg, log=lambda *_: None)
    assert second == {**second, "shards_done": 3, "shards_made": 2, "shards_left": 0}
    assert calls == [("full", None), ("full", None), ("window", 72)]
    rows = load_trace_rows(tmp_path)
    assert len(rows) == 3 * 2 * 2 and {r["policy"] for r in rows} == {"base-window-B72", "base-full", "helper-full"}
    assert all(r["labels"][-1] == 1 for r in rows)
    assert not list(tmp_path.rglob("*.tmp*"))
    with pytest.raises(ValueError, match="generate it first"):
        load_trace_rows(tmp_path / "missing")


def test_prm_batches_draw_policy_traces(tmp_path):
    from trainers.testbed_lm import TOKEN_ID
    from trainers.testbed_prm import CorruptStream, PRMConfig

    p = _problem()
    tokens, labels = process_labels(p.question, _generated(p), "chain")
    (tmp_path / "base-full").mkdir()
    (tmp_path / "base-full" / "000.jsonl").write_text(json.dumps({"tokens": tokens, "labels": labels}) + "\n")
    cfg = PRMConfig.from_dict({"data": {"family": "chain", "long_batch": 3}, "trace_prob": 1.0, "traces": {"out_dir": str(tmp_path)}})
    batch = CorruptStream(cfg, 0).batch(0)
    assert batch["input_ids"].shape[0] == 3
    assert batch["input_ids"][0, : len(tokens)].tolist() == [TOKEN_ID[t] for t in tokens]
    assert batch["labels"][0, : len(labels)].tolist() == labels
    with pytest.raises(ValueError, match="traces"):
        PRMConfig.from_dict({"trace_prob": 0.5})


@pytest.mark.skipif(not STEP_PRM.is_dir(), reason="checkpoints/testbed-chain-fair-step-prm is not trained yet")
def test_step_prm_loads_from_safetensors_and_reads_premature_answers(one_thread):
    """The shipped step PRM: safetensors only (no pickle), loads as the default verifier of the fair helper, and on
    reference traces of 40 problems ranks a right step above a miscomputed one (AUROC 1.000 measured) and a right
    answer above the same answer given two steps early (0.671 measured: such premature answers on reference
    traces are harder for it than the fair LRM's own answers, 0.924 in reports/prm-chain-fair-step-dev.json)."""
    from dynts.models import load_tokenizer
    from dynts.rescue import StepRequest
    from eval.rescue.verifiers import default_verifier, load_eval_prm

    assert (STEP_PRM / "model.safetensors").is_file() and not list(STEP_PRM.glob("*.bin")) and not list(STEP_PRM.glob("*.pt"))
    assert default_verifier("checkpoints/testbed-chain-fair-helper") == "checkpoints/testbed-chain-fair-step-prm"
    scorer = load_eval_prm(str(STEP_PRM), ";")
    tokenizer = load_tokenizer(str(STEP_PRM))
    ids = tokenizer.convert_tokens_to_ids
    right, premature, good_step, bad_step = [], [], [], []
    for i in range(40):
        p = task.make_problem(f"prm-traces-test-load:{i}", min_think=150, max_think=400, family="chain")
        if p.asked < 3:
            continue
        gen = _generated(p)
        seps = _seps(gen)
        prompt = ids(list(p.tokens[: task.QUESTION_TOKENS]))
        steps = [ids(gen[a:b + 1]) for a, b in zip([0, *[s + 1 for s in seps[:-1]]], seps)]
        answer = ids([task.END_THINK, f"r{p.asked}=", str(p.answer), task.EOS])

        def request(committed, candidate):
            return StepRequest(question=p.question, prompt_ids=prompt, steps=committed, candidate=candidate, tokenizer=tokenizer)

        right.append(request(steps[: p.asked], answer))
        premature.append(request(steps[: p.asked - 2], answer))
        good_step.append(request(steps[:1], steps[1]))
        wrong = list(steps[1])
        wrong[-2] = ids(str((int(gen[seps[1] - 1]) + 4) % 10))
        bad_step.append(request(steps[:1], wrong))
    scores = scorer.score(right + premature + good_step + bad_step)
    n = len(right)
    assert n >= 30

    def auroc(positive: list[float], negative: list[float]) -> float:  # P(a positive outscores a negative)
        return sum((p > q) + 0.5 * (p == q) for p in positive for q in negative) / (len(positive) * len(negative))

    assert auroc(scores[:n], scores[n : 2 * n]) > 0.6
    assert auroc(scores[2 * n : 3 * n], scores[3 * n :]) > 0.95


def test_step_requests_give_the_prm_the_rows_it_is_trained_on(tmp_path):
    """eval.rescue.step_auroc asks each labelled step as the search asks it; the testbed PRM's encoding of that
    request is the training row cut at the step's ";" (the answer: EOS dropped, ";" appended)."""
    from dynts.models import load_tokenizer
    from eval.rescue.step_auroc import step_requests_from_traces
    from eval.rescue.verifiers import load_eval_prm

    p = _problem()
    gen = _generated(p)
    premature = gen[: _seps(gen)[p.asked - 2] + 1] + [task.END_THINK, f"r{p.asked}=", str(p.answer)]
    rows = []
    for name, trace in (("base-full", gen), ("helper-full", premature)):
        tokens, labels = process_labels(p.question, trace, "chain")
        rows.append({"tokens": tokens, "labels": labels, "policy": name, "problem": p.name})
        (tmp_path / name).mkdir()
        (tmp_path / name / "000.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    tokenizer = load_tokenizer(str(ROOT / "checkpoints" / "testbed-chain-fair-prm"))
    requests, labels, groups, info = step_requests_from_traces(tmp_path, tokenizer)
    assert info["answers"] == 2 and info["by_policy"]["helper-full"]["wrong"] == 1 and set(groups) == {p.name}
    prm = load_eval_prm(str(ROOT / "checkpoints" / "testbed-chain-fair-prm"), ";")
    expected = [(row["tokens"][: j + 1], lab) for row in sorted(rows, key=lambda r: r["policy"])
                for j, lab in enumerate(row["labels"]) if lab != IGNORE]
    assert [(tokenizer.convert_ids_to_tokens(prm.encode(r)), lab) for r, lab in zip(requests, labels)] == expected
    assert requests[-1].candidate[-1] == tokenizer.eos_token_id


def test_grouped_auroc_interval_is_the_bootstrap_of_the_plain_auroc():
    """eval.rescue.answers.grouped_auroc scores every resample at once; each equals torchmetrics' AUROC of the
    items of the drawn groups (ties half), so its interval is the plain bootstrap's."""
    import random

    import torch

    from eval.rescue.answers import grouped_auroc, weighted_aurocs
    from trainers.testbed_prm import auroc

    rng = random.Random(3)
    labels = [int(rng.random() < 0.7) for _ in range(120)]
    scores = [round(rng.random() * 0.6 + 0.3 * y, 1) for y in labels]  # many ties
    groups = [str(rng.randrange(25)) for _ in labels]
    keys = list(dict.fromkeys(groups))
    member = torch.tensor([keys.index(g) for g in groups])
    draws = [rng.choices(range(len(keys)), k=len(keys)) for _ in range(20)]
    counts = torch.tensor([[d.count(g) for g in range(len(keys))] for d in draws], dtype=torch.float64)
    fast = weighted_aurocs(scores, labels, member, counts).tolist()
    for d, value in zip(draws, fast):
        idx = [i for g in d for i in range(len(groups)) if keys.index(groups[i]) == g]
        assert value == pytest.approx(auroc([scores[i] for i in idx], [labels[i] for i in idx]), abs=1e-6)
    result = grouped_auroc(scores, labels, groups, resamples=200)
    assert result["auroc"] == auroc(scores, labels) and result["ci95"][0] <= result["auroc"] <= result["ci95"][1]


def test_answer_scores_are_reused_only_from_a_record_of_the_same_answers(tmp_path):
    """step_auroc --answers-from: a factor held by an earlier answers record of the same samples is not scored again
    (a product multiplies the reused factors); a record of other answers is refused."""
    from eval.rescue.answers import score_verifiers
    from eval.rescue.step_auroc import reused_scores

    record = tmp_path / "answers.json"
    record.write_text(json.dumps({"verifiers": ["no-such-prm", "likelihood:no-such-lm", "no-such-prm*likelihood:no-such-lm"],
                                  "samples": {"scores": {"labels": [1, 0], "groups": ["p1", "p2"], "no-such-prm": [0.9, 0.2],
                                                         "likelihood:no-such-lm": [0.5, 0.5],
                                                         "no-such-prm*likelihood:no-such-lm": [0.45, 0.1]}}}))
    known = reused_scores(record, [1, 0], ["p1", "p2"])
    assert known == {"no-such-prm": [0.9, 0.2], "likelihood:no-such-lm": [0.5, 0.5]}
    scores = score_verifiers(["no-such-prm*likelihood:no-such-lm"], [object(), object()], known=known, log=lambda *_: None)
    assert scores == {"no-such-prm*likelihood:no-such-lm": [0.45, 0.1]}
    with pytest.raises(SystemExit, match="other answers"):
        reused_scores(record, [1, 1], ["p1", "p2"])


def test_kept_scores_come_only_from_a_record_of_the_same_sets(tmp_path):
    """step_auroc --scores-from / --keep: an unchanged verifier's scores of an earlier step_auroc record are reused per
    set; a record of other steps, or one without the verifier, is refused."""
    from eval.rescue.step_auroc import kept_scores

    record = tmp_path / "steps.json"
    record.write_text(json.dumps({"steps": {"scores": {"labels": [1, 0], "groups": ["dev:1", "dev:2"], "a": [0.7, 0.1],
                                                       "b": [0.3, 0.4]}}}))
    assert kept_scores(record, "steps", ["a"], [1, 0], ["dev:1", "dev:2"]) == {"a": [0.7, 0.1]}
    with pytest.raises(SystemExit, match="other steps"):
        kept_scores(record, "steps", ["a"], [1, 0], ["dev:1", "dev:3"])
    with pytest.raises(SystemExit, match="no steps scores"):
        kept_scores(record, "steps", ["c"], [1, 0], ["dev:1", "dev:2"])
