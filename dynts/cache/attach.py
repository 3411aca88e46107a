"""Driving a model with a :class:`~dynts.cache.BoundedCache`: :func:`build_cache` sizes one for a model,
:func:`attach` hooks the model's forward so that every forward using the cache evicts, gets the validity
mask, records the statistics its evictor needs and (with a predictor) scores its new tokens."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

import torch

from ..attention import RECORD_CHUNK_ROWS, recording_attention
from ..compiled import scoring_slot
from ..core.budget import Budget
from ..evictors import Evictor
from ..hf_compat import cache_keyword, route_cache_keyword
from ..predictor import ImportancePredictor
from .bounded import BoundedCache
from .retire import RowRetirement
from .scores import PredictorScores

__all__ = ["attach", "build_cache"]


def build_cache(
    model: torch.nn.Module,
    evictor: Evictor,
    budget: Budget | None,
    think_end_token_id: int | Sequence[int] | None = None,
    **cache_options: Any,
) -> BoundedCache:
    """A :class:`BoundedCache` sized for ``model``."""
    cache_options.setdefault("defer_scores", True)
    config = model.config.get_text_config()
    if evictor.per_head:
        cache_options.setdefault("kv_heads", getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return BoundedCache(
        config.num_hidden_layers,
        evictor,
        budget if evictor.bounded else None,
        think_end_token_id=think_end_token_id,
        **cache_options,
    )


@contextmanager
def attach(
    model: torch.nn.Module, cache: BoundedCache, predictor: ImportancePredictor | None = None,
    retirement: RowRetirement | None = None,
) -> Iterator[BoundedCache]:
    """Drive ``model`` with ``cache`` inside the block: every forward that uses ``cache`` evicts,
    gets the validity mask, records the statistics its evictor needs, and (with ``predictor``)
    scores its new tokens from the final hidden state of the same forward. With ``retirement``
    (:class:`~dynts.cache.retire.RowRetirement`) decode steps run on the rows still generating."""

    keyword = cache_keyword(model)

    def before(module, args, kwargs):
        used = kwargs.get("cache", kwargs.get("past_key_values"))
        if used is not cache:
            return None
        route_cache_keyword(kwargs, keyword)  # `cache=` also reaches a model that takes `past_key_values`
        if retirement is not None:
            kwargs = retirement.before(cache, kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        mask = cache.begin_forward(ids, kwargs.get("attention_mask"), ref.shape[0], ref.shape[1], ref.device)
        kwargs["attention_mask"] = mask
        return args, kwargs

    def after(module, args, kwargs, output):
        if kwargs.get("cache", kwargs.get("past_key_values")) is cache:
            cache.end_forward()
            if retirement is not None:
                return retirement.after(output)
        return None

    if retirement is not None and cache.static:
        raise ValueError("finished rows cannot leave a static-layout cache (compile=True): pass retire_finished=False")
    if predictor is not None and cache.per_head:
        raise ValueError(f"method={cache.evictor.name!r} with per_head=True reads no predictor scores; pass predictor=None")
    if "scores" in cache.requires and predictor is None:
        raise ValueError(f"method={cache.evictor.name!r} needs predictor=... (an ImportancePredictor or its directory)")
    with ExitStack() as stack:
        handles = [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True),
        ]
        if predictor is not None:
            cache.scorer = PredictorScores(predictor, cache.defer_scores)
            slot = scoring_slot(model)
            outer, slot[0] = slot[0], cache
            stack.callback(slot.__setitem__, 0, outer)
            stack.callback(cache.flush_scores)
        stack.callback(lambda: [h.remove() for h in handles])
        if cache.requires & {"attention", "window_attention"}:
            # H2O sums every query row; the window statistics only need the last rows of a forward
            rows = None if "attention" in cache.requires else cache.observation_window
            stack.enter_context(recording_attention(
                model, lambda module, probs, first_row: cache.record_attention(probs, first_row, module.layer_idx if cache.per_head else 0),
                last_rows=rows, chunk_rows=RECORD_CHUNK_ROWS,
            ))
        yield cache
