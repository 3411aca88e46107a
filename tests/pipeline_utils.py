"""Helpers for the predictor-pipeline tests: tiny models saved as local HF directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from data_pipeline.testbed.task import VOCAB
from data_pipeline.testbed.tokenizer import build_tokenizer


def tiny_testbed_lm(directory: Path, seed: int = 0, uniform: bool = True) -> Path:
    """A tiny random Qwen2 over the testbed vocabulary (75 words), saved with the testbed tokenizer.

    ``uniform``: zero LM head, so sampling is uniform over the top-k words and traces with
    ``</think>`` and EOS appear quickly.
    """
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    if uniform:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def tiny_eval_testbed(model_dir: Path, predictor_dir: Path | None = None) -> None:
    """A random 2-layer Qwen2 (hidden 32, GQA 2:1, tied) over the testbed vocabulary with its
    tokenizer in ``model_dir``, and an untrained 32-wide importance predictor in ``predictor_dir``
    (the layout the eval harness and the demo read)."""
    import dynts

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    if predictor_dir is not None:
        dynts.ImportancePredictor(32).save_pretrained(predictor_dir)


def write_yaml(path: Path, values: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(values))
    return path


def word_rows_token_info(rows: list[list[str]], n_keep: int):
    """The :class:`TokenInfo` of testbed word rows, left-padded: question, thinking, and the answer after
    ``</think>``; positions ``0 .. n-1``, ``W_l = 8``."""
    import torch

    from data_pipeline.testbed import task
    from dynts.evictors import Segment, TokenInfo

    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    seg = torch.full((len(rows), n), int(Segment.PAD))
    pos = torch.zeros(len(rows), n, dtype=torch.long)
    for b, r in enumerate(rows):
        off = n - len(r)
        ids[b, off:] = torch.tensor([task.VOCAB.index(t) for t in r])
        pos[b] = torch.arange(n)
        end = r.index(task.END_THINK) if task.END_THINK in r else len(r)
        for i in range(len(r)):
            seg[b, off + i] = Segment.QUESTION if i < task.QUESTION_TOKENS else (Segment.THINKING if i < end else Segment.ANSWER)
    return TokenInfo(positions=pos, segments=seg, token_ids=ids, n_keep=n_keep, local_window=8, question_length=n)
