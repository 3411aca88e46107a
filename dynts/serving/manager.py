"""The continuous-batching manager with eviction: requests arriving over time, results with statistics.

:class:`EvictingBatchingManager` is transformers' ``ContinuousBatchingManager`` whose batch processor
is an :class:`~dynts.serving.processor.EvictingBatchProcessor`. Use it like the stock manager
(``start`` / ``add_request`` / ``get_result`` / ``stop``); :func:`init_evicting_batching` builds one
for a model. DynTS scores come from a forward hook on the model's final norm: it copies the packed
batch's hidden states ``[1, T, h]`` into the processor's static buffer, and the predictor scores them
after the forward, one score per new token. Nothing in the forward depends on the batch's slots, so the
engine's CUDA graphs stay on (:func:`engine_config`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from ..predictor import final_norm
from ..thinking import think_end_ids
from .admission import isolate_failure
from .processor import EvictingBatchProcessor
from .sampling import PerRequestSampler, SamplingParams, neutral_generation_config
from ..core import EvictionSettings

__all__ = ["EvictingBatchingManager", "check_model", "engine_config", "init_evicting_batching"]


def check_model(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` for models whose layers are not all full attention with per-head K/V (no MLA)."""
    text_config = model.config.get_text_config()
    groups = group_layers_by_attn_type(text_config)
    other = sorted(set(groups) - {"full_attention"})
    if other:
        raise ValueError(
            f"dynts serving supports full-attention models only; this model has {other} layers (the engine's "
            "sliding-window allocator is a ring buffer that never frees blocks early); use dynts.generate instead"
        )
    if getattr(text_config, "kv_lora_rank", None) is not None:  # the engine's own test for MLA layers
        raise ValueError(
            "dynts serving evicts per-head keys and values; this model's layers are multi-head latent attention "
            "(transformers 5.25's engine caches one compressed latent row per token for them, MLACacheAllocator)"
        )


class EvictingBatchingManager(ContinuousBatchingManager):
    """``ContinuousBatchingManager`` whose requests each hold at most ``budget`` KV entries.

    Build it with :func:`init_evicting_batching`. Extra over the stock manager: :meth:`add_request`
    checks the prompt against the budget (``ValueError``), :meth:`request_stats` returns a finished
    request's ``peak_slots``, ``evictions``, ``evicted_tokens``, ``freed_blocks``, ``peak_blocks``.
    """

    eviction: EvictionSettings
    think_end_ids: tuple[int, ...] | None
    predictor: torch.nn.Module | None
    # per-request sampling (init_evicting_batching(per_request_sampling=True)): request id -> parameters
    sampling: dict[str, SamplingParams] | None = None
    default_sampling: SamplingParams | None = None
    isolate_errors: bool = True

    def _create_batch_processor(self):
        self.continuous_batching_config.use_async_batching = False
        if self.eviction.bounded:
            self.continuous_batching_config.allow_block_sharing = False
        processor = super()._create_batch_processor()
        if not isinstance(processor, EvictingBatchProcessor):
            processor.__class__ = EvictingBatchProcessor
            processor.attach_eviction(self.eviction, self.think_end_ids, self.finished_stats)
            if self.sampling is not None:
                processor.attach_sampler(PerRequestSampler(self.sampling.get, self.default_sampling))
            if self.predictor is not None:
                processor.attach_predictor(self.predictor)
        self.last_processor = processor
        return processor

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    sampling: SamplingParams | None = None, **kwargs: Any) -> str | None:
        """The stock ``add_request``; ``sampling``: this request's own parameters (needs
        ``init_evicting_batching(per_request_sampling=True)``)."""
        self.eviction.check_prompt(len(input_ids))
        limit = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_new_tokens={limit!r} must be a positive int")
        if sampling is not None:
            if self.sampling is None:
                raise ValueError("sampling=... needs a manager built with init_evicting_batching(per_request_sampling=True)")
            if request_id is None:
                with self._request_lock:
                    request_id = f"req_{self._request_counter}"
                    self._request_counter += 1
            self.sampling[request_id] = sampling
        return super().add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **kwargs)

    def release(self, request_id: str) -> None:
        """Forget a delivered request's sampling parameters and statistics (a long-running server calls this)."""
        if self.sampling is not None:
            self.sampling.pop(request_id, None)
        self.finished_stats.pop(request_id, None)

    def _generation_loop_body(self, batch_processor, bootstrapping: bool) -> bool:
        """The stock loop body; an exception fails only the requests it belongs to
        (:func:`~dynts.serving.admission.isolate_failure`) and the loop goes on."""
        try:
            return super()._generation_loop_body(batch_processor, bootstrapping)
        except Exception as error:
            if not self.isolate_errors or not isinstance(batch_processor, EvictingBatchProcessor):
                raise
            isolate_failure(batch_processor, error)
            return True

    def request_stats(self, request_id: str) -> dict[str, int]:
        """A request's statistics (final once its result is delivered; empty if unknown)."""
        processor = self.last_processor
        if processor is not None:
            return processor.request_stats(request_id)
        return dict(self.finished_stats.get(request_id, {}))

    def engine_stats(self) -> dict[str, Any]:
        """Pool-level statistics: ``preemptions``, ``peak_blocks_in_use``, ``blocks_in_use``, ``num_blocks``."""
        p = self.last_processor
        if p is None:
            return {}
        # block_trace rows: (seconds since the engine started, blocks in use, requests in flight)
        return p.policy.engine_stats(blocks_in_use=p.blocks_in_use(), free_blocks=p.free_blocks_in_pool(),
                                     num_blocks=p.cache.num_blocks)

    def _stash_hidden(self, module, args, output) -> None:
        """Forward hook on the final norm: copy its output into the processor's static buffer (captured
        into the engine's CUDA graphs; the predictor runs after the forward, in ``update_batch``)."""
        processor = self.last_processor
        if isinstance(processor, EvictingBatchProcessor) and processor.hidden_buffer is not None:
            processor.stash_hidden(output[0] if isinstance(output, tuple) else output)

    def destroy(self) -> None:
        hook = getattr(self, "_score_hook", None)
        if hook is not None:
            hook.remove()
            self._score_hook = None
        super().destroy()


def init_evicting_batching(
    model: torch.nn.Module,
    settings: EvictionSettings,
    *,
    tokenizer=None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    per_request_sampling: bool = False,
) -> EvictingBatchingManager:
    """Build (not start) an :class:`EvictingBatchingManager` for ``model``.

    ``per_request_sampling``: each request decodes with the :class:`~dynts.serving.sampling.SamplingParams`
    given to ``add_request(sampling=...)`` (default: the generation config's own sampling) instead of the
    engine's one batch-wide mode; the engine then runs without CUDA graphs (:func:`engine_config` says why).

    ``continuous_batching_config`` sizes the paged cache (``num_blocks``, ``page_size``,
    ``max_batch_tokens``; set them on CPU). Async batching and (when evicting) prefix block
    sharing are switched off: both assume a request's cache only grows.
    """
    check_model(model)
    if not isinstance(settings, EvictionSettings):
        raise ValueError(f"settings must be an EvictionSettings, got {type(settings).__name__}")
    settings.check_served()
    if tokenizer is not None:
        settings.evictor.bind(tokenizer)
    cb_config = engine_config(continuous_batching_config, settings, per_request_sampling)
    gen_config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if gen_config.eos_token_id is None:
        gen_config.eos_token_id = -1
    default_sampling = None
    if per_request_sampling:
        default_sampling = SamplingParams.from_generation_config(gen_config)
        gen_config = neutral_generation_config(gen_config)
    manager = EvictingBatchingManager(model=model, generation_config=gen_config, continuous_batching_config=cb_config)
    manager.eviction = settings
    manager.think_end_ids = think_end_ids(tokenizer, settings.think_end)
    manager.predictor = None
    manager._score_hook = None
    manager.finished_stats = {}
    manager.last_processor = None
    manager.sampling = {} if per_request_sampling else None
    manager.default_sampling = default_sampling
    if settings.needs_scores:
        manager.predictor = settings.load_predictor(model)
        manager._score_hook = final_norm(model).register_forward_hook(manager._stash_hidden)
    return manager


def engine_config(config: ContinuousBatchingConfig | None, settings: EvictionSettings,
                  per_request_sampling: bool) -> ContinuousBatchingConfig:
    """The engine's configuration for ``settings`` (a copy of ``config``; the caller's is left as it was).

    Off: async batching (it prepares batch N+1 before N's eviction) and, when evicting, prefix block
    sharing (it assumes a request's cache only grows). CUDA graphs stay as configured (``None``: the
    engine decides), DynTS included (its forward only fills a static buffer), except with
    ``per_request_sampling``: :class:`~dynts.serving.sampling.PerRequestSampler` replaces the sampling
    step inside the captured forward and decides on the host which rows are greedy, seeded or penalised
    (Python lists rebuilt every batch, one ``torch.Generator`` per seeded request); a replay would
    repeat the first capture's rows and generators, so that step runs eagerly."""
    cb_config = copy.deepcopy(config) if config is not None else ContinuousBatchingConfig()
    cb_config.use_async_batching = False
    if settings.bounded:
        cb_config.allow_block_sharing = False
    if per_request_sampling:
        cb_config.use_cuda_graph = False
    return cb_config
