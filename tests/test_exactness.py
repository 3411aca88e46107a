"""With a budget that never fills, every method must be token-identical to plain ``model.generate``."""

from __future__ import annotations

import pytest
import torch

import dynts
from conftest import padded_batch

METHODS = ["full", "window", "streamingllm", "dynts", "h2o", "snapkv", "sepllm", "rkv", "random"]


def reference(model, ids, mask, new):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lengths", [[9], [5, 12, 3, 8]], ids=["batch1", "batch4-padded"])
def test_no_eviction_is_exact(family_model, method, lengths):
    ids, mask = padded_batch(lengths)
    new = 24
    expected = reference(family_model, ids, mask, new)
    predictor = dynts.ImportancePredictor(family_model.config.hidden_size)
    result = dynts.generate(
        family_model, input_ids=ids, attention_mask=mask, method=method, budget=ids.shape[1] + new + 8,
        local_window=4, predictor=predictor, max_new_tokens=new, pad_token_id=0, do_sample=False,
    )
    assert result.stats["evictions"] == 0
    assert torch.equal(result.sequences, expected)


@pytest.mark.slow
def test_smollm2_no_eviction_is_exact(smollm2):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "Two plus two equals four, and three plus three", "Hi", "Count: 1, 2, 3,"]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    new = 6
    expected = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for method in ["window", "dynts"]:
        result = dynts.generate(
            model, tokenizer, prompts, method=method, budget=64, local_window=8,
            predictor=dynts.ImportancePredictor(model.config.hidden_size), max_new_tokens=new, do_sample=False,
        )
        assert torch.equal(result.sequences, expected[:, enc["input_ids"].shape[1] :]), method
