"""Prompts to token ids to left-padded batches: the one implementation every caller uses.

``encode_prompt`` turns one prompt (a string, a chat message list or token ids) into ids the way
:func:`dynts.generate` does; ``pad_rows`` stacks rows of different lengths into ``[b, width]``
padded ids and their attention mask (left-padded for generation, so every row's next token sits in
the last column; right-padded for scoring); ``pad_id`` is the padding token a tokenizer implies.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["encode_prompt", "encode_prompts", "pad_id", "pad_rows"]


def encode_prompt(tokenizer, prompt: str | Sequence[dict] | Sequence[int]) -> list[int]:
    """Token ids of one prompt: ids pass through; a string gets the tokenizer's special tokens; a chat
    (list of ``{"role", "content"}``) gets the chat template with the generation prompt and no
    further special tokens (the template already has them)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need tokenizer=...; or pass token id lists")
        return tokenizer(prompt)["input_ids"]
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("chat prompts need tokenizer=...")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not prompt or not all(isinstance(t, int) for t in prompt):
        raise ValueError("a prompt must be a string, a chat message list or a non-empty list of token ids")
    return prompt


def pad_id(tokenizer) -> int | None:
    """The tokenizer's pad token id, else its EOS id (models without a pad token pad with EOS)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pad_rows(rows: Sequence[Sequence[int]], pad: int, *, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id rows of different lengths, padded with ``pad`` to the longest.

    Args:
        rows: token ids, one list per row (an empty row becomes all pads).
        pad: the padding token id (:func:`pad_id`).
        side: ``"left"`` (generation and importance: every row ends in the last column) or
            ``"right"`` (scoring a row's tokens at their own positions from column 0).

    Returns ``(input_ids, attention_mask)``, both ``[b, width]`` long; the mask is 1 on real tokens.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} must be 'left' or 'right'")
    if not rows:
        raise ValueError("rows is empty; pass at least one row of token ids")
    if pad is None:
        raise ValueError("pad is None; pass the tokenizer's pad (or EOS) token id, e.g. dynts.prompts.pad_id(tokenizer)")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            ids[i, cols] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, cols] = 1
    return ids, mask


def encode_prompts(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids for raw strings (tokenizer's special tokens added) or chats (template applied)."""
    if tokenizer is None:
        raise ValueError("prompts=... needs tokenizer=...; or pass input_ids=... instead")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty; pass a string or a non-empty list")
    chats = [not isinstance(p, str) for p in prompts]
    if any(chats) and not all(chats):
        raise ValueError("prompts mixes strings and chat message lists; pass one kind per call")
    return pad_rows([encode_prompt(tokenizer, p) for p in prompts], pad_id(tokenizer))
