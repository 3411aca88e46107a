"""Step-order negatives for the testbed PRM: a step that repeats an earlier step, or skips one.

The shipped PRM is trained on wrong digits and operands (:func:`trainers.testbed_prm.corrupt`); an
evicted base that lost its earlier steps fails differently -- it writes a step *again* (the same key
and computation as an earlier step) or jumps ahead. Both are wrong by the testbed's own check (a step
is right when it is the next key, copies the question's operands and computes its value). A held-out
row here is a reference trace cut after step ``k``, with step ``k`` either kept (label 1) or replaced
(label 0) by

* ``repeat``: an exact copy of an earlier step ``j < k`` (its key written a second time), or
* ``skip``: step ``k + 1`` written in place of step ``k`` (one key skipped);

labelled only at that step's ``;``. ``python -m trainers.testbed_prm checkpoints/testbed-prm``
prints a PRM's AUROC on both, next to its AUROC on the training-style negatives.

:func:`order_row` makes the training rows of a step-order-aware PRM (``order_prob`` in
:class:`~trainers.testbed_prm.PRMConfig`, ``configs/testbed/prm-order.yaml``): a (corrupted) training
trace cut after a random step ``k`` that is, half the time, replaced by a repeat, a skip, or a
``rekey`` (step ``k``'s own computation under an earlier step's key: the shape of the testbed LRM's
loops, which rewrite a key with other operands). The held-out kinds stay ``repeat`` and ``skip``.
"""

from __future__ import annotations

import random

from data_pipeline.testbed import task

__all__ = ["IGNORE", "ORDER_KINDS", "TRAIN_KINDS", "order_heldout", "order_negative", "order_row", "step_span"]

IGNORE = -100  # "no label here" (cross-entropy's ignore_index); the PRM's labels use it too

ORDER_KINDS = ("repeat", "skip")
TRAIN_KINDS = ("repeat", "skip", "rekey")
KEY = 6  # offset of rK= in a step: x xv op y yv gives rK= v ;


def step_span(end: int) -> slice:
    """The tokens of the step whose ``;`` is at ``end``."""
    return slice(end - task.STEP_TOKENS + 1, end + 1)


def order_negative(problem: task.Problem, rng: random.Random, kind: str, negative: bool) -> tuple[list[str], list[int]] | None:
    """The reference trace up to a random step ``k`` (``k >= 2`` for ``repeat``, ``k`` below the
    last step for ``skip``), that step replaced by an order negative when ``negative``; labelled at
    its ``;`` only. ``None`` when the trace has too few steps."""
    if kind not in ORDER_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {ORDER_KINDS}")
    toks = list(problem.tokens[: problem.tokens.index(task.END_THINK)])
    ends = [i for i, t in enumerate(toks) if t == task.SEP]
    lo, hi = (1, len(ends) - 1) if kind == "repeat" else (0, len(ends) - 2)
    if hi < lo:
        return None
    k = rng.randint(lo, hi)
    end = ends[k]
    row = toks[: end + 1]
    if negative:
        source = ends[rng.randrange(k)] if kind == "repeat" else ends[k + 1]
        row[step_span(end)] = toks[step_span(source)]
    labels = [IGNORE] * len(row)
    labels[end] = 0 if negative else 1
    return row, labels


def order_row(toks: list[str], labels: list[int], rng: random.Random, negative: bool,
              key_labels: bool = False) -> tuple[list[str], list[int]] | None:
    """A training row from a labelled thinking trace (:func:`~trainers.testbed_prm.corrupt`'s
    output): cut after a random step ``k`` and labelled at that step only (earlier steps are
    context; a step's order is the one thing it is checked for here, so its label is not diluted by
    the prefix's digit labels). When ``negative``, step ``k`` is replaced by one of
    :data:`TRAIN_KINDS` and labelled 0 at its ``;`` (its digits keep their local checks, which still
    pass). ``key_labels`` also labels its key token "this is the next key". ``None`` when the trace
    has fewer than 3 steps."""
    ends = [i for i, t in enumerate(toks) if t == task.SEP]
    if len(ends) < 3:
        return None
    kind = rng.choice(TRAIN_KINDS)
    k = rng.randint(1, len(ends) - 1) if kind != "skip" else rng.randint(0, len(ends) - 2)
    end = ends[k]
    span = step_span(end)
    key = span.start + KEY
    row = list(toks[: end + 1])
    lab = [IGNORE] * span.start + list(labels[span])
    if negative:
        if kind == "repeat":
            row[span] = toks[step_span(ends[rng.randrange(k)])]
        elif kind == "skip":
            row[span] = toks[step_span(ends[k + 1])]
        else:
            row[key] = toks[step_span(ends[rng.randrange(k)]).start + KEY]
        lab[end] = 0
    if key_labels:
        lab[key] = int(row[key] == f"r{k + 1}=")
    return row, lab


def order_heldout(name: str, n: int, kind: str, min_think: int = 60, max_think: int = 700,
                  family: str = "copy") -> list[tuple[list[str], list[int]]]:
    """``n`` held-out problems of set ``name`` (task ``family``), half of them with an order negative of ``kind``."""
    rows = []
    for i, p in enumerate(task.problem_set(name, n, min_think=min_think, max_think=max_think, family=family)):
        rng = random.Random(f"{name}-order-{kind}:{p.name}")
        row = order_negative(p, rng, kind, negative=i % 2 == 1)
        if row is not None:
            rows.append(row)
    return rows
