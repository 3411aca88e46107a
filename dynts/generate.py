"""``dynts.generate``: Hugging Face ``generate`` with a bounded, evicting KV cache."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .cache import BoundedCache, RowRetirement, attach, build_cache
from .compiled import compiled_decode
from .core.settings import EvictionSettings
from .hf_compat import cache_keyword
from .prompts import encode_prompts, pad_id
from .thinking import think_end_ids

__all__ = ["GenerationResult", "generate"]


@dataclass
class GenerationResult:
    """Output of :func:`generate`.

    Attributes:
        sequences: ``[b, new]`` generated token ids (prompt excluded; finished rows padded).
        texts: decoded ``sequences`` (when a tokenizer was given), special tokens skipped.
        stats: ``peak_cache_tokens``, ``evictions``, ``new_tokens``, ``seconds``,
            ``tokens_per_second``, ``peak_kv_bytes`` and more (see :func:`generate`).
        cache: the cache after decoding, for inspection.
    """

    sequences: torch.Tensor
    texts: list[str] | None
    stats: dict[str, Any]
    cache: BoundedCache | None = field(default=None, repr=False)


def generate(
    model: torch.nn.Module,
    tokenizer=None,
    prompts: str | Sequence[str] | Sequence[Sequence[dict]] | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int,
    compile: bool | str = False,
    eviction: EvictionSettings | None = None,
    retire_finished: bool | RowRetirement = False,
    **keywords: Any,
) -> GenerationResult:
    """Generate with a KV cache bounded to ``budget`` entries, evicting with ``method``.

    Args:
        model: a Hugging Face causal LM (Llama, Qwen2, Qwen3, ... families).
        tokenizer: needed with ``prompts`` and for ``texts``.
        prompts: a string, a list of strings (left-padded batch), or chat message lists (the
            chat template is applied).
        input_ids / attention_mask: pre-tokenised ``[b, M]`` input instead of ``prompts``.
        max_new_tokens: generation length cap.
        compile: ``True`` (or a ``torch.compile`` mode) decodes with a static-layout cache and a
            compiled decode step (:mod:`dynts.compiled`); the first steps pay the compilation.
        eviction: an :class:`~dynts.core.EvictionSettings`, instead of the eviction keywords below.
        retire_finished: decode steps run on the rows that have not emitted EOS yet (a batch of traces of
            different lengths stops paying for its finished rows), with the same sequences
            (:mod:`dynts.cache.retire`); ``result.cache`` then holds the rows running at the end. A
            :class:`~dynts.cache.RowRetirement` (unused) gives its settings. Not with ``compile``.
        **keywords: the eviction keywords (:class:`~dynts.core.EvictionSettings`):

            - ``method``: a name from :func:`dynts.available_methods` or an :class:`Evictor` (default ``"dynts"``);
            - ``budget``: ``B``, the most KV entries held (not needed for ``full``), or a :class:`Budget`
              (then ``local_window`` and ``retention`` come from it; e.g. ``sizing="official"``);
            - ``local_window``: ``W_l`` recent tokens always kept;
            - ``retention``: fraction of the selection window kept at each eviction event (default 0.4);
            - ``predictor``: :class:`ImportancePredictor`, its directory or ``"auto"`` (required by
              ``dynts``); it must have been trained on ``model`` (:func:`dynts.predictor.load_predictor`);
            - ``think_end``: the delimiter closing the thinking segment (default ``"</think>"``): text
              (encoded with ``tokenizer``; it may span several tokens), a token id or a sequence of ids;
              the delimiter and the tokens after it are answer tokens. ``None``: no answer detection. A
              text delimiter without a tokenizer, or one the tokenizer cannot encode, warns that
              detection is off;
            - ``method_options``: fields of the method's dataclass (e.g. ``{"sink_size": 4}``);

            every other keyword goes to ``model.generate`` (``do_sample``, ``temperature``, ...).
            Sampling follows ``model.generation_config`` (e.g. an R1 model's T=0.6, top-p 0.95)
            unless given here; pass ``do_sample=False`` for greedy decoding.
    """
    settings = EvictionSettings.resolve(eviction, keywords)  # what remains goes to model.generate
    evictor = settings.evictor
    if tokenizer is not None:
        evictor.bind(tokenizer)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if input_ids is None:
        if prompts is None:
            raise ValueError("pass prompts=... (with tokenizer=...) or input_ids=...")
        input_ids, attention_mask = encode_prompts(tokenizer, prompts)
    elif input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    config = model.config.get_text_config()
    max_positions = getattr(config, "max_position_embeddings", None)
    prompt_length = input_ids.shape[1]
    if max_positions and prompt_length > max_positions:
        raise ValueError(
            f"prompts are {prompt_length} tokens but the model accepts at most {max_positions} "
            "(max_position_embeddings); shorten the prompts"
        )
    bounds = settings.bounds
    if bounds is not None:
        bounds.check_question(prompt_length)
    predictor = settings.load_predictor(model)  # only score-based methods get one: no per-token MLP otherwise
    static = {"static": True, "max_length": prompt_length + max_new_tokens} if compile else {}
    if retire_finished and compile:
        raise ValueError("retire_finished=True needs compile=False (a compiled decode keeps every row in its fixed-shape step)")
    eos_ids = _eos_ids(keywords.get("eos_token_id", model.generation_config.eos_token_id))
    retirement = None
    if isinstance(retire_finished, RowRetirement):
        retirement = retire_finished
    elif retire_finished and eos_ids and input_ids.shape[0] > 1:
        retirement = RowRetirement(eos_ids)
    cache = build_cache(model, evictor, bounds, think_end_ids(tokenizer, settings.think_end), **static)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if tokenizer is not None and keywords.get("pad_token_id") is None:
        keywords["pad_token_id"] = pad_id(tokenizer)
    cache_kw = cache_keyword(model)  # generate validates its keywords against forward's (hf_compat)
    start = time.perf_counter()
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(attach(model, cache, predictor, retirement))
        if compile:
            stack.enter_context(compiled_decode(model, None if compile is True else compile))
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            **{cache_kw: cache},
            **keywords,
        )
    seconds = time.perf_counter() - start
    sequences = out[:, prompt_length:]
    lengths, finished = _generated_lengths(sequences, eos_ids)
    new_tokens = int(sum(lengths))
    stats = {
        "method": evictor.name,
        "budget": bounds.budget if bounds else None,
        "n_keep": cache.n_keep,
        "peak_cache_tokens": cache.stats.peak_cache_tokens,
        "evictions": cache.stats.evictions,
        "evicted_tokens": cache.stats.evicted_tokens,
        "new_tokens": new_tokens,
        "lengths": lengths,
        "finished": finished,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
        "peak_kv_bytes": cache.stats.peak_kv_bytes,
        "allocated_kv_bytes": cache.allocated_kv_bytes,
        "retired_rows": retirement.retired if retirement is not None else 0,
    }
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=True) if tokenizer is not None else None
    return GenerationResult(sequences=sequences, texts=texts, stats=stats, cache=cache)


def _eos_ids(eos: int | Sequence[int] | None) -> list[int]:
    """The EOS ids as a list (``generate``'s ``eos_token_id`` keyword, else the model's generation config)."""
    return [eos] if isinstance(eos, int) else list(eos or [])


def _generated_lengths(sequences: torch.Tensor, eos_ids: list[int]) -> tuple[list[int], list[bool]]:
    """Tokens generated per row, up to and including the first EOS, and whether the row emitted one."""
    if not eos_ids:
        return [sequences.shape[1]] * sequences.shape[0], [False] * sequences.shape[0]
    is_eos = torch.isin(sequences, torch.tensor(eos_ids, device=sequences.device))
    done = is_eos.any(1)
    first = torch.where(done, is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], sequences.shape[1], dtype=torch.long))
    return first.tolist(), done.tolist()
