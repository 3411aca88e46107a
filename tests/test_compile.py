"""The static-layout cache and the compiled decode step match the eager bounded cache.

Static layout eager (every method, padded batch): same kept positions every step, logits within
float noise. Compiled (``torch.compile`` on CPU, ~5-10 s per graph): token-identical to the eager
bounded cache under greedy decoding, with and without eviction, statistics included; the graph is
compiled once per model and method and reused by the next call (no recompilation, no graph break).
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from torch._dynamo.utils import counters

import dynts
from dynts.compiled import check_single_device, compiled_decode
from conftest import decode_with_cache, padded_batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["window", "streamingllm", "h2o", "snapkv", "rkv", "dynts", "sepllm"]


def _predictor(model):
    torch.manual_seed(1)
    return dynts.ImportancePredictor(model.config.hidden_size).eval()


def _evictor(method):
    options = {"separator_token_ids": tuple(range(3, 128, 9))} if method == "sepllm" else {}
    return dynts.make_evictor(method, **options)


@pytest.mark.parametrize("method", METHODS)
def test_static_layout_matches_dynamic(qwen2, method):
    ids, mask = padded_batch([18, 11, 15], seed=3)
    predictor = _predictor(qwen2)
    runs = [
        decode_with_cache(qwen2, ids, mask, _evictor(method), 32, 40, predictor, static=static)
        for static in (False, True)
    ]
    (seq_a, logits_a, visible_a, sizes_a, cache_a), (seq_b, logits_b, visible_b, sizes_b, cache_b) = runs
    assert cache_a.stats.evictions > 1 and cache_b.stats.evictions == cache_a.stats.evictions
    assert torch.equal(seq_a, seq_b)
    assert visible_a == visible_b and sizes_a == sizes_b
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-5)
    assert cache_b.capacity == cache_a.capacity  # fixed buffers: never grown
    n = cache_a.length
    if cache_a.attention is not None:
        torch.testing.assert_close(cache_b.attention[:, :n], cache_a.attention[:, :n], rtol=1e-4, atol=1e-5)
    if cache_a.window_attention is not None:  # the observation rows, in time order
        torch.testing.assert_close(cache_b.ordered_window_attention()[..., :n], cache_a.ordered_window_attention()[..., :n],
                                   rtol=1e-4, atol=1e-5)


def test_static_full_cache_needs_max_length(qwen2):
    cache = dynts.build_cache(qwen2, dynts.make_evictor("full"), None, static=True)
    ids, mask = padded_batch([5], seed=0)
    with pytest.raises(ValueError, match="max_length"), dynts.attach(qwen2, cache), torch.no_grad():
        qwen2(input_ids=ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="max_length"):
        dynts.build_cache(qwen2, dynts.make_evictor("full"), None, static=True, max_length=0)


def test_bad_compile_mode(qwen2):
    ids, mask = padded_batch([6], seed=0)
    with pytest.raises(ValueError, match="compile mode"):
        dynts.generate(qwen2, input_ids=ids, attention_mask=mask, method="full", max_new_tokens=2, compile="fast")


def test_compile_on_a_multi_gpu_dispatch_is_a_clear_error(qwen2, monkeypatch):
    ids, mask = padded_batch([6], seed=0)
    monkeypatch.setattr(qwen2, "hf_device_map", {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}, raising=False)
    with pytest.raises(ValueError, match="single-device") as err:
        dynts.generate(qwen2, input_ids=ids, attention_mask=mask, method="full", max_new_tokens=2, compile=True)
    assert "['0', '1']" in str(err.value) and "compile=False" in str(err.value)
    assert "forward" not in qwen2.__dict__  # nothing was patched
    monkeypatch.setattr(qwen2, "hf_device_map", {"": 0}, raising=False)  # one device: compiles as usual
    check_single_device(qwen2)


@pytest.fixture(scope="module")
def compile_model():
    torch._dynamo.reset()
    return tiny_model("qwen2", seed=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "budget"),
    [("full", None), ("h2o", 40), ("snapkv", 40), ("dynts", 40)],  # no eviction; attention (and window) recording; scores
)
def test_compiled_decode_is_token_identical(compile_model, method, budget):
    ids, mask = padded_batch([21, 13], seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, method=method, budget=budget, local_window=8,
              max_new_tokens=48, predictor=_predictor(compile_model))
    eager = dynts.generate(compile_model, **kw)
    counters.clear()
    compiled = dynts.generate(compile_model, compile=True, **kw)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # one decode graph; prefill stays eager
    again = dynts.generate(compile_model, compile=True, **kw)  # a new cache reuses the graph
    assert counters["stats"]["unique_graphs"] == 1
    for result in (compiled, again):
        assert torch.equal(result.sequences, eager.sequences)
        assert result.stats["evictions"] == eager.stats["evictions"]
        assert result.cache.kept_positions(0).tolist() == eager.cache.kept_positions(0).tolist()
    if budget is not None:
        assert eager.stats["evictions"] >= 2
    else:
        assert compiled.cache.capacity == max(64, ids.shape[1] + 48)  # prompt + new tokens, allocated once
    n = eager.cache.length
    a, b = eager.cache, again.cache
    for ref, got in ((a.attention, b.attention), (a.scores, b.scores), (a.ordered_window_attention(), b.ordered_window_attention())):
        if ref is not None and not ref[..., :n].isnan().all():
            torch.testing.assert_close(got[..., :n], ref[..., :n], rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.slow
def test_compiled_lanes_of_one_shape_keep_their_own_hooks():
    """Methods whose decode graphs have identical shapes (same batch, same capacity) but different
    work (nothing / attention recording / predictor scores) each get their own graph: torch.compile
    does not guard on hooks, so a graph traced for one must never serve another."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", seed=3)
    ids, mask = padded_batch([17, 12], seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, budget=36, local_window=8, max_new_tokens=40, eos_token_id=None, pad_token_id=0,
              predictor=_predictor(model))
    for method in ("window", "dynts", "h2o", "dynts"):
        eager = dynts.generate(model, method=method, **kw)
        compiled = dynts.generate(model, method=method, compile=True, **kw)
        assert eager.stats["evictions"] >= 2 and compiled.cache.capacity == eager.cache.capacity
        assert torch.equal(compiled.sequences, eager.sequences), method
        n = eager.cache.length
        torch.testing.assert_close(compiled.cache.scores[:, :n], eager.cache.scores[:, :n], equal_nan=True,
                                   rtol=1e-4, atol=1e-5)
        if eager.cache.attention is not None:
            torch.testing.assert_close(compiled.cache.attention[:, :n], eager.cache.attention[:, :n],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_step_without_position_ids_compiles_once():
    """A caller that passes no position_ids (the model derives them from get_seq_length) still gets
    one graph for every step, and the same tokens as the eager cache."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", seed=5)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    tokens = {}
    for compile_ in (False, True):
        cache = dynts.build_cache(model, dynts.make_evictor("window"), dynts.Budget(24, 4, 0.5), static=compile_)
        counters.clear()
        with torch.no_grad(), dynts.attach(model, cache), ExitStack() as stack:
            if compile_:
                stack.enter_context(compiled_decode(model))
            out = model(input_ids=ids, cache=cache)
            seq = []
            for _ in range(30):
                token = out.logits[:, -1:].argmax(-1)
                seq.append(token)
                out = model(input_ids=token, cache=cache)
        tokens[compile_] = torch.cat(seq, 1)
        assert cache.stats.evictions >= 2
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(tokens[True], tokens[False])
