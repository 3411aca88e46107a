"""dynts on vLLM 0.34's V2 runner with async scheduling on (vLLM's default): the one-round lookahead is exact.

Under async scheduling the scheduler plans round N+1 before it has seen round N's sampled token. The plugin's
plan is exact by construction: an event decided at ``schedule(N+1)`` covers the K/V rows forwards <= N wrote
(the copy runs in round N+1, after forward N), the plan carries that round's ``shift`` for every request, and a
token whose id is still being sampled is scored at once and labelled when its id arrives with the next plan,
before that plan's events. Runs on the CPU test bed (``make check-vllm-v2``); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

pytest.importorskip("vllm", reason="needs vLLM's 0.34 CPU build (make check-vllm-v2)")

from dynts.vllm.compat import installed_vllm  # noqa: E402
from test_vllm_plugin import (PREDICTOR, TESTBED, assert_bounded_and_freed, fresh_questions, reference,  # noqa: E402
                              run_engine)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(Version(Version(installed_vllm()).base_version) < Version("0.34"),
                                 reason="async scheduling with eviction runs on vLLM 0.34's V2 runner")]

BUDGET, WINDOW = 96, 16  # n_keep = 56
METHODS = ["dynts", "window", "streamingllm", "sepllm"]


def requests(n: int) -> list[dict]:
    return [{"prompt_token_ids": p, "max_tokens": 400, "arrive_at_step": 9 * i,
             "extra_args": {"dynts": {"method": METHODS[i % 4]}}} for i, p in enumerate(fresh_questions(n))]


def run(tmp_path, n: int, **options) -> dict:
    engine = {"method": "dynts", "budget": BUDGET, "local_window": WINDOW, "predictor": str(PREDICTOR)}
    return run_engine(tmp_path, TESTBED, requests(n), additional_config={"dynts": engine}, num_gpu_blocks_override=40,
                      async_scheduling=True, **options)


def mismatches(result: dict, testbed, n: int, skip: set[str] = frozenset()) -> list[str]:
    model, tok = testbed
    out = []
    for i, request in enumerate(requests(n)):
        if str(i) in skip:
            continue
        method = METHODS[i % 4]
        extra = {"predictor": PREDICTOR} if method == "dynts" else {}
        want = reference(model, tok, request["prompt_token_ids"], 400, method=method, budget=BUDGET,
                         local_window=WINDOW, **extra)
        if result["outputs"][str(i)].get("token_ids") != want:
            out.append(f"request {i} ({method})")
    return out


@pytest.fixture(scope="module")
def testbed():
    import dynts

    return dynts.load("testbed", dtype="float32", device="cpu")


def test_async_every_method_equals_generate_alone(tmp_path, testbed):
    """Eight requests arriving while others decode, four methods, async scheduling on: each token-identical
    to dynts.generate on it alone; bounded, blocks freed, no preemption. The per-step writes are the ones a
    FULL CUDA graph would see (vLLM captures none on CPU): ``seq_lens`` lowered in the runner's persistent
    buffer and slot mappings in vLLM's persistent buffer on every shifted step, and no K/V copy inside the
    model's forward."""
    result = run(tmp_path, 8, check_buffers=True)
    assert result["engine_classes"]["scheduler"] == "AsyncScheduler" and result["engine_classes"]["batch_queue"]
    buffers = result["buffers"]
    assert buffers["shifted_steps"] > 0 and buffers["copies"] > 0
    assert buffers["seq_lens_in_place"] == buffers["slot_mappings_in_place"] == buffers["shifted_steps"]
    assert buffers["copies_in_forward"] == 0
    assert_bounded_and_freed(result, BUDGET)
    assert all(s["evictions"] > 0 for s in result["request_stats"].values())
    assert mismatches(result, testbed, 8) == []


def test_a_one_step_stale_count_is_caught(tmp_path, testbed):
    """The async bug of the field (a worker slot mapping from the evicted count of the round before, R-KV's
    issue) does not go unnoticed, and it never stops the engine: the requests it touches either diverge from
    dynts.generate (the test above would fail on such an adapter), or would store past the slot-table row reserved
    for their budget and finish with ``finish_reason="error"``, one log line each naming why."""
    from test_vllm_plugin import drive_engine

    engine = {"method": "dynts", "budget": BUDGET, "local_window": WINDOW, "predictor": str(PREDICTOR)}
    proc, result = drive_engine(tmp_path, TESTBED, requests(4), stale_shift=True, additional_config={"dynts": engine},
                                num_gpu_blocks_override=40, async_scheduling=True)
    assert proc.returncode == 0 and result is not None, proc.stderr[-4000:]
    assert result["engine_classes"]["scheduler"] == "AsyncScheduler"
    failed = {rid for rid, out in result["outputs"].items() if out.get("finish_reason") == "error"}
    lines = [line for line in result["log_warnings"] if "past the" in line and "max_budget" in line]
    assert len(lines) == len(failed), (failed, result["log_warnings"])
    assert failed or mismatches(result, testbed, 4), "a stale evicted count went unnoticed"


def test_a_fault_in_one_request_ends_that_request_only(tmp_path, testbed):
    """A broken invariant in one of eight concurrent requests (the worker loses its 30th shipment of token ids, so
    the next arrives from an index it does not hold): that request finishes with ``finish_reason="error"`` and one
    log line naming it and why, the engine goes on, the other seven are token-identical to dynts.generate alone,
    and every block is back in the pool at the end."""
    victim = "5"
    result = run(tmp_path, 8, lose_shipment=(victim, 30))
    assert result["engine_classes"]["scheduler"] == "AsyncScheduler"
    outputs = result["outputs"]
    assert outputs[victim]["finish_reason"] == "error", outputs[victim]
    assert all(out["finish_reason"] in ("stop", "length") for rid, out in outputs.items() if rid != victim)
    lines = [line for line in result["log_warnings"] if "fails" in line]
    assert len(lines) == 1 and f"request {victim}" in lines[0] and "token ids arrive from index" in lines[0], lines
    assert mismatches(result, testbed, 8, skip={victim}) == []
    assert result["free_blocks_at_end"] == result["num_blocks"] - 1


def test_a_short_soak_passes(tmp_path):
    """``scripts/vllm_soak.py`` at a small size (12 requests, mixed methods, shared questions, aborts while an
    eviction is in flight, a tight pool that makes stock vLLM preempt, async scheduling): exit 0, every finished
    request exact, no engine death, every block free, the plugin's RSS growth within the slack of stock's."""
    soak = Path(__file__).resolve().parents[1] / "scripts" / "vllm_soak.py"
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(soak), "--requests", "12", "--max-tokens", "160", "--every-steps", "4",
                           "--abort-every", "4", "--abort-after", "40", "--json", str(out)], capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["ok"] and summary["mismatches"] == [] and summary["compared"] >= 6
    # every abort of this run is an evicting request's, at its second event (one that finishes first just finishes)
    assert summary["aborted"]["plugin"] == summary["aborted_in_event"] >= 1
    assert summary["preemptions"]["stock"] > 0 and summary["engine_deaths"] == {"stock": None, "plugin": None}
