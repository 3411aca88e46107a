"""SepLLM (Chen et al., ICML 2025, arXiv:2412.12094): a segment's information is condensed into the
separator that closes it, so the cache keeps attention sinks, separators and neighbouring tokens.

As the DynTS paper sets it up for comparison (C.3): separators are preserved and the *earliest*
generated non-separator tokens are evicted until the cache holds the ``n_keep`` entries every method
keeps. Priority, highest first: sinks (the first ``sink_size`` real tokens), the local window and (by
default) the prompt are protected; then separators, most recent first; then the other tokens, most
recent first. Separators only go, oldest first, when they alone would overflow ``n_keep``.

Separators are token ids. :func:`separator_ids` finds them in a vocabulary (every token whose text is
or ends with one of SepLLM's separators), and :func:`dynts.generate` fills them in from its tokenizer
through :meth:`SepLLM.bind`, so ``method="sepllm"`` needs no manual ids.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from .base import Evictor, Segment, TokenInfo, first_valid_mask, keep_top, recent_mask, register
from .options import check_flag

# SepLLM's separators (its code also lists " " and "\t"; add them through ``separators`` if wanted).
SEPARATORS: tuple[str, ...] = (".", ",", "?", "!", ";", ":", "\n")

_CACHE: "weakref.WeakKeyDictionary[object, dict[tuple[str, ...], tuple[int, ...]]]" = weakref.WeakKeyDictionary()


def _check_separators(separators: object) -> tuple[str, ...]:
    if isinstance(separators, str) or not isinstance(separators, Sequence) or not separators:
        raise ValueError(f"separators={separators!r} must be a non-empty list of strings such as ('.', ',', '\\n')")
    if not all(isinstance(s, str) and s for s in separators):
        raise ValueError(f"separators={separators!r} must contain only non-empty strings")
    return tuple(separators)


def separator_ids(tokenizer, separators: Sequence[str] = SEPARATORS) -> tuple[int, ...]:
    """Ids of every vocabulary token whose decoded text is or ends with one of ``separators``.

    Special tokens are skipped. Byte-level BPE vocabularies hold many such tokens (``"."``, ``" ."``,
    ``").\\n"``, ``"..."``, ...; 266 in SmolLM2's). The scan (~0.7 s for 49k tokens) is cached per
    tokenizer object.
    """
    separators = _check_separators(separators)
    try:
        memo = _CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable / hashable: no caching
        memo = {}
    if separators not in memo:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        found = tuple(i for i, text in zip(ids, texts) if text.endswith(separators))
        if not found:
            raise ValueError(f"no token of this tokenizer decodes to one of separators={separators!r}")
        memo[separators] = found
    return memo[separators]


@register("sepllm")
@dataclass
class SepLLM(Evictor):
    """Keep sinks + separators + the local window (+ the prompt); evict the oldest other tokens first.

    Args:
        separator_token_ids: the separator ids; ``None`` = found from the tokenizer by :meth:`bind`
            (``dynts.generate`` calls it) or :meth:`from_tokenizer`.
        separators: separator strings used to find the ids (default: SepLLM's punctuation + newline).
        sink_size: initial "attention sink" tokens kept (SepLLM: 4).
        keep_question: protect the prompt; on by default since C.3 evicts the earliest *generated*
            non-separator tokens.
    """

    separator_token_ids: tuple[int, ...] | None = None
    separators: tuple[str, ...] = SEPARATORS
    sink_size: int = 4
    keep_question: bool = True

    def __post_init__(self) -> None:
        self.separators = _check_separators(self.separators)
        if self.separator_token_ids is not None:
            ids = self.separator_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
                raise ValueError(
                    f"separator_token_ids={ids!r} must be a non-empty list of token ids "
                    "(or None to find them from the tokenizer)"
                )
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ValueError(f"separator_token_ids={ids!r} must contain only ints >= 0")
            self.separator_token_ids = tuple(sorted(set(ids)))
        if not isinstance(self.sink_size, int) or isinstance(self.sink_size, bool) or self.sink_size < 0:
            raise ValueError(f"sink_size={self.sink_size!r} must be an int >= 0 (SepLLM uses 4)")
        check_flag("keep_question", self.keep_question)

    @classmethod
    def from_tokenizer(cls, tokenizer, separators: Sequence[str] = SEPARATORS, **options) -> "SepLLM":
        """A SepLLM whose separator ids are those of ``tokenizer`` (see :func:`separator_ids`)."""
        return cls(separator_token_ids=separator_ids(tokenizer, separators), separators=tuple(separators), **options)

    def bind(self, tokenizer) -> None:
        if self.separator_token_ids is None:
            self.separator_token_ids = separator_ids(tokenizer, self.separators)

    def protected_prefix(self, question_length: int) -> int:
        return question_length if self.keep_question else min(self.sink_size, question_length)

    def constants(self) -> dict[str, tuple[int, ...]]:
        return {} if self.separator_token_ids is None else {"separators": tuple(self.separator_token_ids)}

    def select(self, info: TokenInfo) -> torch.Tensor:
        if self.separator_token_ids is None:
            raise ValueError(
                "method='sepllm' has no separator ids: pass tokenizer=... to dynts.generate, build it with "
                "SepLLM.from_tokenizer(tokenizer), or set method_options={'separator_token_ids': [...]}"
            )
        n = info.shape[1]
        ids = self.constant("separators", info.token_ids.device)
        is_separator = torch.isin(info.token_ids, ids)
        recency = torch.arange(n, device=info.positions.device).float().expand(info.shape)
        priority = torch.where(is_separator, recency + n, recency)  # any separator outranks any other token
        protected = first_valid_mask(info, self.sink_size) | recent_mask(info, info.local_window)
        if self.keep_question:
            protected = protected | (info.segments == Segment.QUESTION)
        return keep_top(priority.masked_fill(protected, float("inf")), info)
