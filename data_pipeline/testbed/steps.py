"""The testbed's exact step check: is a thinking step (or the answer) right given the steps committed before it?

The process label of the step PRM's training traces (:mod:`trainers.testbed_prm_traces`) and the ideal process
reward of ``dynts rescue --prm testbed-verifier`` (:func:`eval.rescue.verifiers.testbed_step_verifier`).
"""

from __future__ import annotations

from typing import Sequence

from . import task

__all__ = ["check_step"]


def check_step(question: str, steps: Sequence[str], family: str = "copy") -> bool:
    """True when the last of ``steps`` is right given the ones before it.

    A thinking step (``x xv op y yv gives rK= v ;``) is right when it is the next key, copies the question's
    operand values and computes ``v`` right; an answer step (``</think> rK= v``) when it names the asked key and
    carries the value that key has in the committed steps. ``family="chain"``: an operand naming a result (``r3``)
    must copy the value written at that result's most recent committed definition (``task.operand_copies``).
    """
    parsed = task.parse_question(question)
    if parsed is None:
        return False
    operands, asked = parsed
    words = steps[-1].split()
    if task.END_THINK in words:
        return bool(task.check_answer(question, " ".join([*" ".join(steps[:-1]).split(), *words]), family))
    found = task.parse_steps(words + ([task.SEP] if words and words[-1] != task.SEP else []), family)
    if len(found) != 1:
        return False
    x, xv, op, y, yv, key, v = found[0]
    committed = task.parse_steps(" ".join(steps[:-1]), family)
    if family == "copy":
        copied = (xv, yv) == (operands[task.VARIABLES.index(x)], operands[task.VARIABLES.index(y)])
    else:
        text = " ".join(steps[:-1]).split() + words + ([task.SEP] if words[-1] != task.SEP else [])
        copied = all(task.operand_copies(text, operands, family)[-2:])
    return bool(copied and v == task.OPS[op](xv, yv) and key == len(committed) + 1)  # type: ignore[operator]
