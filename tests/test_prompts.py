"""dynts.prompts: the one prompt encoding and the one row padding every package uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from data_pipeline.questions import Question, encode_prompt as encode_question
from data_pipeline.testbed.tokenizer import build_tokenizer
from dynts.prompts import encode_prompts
from dynts.prompts import encode_prompt, pad_id, pad_rows
from eval.harness.prompts import encode_prompts as encode_messages


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_pad_rows_left_and_right():
    ids, mask = pad_rows([[5, 6, 7], [8], []], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = pad_rows([[5, 6, 7], [8]], pad=2, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 2, 2]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="side="):
        pad_rows([[1]], 0, side="middle")
    with pytest.raises(ValueError, match="rows is empty"):
        pad_rows([], 0)
    with pytest.raises(ValueError, match="pad is None"):
        pad_rows([[1]], None)


def test_pad_id_falls_back_to_eos():
    assert pad_id(SimpleNamespace(pad_token_id=4, eos_token_id=3)) == 4
    assert pad_id(SimpleNamespace(pad_token_id=0, eos_token_id=3)) == 0
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=3)) == 3


def test_generate_encoding_matches_the_tokenizers_own_left_padding(tok):
    strings = ["a b c", "a"]
    ref = tok(strings, return_tensors="pt", padding=True, add_special_tokens=True)
    ids, mask = encode_prompts(tok, strings)
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    chats = [[{"role": "user", "content": "a b c"}], [{"role": "user", "content": "a"}]]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    ref = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = encode_prompts(tok, chats)
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])


def test_every_caller_encodes_like_encode_prompt(tok):
    chat = [{"role": "user", "content": "a b"}]
    templated = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, chat) == templated
    assert encode_prompt(tok, "a b") == tok("a b")["input_ids"]
    assert encode_prompt(tok, [7, 8]) == [7, 8]
    assert encode_messages(tok, ["a b"]) == [templated]
    assert encode_messages(tok, ["a b"], chat_template=False) == [tok("a b", add_special_tokens=True)["input_ids"]]
    assert encode_question(tok, Question("q", "a b", "1")) == templated
    with pytest.raises(ValueError, match="a prompt must be"):
        encode_prompt(tok, [])
