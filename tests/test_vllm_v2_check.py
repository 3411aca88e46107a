"""The verdict of the vLLM check on a GPU with vLLM installed (:mod:`eval.perf.vllm_v2_check`): inconclusive is
not a pass. Model-free: ``dynts vllm-check`` is replaced by a stand-in that exits with a given status per run."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace as NS

import pytest

from eval.perf import vllm_v2_check as check


@pytest.fixture
def statuses(monkeypatch, tmp_path):
    """Set ``statuses[(label, dtype)]`` (default 0); every call is recorded in ``statuses["calls"]``."""
    table: dict = {"calls": []}
    monkeypatch.setattr(check, "skip_reason", lambda: None)
    monkeypatch.setattr(check, "tiny_r1_model", lambda root: tmp_path / "tiny-r1")

    def fake_run(command, **kwargs):
        dtype = command[command.index("--dtype") + 1]
        label = next(label for label, *_ in check.RUNS if f"{label}.json" in " ".join(command)
                     or f"{label}-float32.json" in " ".join(command))
        table["calls"].append((label, dtype, command))
        return NS(returncode=table.get((label, dtype), 0), stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    return table


def test_every_run_exact_in_bfloat16_passes_without_a_rerun(statuses):
    result = check.vllm_v2_check(dry_run=False)
    assert result["ok"] and result["verdicts"] == ["exact"] * len(check.RUNS)
    assert {r["decided_by"] for r in result["runs"]} == {"bfloat16"}
    assert all(dtype == "bfloat16" for _, dtype, _ in statuses["calls"])


def test_an_inconclusive_run_is_decided_by_float32(statuses):
    statuses[("fa3-streamingllm", "bfloat16")] = 4
    result = check.vllm_v2_check(dry_run=False)
    run = next(r for r in result["runs"] if r["label"] == "fa3-streamingllm")
    assert run["status"] == 4 and run["float32"]["status"] == 0
    assert run["verdict"] == "exact" and run["decided_by"] == "float32" and result["ok"]
    label, dtype, command = statuses["calls"][2]
    assert (label, dtype) == ("fa3-streamingllm", "float32")
    assert "TRITON_ATTN" in command and "--flash-attn-version" not in command
    assert "--cudagraph-mode" in command and "FULL_AND_PIECEWISE" in command


@pytest.mark.parametrize("float32_status, verdict", [(4, "inconclusive"), (1, "mismatch"), (3, "error")])
def test_inconclusive_is_not_a_pass(statuses, float32_status, verdict):
    statuses[("fa2-streamingllm", "bfloat16")] = 4
    statuses[("fa2-streamingllm", "float32")] = float32_status
    result = check.vllm_v2_check(dry_run=False)
    assert result["verdicts"][0] == verdict and not result["ok"]


def test_a_bfloat16_mismatch_fails_without_a_rerun(statuses):
    statuses[("fa2-testbed-dynts", "bfloat16")] = 1
    result = check.vllm_v2_check(dry_run=False)
    assert result["verdicts"] == ["exact", "exact", "mismatch"] and not result["ok"]
    assert len(statuses["calls"]) == len(check.RUNS)


def test_out_of_time_is_not_a_pass(statuses):
    result = check.vllm_v2_check(dry_run=False, seconds=30.0)
    assert result["verdicts"] == ["inconclusive"] * len(check.RUNS) and not result["ok"]
