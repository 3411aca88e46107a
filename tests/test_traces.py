"""Trace generation: answer location, grading, filtering, atomic shards, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from data_pipeline.grading import find_answer_start, make_grader
from data_pipeline.questions import Question, encode_prompt, load_questions
from data_pipeline.testbed.tokenizer import build_tokenizer
from data_pipeline.traces import TRACE_FEATURES, TraceConfig, generate_traces
from pipeline_utils import tiny_testbed_lm, write_yaml

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_testbed_lm(tmp_path_factory.mktemp("tiny-lm"))


def trace_settings(model_dir: Path, out: Path, **overrides) -> dict:
    values = dict(
        model=str(model_dir), questions="testbed:tiny:12", output_dir=str(out), samples_per_question=2,
        max_new_tokens=40, batch_size=4, shard_size=6, grader="any", require_eos=False, progress=False,
        accelerator="cpu", threads=1,
    )
    values.update(overrides)
    return values


def test_delimiter_rule_on_testbed_tokens():
    tok = build_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert find_answer_start(enc("a 1 plus b 2 gives r1= 3 ; </think> r1= 3 <eos>"), tok) == (9, "ok")
    assert find_answer_start(enc("a 1 plus b 2 gives r1= 3 ;"), tok) == (None, "no_delimiter")
    assert find_answer_start(enc("wait so </think> <eos>"), tok) == (None, "no_answer")
    assert find_answer_start(enc("</think> r1= 3"), tok) == (None, "no_thinking")


def test_line_rules_with_a_bpe_tokenizer():
    from transformers import AutoTokenizer

    from dynts.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    text = "First, 3 + 4 = 7.\nThen 7 * 2 = 14.\n#### 14"
    ids = tok.encode(text, add_special_tokens=False)
    start, reason = find_answer_start(ids, tok, "gsm8k")
    assert reason == "ok" and tok.decode(ids[start:]).startswith("####")
    start2, _ = find_answer_start(ids, tok, "last_line")
    assert start2 == start
    boxed = tok.encode("So x = 2.\nThe answer is \\boxed{2}.", add_special_tokens=False)
    s3, _ = find_answer_start(boxed, tok, "boxed")
    assert tok.decode(boxed[s3:]).startswith("The answer")
    assert find_answer_start(tok.encode("#### 14", add_special_tokens=False), tok, "gsm8k") == (None, "no_thinking")
    with pytest.raises(ValueError, match="answer_rule"):
        find_answer_start(ids, tok, "first_line")


def test_graders():
    q = Question("q", "What is 1/2?", "\\frac{1}{2}")
    assert make_grader("math")(q, "", "so the answer is $\\boxed{0.5}$")
    assert not make_grader("math")(q, "", "\\boxed{3}")
    tb = load_questions("testbed:grade:1")[0]
    from data_pipeline.testbed.task import problem_set

    ref = problem_set("grade", 1)[0]
    thinking = " ".join(ref.tokens[14:])
    assert make_grader("testbed")(tb, thinking, "")
    wrong = thinking.rsplit(" ", 2)[0] + f" {(ref.answer + 1) % 10} <eos>"
    assert not make_grader("testbed")(tb, wrong, "")
    with pytest.raises(ValueError, match="grader"):
        make_grader("nope")


def test_load_questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        json.dumps({"question": "2+2?", "answer": "2 and 2 make 4.\n#### 4", "idx": 7}) + "\n"
        + json.dumps({"problem": "x?", "solution": "so \\boxed{\\frac{1}{2}}"}) + "\n"
    )
    qs = load_questions(str(path), system="Think step by step.")
    assert [(q.question_id, q.gold) for q in qs] == [("7", "4"), ("1", "\\frac{1}{2}")]
    gsm = load_questions("textarena:gsm8k", limit=2)
    assert gsm[0].gold == "18"
    assert len(load_questions("testbed:abc:3")) == 3
    with pytest.raises(ValueError, match="testbed:<set name>:<count>"):
        load_questions("testbed:abc")
    with pytest.raises(ValueError, match="neither"):
        load_questions(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no answer"}) + "\n")
    with pytest.raises(ValueError, match="gold answer"):
        load_questions(str(bad))


def test_traces_schema_filtering_and_skip(model_dir, tmp_path):
    stats = generate_traces(trace_settings(model_dir, tmp_path / "t"))
    status = stats["by_status"]
    # a uniform random model often never closes its thinking: skipped and counted, not crashed
    assert status.get("no_delimiter", 0) > 0 and status.get("kept", 0) > 0
    assert stats["decided"] == 24 and stats["records"] == status["kept"]
    data = load_from_disk(str(tmp_path / "t" / "dataset"))
    assert list(data.features) == list(TRACE_FEATURES)
    tok = build_tokenizer()
    prompts = {q.question_id: encode_prompt(tok, q) for q in load_questions("testbed:tiny:12")}
    end_think = tok.convert_tokens_to_ids("</think>")
    for row in data:
        assert row["input_ids"][: row["question_len"]] == prompts[row["question_id"]]
        assert row["input_ids"][row["answer_start"]] == end_think
        assert end_think not in row["input_ids"][row["question_len"] : row["answer_start"]]
        assert row["correct"] and row["gold"]
    before = sorted((tmp_path / "t" / "shards").iterdir())
    assert generate_traces(trace_settings(model_dir, tmp_path / "t"))["records"] == len(data)  # done: skipped
    assert sorted((tmp_path / "t" / "shards").iterdir()) == before


def test_require_correct_and_eos_filters(model_dir, tmp_path):
    stats = generate_traces(trace_settings(model_dir, tmp_path / "t", grader="testbed", require_eos=True))
    assert stats["records"] == 0  # a random model never answers correctly and completely
    assert set(stats["by_status"]) <= {"no_delimiter", "no_answer", "no_thinking", "truncated", "incorrect"}
    assert len(load_from_disk(str(tmp_path / "t" / "dataset"))) == 0


def test_bad_settings():
    with pytest.raises(ValueError, match="answer_rule"):
        TraceConfig(answer_rule="nope")
    with pytest.raises(ValueError, match="top_p"):
        TraceConfig(top_p=0.0)
    with pytest.raises(ValueError, match="unknown traces settings"):
        TraceConfig.from_dict({"temprature": 0.6})


def test_resume_after_sigkill_every_sample_exactly_once(model_dir, tmp_path):
    out = tmp_path / "t"
    settings = trace_settings(model_dir, out, questions="testbed:resume:24", batch_size=2, shard_size=4, max_new_tokens=64)
    config = write_yaml(tmp_path / "traces.yaml", {"traces": settings})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_pipeline.traces", "--config", str(config)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    shards = out / "shards"
    deadline = time.time() + 120
    while time.time() < deadline and not (shards.is_dir() and any(p.name.startswith("shard-") for p in shards.iterdir())):
        time.sleep(0.05)
    still_running = proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert still_running, "the job finished before it could be killed mid-way"
    written = [p for p in shards.iterdir() if p.name.startswith("shard-")]
    assert 1 <= len(written) < 12 and not (out / "dataset").exists()

    stats = generate_traces(settings)  # restart: finishes the rest
    decided = Counter()
    for shard in (out / "shards").iterdir():
        assert shard.name.startswith("shard-"), f"leftover temporary directory {shard.name}"
        for entry in json.loads((shard / "done.json").read_text()):
            decided[tuple(entry["key"])] += 1
    expected = {(f"resume:{i}", s) for i in range(24) for s in range(2)}
    assert set(decided) == expected and set(decided.values()) == {1}
    assert stats["decided"] == 48
    data = load_from_disk(str(out / "dataset"))
    keys = list(zip(data["question_id"], data["sample_id"]))
    assert len(keys) == len(set(keys)) == stats["by_status"]["kept"] > 0


# backend: vllm runs for real in tests/test_vllm_traces.py (vLLM's CPU build, `make check-vllm`)


def test_shard_store_merge_drops_duplicates_and_keeps_schema(tmp_path):
    from data_pipeline.shards import ShardStore

    store = ShardStore(tmp_path, TRACE_FEATURES, ("question_id", "sample_id"))
    rec = dict(question_id="q1", sample_id=0, input_ids=[1, 2, 3], question_len=1, answer_start=2, text="x", gold="1", correct=True)
    store.write([rec], [(("q1", 0), "kept")], rank=0)
    store.write([rec, dict(rec, sample_id=1)], [(("q1", 0), "kept"), (("q1", 1), "kept")], rank=1)  # DDP padding repeat
    store.write([], [(("q2", 0), "no_delimiter")], rank=0)  # an all-rejected shard still records its decisions
    (tmp_path / "shards" / ".tmp-shard-killed").mkdir()  # left by a SIGKILL
    store.clean_partial()
    assert not (tmp_path / "shards" / ".tmp-shard-killed").exists()
    assert store.done() == {("q1", 0): "kept", ("q1", 1): "kept", ("q2", 0): "no_delimiter"}
    merged = store.merge(sort_key=lambda k: (k["question_id"], -k["sample_id"]))
    assert list(zip(merged["question_id"], merged["sample_id"])) == [("q1", 1), ("q1", 0)]
    assert store.stats()["by_status"] == {"kept": 2, "no_delimiter": 1}
