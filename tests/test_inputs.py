"""Bad input gets a ValueError naming the parameter and the fix."""

from __future__ import annotations

import pytest
import torch

import dynts
from dynts.hf_compat import cache_keyword
from conftest import padded_batch


@pytest.fixture()
def ids():
    return padded_batch([10])


def run(model, ids, **kw):
    options = dict(method="window", budget=64, local_window=8, max_new_tokens=4, pad_token_id=0)
    options.update(kw)
    return dynts.generate(model, input_ids=ids[0], attention_mask=ids[1], **options)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(budget=12, local_window=8), ["budget=12", "local_window"]),
        (dict(budget=0), ["budget=0"]),
        (dict(budget=-5), ["budget=-5"]),
        (dict(local_window=-1), ["local_window=-1"]),
        (dict(retention=0.0), ["retention=0.0", "(0, 1]"]),
        (dict(retention=1.5), ["retention=1.5"]),
        (dict(method="nope"), ["method='nope'", "dynts", "window"]),
        (dict(max_new_tokens=0), ["max_new_tokens=0"]),
        (dict(method="dynts"), ["predictor"]),
        (dict(method="streamingllm", method_options={"sink_size": -1}), ["sink_size=-1"]),
        (dict(method="window", budget=None), ["budget"]),
    ],
)
def test_bad_arguments(qwen2, ids, kw, words):
    with pytest.raises(ValueError) as err:
        run(qwen2, ids, **kw)
    for word in words:
        assert word in str(err.value)


def test_predictor_hidden_size_mismatch(qwen2, ids):
    with pytest.raises(ValueError, match="hidden_size 32 != 64"):
        run(qwen2, ids, method="dynts", predictor=dynts.ImportancePredictor(32))


def test_prompt_longer_than_model_maximum(qwen2):
    long = torch.randint(3, 100, (1, qwen2.config.max_position_embeddings + 1))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dynts.generate(qwen2, input_ids=long, method="full", max_new_tokens=1)


def test_prompts_need_tokenizer(qwen2):
    with pytest.raises(ValueError, match="tokenizer"):
        dynts.generate(qwen2, prompts="hello", method="full", max_new_tokens=1)


def test_cache_refuses_untracked_forward(qwen2, ids):
    cache = dynts.build_cache(qwen2, dynts.make_evictor("window"), dynts.Budget(64, 8))
    with pytest.raises(RuntimeError, match="dynts.attach"):
        qwen2(input_ids=ids[0], **{cache_keyword(qwen2): cache})  # before 5.24 a `cache=` never reaches the cache


def test_available_methods_lists_core():
    assert {"full", "window", "streamingllm", "dynts"} <= set(dynts.available_methods())
