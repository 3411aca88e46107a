"""The pipeline's vLLM trace backend for real, on vLLM's CPU build (``make check-vllm``).

``python -m data_pipeline.traces`` with ``backend: vllm`` samples ``k`` traces per testbed question
with the bundled testbed LRM, filters them, and resumes after a SIGKILL: each run is its own process
(vLLM keeps process-wide state). The engine runs inside that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which saves two process starts (~30 s on 2 cores) per run;
the default EngineCore subprocess takes the same code path. Skipped unless ``import vllm`` works.
"""

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

pytest.importorskip("vllm")

from datasets import load_from_disk  # noqa: E402

from data_pipeline.grading import make_grader  # noqa: E402
from data_pipeline.questions import load_questions  # noqa: E402
from data_pipeline.shards import DONE_NAME  # noqa: E402
from dynts.models import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS, K = "testbed:pipeline:6", 3
STATUSES = {"kept", "no_delimiter", "no_answer", "no_thinking", "truncated", "incorrect"}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}


def write_config(path: Path, out: Path) -> Path:
    import yaml

    # 120 new tokens cut the longer testbed traces: kept and rejected items both occur
    traces = dict(model="testbed", questions=QUESTIONS, output_dir=str(out), samples_per_question=K,
                  max_new_tokens=120, shard_size=3, grader="testbed", backend="vllm", progress=False,
                  vllm_args={"enforce_eager": True, "block_size": 32, "max_num_seqs": 8})
    path.write_text(yaml.safe_dump({"traces": traces}))
    return path


def start(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "data_pipeline.traces", "--config", str(config)], cwd=ROOT,
                            env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: the kill reaches all of it


def run(config: Path) -> dict:
    proc = start(config)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    lines = stdout.splitlines()  # the stage prints its stats as indented JSON, "{" ... "}" on their own lines
    first = lines.index("{")
    return json.loads("\n".join(lines[first : lines.index("}", first) + 1]))


def shards(out: Path) -> dict[str, list]:
    return {p.name: json.loads((p / DONE_NAME).read_text())
            for p in sorted((out / "shards").glob("shard-*")) if (p / DONE_NAME).is_file()}


def test_vllm_traces_k_samples_filter_and_resume(tmp_path):
    # ---- an uninterrupted run: the reference
    ref_out = tmp_path / "ref"
    ref_stats = run(write_config(tmp_path / "ref.yaml", ref_out))
    questions = load_questions(QUESTIONS)
    assert ref_stats["decided"] == len(questions) * K
    by_status = ref_stats["by_status"]
    assert set(by_status) <= STATUSES and sum(by_status.values()) == len(questions) * K
    assert by_status.get("kept", 0) == ref_stats["records"] >= 2 and ref_stats["records"] < len(questions) * K
    decided = [entry for done in shards(ref_out).values() for entry in done]
    keys = Counter(tuple(e["key"]) for e in decided)
    assert keys == Counter({(q.question_id, s): 1 for q in questions for s in range(K)})  # k samples each, once

    # ---- the filter: every kept record is a complete, correct trace
    tok = load_tokenizer("testbed")
    grader = make_grader("testbed")
    gold = {q.question_id: q for q in questions}
    ref = load_from_disk(str(ref_out / "dataset"))
    think_end = tok.convert_tokens_to_ids("</think>")
    for rec in ref:
        generated = rec["input_ids"][rec["question_len"]:]
        assert 0 < len(generated) <= 120 and generated[-1] == tok.eos_token_id
        assert rec["input_ids"][rec["answer_start"]] == think_end and rec["correct"]
        answer = tok.decode(rec["input_ids"][rec["answer_start"]:], skip_special_tokens=True).split("</think>", 1)[-1]
        assert grader(gold[rec["question_id"]], rec["text"], answer)
    texts = Counter(ref["text"])
    assert max(texts.values()) == 1  # each sample has its own seed: no two kept traces alike

    # ---- interrupted: SIGKILL once the first shard is on disk, then resume
    out = tmp_path / "resumed"
    config = write_config(tmp_path / "resumed.yaml", out)
    proc = start(config)
    deadline = time.monotonic() + 240
    while not shards(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be interrupted: {proc.communicate()[1][-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    before = shards(out)
    assert 1 <= len(before) < len(shards(ref_out)) and not (out / "dataset").exists()
    stats = run(config)
    after = shards(out)
    assert {name: after[name] for name in before} == before  # finished shards are kept, not redone
    assert stats["decided"] == len(questions) * K and stats["by_status"] == by_status
    resumed = load_from_disk(str(out / "dataset"))
    assert resumed.to_list() == ref.to_list()  # per-item seeds: the resumed job samples what the reference did

    # ---- a finished job: nothing new (no engine, no shard)
    stamp = (out / "dataset" / "stats.json").stat().st_mtime_ns
    assert run(config)["decided"] == len(questions) * K
    assert shards(out) == after and (out / "dataset" / "stats.json").stat().st_mtime_ns == stamp
