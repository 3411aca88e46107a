"""``dynts.generate_batch``: a list of prompts through continuous batching with a bounded cache per request."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import ContinuousBatchingConfig

from ..prompts import encode_prompt, pad_id  # encode_prompt re-exported: dynts.serving.batch.encode_prompt
from .manager import init_evicting_batching
from .pool import plan_pool
from ..core import EvictionSettings

__all__ = ["ServedResult", "encode_prompt", "generate_batch"]


@dataclass
class ServedResult:
    """One request's output.

    Attributes:
        request_id: the engine's id.
        prompt_ids: the prompt tokens.
        sequence: generated token ids (EOS included when emitted).
        text: ``sequence`` decoded (special tokens skipped) when a tokenizer was given.
        stats: ``peak_slots``, ``evictions``, ``evicted_tokens``, ``freed_blocks``, ``peak_blocks``,
            ``reserved_blocks``.
        error: the engine's error message, ``None`` on success.
    """

    request_id: str
    prompt_ids: list[int]
    sequence: list[int]
    text: str | None = None
    stats: dict[str, int] = field(default_factory=dict)
    error: str | None = None


def generate_batch(
    model: torch.nn.Module,
    tokenizer=None,
    prompts: Sequence[Any] = (),
    *,
    max_new_tokens: int,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    timeout: float = 600.0,
    eviction: EvictionSettings | None = None,
    **keywords: Any,
) -> list[ServedResult]:
    """Generate for every prompt with continuous batching, each request's KV cache bounded to ``budget``.

    The eviction keywords (``method``, ``budget``, ``local_window``, ``retention``, ``predictor``,
    ``think_end``, ``method_options``; or ``eviction=EvictionSettings(...)``) mean what they mean in
    :func:`dynts.generate`; each request evicts on its own, exactly as ``dynts.generate`` would on that
    prompt alone. The other ``keywords`` are ``GenerationConfig`` fields (``do_sample``,
    ``temperature``, ``top_p``, ...) overriding the model's ``generation_config``, which is followed
    otherwise (as :func:`dynts.generate` does). ``continuous_batching_config`` sizes the paged cache
    (``num_blocks``, ``page_size``, ``max_batch_tokens``); without ``num_blocks`` the pool is sized from
    the memory free on the model's device (:func:`dynts.serving.pool.plan_pool`). Returns one
    :class:`ServedResult` per prompt, in order.
    """
    sampling = keywords
    settings = EvictionSettings.resolve(eviction, sampling).check_served()
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty; pass a list of prompts")
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    for i, p in enumerate(ids):
        try:
            settings.check_prompt(len(p))
        except ValueError as err:
            raise ValueError(f"prompts[{i}]: {err}") from None
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.update(**{**sampling, "max_new_tokens": max_new_tokens})
    if tokenizer is not None and gen_config.pad_token_id is None:
        gen_config.pad_token_id = pad_id(tokenizer)
    cb_config = copy.deepcopy(continuous_batching_config) if continuous_batching_config else ContinuousBatchingConfig()
    if cb_config.num_blocks is None:
        longest = max(settings.reserved_slots(len(p), max_new_tokens) for p in ids)
        cb_config.num_blocks = plan_pool(model, settings, cb_config.page_size, sized_requests=len(ids),
                                         longest=longest).num_blocks
    manager = init_evicting_batching(
        model, settings, tokenizer=tokenizer, generation_config=gen_config, continuous_batching_config=cb_config,
    )
    outputs, request_ids = {}, []
    manager.start()
    try:
        request_ids += [manager.add_request(p, max_new_tokens=max_new_tokens) for p in ids]
        deadline = time.monotonic() + timeout
        while len(outputs) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                outputs[result.request_id] = result
            elif result is None and not manager.is_running():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"generate_batch: {len(request_ids) - len(outputs)} requests unfinished after {timeout}s")
    finally:
        manager.stop(block=True, timeout=30)
        fatal = manager.background_thread_status.fatal_error
        results = []
        for rid, prompt in zip(request_ids, ids):
            out = outputs.get(rid)
            results.append(ServedResult(
                request_id=rid,
                prompt_ids=prompt,
                sequence=list(out.generated_tokens) if out else [],
                text=tokenizer.decode(out.generated_tokens, skip_special_tokens=True) if out and tokenizer else None,
                stats=manager.request_stats(rid),
                error=(out.error if out else f"no result ({fatal or 'engine stopped'})"),
            ))
        manager.destroy()
    failed = [r for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; first: {failed[0].error}")
    return results
