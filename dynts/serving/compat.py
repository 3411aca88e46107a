"""The transformers versions whose continuous-batching internals :mod:`dynts.serving` was built on.

The engine's internals are private and change between minor releases (``RequestState.position_offset``,
the allocators' block tables, the batch processor's hooks), so the serving extra pins a range and
checks it at import with a clear error. :func:`missing_internals` lists what is used, so a test can
fail loudly when an upgrade removes one of them. Read in the sources of 5.24.0 and 5.25.0: 5.25 adds an
allocator for MLA layers (``MLACacheAllocator``, one latent row per token, registered under
``full_attention``), which :class:`~dynts.serving.processor.EvictingBatchProcessor` refuses, and syncs the
device where 5.24 synced the IO streams; everything listed here is the same in both.
"""

from __future__ import annotations

import inspect

import transformers
from packaging.version import Version

__all__ = ["SUPPORTED_TRANSFORMERS", "check_transformers_version", "missing_internals"]

# Inclusive lower bound, exclusive upper bound (keep in sync with the ``serve`` extra in pyproject.toml).
SUPPORTED_TRANSFORMERS = ("5.24.0", "5.26.0")


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless ``transformers`` lies in :data:`SUPPORTED_TRANSFORMERS`."""
    found = Version(version or transformers.__version__)
    low, high = (Version(v) for v in SUPPORTED_TRANSFORMERS)
    if not (low <= Version(found.base_version) < high):
        raise ImportError(
            f"dynts.serving needs transformers>={low},<{high} (its continuous-batching internals are private "
            f"and change between releases); found {found}. Install it with "
            f"`pip install 'transformers>={low},<{high}'` or `pip install 'dynts-lrm[serve]'`"
        )


def missing_internals() -> list[str]:
    """Names of the engine internals :mod:`dynts.serving` relies on that this transformers lacks."""
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import continuous_api, requests, scheduler
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    missing = []

    def need(owner, name: str, params: tuple[str, ...] = ()) -> None:
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        if not hasattr(owner, name):
            missing.append(label)
            return
        if params:
            found = inspect.signature(getattr(owner, name)).parameters
            for p in params:
                if p not in found:
                    missing.append(f"{label}({p}=...)")

    processor = continuous_api.ContinuousBatchProcessor
    need(processor, "prepare_next_batch")
    need(processor, "update_batch")
    need(processor, "reset")
    init_source = inspect.getsource(processor.__init__)
    for name in ("max_batch_tokens", "cb_config", "config", "model_dtype", "model_device"):  # size the hidden buffer
        if f"self.{name} =" not in init_source:
            missing.append(f"ContinuousBatchProcessor.{name}")
    manager = continuous_api.ContinuousBatchingManager
    need(manager, "_create_batch_processor")
    need(manager, "__init__", ("model", "generation_config", "continuous_batching_config", "workload_hints"))
    need(manager, "add_request", ("input_ids", "request_id", "max_new_tokens", "streaming", "eos_token_id"))
    need(manager, "get_result", ("request_id", "timeout"))
    need(scheduler.Scheduler, "_get_waiting_candidates")
    fields = requests.RequestState.__dataclass_fields__
    for name in ("position_offset", "initial_tokens", "generated_tokens", "request_id", "max_new_tokens"):
        if name not in fields:
            missing.append(f"RequestState.{name}")
    need(requests.FutureRequestState, "__init__", ("state", "has_new_token", "complete_blocks", "query_length"))
    alloc = full_attention.FullAttentionCacheAllocator
    need(alloc, "get_read_indices", ("request_id", "past_length", "query_length"))
    need(alloc, "register_cache_tensor")
    need(cb_cache.PagedAttentionCache, "__init__", ("config", "continuous_batching_config"))
    for name in ("cache_allocators", "pool"):
        if name not in inspect.getsource(cb_cache.PagedAttentionCache.__init__):
            missing.append(f"PagedAttentionCache.{name}")
    source = inspect.getsource(alloc.register_cache_tensor)
    if "_kv_token_views" not in source:
        missing.append("FullAttentionCacheAllocator._kv_token_views")
    io_source = inspect.getsource(continuous_api.ContinuousBatchingIOs.prepare_batch_tensors) if hasattr(
        continuous_api, "ContinuousBatchingIOs"
    ) else ""
    for name in ("requests_in_batch", "position_ids"):
        if name not in io_source:
            missing.append(f"ContinuousBatchingIOs.{name}")
    io_class = getattr(continuous_api, "ContinuousBatchingIOs", None)
    if io_class is None or "self.compute_stream =" not in inspect.getsource(io_class.__init__):
        missing.append("ContinuousBatchingIOs.compute_stream")
    return missing
