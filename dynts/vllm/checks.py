"""What the plugin refuses, and where: the engine configuration before any model load, the worker's
attention layout and KV-cache groups when the KV cache is built.

The plugin moves KV slots inside vLLM's blocks behind the scheduler's back, so it runs only in the
configurations it is tested in. :func:`check_engine` runs on the engine configuration in the front
end (``EngineArgs.create_engine_config``, before the model loads) and again in the engine core
(``Scheduler.__init__``); :func:`check_worker` runs in every worker when its KV cache is allocated
(``initialize_kv_cache``, before the first request): one KV-cache group of plain full attention
(:func:`kv_spec_problem`); :func:`request_problem` runs on every request in the front end
(``InputProcessor.process_inputs``: HTTP 400). Each refusal names the setting and the fix; docs/vllm.md lists
what was checked in vLLM 0.34's runner.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_PARALLEL", "SUPPORTED_BACKENDS", "check_engine", "check_kv_sharing", "check_worker",
           "engine_problems", "kv_spec_problem", "request_problem", "value_head_size_problem"]

# Attention backends whose KV layout has a tested slot copy (dynts.vllm.layouts); CPU_ATTN: the CPU build.
SUPPORTED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN")
# (ParallelConfig field, its flag, what it is): context parallelism shards a request's slots across ranks by
# position (vLLM 0.34 BlockTables(cp_size=...), the PCP manager's own prepare_attn); the plugin's copy moves whole
# slots inside one rank's blocks.
CONTEXT_PARALLEL = (("decode_context_parallel_size", "--decode-context-parallel-size", "decode context parallelism"),
                    ("prefill_context_parallel_size", "--prefill-context-parallel-size", "prefill context parallelism"))


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
    for field, flag, what in CONTEXT_PARALLEL:
        size = _get(parallel, field, default=1) or 1
        if size > 1:
            problems.append(f"{what} ({field}={size}: each rank stores every {size}-th slot of a request): "
                            f"set {flag} 1 (tensor parallelism is supported)")
    if _get(vllm_config, "cache_config", "kv_sharing_fast_prefill", default=False):
        problems.append("KV-sharing fast prefill (layers that reuse another layer's K/V skip prompt tokens): "
                        "drop --kv-sharing-fast-prefill")
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


def request_problem(request: Any) -> str | None:
    """Why an engine with dynts cannot serve one request (``None``: it can), each with the fix: a prompt given as
    embeddings, or vLLM 0.34's streaming input (a ``resumable`` request). ``request``: the ``EngineCoreRequest``
    the front end built."""
    if getattr(request, "prompt_embeds", None) is not None:
        return ("a prompt given as prompt_embeds has no token ids, which dynts reads for every stored token "
                "(segments, separators, the prompt's length against the budget): send the prompt as text or token "
                "ids, or serve prompt_embeds from an engine without additional_config['dynts']")
    if getattr(request, "resumable", False):
        return ("streaming input (a resumable request) is re-sent to the workers as a new request at each input "
                "chunk while the scheduler keeps its evicted count: send the whole prompt in one request, or serve "
                "streaming input from an engine without additional_config['dynts']")
    return None


def kv_spec_problem(spec: Any) -> str | None:
    """What makes one KV-cache group's spec other than plain full attention (``None``: plain full attention).

    The plugin is exact only where every stored slot stays where the plugin put it and is read by every later
    token: vLLM's ``FullAttentionSpec`` itself (not a subclass: MLA latents, sink or sparse variants), without a
    sliding window or attention chunk (vLLM frees or nulls blocks behind a window by *logical* position,
    ``num_computed_tokens``, which after a compaction hold kept K/V), causal, one token per stored state. A
    ``UniformTypeKVCacheSpecs`` group is checked layer by layer."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError:  # a stand-in runner without vLLM (eval/perf's hook benches): its spec class says its kind
        FullAttentionSpec = None

    layers = getattr(spec, "kv_cache_specs", None)
    for layer in (layers.values() if isinstance(layers, dict) and layers else [spec]):
        kind = type(layer).__name__
        if (type(layer) is not FullAttentionSpec) if FullAttentionSpec is not None else kind != "FullAttentionSpec":
            window = getattr(layer, "sliding_window", None) or getattr(layer, "attention_chunk_size", None)
            return f"{kind} layers" + (f" (window {window})" if window else "")
        if layer.sliding_window is not None:
            return f"sliding-window layers kept as full attention (window {layer.sliding_window})"
        if getattr(layer, "attention_chunk_size", None) is not None:
            return f"chunked local attention (chunk {layer.attention_chunk_size})"
        if getattr(layer, "non_causal", False):
            return "non-causal attention layers"
        if getattr(layer, "tokens_per_state", 1) != 1:
            return f"{layer.tokens_per_state} tokens per stored state"
    return None


def value_head_size_problem(spec: Any) -> str | None:
    """``None`` when every layer's values have the keys' head size (vLLM's ``head_size_v``, absent or equal to
    ``head_size``), else what differs. The paged geometry (:mod:`dynts.vllm.layouts`) splits each slot's content into
    equal key and value halves, so unequal sizes would move the wrong bytes."""
    layers = getattr(spec, "kv_cache_specs", None)
    for layer in (layers.values() if isinstance(layers, dict) and layers else [spec]):
        head, value = getattr(layer, "head_size", None), getattr(layer, "head_size_v", None)
        if value is not None and head is not None and value != head:
            return f"values of head size {value} beside keys of head size {head} (head_size_v != head_size)"
    return None


def check_kv_sharing(runner: Any) -> None:
    """``NotImplementedError`` for a model with cross-layer KV sharing (a layer attending over another layer's K/V,
    ``kv_sharing_target_layer_name``): vLLM lists such layers in their target's KV-cache group, so one K/V tensor
    would be compacted once per layer that reads it, and a slot move applied twice is not the move."""
    context = runner.compilation_config.static_forward_context
    shared = [name for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names
              if getattr(context.get(name), "kv_sharing_target_layer_name", None)]
    if shared:
        raise NotImplementedError(
            f"dynts.vllm compacts each layer's own KV cache; this model shares K/V across layers ({len(shared)} layers "
            f"reuse another layer's cache, e.g. {shared[0]}). Serve it without additional_config['dynts']"
        )


def check_worker(kv_cache_config: Any, kernel_block_sizes: Any) -> int:
    """The block size of the one KV-cache group; ``NotImplementedError`` for a model with several groups
    (sliding-window or hybrid layers), a group other than plain full attention (:func:`kv_spec_problem`: one
    sliding-window or chunked-local group included), or a backend that splits vLLM's blocks into smaller kernel
    blocks."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"dynts.vllm supports models whose layers all use full attention (one KV cache group); this model has "
            f"{len(groups)} groups (sliding-window or hybrid layers). Serve it without additional_config['dynts']"
        )
    spec = groups[0].kv_cache_spec
    problem = kv_spec_problem(spec)
    if problem is not None:
        raise NotImplementedError(
            f"dynts.vllm evicts only from plain full-attention KV caches; this model's KV cache has {problem}, "
            "where vLLM frees or skips blocks by logical position behind the plugin's compaction. Serve it "
            "without additional_config['dynts']"
        )
    sizes = value_head_size_problem(spec)
    if sizes is not None:
        raise NotImplementedError(
            f"dynts.vllm moves a slot's keys and values as two equal halves of its content; this model's KV cache has "
            f"{sizes}. Serve it without additional_config['dynts']"
        )
    block_size = spec.block_size
    kernel = list(kernel_block_sizes or [block_size])
    if kernel != [block_size]:
        raise NotImplementedError(
            f"the attention backend splits vLLM's blocks of {block_size} tokens into kernel blocks of {kernel}; "
            f"dynts.vllm maps slots through whole blocks: pass --block-size {kernel[0]}"
        )
    return block_size
