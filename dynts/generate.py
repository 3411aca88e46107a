"""``dynts.generate``: Hugging Face ``generate`` with a bounded, evicting KV cache."""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .attention import RECORD_CHUNK_ROWS, recording_attention
from .budget import Budget
from .cache import BoundedCache
from .compiled import compiled_decode, scoring_slot
from .evictors import Evictor, make_evictor
from .hf_compat import cache_keyword, route_cache_keyword
from .predictor import BaseModelFingerprint, ImportancePredictor, final_norm, find_predictor  # final_norm re-exported
from .prompts import encode_prompt, pad_rows, pad_id
from .thinking import think_end_ids

__all__ = ["GenerationResult", "attach", "build_cache", "encode_prompts", "final_norm", "generate", "load_predictor"]


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


def load_predictor(
    predictor: ImportancePredictor | str | Path,
    model: torch.nn.Module | Any,
    *,
    strict: bool = True,
    final_norm_weight: torch.Tensor | None = None,
    name_or_path: str | None = None,
    search_dirs: Sequence[str | Path] | None = None,
) -> ImportancePredictor:
    """Load a predictor for ``model``, check it was trained on that model, and place it.

    Args:
        predictor: an :class:`ImportancePredictor`, its directory, or ``"auto"``
            (:func:`dynts.predictor.find_predictor`: ``dynts-predictor-<model basename>`` in
            ``search_dirs``, ``$DYNTS_PREDICTOR_PATH``, the shipped checkpoints or the HF cache).
        model: the Hugging Face model, or only its config (``PretrainedConfig``) where no model
            object exists (vLLM); then pass ``final_norm_weight`` too.
        strict: a predictor of another base model raises ``ValueError``; ``False`` warns instead.
        final_norm_weight: with a config: the final norm's weight ``[d]`` (its hash identifies
            the model; the predictor moves to its device).
        name_or_path: the model's name for messages and ``"auto"`` (default: the config's).
        search_dirs: extra directories for ``"auto"``.

    Returns the predictor in eval mode on the final norm's device (a sharded model's last stage).
    """
    if isinstance(model, torch.nn.Module):
        fingerprint = BaseModelFingerprint.from_model(model, name_or_path)
        param = next(final_norm(model).parameters(), None)
        device = param.device if param is not None else next(model.parameters()).device
    else:
        fingerprint = BaseModelFingerprint.from_config(model, final_norm_weight, name_or_path)
        device = final_norm_weight.device if final_norm_weight is not None else None
    if isinstance(predictor, str) and predictor == "auto":
        predictor = find_predictor(fingerprint, search_dirs)
    if isinstance(predictor, (str, Path)):
        path, predictor = predictor, ImportancePredictor.from_pretrained(predictor)
        if predictor.config.base_model is None:
            warnings.warn(
                f"predictor {str(path)!r} records no base model (its config has no base_model): only its hidden "
                "size is checked; add one with `python -m trainers.predictor_card --predictor DIR --backbone MODEL`",
                stacklevel=2,
            )
    if not isinstance(predictor, ImportancePredictor):
        raise ValueError(f"predictor must be an ImportancePredictor, a directory or 'auto', got {type(predictor).__name__}")
    predictor.check_base_model(fingerprint, strict=strict)
    return (predictor.to(device) if device is not None else predictor).eval()


def build_cache(
    model: torch.nn.Module,
    evictor: Evictor,
    budget: Budget | None,
    think_end_token_id: int | Sequence[int] | None = None,
    **cache_options: Any,
) -> BoundedCache:
    """A :class:`BoundedCache` sized for ``model``."""
    cache_options.setdefault("defer_scores", True)
    return BoundedCache(
        model.config.get_text_config().num_hidden_layers,
        evictor,
        budget if getattr(evictor, "bounded", True) else None,
        think_end_token_id=think_end_token_id,
        **cache_options,
    )


@contextmanager
def attach(
    model: torch.nn.Module, cache: BoundedCache, predictor: ImportancePredictor | None = None
) -> Iterator[BoundedCache]:
    """Drive ``model`` with ``cache`` inside the block: every forward that uses ``cache`` evicts,
    gets the validity mask, records the statistics its evictor needs, and (with ``predictor``)
    scores its new tokens from the final hidden state of the same forward."""

    keyword = cache_keyword(model)

    def before(module, args, kwargs):
        used = kwargs.get("cache", kwargs.get("past_key_values"))
        if used is not cache:
            return None
        route_cache_keyword(kwargs, keyword)  # `cache=` also reaches a model that takes `past_key_values`
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        mask = cache.begin_forward(ids, kwargs.get("attention_mask"), ref.shape[0], ref.shape[1], ref.device)
        kwargs["attention_mask"] = mask
        return args, kwargs

    def after(module, args, kwargs, output):
        if kwargs.get("cache", kwargs.get("past_key_values")) is cache:
            cache.end_forward()

    if "scores" in cache.requires and predictor is None:
        raise ValueError(f"method={cache.evictor.name!r} needs predictor=... (an ImportancePredictor or its directory)")
    with ExitStack() as stack:
        handles = [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True),
        ]
        if predictor is not None:
            cache.predictor = predictor
            cache.predictor_device = next(predictor.parameters()).device
            slot = scoring_slot(model)
            outer, slot[0] = slot[0], cache
            stack.callback(slot.__setitem__, 0, outer)
            stack.callback(cache.flush_scores)
        stack.callback(lambda: [h.remove() for h in handles])
        if cache.requires & {"attention", "window_attention"}:
            # H2O sums every query row; the window statistics only need the last rows of a forward
            rows = None if "attention" in cache.requires else cache.observation_window
            stack.enter_context(recording_attention(
                model, lambda module, probs, first_row: cache.record_attention(probs, first_row),
                last_rows=rows, chunk_rows=RECORD_CHUNK_ROWS,
            ))
        yield cache


def encode_prompts(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids for raw strings (tokenizer's special tokens added) or chats (template applied)."""
    if tokenizer is None:
        raise ValueError("prompts=... needs tokenizer=...; or pass input_ids=... instead")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty; pass a string or a non-empty list")
    chats = [not isinstance(p, str) for p in prompts]
    if any(chats) and not all(chats):
        raise ValueError("prompts mixes strings and chat message lists; pass one kind per call")
    return pad_rows([encode_prompt(tokenizer, p) for p in prompts], pad_id(tokenizer))


def generate(
    model: torch.nn.Module,
    tokenizer=None,
    prompts: str | Sequence[str] | Sequence[Sequence[dict]] | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    method: str | Evictor = "dynts",
    budget: int | Budget | None = None,
    local_window: int | None = None,
    retention: float = 0.4,
    predictor: ImportancePredictor | str | Path | None = None,
    max_new_tokens: int,
    think_end: str | int | Sequence[int] | None = "</think>",
    method_options: dict[str, Any] | None = None,
    compile: bool | str = False,
    **generate_kwargs: Any,
) -> GenerationResult:
    """Generate with a KV cache bounded to ``budget`` entries, evicting with ``method``.

    Args:
        model: a Hugging Face causal LM (Llama, Qwen2, Qwen3, ... families).
        tokenizer: needed with ``prompts`` and for ``texts``.
        prompts: a string, a list of strings (left-padded batch), or chat message lists (the
            chat template is applied).
        input_ids / attention_mask: pre-tokenised ``[b, M]`` input instead of ``prompts``.
        method: a name from :func:`dynts.available_methods` or an :class:`Evictor`.
        budget: ``B``, the most KV entries held (not needed for ``full``), or a :class:`Budget`
            (then ``local_window`` and ``retention`` come from it; e.g. ``sizing="official"``).
        local_window: ``W_l`` recent tokens always kept.
        retention: fraction of the selection window kept at each eviction event.
        predictor: :class:`ImportancePredictor`, its directory or ``"auto"`` (required by
            ``dynts``); it must have been trained on ``model`` (:func:`load_predictor`).
        max_new_tokens: generation length cap.
        think_end: the delimiter closing the thinking segment: text (encoded with ``tokenizer``; it
            may span several tokens), a token id or a sequence of ids; the delimiter and the tokens
            after it are answer tokens. ``None``: no answer detection. A text delimiter without a
            tokenizer, or one the tokenizer cannot encode, warns that detection is off.
        method_options: fields of the method's dataclass (e.g. ``{"sink_size": 4}``).
        compile: ``True`` (or a ``torch.compile`` mode) decodes with a static-layout cache and a
            compiled decode step (:mod:`dynts.compiled`); the first steps pay the compilation.
        **generate_kwargs: passed to ``model.generate`` (``do_sample``, ``temperature``, ...).
            Sampling follows ``model.generation_config`` (e.g. an R1 model's T=0.6, top-p 0.95)
            unless given here; pass ``do_sample=False`` for greedy decoding.
    """
    evictor = make_evictor(method, **(method_options or {}))
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
    bounds = None
    if getattr(evictor, "bounded", True):
        if isinstance(budget, Budget):  # a full Budget (e.g. sizing="official"); local_window/retention unused
            bounds = budget
        elif budget is None or local_window is None:
            raise ValueError(f"method={evictor.name!r} needs budget=... and local_window=... (e.g. 1024 and 128)")
        else:
            bounds = Budget(budget, local_window, retention)
        bounds.check_question(prompt_length)
    if "scores" in evictor.requires:
        if predictor is None:
            raise ValueError(f"method={evictor.name!r} needs predictor=... (an ImportancePredictor or its directory)")
        predictor = load_predictor(predictor, model)
    elif predictor is not None:
        predictor = None  # only score-based methods use it; skip the per-token MLP
    static = {"static": True, "max_length": prompt_length + max_new_tokens} if compile else {}
    cache = build_cache(model, evictor, bounds, think_end_ids(tokenizer, think_end), **static)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if tokenizer is not None and generate_kwargs.get("pad_token_id") is None:
        generate_kwargs["pad_token_id"] = pad_id(tokenizer)
    cache_kw = cache_keyword(model)  # generate validates its keywords against forward's (hf_compat)
    start = time.perf_counter()
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(attach(model, cache, predictor))
        if compile:
            stack.enter_context(compiled_decode(model, None if compile is True else compile))
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            **{cache_kw: cache},
            **generate_kwargs,
        )
    seconds = time.perf_counter() - start
    sequences = out[:, prompt_length:]
    lengths = _generated_lengths(sequences, model.generation_config.eos_token_id, generate_kwargs)
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
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else float("inf"),
        "peak_kv_bytes": cache.stats.peak_kv_bytes,
        "allocated_kv_bytes": cache.allocated_kv_bytes,
    }
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=True) if tokenizer is not None else None
    return GenerationResult(sequences=sequences, texts=texts, stats=stats, cache=cache)


def _generated_lengths(sequences: torch.Tensor, default_eos, generate_kwargs: dict) -> list[int]:
    """Tokens generated per row, up to and including the first EOS."""
    eos = generate_kwargs.get("eos_token_id", default_eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids:
        return [sequences.shape[1]] * sequences.shape[0]
    is_eos = torch.isin(sequences, torch.tensor(eos_ids, device=sequences.device))
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], sequences.shape[1], dtype=torch.long))
    return first.tolist()
