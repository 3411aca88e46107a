"""Traces for the analyses: the pipeline's dataset schema, checks, loading, and small builders.

A trace dataset (a ``datasets.Dataset``, one row per sampled response) has the columns

==============  ===========  =================================================================
``question_id`` str
``sample_id``   int          index of the sample for that question
``input_ids``   list[int]    question + thinking + answer
``question_len`` int         prompt tokens (the question window ``W_q``)
``answer_start`` int         index of the first answer token (``</think>``, or a rule-based cue)
``text``        str          the decoded ``input_ids``
``gold``        str          the reference answer
``correct``     bool         whether the sampled answer was graded correct
``importance``  list[float]  answer-to-thinking attention per token (``len == len(input_ids)``)
==============  ===========  =================================================================

Thinking tokens are ``input_ids[question_len:answer_start]``. ``importance`` comes from
:func:`dynts.importance.sequence_importance` (DynTS paper Eq. 6, appendix B.1):
:func:`add_importance` fills it in.

Datasets written by the pipeline (``dynts pipeline``: ``runs/pipeline-*/importance/dataset``) are
read as they are. The builders here make small in-process trace sets for the analyses themselves
(notebooks, tests, ``dynts analyze traces``): testbed problems (the generator's reference traces,
or the testbed model's own samples) and chat-model answers to GSM8K questions closed by an appended
answer cue (the rule-based answer start: unlike the pipeline's ``last_line`` rule it also works for
responses cut by the token cap).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dynts.io import replace_directory
from dynts.prompts import pad_rows

__all__ = [
    "IMPORTANCE",
    "TRACE_COLUMNS",
    "ChatTraceConfig",
    "add_importance",
    "chat_traces",
    "check_traces",
    "load_model",
    "load_tokenizer",
    "load_traces",
    "save_traces",
    "testbed_traces",
    "token_char_spans",
]

TRACE_COLUMNS = ("question_id", "sample_id", "input_ids", "question_len", "answer_start", "text", "gold", "correct")
IMPORTANCE = "importance"


def _rows(traces: Any) -> Sequence[dict]:
    """A ``datasets.Dataset`` or a list of dicts, as an indexable sequence of dicts."""
    if isinstance(traces, (list, tuple)):
        return traces
    if hasattr(traces, "column_names") and hasattr(traces, "__getitem__"):
        return traces
    raise ValueError(f"traces must be a datasets.Dataset or a list of dicts, got {type(traces).__name__}")


def _columns(traces: Any) -> set[str]:
    if hasattr(traces, "column_names"):
        return set(traces.column_names)
    return set(traces[0]) if len(traces) else set()


def check_traces(traces: Any, *, importance: bool = True) -> None:
    """Raise ``ValueError`` unless ``traces`` follows the schema (and carries ``importance``).

    Checks the columns, and per row that ``0 < question_len < answer_start <= len(input_ids)``
    (at least one thinking token) and that ``importance`` has one score per token.
    """
    rows = _rows(traces)
    if len(rows) == 0:
        raise ValueError("traces is empty; build some with eval.analyses.traces or `dynts analyze traces`")
    cols = _columns(traces)
    missing = [c for c in TRACE_COLUMNS if c not in cols]
    if missing:
        raise ValueError(f"traces lack the columns {missing}; the schema is {list(TRACE_COLUMNS)} (+ 'importance')")
    if importance and IMPORTANCE not in cols:
        raise ValueError(
            "traces have no 'importance' column (answer-to-thinking attention scores); compute them with "
            "eval.analyses.traces.add_importance(traces, model) or `dynts analyze traces ...`"
        )
    for i in range(len(rows)):
        row = rows[i]
        n, q, a = len(row["input_ids"]), int(row["question_len"]), int(row["answer_start"])
        if not 0 < q < a <= n:
            raise ValueError(
                f"trace {i} ({row['question_id']}/{row['sample_id']}): need 0 < question_len ({q}) < "
                f"answer_start ({a}) <= len(input_ids) ({n}), i.e. at least one thinking token"
            )
        if importance:
            scores = row[IMPORTANCE]
            if scores is None or len(scores) != n:
                got = None if scores is None else len(scores)
                raise ValueError(f"trace {i}: importance has {got} scores for {n} tokens; recompute it with add_importance")


def load_traces(path: str | os.PathLike) -> Any:
    """A trace dataset from a ``save_to_disk`` directory or a ``.jsonl``/``.json``/``.parquet`` file."""
    import datasets

    path = Path(path)
    if path.is_dir():
        return datasets.load_from_disk(str(path))
    if not path.is_file():
        raise ValueError(f"traces={str(path)!r} does not exist; pass a dataset directory or a .jsonl/.parquet file")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"traces={str(path)!r}: unknown format; use a save_to_disk directory, .jsonl or .parquet")
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def save_traces(traces: Any, path: str | os.PathLike) -> Path:
    """Write ``traces`` to ``path`` (a ``save_to_disk`` directory) atomically; returns ``path``."""
    import datasets

    path = Path(path)
    if not isinstance(traces, datasets.Dataset):
        traces = datasets.Dataset.from_list(list(traces))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    traces.save_to_disk(str(tmp))
    return replace_directory(tmp, path)


def add_importance(traces: Any, model: torch.nn.Module, *, max_batch_tokens: int = 16384) -> Any:
    """``traces`` with the ``importance`` column: answer-to-thinking attention summed over layers,
    heads and answer rows (:func:`dynts.importance.sequence_importance`)."""
    import datasets

    from dynts.importance import sequence_importance

    check_traces(traces, importance=False)
    rows = list(traces) if not isinstance(traces, list) else traces
    pad = model.config.get_text_config().pad_token_id
    out = sequence_importance(
        model, [r["input_ids"] for r in rows], [int(r["answer_start"]) for r in rows],
        max_batch_tokens=max_batch_tokens, pad_token_id=pad if pad is not None else 0,
    )
    data = [{**{k: v for k, v in r.items() if k != IMPORTANCE}, IMPORTANCE: o.scores.float().tolist()} for r, o in zip(rows, out)]
    return datasets.Dataset.from_list(data)


def load_model(name: str | os.PathLike, **load_options: Any) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` through :func:`dynts.load` (``dtype``, ``device``, ``device_map``, ...)."""
    import dynts

    return dynts.load(str(name), **load_options)


def load_tokenizer(name: str | os.PathLike) -> Any:
    """The tokenizer alone (:func:`dynts.models.load_tokenizer`)."""
    from dynts.models import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(str(name))


# ------------------------------------------------------------------ testbed traces


def testbed_traces(
    problems: Iterable[Any],
    tokenizer: Any,
    model: torch.nn.Module | None = None,
    *,
    samples: int = 1,
    seed: int = 0,
    max_new_tokens: int | None = None,
    batch_size: int = 50,
) -> Any:
    """Traces of testbed problems (``data_pipeline.testbed.task.Problem``).

    Without ``model``: the generator's reference traces (always correct). With ``model``: ``samples``
    sampled responses per problem (the testbed's sampling settings); responses that never close
    the thinking with ``</think>`` are dropped (paper B.1 keeps complete traces only). ``gold`` is
    the asked step's value; ``correct`` is the task's exact checker.
    """
    import datasets

    from data_pipeline.testbed import task

    problems = list(problems)
    if samples < 1:
        raise ValueError(f"samples={samples} must be >= 1")
    end_id = tokenizer.convert_tokens_to_ids(task.END_THINK)
    rows = []
    if model is None:
        for p in problems:
            ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
            rows.append(_testbed_row(p, 0, ids, end_id, tokenizer, True))
        return datasets.Dataset.from_list(rows)
    from trainers.testbed_eval import generate_texts

    cap = max_new_tokens or max(len(p.tokens) for p in problems) + 200
    for s in range(samples):
        texts = generate_texts(model, tokenizer, problems, max_new_tokens=cap, batch_size=batch_size, seed=seed + s)
        for p, text in zip(problems, texts):
            ids = tokenizer(p.prompt + " " + text, add_special_tokens=False)["input_ids"]
            if end_id not in ids[task.QUESTION_TOKENS :]:
                continue
            rows.append(_testbed_row(p, s, ids, end_id, tokenizer, task.check_answer(p, text)))
    if not rows:
        raise ValueError("no sampled response closed its thinking with </think>; raise max_new_tokens or check the model")
    return datasets.Dataset.from_list(rows)


def _testbed_row(problem: Any, sample: int, ids: list[int], end_id: int, tokenizer: Any, correct: bool) -> dict:
    from data_pipeline.testbed import task

    start = ids.index(end_id, task.QUESTION_TOKENS)
    return {
        "question_id": problem.name,
        "sample_id": sample,
        "input_ids": ids,
        "question_len": task.QUESTION_TOKENS,
        "answer_start": start,
        "text": tokenizer.decode(ids),
        "gold": str(problem.answer),
        "family": problem.family,
        "correct": bool(correct),
    }


# ------------------------------------------------------------------ chat-model traces (no think delimiter)


@dataclass
class ChatTraceConfig:
    """How :func:`chat_traces` prompts a chat model without a thinking delimiter.

    The model writes its reasoning (at most ``max_reasoning_tokens``), which is cut after its last
    complete sentence; then ``answer_cue`` is appended (the rule-based answer start) and the model
    writes at most ``max_answer_tokens`` more greedily: the answer rows of the importance.
    """

    instruction: str = "Solve the problem step by step."
    answer_cue: str = "\nTherefore, the final answer is"
    max_reasoning_tokens: int = 128
    max_answer_tokens: int = 8
    batch_size: int = 8
    min_reasoning_tokens: int = 8
    sampling: dict | None = None  # None: greedy

    def __post_init__(self) -> None:
        for name in ("max_reasoning_tokens", "max_answer_tokens", "batch_size", "min_reasoning_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not self.answer_cue.strip():
            raise ValueError("answer_cue must contain text (it marks where the answer starts)")


def token_char_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: ``text`` is ``ids`` decoded, ``spans[i]`` the ``[start, end)`` characters of token ``i``.

    Uses the tokenizer's offset mapping when re-encoding ``text`` gives back exactly ``ids``; else
    (byte-level merges across token boundaries, special tokens) decodes prefix by prefix.
    """
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == ids:
            spans = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
            # fast tokenizers report a leading space outside the span; extend back to cover the gap
            fixed, prev = [], 0
            for s, e in spans:
                fixed.append((min(prev, s), max(e, prev)))
                prev = max(e, prev)
            return text, fixed
    spans, prev = [], 0
    for i in range(len(ids)):
        end = len(tokenizer.decode(ids[: i + 1], clean_up_tokenization_spaces=False))
        spans.append((prev, max(prev, end)))
        prev = max(prev, end)
    return text, spans


def _sentence_cut(tokenizer: Any, ids: list[int]) -> int:
    """Length of the prefix of ``ids`` that ends with the last complete sentence (``.!?`` or newline)."""
    text, spans = token_char_spans(tokenizer, ids)
    for i in range(len(ids) - 1, -1, -1):
        s, e = spans[i]
        if any(ch in ".!?\n" for ch in text[s:e]):
            return i + 1
    return len(ids)


@torch.no_grad()
def chat_traces(
    model: torch.nn.Module,
    tokenizer: Any,
    questions: Sequence[tuple[str, str, str]],
    config: ChatTraceConfig | None = None,
    *,
    grader: Any = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """Traces of a chat model answering ``questions`` (``(id, question, gold)`` triples).

    ``question_len`` is the templated prompt, ``answer_start`` the first token of the answer cue.
    ``correct`` is ``grader.grade(gold, answer_text).correct`` (default: math-verify).
    Responses with fewer than ``min_reasoning_tokens`` reasoning tokens are dropped.
    ``progress(done, total)`` is called after each batch of questions.
    """
    import datasets

    import dynts

    from data_pipeline.grading import MathGrader

    config = config or ChatTraceConfig()
    grader = grader or MathGrader()
    if not questions:
        raise ValueError("questions is empty")
    cue = tokenizer.encode(config.answer_cue, add_special_tokens=False)
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    sampling = dict(config.sampling or {"do_sample": False})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(seed)
    rows = []
    for lo in range(0, len(questions), config.batch_size):
        batch = questions[lo : lo + config.batch_size]
        chats = [[{"role": "user", "content": f"{q}\n{config.instruction}".strip()}] for _, q, _ in batch]
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids, mask = pad_rows(prompts, pad)
        first = dynts.generate(
            model, tokenizer, input_ids=ids, attention_mask=mask, method="full",
            max_new_tokens=config.max_reasoning_tokens, **sampling,
        )
        prefixes = []
        for prompt, seq in zip(prompts, first.sequences.tolist()):
            reasoning = [t for t in seq if t not in eos_ids and t != tokenizer.pad_token_id]
            reasoning = reasoning[: _sentence_cut(tokenizer, reasoning)]
            prefixes.append((prompt, reasoning))
        keep = [i for i, (_, r) in enumerate(prefixes) if len(r) >= config.min_reasoning_tokens]
        if not keep:
            continue
        ids, mask = pad_rows([prefixes[i][0] + prefixes[i][1] + cue for i in keep], pad)
        second = dynts.generate(
            model, tokenizer, input_ids=ids, attention_mask=mask, method="full",
            max_new_tokens=config.max_answer_tokens, do_sample=False,
        )
        for row, i in enumerate(keep):
            qid, _, gold = batch[i]
            prompt, reasoning = prefixes[i]
            answer = []
            for t in second.sequences[row].tolist():
                if t in eos_ids or t == pad:
                    break
                answer.append(t)
            full = prompt + reasoning + cue + answer
            answer_text = tokenizer.decode(cue + answer, skip_special_tokens=True)
            rows.append({
                "question_id": str(qid),
                "sample_id": 0,
                "input_ids": full,
                "question_len": len(prompt),
                "answer_start": len(prompt) + len(reasoning),
                "text": tokenizer.decode(full),
                "gold": str(gold),
                "correct": bool(grader.grade(str(gold), answer_text).correct),
            })
        if progress is not None:
            progress(min(lo + config.batch_size, len(questions)), len(questions))
    if not rows:
        raise ValueError("no response had enough reasoning tokens; raise max_reasoning_tokens")
    return datasets.Dataset.from_list(rows)
