"""What the plugin refuses, and where: the engine configuration before any model load, the worker's
attention layout and KV-cache groups when the KV cache is built.

The plugin moves KV slots inside vLLM's blocks behind the scheduler's back, so it runs only in the
configurations it is tested in. :func:`check_engine` runs on the engine configuration in the front
end (``EngineArgs.create_engine_config``, before the model loads) and again in the engine core
(``Scheduler.__init__``); :func:`check_worker` runs in every worker when its KV cache is allocated
(``initialize_kv_cache``, before the first request). Each refusal names the setting and the fix.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_BACKENDS", "check_engine", "check_worker", "engine_problems"]

# Attention backends whose KV layout has a tested slot copy (dynts.vllm.layouts); CPU_ATTN: the CPU build.
SUPPORTED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN")


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def engine_problems(vllm_config: Any, runner: str | None = None) -> list[str]:
    """Every engine setting the plugin has not been tested with, each with its fix (empty: supported).
    ``runner``: the model runner the plugin drives on this release (default: the installed vLLM's)."""
    if runner is None:
        from .compat import runner_of

        runner = runner_of()
    problems = []
    if runner == "v1" and _get(vllm_config, "use_v2_model_runner", default=False):
        problems.append("vLLM's V2 model runner on vLLM 0.32: set VLLM_USE_V2_MODEL_RUNNER=0 (or use vLLM 0.34)")
    if runner == "v1" and _get(vllm_config, "scheduler_config", "async_scheduling", default=False):
        problems.append("async scheduling on vLLM 0.32: pass --no-async-scheduling (Python: async_scheduling=False), "
                        "or use vLLM 0.34")
    if _get(vllm_config, "speculative_config") is not None:
        problems.append("speculative decoding: drop --speculative-config")
    if _get(vllm_config, "parallel_config", "pipeline_parallel_size", default=1) > 1:
        problems.append("pipeline parallelism: set --pipeline-parallel-size 1 (tensor parallelism is supported)")
    parallel = _get(vllm_config, "parallel_config")
    if _get(parallel, "enable_dbo", default=False) or (_get(parallel, "ubatch_size", default=0) or 0) > 1:
        problems.append("micro-batching (DBO): drop --enable-dbo and --ubatch-size")
    dtype = _get(vllm_config, "cache_config", "cache_dtype", default="auto")
    if str(dtype) not in ("auto", "None"):
        problems.append(f"a quantized KV cache (kv_cache_dtype={dtype!r}): drop --kv-cache-dtype")
    connector = _get(vllm_config, "kv_transfer_config", "kv_connector")
    if connector is not None:
        problems.append(f"a KV connector ({connector}: kv_transfer_config / --kv-offloading-size): drop it")
    backend = _get(vllm_config, "attention_config", "backend")
    name = getattr(backend, "name", backend)
    if name is not None and str(name) not in SUPPORTED_BACKENDS:
        problems.append(f"attention backend {name}: pass --attention-backend FLASH_ATTN (supported: "
                        f"{', '.join(SUPPORTED_BACKENDS)})")
    return problems


def check_engine(vllm_config: Any, runner: str | None = None) -> None:
    """Raise ``ValueError`` for an engine configuration the plugin has not been tested with (every problem,
    each with its fix)."""
    problems = engine_problems(vllm_config, runner)
    if problems:
        raise ValueError("dynts.vllm cannot evict with " + "; ".join(problems)
                         + ". Change these settings, or start vLLM without additional_config['dynts']")


def check_worker(kv_cache_config: Any, kernel_block_sizes: Any) -> int:
    """The block size of the one KV-cache group; ``NotImplementedError`` for a model with several groups
    (sliding-window or hybrid layers) or a backend that splits vLLM's blocks into smaller kernel blocks."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"dynts.vllm supports models whose layers all use full attention (one KV cache group); this model has "
            f"{len(groups)} groups (sliding-window or hybrid layers). Serve it without additional_config['dynts']"
        )
    block_size = groups[0].kv_cache_spec.block_size
    kernel = list(kernel_block_sizes or [block_size])
    if kernel != [block_size]:
        raise NotImplementedError(
            f"the attention backend splits vLLM's blocks of {block_size} tokens into kernel blocks of {kernel}; "
            f"dynts.vllm maps slots through whole blocks: pass --block-size {kernel[0]}"
        )
    return block_size
