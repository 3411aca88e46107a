"""The thinking delimiter (``</think>``): from a string to its token ids, and a per-row matcher that
finds it in a stream of generated tokens even when the tokenizer splits it into several tokens.

Reasoning models (DeepSeek-R1 distills, Qwen3, QwQ) close their reasoning with ``</think>`` and then
write the answer. The cache labels every generated token :attr:`~dynts.evictors.Segment.THINKING`
until the row has emitted the whole delimiter, and :attr:`~dynts.evictors.Segment.ANSWER` from the
delimiter's first token on (the delimiter itself counts as answer). Tokenizers that know
``</think>`` as one token give a one-id delimiter; others (SmolLM2, a word-level tokenizer without
the tag) give several ids, matched here as a sequence with a Knuth-Morris-Pratt automaton whose
state is one integer per row, so a delimiter split across decode steps is found, rows are
independent, and nothing is read back to the host.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

__all__ = ["DelimiterMatcher", "think_end_ids"]


def _detection_off(think_end: Any, why: str) -> None:
    # Python's default warning filter shows a given message once per process.
    warnings.warn(
        f"answer detection is off: think_end={think_end!r} {why}; every generated token counts as thinking "
        "(DynTS will not protect the answer). Pass tokenizer=... or think_end as token id(s).",
        UserWarning,
        stacklevel=3,
    )


def think_end_ids(tokenizer: Any, think_end: str | int | Sequence[int] | None) -> tuple[int, ...] | None:
    """The token ids of the thinking delimiter, or ``None`` when answer detection is off.

    Args:
        tokenizer: a Hugging Face tokenizer (may be ``None`` when ``think_end`` is given as ids).
        think_end: the delimiter text (``"</think>"``), one token id, a sequence of ids, or ``None``
            (no thinking segment: every generated token is thinking; no warning).

    A text delimiter is encoded without special tokens; it may yield several ids. When the text
    cannot be turned into ids (no tokenizer, an empty encoding, or unknown-token ids) a
    ``UserWarning`` says that answer detection is off, and ``None`` is returned.
    """
    if think_end is None:
        return None
    if isinstance(think_end, bool):
        raise ValueError(f"think_end={think_end!r} must be a string, a token id, a sequence of ids or None")
    if isinstance(think_end, int):
        think_end = (think_end,)
    if not isinstance(think_end, str):
        ids = tuple(think_end)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"think_end={think_end!r} must hold non-negative token ids, e.g. (151649,)")
        return ids
    if not think_end:
        _detection_off(think_end, "is empty")
        return None
    if tokenizer is None:
        _detection_off(think_end, "is text but no tokenizer was given")
        return None
    ids = tuple(tokenizer.encode(think_end, add_special_tokens=False))
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids:
        _detection_off(think_end, "encodes to no tokens")
        return None
    if unk is not None and unk in ids:
        _detection_off(think_end, f"encodes to the unknown token ({ids})")
        return None
    return ids


class DelimiterMatcher:
    """Finds a delimiter's id sequence in batched token streams, one automaton state per row.

    Args:
        ids: the delimiter's token ids (``m >= 1``).

    The state of a row is the length of the longest delimiter prefix that ends its stream so far
    (``0 .. m-1``); :meth:`scan` advances it over a forward's new tokens. The transition table
    ``[m, k + 1]`` has one column per distinct delimiter id (column 0: any other token), built once
    on the host; scanning is a gather per new token on the states' device. :meth:`step` is the same
    transition for one token on the host (serving keeps one integer state per request).
    """

    def __init__(self, ids: Sequence[int]):
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise ValueError("a delimiter needs at least one token id")
        self.ids = ids
        self.length = len(ids)
        distinct = sorted(set(ids))
        column = {t: c + 1 for c, t in enumerate(distinct)}
        fail = [0] * len(ids)  # KMP prefix function
        for i in range(1, len(ids)):
            k = fail[i - 1]
            while k and ids[i] != ids[k]:
                k = fail[k - 1]
            fail[i] = k + (ids[i] == ids[k])
        table = [[0] * (len(distinct) + 1) for _ in ids]
        for state in range(len(ids)):
            for token, c in column.items():
                s = state
                while s and ids[s] != token:
                    s = fail[s - 1]
                table[state][c] = s + 1 if ids[s] == token else 0
        self._column = column
        self._host_table = table
        self._tokens = torch.tensor(distinct, dtype=torch.long)
        self._table = torch.tensor(table, dtype=torch.long)
        self._ids = torch.tensor(ids, dtype=torch.long)

    def _on(self, device: torch.device) -> None:
        if self._table.device != device:
            self._tokens, self._table, self._ids = self._tokens.to(device), self._table.to(device), self._ids.to(device)

    def scan(self, state: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance ``state`` ``[b]`` over ``input_ids`` ``[b, q]``; ``valid`` ``[b, q]`` False on
        padding (skipped: it neither extends nor breaks a match).

        Returns ``(closes, state)``: ``closes`` ``[b, q]`` True on each token that completes the
        delimiter, and the new state ``[b]``.
        """
        self._on(input_ids.device)
        weights = torch.arange(1, len(self._tokens) + 1, device=input_ids.device)
        column = ((input_ids.unsqueeze(-1) == self._tokens) * weights).sum(-1)  # [b, q], 0 = other token
        closes = torch.zeros_like(valid)
        for j in range(input_ids.shape[1]):
            nxt = self._table[state, column[:, j]]
            done = nxt == self.length
            closes[:, j] = valid[:, j] & done
            state = torch.where(valid[:, j], nxt.masked_fill(done, 0), state)
        return closes, state

    def step(self, state: int, token: int) -> tuple[bool, int]:
        """Advance one row's ``state`` over one real ``token`` on the host, by :meth:`scan`'s table.

        Returns ``(closes, state)``: whether ``token`` completes the delimiter, and the new state
        (``0`` after a completion, as in :meth:`scan`).
        """
        nxt = self._host_table[state][self._column.get(token, 0)]
        return (True, 0) if nxt == self.length else (False, nxt)

    def piece_ids(self, index: torch.Tensor) -> torch.Tensor:
        """The delimiter's ids at ``index`` (any shape, clamped to ``0 .. m-1``)."""
        self._on(index.device)
        return self._ids[index.clamp(0, self.length - 1)]
