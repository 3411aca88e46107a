"""What each cached token is: question, thinking, answer or padding -- the one labelling rule.

The rule: prompt tokens are :attr:`Segment.QUESTION`; generated tokens are :attr:`Segment.THINKING`
until the request has emitted the whole thinking delimiter (``</think>``, maybe several tokens);
the delimiter -- all its tokens, also those stored by earlier forwards -- and everything after it
are :attr:`Segment.ANSWER`. A delimiter token lost to an eviction is simply not found.

It runs on two kinds of data, side by side here:

* :func:`label_rows` -- a batch of rows on the device (the dense and ragged caches): ``[b, q]`` new
  ids, the matcher state a ``[b]`` tensor, nothing read back to the host;
* :func:`label_request` -- one request's new ids on the host (the paged engines, whose per-request
  state is host integers): the matcher state one int, the stored pieces relabelled in its table row.

Both step the same :class:`~dynts.thinking.DelimiterMatcher` automaton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..evictors.base import Segment
from ..thinking import DelimiterMatcher

__all__ = ["AnswerState", "label_request", "label_rows"]


@dataclass
class AnswerState:
    """Per-request host state of the rule: has it emitted the delimiter, how much of it matched so far."""

    in_answer: bool = False
    think_match: int = 0


def label_rows(
    delimiter: DelimiterMatcher | None,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    in_answer: torch.Tensor,
    think_match: torch.Tensor,
    stored_segments: torch.Tensor,
    stored_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments ``[b, q]`` of generated tokens ``input_ids`` (``valid`` False on padding).

    ``in_answer`` / ``think_match`` ``[b]`` are the rows' state (``in_answer`` updated in place; the new
    ``think_match`` is returned). ``stored_segments`` / ``stored_ids`` ``[b, n]`` are views of the stored
    slots: the delimiter's first tokens, stored by earlier forwards, are relabelled there in place.
    Returns ``(segments, think_match)``."""
    if delimiter is None:
        seg = torch.full_like(input_ids, int(Segment.THINKING))
        return torch.where(valid, seg, int(Segment.PAD)), think_match
    m = delimiter.length
    closes, think_match = delimiter.scan(think_match, input_ids, valid)
    after = closes.long().cumsum(1) > 0
    newly = ~in_answer & after[:, -1]
    answer = in_answer.unsqueeze(1) | after
    if m > 1:  # the delimiter's first tokens: in this forward, or stored by earlier ones
        real = valid.long().cumsum(1)  # [b, q] 1-based count of real tokens
        closing = (real * (closes & (closes.long().cumsum(1) == 1))).sum(1)  # real count at the first close
        answer |= valid & newly.unsqueeze(1) & (real > (closing - m).unsqueeze(1))
        _relabel_stored_rows(delimiter, stored_segments, stored_ids, torch.where(newly, (m - closing).clamp(min=0), 0))
    in_answer |= newly
    seg = torch.where(answer, int(Segment.ANSWER), int(Segment.THINKING))
    return torch.where(valid, seg, int(Segment.PAD)), think_match


def _relabel_stored_rows(delimiter: DelimiterMatcher, segments: torch.Tensor, token_ids: torch.Tensor,
                         pieces: torch.Tensor) -> None:
    """Mark as answer the last ``pieces`` ``[b]`` real stored slots of each row that hold the
    delimiter's first ids."""
    real = segments != Segment.PAD
    rank = real.flip(1).long().cumsum(1).flip(1)  # 1 on the last real slot
    index = pieces.unsqueeze(1) - rank  # the delimiter id a slot must hold
    hit = real & (rank <= pieces.unsqueeze(1)) & (segments == Segment.THINKING)
    hit &= token_ids == delimiter.piece_ids(index)
    segments.masked_fill_(hit, int(Segment.ANSWER))


def label_request(
    delimiter: DelimiterMatcher | None,
    state: AnswerState,
    new: Sequence[int],
    start: int,
    question_length: int,
    relabel_stored: Callable[[Sequence[int]], None],
) -> list[int]:
    """Segments of one request's ``new`` tokens (absolute index ``start`` on), on the host.

    ``state`` is updated in place; when the delimiter closes with some of its first tokens stored by
    earlier forwards, ``relabel_stored(pieces)`` is called with those ids (the caller marks them as
    answer in its table). Reads nothing back from the device."""
    seg: list[int] = []
    generated = 0
    for i, tok in enumerate(new):
        if start + i < question_length:
            seg.append(int(Segment.QUESTION))
            continue
        generated += 1
        if delimiter is not None and not state.in_answer:
            closes, state.think_match = delimiter.step(state.think_match, tok)
            if closes:
                state.in_answer = True
                m = delimiter.length
                here = min(m, generated)  # the delimiter's last tokens, in this forward
                seg[len(seg) - (here - 1):] = [int(Segment.ANSWER)] * (here - 1)
                if here < m:  # its first tokens were stored by earlier forwards
                    relabel_stored(delimiter.ids[: m - here])
        seg.append(int(Segment.ANSWER if state.in_answer else Segment.THINKING))
    return seg
