"""Full-cache generation checks for testbed models (plain HF ``generate``, no eviction)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data_pipeline.testbed import task

SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


class BanUntil:
    """Logits processor: forbid ``token_id`` for the first ``n`` generated tokens (e.g. ``</think>``:
    the tiny LRM may stop thinking before it wrote the asked step, more so under eviction)."""

    def __init__(self, token_id: int, n: int, prompt_length: int) -> None:
        self.token_id, self.n, self.prompt_length = token_id, n, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.prompt_length < self.n:
            scores[:, self.token_id] = float("-inf")
        return scores


def load_testbed(name: str, **kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``dynts.load(name, **kwargs)``: the model and its word-level tokenizer, loaded as saved."""
    import dynts

    return dynts.load(name, **kwargs)


@torch.no_grad()
def generate_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[task.Problem],
    max_new_tokens: int = 1100,
    batch_size: int = 50,
    seed: int = 0,
    sampling: dict[str, Any] | None = None,
) -> list[str]:
    """Generated continuations (after ``<think>``) for each problem's prompt, full cache."""
    model.eval()
    torch.manual_seed(seed)
    out: list[str] = []
    for i in range(0, len(problems), batch_size):
        prompts = [p.prompt for p in problems[i : i + batch_size]]
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        seqs = model.generate(**enc, max_new_tokens=max_new_tokens, **(sampling if sampling is not None else SAMPLING))
        out += tokenizer.batch_decode(seqs[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def written_value(problem: task.Problem, text: str) -> int | None:
    """The value the trace itself wrote after the asked key (first occurrence), if any."""
    for *_rest, key, v in task.parse_steps(text, problem.family):
        if key == problem.asked:
            return v
    return None


def score(problems: Sequence[task.Problem], texts: Sequence[str], records: bool = False) -> dict[str, Any]:
    """Accuracy, parse rate, mean thinking length and where errors come from.

    ``retrieval``: the answer equals the value the trace wrote for the asked key (the long-range
    lookup), among parsed answers; ``operand_copy``: step operands equal the question's values
    (chain: or the values written for the results they name, ``task.operand_copies``);
    ``step_arithmetic``: ``xv op yv == v`` as written. ``records``: also the per-problem results
    behind the numbers, compact (``correct`` and ``parsed`` as strings of ``0``/``1``, one per
    problem in order, the thinking length of each trace and the problem names).
    """
    correct = [task.check_answer(p, t) for p, t in zip(problems, texts)]
    answers = [task.parse_answer(t) for t in texts]
    lengths = [len(task.thinking_words(t)) for t in texts]
    retrieved = [a is not None and a[1] == written_value(p, t) for p, t, a in zip(problems, texts, answers)]
    steps = [(p, s) for p, t in zip(problems, texts) for s in task.parse_steps(t, p.family)]
    arith = [task.OPS[op](xv, yv) == v for _p, (_x, xv, op, _y, yv, _k, v) in steps]  # type: ignore[operator]
    pairs = [task.operand_copies(t, p.operands, p.family) for p, t in zip(problems, texts)]
    copied = [a and b for c in pairs for a, b in zip(c[::2], c[1::2])]  # both operands of a step right
    n_parsed = sum(a is not None for a in answers)
    result: dict[str, Any] = {
        "n": len(texts),
        "accuracy": sum(correct) / len(texts),
        "parse_rate": n_parsed / len(texts),
        "mean_thinking_tokens": statistics.mean(lengths),
        "retrieval": sum(retrieved) / max(1, n_parsed),
        "operand_copy": sum(copied) / max(1, len(copied)),
        "step_arithmetic": sum(arith) / max(1, len(arith)),
    }
    if records:
        bits = lambda xs: "".join("1" if x else "0" for x in xs)  # noqa: E731
        result["records"] = {"problems": [p.name for p in problems], "correct": bits(correct),
                             "parsed": bits(a is not None for a in answers), "thinking_tokens": lengths}
    return result
