"""What dynts.vllm refuses, and that it refuses before the model loads; the internals check over a source tree;
the state the plugin keeps stays bounded. Model-free except one engine start. Runs in the vLLM venv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (make test builds .venv-vllm)")

from dynts.models import checkpoints_dir  # noqa: E402
from dynts.vllm.checks import check_engine, check_worker, engine_problems  # noqa: E402

TESTBED = checkpoints_dir() / "testbed-lrm"


def engine_config(**changes):
    """A VllmConfig-like object with every field the checks read, set to a supported value."""
    parts = {
        "use_v2_model_runner": False,
        "scheduler_config": NS(async_scheduling=False),
        "speculative_config": None,
        "parallel_config": NS(pipeline_parallel_size=1, enable_dbo=False, ubatch_size=0),
        "cache_config": NS(cache_dtype="auto"),
        "kv_transfer_config": None,
        "attention_config": NS(backend=None),
    }
    parts.update(changes)
    return NS(**parts)


@pytest.mark.parametrize("changes, words", [
    ({"use_v2_model_runner": True}, "VLLM_USE_V2_MODEL_RUNNER=0"),
    ({"scheduler_config": NS(async_scheduling=True)}, "--no-async-scheduling"),
    ({"speculative_config": NS(method="ngram")}, "drop --speculative-config"),
    ({"parallel_config": NS(pipeline_parallel_size=2, enable_dbo=False, ubatch_size=0)}, "--pipeline-parallel-size 1"),
    ({"parallel_config": NS(pipeline_parallel_size=1, enable_dbo=True, ubatch_size=0)}, "drop --enable-dbo"),
    ({"parallel_config": NS(pipeline_parallel_size=1, enable_dbo=False, ubatch_size=2)}, "--ubatch-size"),
    ({"cache_config": NS(cache_dtype="fp8")}, "kv_cache_dtype='fp8'"),
    ({"kv_transfer_config": NS(kv_connector="LMCacheConnectorV1")}, "LMCacheConnectorV1"),
    ({"attention_config": NS(backend=NS(name="FLASHINFER"))}, "--attention-backend FLASH_ATTN"),
])
def test_each_unsupported_engine_setting_is_refused_with_its_fix(changes, words):
    with pytest.raises(ValueError, match="dynts.vllm cannot evict with") as err:
        check_engine(engine_config(**changes), runner="v1")
    assert words in str(err.value)


def test_supported_settings_pass_and_every_problem_is_listed():
    assert engine_problems(engine_config(), runner="v1") == []
    assert engine_problems(engine_config(attention_config=NS(backend=NS(name="FLASH_ATTN")),
                                         kv_transfer_config=NS(kv_connector=None)), runner="v1") == []
    v2_defaults = engine_config(use_v2_model_runner=True, scheduler_config=NS(async_scheduling=True))
    assert len(engine_problems(v2_defaults, runner="v1")) == 2
    assert engine_problems(v2_defaults, runner="v2") == []  # vLLM 0.34: the V2 runner with async scheduling


def test_worker_refuses_several_kv_groups_and_split_kernel_blocks():
    group = NS(kv_cache_spec=NS(block_size=32))
    assert check_worker(NS(kv_cache_groups=[group]), [32]) == 32
    assert check_worker(NS(kv_cache_groups=[group]), None) == 32
    with pytest.raises(NotImplementedError, match="one KV cache group.*2 groups"):
        check_worker(NS(kv_cache_groups=[group, group]), [32, 32])
    with pytest.raises(NotImplementedError, match="--block-size 16"):
        check_worker(NS(kv_cache_groups=[group]), [16])


REFUSE = """
import os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
if __name__ == "__main__":
    from vllm import LLM
    try:
        LLM(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True, max_model_len=512,
            async_scheduling=False, kv_cache_dtype="fp8", additional_config={"dynts": {"method": "streamingllm", "budget": 96,
                                                               "local_window": 16}})
    except ValueError as err:
        print("REFUSED", err)
"""


def test_a_real_engine_refuses_before_the_model_loads(tmp_path):
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE)
    proc = subprocess.run([sys.executable, str(script), str(TESTBED)], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "REFUSED dynts.vllm cannot evict with a quantized KV cache" in proc.stdout, out[-3000:]
    assert "drop --kv-cache-dtype" in proc.stdout
    assert "Starting to load model" not in out and "Loading weights" not in out


def test_serve_sets_what_the_plugin_needs():
    from dynts.vllm.serve import engine_choices

    env, flags = engine_choices([], cuda=True, runner="v1")
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert flags == ["--no-async-scheduling", "--attention-backend", "FLASH_ATTN"]
    assert engine_choices(["--attention-backend", "TRITON_ATTN"], cuda=True, runner="v1")[1] == ["--no-async-scheduling"]
    assert engine_choices([], cuda=False, runner="v1")[1] == ["--no-async-scheduling"]  # the CPU build has one backend
    # vLLM 0.34: the V2 runner is the only one, and async scheduling stays vLLM's default
    assert engine_choices([], cuda=True, runner="v2") == ({}, ["--attention-backend", "FLASH_ATTN"])
    assert engine_choices([], cuda=False, runner="v2") == ({}, [])


def test_internals_check_reads_a_source_tree(tmp_path):
    """The installed vLLM's source has every internal; a tree with one method renamed is reported."""
    from dynts.vllm.compat import INTERNALS, missing_internals, vllm_source_root

    assert missing_internals() == []
    root = vllm_source_root()
    for file in {entry[0] for entry in INTERNALS if (root / entry[0]).is_file()}:  # the installed runner's files
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / file, tmp_path / file)
    assert missing_internals(tmp_path) == []
    manager = tmp_path / "v1/core/kv_cache_manager.py"
    manager.write_text(manager.read_text().replace("def get_computed_blocks(", "def get_cached_blocks("))
    (tmp_path / "v1/worker/cpu_worker.py").unlink()
    missing = missing_internals(tmp_path)
    assert "KVCacheManager.get_computed_blocks" in missing
    assert "CPUWorker.determine_available_memory (no vllm/v1/worker/cpu_worker.py)" in missing


def test_per_request_variants_are_bounded():
    from dynts.vllm.config import MAX_VARIANTS, PluginConfig

    config = PluginConfig({"method": "window", "budget": 4096, "local_window": 16})
    first = config.for_request({"dynts_budget": 100})
    for budget in range(200, 200 + 2 * MAX_VARIANTS):
        config.for_request({"dynts_budget": budget})
    assert len(config._variants) == MAX_VARIANTS
    assert config.for_request({"dynts_budget": 100}) is not first  # dropped, rebuilt on demand
    again = config.for_request({"dynts_budget": 100})
    assert config.for_request({"dynts_budget": 100}) is again


def test_slot_table_is_sized_by_the_engine_and_charged():
    from dynts.vllm.config import PluginConfig
    from dynts.vllm.worker import TABLE_CELL_BYTES, slot_table_bytes, slot_table_shape

    vllm_config = NS(scheduler_config=NS(max_num_seqs=256), model_config=NS(max_model_len=131072))
    config = PluginConfig({"method": "window", "budget": 4096, "local_window": 512})
    assert slot_table_shape(config, vllm_config) == (256, 4096)
    assert slot_table_bytes(config, vllm_config) == 256 * 4096 * TABLE_CELL_BYTES  # 28.0 MiB
    small = NS(scheduler_config=NS(max_num_seqs=8), model_config=NS(max_model_len=128))
    assert slot_table_shape(config, small) == (8, 128)
