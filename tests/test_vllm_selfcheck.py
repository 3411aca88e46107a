"""``dynts vllm-check``: the verdict rules (anywhere) and the command on vLLM 0.34's CPU test bed (V2 runner, async
scheduling): exact on the testbed LRM with its predictor and on a tiny Llama, a mismatch when a fault is injected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynts.cli import COMMANDS
from dynts.vllm.selfcheck import CheckSettings, compare, default_budget, engine_options, first_divergence, main

TESTS = Path(__file__).parent


def test_verdicts():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence(None, [1]) == 0
    assert compare([1, 2], [1, 2], [1, 2], [1, 2])["verdict"] == "exact"
    assert compare([1, 9], [1, 2], [1, 2], [1, 2]) == {"verdict": "mismatch", "evicted_divergence": 1,
                                                        "control_divergence": None}
    # the control diverged first (numerics), the evicting request no earlier: not the plugin's doing
    assert compare([1, 2, 9], [1, 9, 9], [1, 2, 3], [1, 2, 3])["verdict"] == "inconclusive"
    assert compare([9, 2, 3], [1, 2, 9], [1, 2, 3], [1, 2, 3])["verdict"] == "mismatch"


def test_settings_and_flags():
    assert CheckSettings("m").method == "streamingllm"
    assert CheckSettings("m", predictor=str(TESTS)).method == "dynts"
    with pytest.raises(ValueError, match="predictor='nowhere' is not a directory"):
        CheckSettings("m", predictor="nowhere")
    with pytest.raises(ValueError, match="predictor=DIR"):
        CheckSettings("m", method="dynts")
    with pytest.raises(ValueError, match="requests=0"):
        CheckSettings("m", requests=0)
    budget = default_budget([[1] * 30, [1] * 14], local_window=16, max_tokens=160)
    assert budget % 16 == 0 and budget >= 30 + 16 + 1 + 32
    import argparse

    args = argparse.Namespace(attention_backend="FLASH_ATTN", flash_attn_version=3, cudagraph_mode="FULL_AND_PIECEWISE",
                              enforce_eager=False, no_async_scheduling=False, block_size=None,
                              gpu_memory_utilization=None)
    assert engine_options(args) == {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3},
                                    "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}
    assert COMMANDS["vllm-check"][0] == "dynts.vllm.selfcheck:main"
    assert main(["m", "--method", "dynts"]) == 2  # no predictor: the argument error, before any engine


def test_without_vllm_the_check_says_how_to_install(capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(["testbed"]) == 3 and "pip install 'dynts-lrm[vllm]'" in capsys.readouterr().out


def vllm_check(tmp_path: Path, *args: str, fault: str | None = None) -> tuple[int, dict, str]:
    """``dynts vllm-check`` in its own process (vLLM keeps process-wide state): exit status, JSON, stdout."""
    out = tmp_path / "check.json"
    inject = f"import vllm_faults; vllm_faults.{fault}(); " if fault else ""
    code = f"import sys; {inject}from dynts.cli import main; sys.exit(main(['vllm-check', *sys.argv[1:]]))"
    root = str(TESTS.parent)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, *args, "--block-size", "32", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert out.exists(), proc.stderr[-4000:]
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def needs_v2_testbed():
    pytest.importorskip("vllm", reason="needs vLLM's 0.34 CPU build (make check-vllm-v2)")
    from packaging.version import Version

    from dynts.vllm.compat import installed_vllm

    if Version(Version(installed_vllm()).base_version) < Version("0.34"):
        pytest.skip("the self-check's engine runs are tested on vLLM 0.34's V2 test bed (make check-vllm-v2)")


@pytest.mark.usefixtures("one_thread")
def test_testbed_with_its_predictor_is_exact(tmp_path):
    needs_v2_testbed()
    from dynts.models import checkpoints_dir

    status, result, stdout = vllm_check(tmp_path, "testbed", "--predictor", str(checkpoints_dir() / "testbed-predictor"),
                                        "--requests", "2", "--max-tokens", "96")
    assert status == 0, stdout
    engine = result["engine"]
    assert engine["v2_runner"] and engine["async_scheduling"] and engine["scheduler"] == "AsyncScheduler"
    assert result["settings"]["method"] == "dynts"
    assert [r["verdict"] for r in result["requests"]] == ["exact", "exact"]
    assert all(r["evictions"] > 0 for r in result["requests"])
    assert "EXACT" in stdout and "AsyncScheduler" in stdout


@pytest.mark.usefixtures("one_thread")
def test_tiny_llama_is_exact(tmp_path):
    needs_v2_testbed()
    from test_vllm_plugin import make_tiny_models

    model = make_tiny_models(tmp_path, ("llama",))["llama"]
    status, result, stdout = vllm_check(tmp_path, str(model), "--requests", "2", "--max-tokens", "96")
    assert status == 0, stdout
    assert result["settings"]["method"] == "streamingllm" and all(r["evictions"] > 0 for r in result["requests"])


@pytest.mark.usefixtures("one_thread")
def test_an_injected_fault_is_a_mismatch(tmp_path):
    """The one-step-stale evicted count (tests/vllm_faults.py): the self-check reports it and exits 1."""
    needs_v2_testbed()
    from dynts.models import checkpoints_dir

    status, result, stdout = vllm_check(tmp_path, "testbed", "--predictor", str(checkpoints_dir() / "testbed-predictor"),
                                        "--requests", "2", "--max-tokens", "96", fault="make_shift_stale")
    assert status == 1, stdout
    assert "mismatch" in [r["verdict"] for r in result["requests"]] and "MISMATCH" in stdout
