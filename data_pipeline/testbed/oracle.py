"""Oracle evictor for the testbed: keeps the question, the ground-truth critical tokens and the
most recent tokens ("eviction matters" experiment).

The answer ``</think> rK= v`` copies the value written right after the asked key ``rK=`` in the
thinking. The oracle reads the asked key from the question (``find rK``, always kept) and protects
every thinking slot holding ``rK=`` and the slot right after it (its value); everything else is
kept by recency. Slots carry absolute positions, so the value is found one position after a protected key.

Chain family (``family="chain"``): the answer's value depends on the values its chain of results
read (``task.Problem.critical_positions``), but which results the chain will read is decided as the
trace is written. So the oracle protects every written result until the asked step appears, then
only the asked step's dependency closure as the cache still shows it (each closure step's operand
names ``rJ`` lead to the most recent earlier ``rJ=``): at the end of the thinking exactly the
critical positions, and at every earlier event a superset of what the answer's chain can still read.
The value oracle also keeps the operand names ``rJ`` of the protected steps, so the closure stays
readable after those steps leave the window (at most 4 tokens a step); the step oracle keeps whole
steps. The token oracle (``keep_key=False``) is copy-only: without its key a value cannot be placed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_pipeline.testbed import task
from dynts.evictors.base import EVICTORS, Evictor, Segment, TokenInfo, keep_top, register

_ID = {t: i for i, t in enumerate(task.VOCAB)}
FIND_ID = _ID[task.FIND]
QUERY_TO_KEY = {_ID[q]: _ID[k] for q, k in zip(task.QUERY_KEYS, task.RESULT_KEYS)}
RESULT_IDS = frozenset(QUERY_TO_KEY.values())
X_OFFSET, Y_OFFSET = -task.KEY_INDEX, 3 - task.KEY_INDEX  # a step's operand names, relative to its rK=


def asked_key_ids(info: TokenInfo) -> torch.Tensor:
    """``[b]`` id of the asked result key (``rK=``) per row, read from ``find rK`` in the question;
    -1 where the question holds none."""
    ids, q = info.token_ids, info.segments == Segment.QUESTION
    is_find = (ids == FIND_ID) & q
    out = torch.full((ids.shape[0],), -1, dtype=torch.long, device=ids.device)
    for b in range(ids.shape[0]):
        hits = is_find[b, :-1].nonzero().flatten()
        if len(hits):
            out[b] = QUERY_TO_KEY.get(int(ids[b, hits[0] + 1]), -1)
    return out


def critical_mask(info: TokenInfo, key_ids: torch.Tensor, before: int = 0, after: int = 1) -> torch.Tensor:
    """``[b, n]`` True on the slots from ``before`` positions before a thinking slot holding the
    asked key to ``after`` positions after it (``(0, 1)``: the key and its value; ``(-1, 1)``: the
    value alone)."""
    thinking = info.segments == Segment.THINKING
    is_key = thinking & (info.token_ids == key_ids[:, None])
    pos = info.positions.masked_fill(~info.valid, -(10**9))
    key_pos = pos.masked_fill(~is_key, -(10**9))  # [b, n]; only key slots carry real positions
    offset = pos[:, :, None] - key_pos[:, None, :]  # [b, n, n]: slot minus key position
    near = ((offset >= -before) & (offset <= after) & is_key[:, None, :]).any(-1)
    return near & info.valid


def chain_critical_mask(info: TokenInfo, key_ids: torch.Tensor, keep_step: bool = False) -> torch.Tensor:
    """``[b, n]`` True on the slots the chain oracle protects (module docstring): the live results'
    keys and values (with ``keep_step``, their whole steps) and the operand names ``rJ`` of the
    live steps. Live: every written result until the asked key appears, then its closure."""
    out = torch.zeros(info.shape, dtype=torch.bool)
    thinking = ((info.segments == Segment.THINKING) & info.valid).cpu()
    positions, ids = info.positions.cpu().tolist(), info.token_ids.cpu().tolist()
    for b in range(info.shape[0]):
        slot_at = {positions[b][j]: j for j in range(info.shape[1]) if thinking[b, j]}
        keys = sorted(pos for pos, j in slot_at.items() if ids[b][j] in RESULT_IDS)  # result keys by position
        asked = [pos for pos in keys if ids[b][slot_at[pos]] == int(key_ids[b])]
        if asked:
            live, todo = set(), list(asked)
            while todo:
                pos = todo.pop()
                if pos in live:
                    continue
                live.add(pos)
                for offset in (X_OFFSET, Y_OFFSET):
                    name = slot_at.get(pos + offset)
                    target = None if name is None else QUERY_TO_KEY.get(ids[b][name])
                    if target is not None:
                        earlier = [q for q in keys if q < pos + X_OFFSET and ids[b][slot_at[q]] == target]
                        if earlier:
                            todo.append(earlier[-1])
        else:
            live = set(keys)
        for pos in live:
            span = range(pos + X_OFFSET, pos + 3) if keep_step else (pos, pos + 1, pos + X_OFFSET, pos + Y_OFFSET)
            for q in span:
                j = slot_at.get(q)
                if j is not None and (keep_step or q in (pos, pos + 1) or ids[b][j] in QUERY_TO_KEY):
                    out[b, j] = True
    return out.to(info.positions.device)


@dataclass
class OracleEvictor(Evictor):
    """Question + ground-truth critical tokens (asked key and its value) + the most recent tokens.

    Args:
        key_ids: optional asked ``rK=`` token id per row; read from the question when ``None``.
        keep_step: keep the whole step that wrote the asked key (``x xv op y yv gives rK= v ;``),
            not only the key and its value (the step oracle).
        keep_key: keep the asked key with its value (the value oracle); ``False`` keeps the value
            token alone (the token oracle: one scattered token, the shape a token-level scorer keeps).
        family: the task family (``task.FAMILIES``); ``chain`` protects the asked result's
            dependency closure (module docstring).

    Shapes: ``info.*`` are ``[b, n]``; returns ``[b, n_keep]`` ascending slot indices.
    """

    key_ids: list[int] | None = None
    keep_step: bool = False
    keep_key: bool = True
    family: str = "copy"

    def __post_init__(self) -> None:
        task.check_family(self.family)
        if self.family != "copy" and not self.keep_key:
            raise ValueError(f"keep_key=False (the token oracle) is copy-only; family={self.family!r} needs the keys to follow its chain")
        for name in ("keep_step", "keep_key"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.keep_step and not self.keep_key:
            raise ValueError("keep_step=True keeps the asked key inside its step; keep_key=False only applies with keep_step=False")
        if self.key_ids is not None and any(k not in QUERY_TO_KEY.values() for k in self.key_ids):
            raise ValueError(f"key_ids={self.key_ids!r} must be ids of result keys r1= .. r{task.MAX_KEY}=")

    def select(self, info: TokenInfo) -> torch.Tensor:
        if self.key_ids is not None:
            keys = torch.tensor(self.key_ids, dtype=torch.long, device=info.token_ids.device)
        else:
            keys = asked_key_ids(info)
        priority = torch.arange(info.shape[1], device=info.positions.device).float().expand(info.shape)
        if self.family == "chain":
            critical = chain_critical_mask(info, keys, self.keep_step)
        else:
            span = (task.STEP_TOKENS - 3, 2) if self.keep_step else (0, 1) if self.keep_key else (-1, 1)
            critical = critical_mask(info, keys, *span)
        protect = (info.segments == Segment.QUESTION) | (info.segments == Segment.ANSWER) | critical
        return keep_top(priority.masked_fill(protect, float("inf")), info)


if "testbed-oracle" not in EVICTORS:
    register("testbed-oracle")(OracleEvictor)
