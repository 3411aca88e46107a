"""``dynts eval`` end to end with SmolLM2-135M on a handful of real GSM8K and MATH500 questions:
chat template + the paper's instruction, batched sampling, a budget that really evicts, grading,
tables and plot. Accuracy is meaningless at 8 new tokens; the point is the harness."""

from __future__ import annotations

import csv
import json

import pytest

from dynts.cli import main as dynts_main
from eval.harness.benchmarks import load_benchmark
from eval.harness.prompts import encode_prompts, user_message


@pytest.mark.slow
def test_dynts_eval_smollm2_gsm8k_math500(smollm2, tmp_path, capsys):
    _, tokenizer = smollm2  # also converts the GGUF once, outside the timed command
    longest = 0
    for name in ("gsm8k", "math500"):
        bench = load_benchmark(name).head(2)
        ids = encode_prompts(tokenizer, [user_message(e, bench) for e in bench.examples])
        longest = max(longest, *map(len, ids))
    budget = longest + 3  # question + local window 2 + 1 slot: the longest prompts evict within 8 new tokens
    code = dynts_main([
        "eval", "--model", "smollm2-135m", "--benchmark", "gsm8k,math500", "--limit", "2", "--k", "1",
        "--method", "full,window,streamingllm", "--budget", str(budget), "--local-window", "2",
        "--max-new-tokens", "8", "--batch-size", "2", "--run-dir", str(tmp_path), "--no-progress",
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "| gsm8k | full |" in out and "| math500 | streamingllm |" in out
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(r["benchmark"], r["method"]) for r in rows] == [
        (b, m) for b in ("gsm8k", "math500") for m in ("full", "window", "streamingllm")
    ]
    results = json.loads((tmp_path / "results.json").read_text())
    for r in results:
        assert r["questions"] == 2 and r["samples"] == 2 and r["mean_generated_tokens"] <= 8
        assert 0.0 <= r["pass@1"] <= 1.0
        if r["budget"] is not None:
            assert r["peak_cache_tokens"] <= budget
    assert any(r["evictions"] > 0 for r in results if r["budget"] is not None)
    for path in (tmp_path / "samples").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert isinstance(record["correct"], bool) and record["text"]  # generated and graded
    assert (tmp_path / "accuracy_vs_budget.png").is_file()
