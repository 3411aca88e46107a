"""Prompts: the question, its options (multiple choice) and the paper's instruction, rendered with
the model's chat template (DynTS paper 6.1 follows DeepSeek-R1's protocol: "Please reason step by
step, and put your final answer within \\boxed{}.")."""

from __future__ import annotations

from typing import Sequence

from dynts.prompts import encode_prompt

from .benchmarks import INSTRUCTION, Benchmark, Example
from data_pipeline.grading import LETTERS

__all__ = ["INSTRUCTION", "choice_instruction", "encode_prompts", "user_message"]


def choice_instruction(n_choices: int) -> str:
    """The multiple-choice variant of the instruction: the letter goes in the box."""
    letters = ", ".join(LETTERS[: n_choices - 1]) + f" or {LETTERS[n_choices - 1]}"
    return f"Please reason step by step, and put the letter of your final answer ({letters}) within \\boxed{{}}."


def user_message(example: Example, benchmark: Benchmark) -> str:
    """The user turn: question, lettered options when there are any, then the instruction."""
    text = example.question
    if example.choices:
        text += "\n\n" + "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(example.choices))
    if benchmark.instruction is not None:
        instruction = choice_instruction(len(example.choices)) if example.choices else benchmark.instruction
        text += "\n\n" + instruction
    return text


def encode_prompts(tokenizer, messages: Sequence[str], chat_template: bool = True) -> list[list[int]]:
    """Token ids of each user message: through the tokenizer's chat template (generation prompt
    added) when it has one and ``chat_template`` is on, else the raw text with special tokens."""
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    if chat_template and not use_template:
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template=False (--no-chat-template) to send raw text"
        )
    return [encode_prompt(tokenizer, [{"role": "user", "content": m}] if use_template else m) for m in messages]

