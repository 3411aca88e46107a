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
    ({"parallel_config": NS(pipeline_parallel_size=1, enable_dbo=False, ubatch_size=0, decode_context_parallel_size=2)},
     "set --decode-context-parallel-size 1"),
    ({"parallel_config": NS(pipeline_parallel_size=1, enable_dbo=False, ubatch_size=0, prefill_context_parallel_size=2)},
     "set --prefill-context-parallel-size 1"),
    ({"cache_config": NS(cache_dtype="auto", kv_sharing_fast_prefill=True)}, "drop --kv-sharing-fast-prefill"),
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


def spec(kind: str = "FullAttentionSpec", **fields):
    """A vLLM KV-cache spec of one layer kind (block 32, 1 KV head of 32, fp32)."""
    import torch
    from vllm.v1 import kv_cache_interface

    return getattr(kv_cache_interface, kind)(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32, **fields)


def test_worker_refuses_several_kv_groups_and_split_kernel_blocks():
    group = NS(kv_cache_spec=spec())
    assert check_worker(NS(kv_cache_groups=[group]), [32]) == 32
    assert check_worker(NS(kv_cache_groups=[group]), None) == 32
    with pytest.raises(NotImplementedError, match="one KV cache group.*2 groups"):
        check_worker(NS(kv_cache_groups=[group, group]), [32, 32])
    with pytest.raises(NotImplementedError, match="--block-size 16"):
        check_worker(NS(kv_cache_groups=[group]), [16])


def test_worker_refuses_values_of_another_head_size_than_the_keys():
    """vLLM's ``FullAttentionSpec.head_size_v``: the slot move splits a slot's content into equal key and value
    halves, so a model whose values have another head size is refused at KV-cache setup, naming why."""
    assert check_worker(NS(kv_cache_groups=[NS(kv_cache_spec=spec(head_size_v=32))]), [32]) == 32
    with pytest.raises(NotImplementedError, match=r"two equal halves.*values of head size 64 beside keys of head "
                                                  r"size 32 \(head_size_v != head_size\)"):
        check_worker(NS(kv_cache_groups=[NS(kv_cache_spec=spec(head_size_v=64))]), [32])


@pytest.mark.parametrize("kind, fields, words", [
    ("SlidingWindowSpec", {"sliding_window": 64}, "SlidingWindowSpec layers (window 64)"),
    ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 64}, "ChunkedLocalAttentionSpec layers (window 64)"),
    ("FullAttentionSpec", {"sliding_window": 64}, "sliding-window layers kept as full attention (window 64)"),
    ("FullAttentionSpec", {"attention_chunk_size": 64}, "chunked local attention (chunk 64)"),
    ("FullAttentionSpec", {"non_causal": True}, "non-causal attention layers"),
    ("MLAAttentionSpec", {}, "MLAAttentionSpec layers"),
])
def test_worker_refuses_every_kv_cache_kind_but_plain_full_attention_even_in_one_group(kind, fields, words):
    """One group is not enough: a model whose every layer slides (one SlidingWindowSpec group) is refused, since
    vLLM frees or nulls blocks behind the window by logical position, which after a compaction hold kept K/V."""
    from dynts.vllm.checks import kv_spec_problem

    assert kv_spec_problem(spec()) is None
    with pytest.raises(NotImplementedError, match="plain full-attention KV caches") as err:
        check_worker(NS(kv_cache_groups=[NS(kv_cache_spec=spec(kind, **fields))]), [32])
    assert words in str(err.value) and "without additional_config['dynts']" in str(err.value)


def test_cross_layer_kv_sharing_is_refused():
    """vLLM lists a layer that reads another layer's K/V in its target's group: the same tensor would be compacted
    twice."""
    from dynts.vllm.checks import check_kv_sharing

    def runner(**targets):
        context = {name: NS(kv_sharing_target_layer_name=t) for name, t in targets.items()}
        return NS(compilation_config=NS(static_forward_context=context),
                  kv_cache_config=NS(kv_cache_groups=[NS(layer_names=list(targets))]))

    check_kv_sharing(runner(a=None, b=None))
    with pytest.raises(NotImplementedError, match="shares K/V across layers.*1 layers reuse.*e.g. b"):
        check_kv_sharing(runner(a=None, b="a"))


def test_a_uniform_group_is_checked_layer_by_layer():
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from dynts.vllm.checks import kv_spec_problem

    plain = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": spec(), "b": spec()})
    assert kv_spec_problem(plain) is None
    mixed = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": spec(), "b": spec(sliding_window=64)})
    assert kv_spec_problem(mixed) == "sliding-window layers kept as full attention (window 64)"


def test_prompt_embeds_and_streaming_input_requests_are_refused_with_why():
    """What the front end refuses per request on an engine with dynts (``process_inputs``: vLLM's validation
    error, HTTP 400): a prompt given as embeddings, and a streaming-input (resumable) chunk."""
    from dynts.vllm.checks import request_problem

    assert request_problem(NS(prompt_embeds=None, resumable=False)) is None
    assert "has no token ids" in request_problem(NS(prompt_embeds=object(), resumable=False))
    assert "streaming input" in request_problem(NS(prompt_embeds=None, resumable=True))


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


SLIDING = """
import os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
if __name__ == "__main__":
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from vllm import LLM
    from dynts.models import load_tokenizer

    tok = load_tokenizer("testbed")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                         use_sliding_window=True, sliding_window=64, max_window_layers=0,
                         layer_types=["sliding_attention"] * 2, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).eval().save_pretrained(sys.argv[1])
    tok.save_pretrained(sys.argv[1])
    try:
        llm = LLM(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True, max_model_len=512,
                  additional_config={"dynts": {"method": "streamingllm", "budget": 48, "local_window": 16}})
    except Exception as err:  # the worker's refusal, however vLLM wraps it
        print("REFUSED", type(err).__name__, err)
        cause = err.__cause__ or err.__context__
        while cause is not None:
            print("CAUSE", type(cause).__name__, cause)
            cause = cause.__cause__ or cause.__context__
    else:
        print("STARTED", llm.generate([[5, 6, 7]])[0].outputs[0].token_ids)
"""


def test_a_model_whose_every_layer_slides_is_refused_when_the_kv_cache_is_set_up(tmp_path):
    """One KV-cache group of sliding-window layers (a Qwen2 with every layer sliding, window 64): refused before
    the first request, with the reason, where it used to start and evict on a cache vLLM trims by logical
    position."""
    script = tmp_path / "sliding.py"
    script.write_text(SLIDING)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "sliding-qwen2")], capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert "STARTED" not in proc.stdout, out[-3000:]
    assert "dynts.vllm evicts only from plain full-attention KV caches; this model's KV cache has " \
           "SlidingWindowSpec layers (window 64)" in out, out[-3000:]


EMBEDS = """
import os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
if __name__ == "__main__":
    import torch
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    llm = LLM(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True, max_model_len=512,
              enable_prompt_embeds=True,
              additional_config={"dynts": {"method": "streamingllm", "budget": 96, "local_window": 16}})
    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    try:
        llm.generate({"prompt_embeds": torch.zeros(8, hidden)}, SamplingParams(max_tokens=4))
    except VLLMValidationError as err:
        print("REFUSED", err)
    out = llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    print("SERVED", len(out[0].outputs[0].token_ids))
"""


def test_a_prompt_embeds_request_is_a_validation_error_and_the_engine_serves_on(tmp_path):
    """A request given as ``prompt_embeds`` on an engine with dynts (``enable_prompt_embeds=True``): vLLM's
    validation error (HTTP 400 through the server) naming why; the next request is served."""
    script = tmp_path / "embeds.py"
    script.write_text(EMBEDS)
    proc = subprocess.run([sys.executable, str(script), str(TESTBED)], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert "REFUSED dynts: a prompt given as prompt_embeds has no token ids" in proc.stdout, out[-3000:]
    assert "SERVED 4" in proc.stdout, out[-3000:]


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


def test_internals_check_reads_attributes_and_call_order(tmp_path):
    """On vLLM 0.34 (the V2 runner): besides names, the check reads the attributes the worker reads on the runner,
    the call order inside ``execute_model`` that exactness depends on, and that ``ModelRunnerOutput`` still takes
    the plugin's ``dynts_faults``; a copy of the installed source with one of each changed is reported."""
    from dynts.vllm.compat import INTERNALS, WORKER_V2, missing_internals, runner_of, vllm_source_root

    if runner_of() != "v2":
        pytest.skip("the V2 runner's internals: vLLM 0.34 (make check-vllm-v2)")
    root = vllm_source_root()
    for file in {entry[0] for entry in INTERNALS if (root / entry[0]).is_file()}:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / file, tmp_path / file)
    assert missing_internals(tmp_path) == []
    assert {entry[3][0] for entry in WORKER_V2} >= {"uses", "order", "open", "field", "params"}

    def patch(file: str, old: str, new: str) -> None:
        path = tmp_path / file
        text = path.read_text()
        assert text.count(old) == 1, old
        path.write_text(text.replace(old, new))

    runner = "v1/worker/gpu/model_runner.py"
    patch(runner, "            self.update_requests(scheduler_output)\n", "")  # now after the staged block-table writes
    patch(runner, "            self.block_tables.apply_staged_writes()\n",
          "            self.block_tables.apply_staged_writes()\n            self.update_requests(scheduler_output)\n")
    patch(runner, "self.block_tables = BlockTables(", "self.kv_block_tables = BlockTables(")  # an attribute renamed
    patch("v1/outputs.py", "@dataclass\nclass ModelRunnerOutput:", "@dataclass(slots=True)\nclass ModelRunnerOutput:")
    assert missing_internals(tmp_path) == [
        "GPUModelRunner.initialize_kv_cache uses self.block_tables = BlockTables(",
        "GPUModelRunner.execute_model runs self.block_tables.apply_staged_writes() no longer after "
        "self.update_requests(scheduler_output)",
        "ModelRunnerOutput has __slots__",
    ]


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
    from dynts.vllm.memory import (EVENT_BYTES_PER_SLOT, PREDICTOR_BYTES_PER_TOKEN_AND_DIM, TABLE_CELL_BYTES,
                                   hooks_bytes, predictor_bytes, slot_table_bytes, slot_table_shape)

    vllm_config = NS(scheduler_config=NS(max_num_seqs=256, max_num_batched_tokens=8192),
                     model_config=NS(max_model_len=131072, get_hidden_size=lambda: 3584))
    config = PluginConfig({"method": "window", "budget": 4096, "local_window": 512})
    assert slot_table_shape(config, vllm_config) == (257, 4096)  # a row per request and the scratch row
    assert slot_table_bytes(config, vllm_config) == 257 * 4096 * TABLE_CELL_BYTES  # 28.1 MiB
    # charged: the table and an eviction round of every row; DynTS also its predictor's activations at a full batch
    assert hooks_bytes(config, vllm_config) == 257 * 4096 * (TABLE_CELL_BYTES + EVENT_BYTES_PER_SLOT)
    scoring = PluginConfig({"method": "dynts", "budget": 4096, "local_window": 512,
                            "predictor": str(checkpoints_dir() / "testbed-predictor")})
    assert hooks_bytes(scoring, vllm_config) == (hooks_bytes(config, vllm_config) + predictor_bytes(3584)
                                                 + 8192 * 3584 * PREDICTOR_BYTES_PER_TOKEN_AND_DIM)  # + 147 + 560 MiB
    assert predictor_bytes(3584) == 4 * (3 * 3584 ** 2 + 3 * 3584 + 1)  # d -> 2d -> d/2 -> 1 in fp32
    small = NS(scheduler_config=NS(max_num_seqs=8), model_config=NS(max_model_len=128))
    assert slot_table_shape(config, small) == (9, 128)
    wider = PluginConfig({"method": "window", "budget": 4096, "local_window": 512, "max_budget": 16384})
    assert slot_table_shape(wider, vllm_config) == (257, 16384)  # the largest budget a request may ask for
    assert slot_table_shape(PluginConfig({"method": "full"}), vllm_config) == (257, 1)  # no budget: the scratch slot


def test_dynts_serve_passes_max_budget_to_the_plugin_and_checks_it_first():
    import json

    from dynts.vllm.serve import build_command, parse_args

    flags = ["testbed", "--kv-method", "window", "--kv-budget", "64", "--kv-local-window", "16"]
    command = build_command(*parse_args([*flags, "--kv-max-budget", "256"]))
    engine = json.loads(command[command.index("--additional-config") + 1])["dynts"]
    assert engine["max_budget"] == 256 and engine["budget"] == 64
    with pytest.raises(ValueError, match="max_budget=32 must be an int >= the engine's budget"):
        build_command(*parse_args([*flags, "--kv-max-budget", "32"]))
