"""Serving without a way to kill the engine: request limits for every method, engine errors kept to their
requests, per-request sampling, the default pool sized from free memory, the metric names."""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig

import dynts
from conftest import tiny_model
from dynts.serving import EvictionSettings, init_evicting_batching
from dynts.serving import pool as pool_module
from dynts.serving.admission import EVICTING_MAX_TOKENS, AdmissionError, Limits, default_max_tokens
from dynts.metrics import METRICS, render_prometheus, usage_dynts
from dynts.serving.pool import plan_pool
from dynts.serving.sampling import PerRequestSampler, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 8


# ---------------------------------------------------------------------------------------------- limits
def test_limits_for_the_full_cache():
    limits = Limits(EvictionSettings("full"), num_blocks=32, page_size=PAGE, max_position_embeddings=1024,
                    max_tokens=1024)
    assert limits.admit(10, None) == 246  # what is left of the 256-token pool
    assert limits.admit(10, 50) == 50
    with pytest.raises(AdmissionError, match="holds at most 256 tokens per request .*KV pool"):
        limits.admit(300, 4)
    with pytest.raises(AdmissionError, match="lower max_tokens to 246 or less"):
        limits.admit(10, 247)
    with pytest.raises(AdmissionError, match="over this server's cap of 1024"):
        limits.admit(10, 2000)
    small_context = Limits(EvictionSettings("full"), 32, PAGE, max_position_embeddings=64, max_tokens=64)
    with pytest.raises(AdmissionError, match="max_position_embeddings=64"):
        small_context.admit(70, 1)
    with pytest.raises(AdmissionError, match="empty"):
        limits.admit(0, 1)
    assert default_max_tokens(EvictionSettings("full"), 1024) == 1024


def test_limits_for_an_evicting_method():
    settings = EvictionSettings("window", 64, 8)
    limits = Limits(settings, num_blocks=16, page_size=PAGE, max_position_embeddings=1024,
                    max_tokens=default_max_tokens(settings, 1024))
    assert limits.max_tokens == EVICTING_MAX_TOKENS
    assert limits.admit(10, None) == EVICTING_MAX_TOKENS  # evicting: the cache never outgrows B
    with pytest.raises(AdmissionError, match="budget=64 is smaller than question"):
        limits.admit(60, 4)
    small = Limits(settings, num_blocks=4, page_size=PAGE, max_position_embeddings=1024, max_tokens=100)
    with pytest.raises(AdmissionError, match="reserves 8 KV blocks .* pool holds 4"):
        small.admit(10, 100)
    assert small.admit(10, 20) == 20  # 30 slots: 4 blocks
    with pytest.raises(ValueError, match="num_blocks=0 must be a positive int"):
        Limits(settings, 0, PAGE, None, 10)


# ---------------------------------------------------------------------------------------------- isolation
def test_an_engine_error_fails_only_its_request_and_the_engine_keeps_serving():
    """The full cache, no admission in front: a request that outgrows the pool (the stock engine's "No requests
    can be scheduled and no requests can be offloaded") fails alone; the engine keeps serving the others."""
    model = tiny_model("llama")
    cb = ContinuousBatchingConfig(num_blocks=8, page_size=PAGE, max_batch_tokens=32)  # 64 tokens
    manager = init_evicting_batching(model, EvictionSettings("full"), continuous_batching_config=cb,
                                     per_request_sampling=True)
    manager.start()
    try:
        big = manager.add_request([5, 6, 7, 8, 9, 10], max_new_tokens=200, eos_token_id=-1)
        small = manager.add_request([11, 12, 13], max_new_tokens=10, eos_token_id=-1)
        results = {}
        while len(results) < 2:
            out = manager.get_result(timeout=60)
            assert out is not None, "the engine stopped answering"
            if out.is_finished():
                results[out.request_id] = out
        assert "No requests can be scheduled" in (results[big].error or "")
        assert results[small].error is None and len(results[small].generated_tokens) == 10
        assert manager.is_running()
        after = manager.add_request([14, 15], max_new_tokens=5, eos_token_id=-1)
        out = manager.get_result(after, timeout=60)
        assert out is not None and out.error is None and len(out.generated_tokens) == 5
        assert manager.last_processor.blocks_in_use() == 0
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()


# ---------------------------------------------------------------------------------------------- sampling
def test_sampling_params_validate_every_field():
    for bad in (dict(temperature=-1), dict(temperature=2.5), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                dict(frequency_penalty=-5), dict(presence_penalty=3), dict(seed=1.5), dict(temperature=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    default = SamplingParams(temperature=0.6, top_p=0.95)
    assert SamplingParams.from_request({"seed": 3}, default) == SamplingParams(0.6, 0.95, seed=3)
    assert SamplingParams.from_request({"temperature": 0, "top_p": None}, default).greedy


class Future:
    def __init__(self, rid: str, generated: list[int]) -> None:
        self.has_new_token = True
        self.state = type("State", (), {"request_id": rid, "generated_tokens": generated, "initial_tokens": [],
                                        "_true_initial_tokens": 0})()


def sample(params: dict[str, SamplingParams], logits: torch.Tensor, generated=None) -> list[int]:
    sampler = PerRequestSampler(params.get, SamplingParams())
    sampler.prepare([Future(rid, (generated or {}).get(rid, [])) for rid in params])
    out = torch.zeros(2, logits.shape[0], dtype=torch.long)
    sampler(logits.unsqueeze(0), out)
    return out[0].tolist()


def test_each_row_samples_with_its_own_parameters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    best = logits.argmax(-1).tolist()
    params = {"greedy": SamplingParams(), "top1": SamplingParams(temperature=1.5, top_k=1),
              "nucleus": SamplingParams(temperature=1.0, top_p=1e-6), "seeded": SamplingParams(temperature=2.0, seed=5)}
    first = sample(params, logits)
    assert first[:3] == best[:3]  # greedy, top-k 1 and a tiny nucleus all pick the argmax
    draws = {sample({"seeded": SamplingParams(temperature=2.0, seed=5)}, logits[3:])[0] for _ in range(3)}
    assert draws == {first[3]}  # the same seed, the same draw
    spread = {sample({f"r{i}": SamplingParams(temperature=2.0, seed=i)}, logits[3:])[0] for i in range(20)}
    assert len(spread) > 1


def test_per_request_sampling_with_chunked_prefill_equals_each_request_alone():
    """Requests still prefilling (a prompt split over forwards) leave filler logits rows the sampler must skip."""
    model = tiny_model("llama")
    cb = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, max_batch_tokens=16)
    manager = init_evicting_batching(model, EvictionSettings("window", 32, 4), per_request_sampling=True,
                                     continuous_batching_config=cb)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 24, 20)]
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=40, eos_token_id=-1, sampling=SamplingParams()) for p in prompts]
        outs = {rid: manager.get_result(rid, timeout=60) for rid in ids}
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    for rid, prompt in zip(ids, prompts):
        reference = dynts.generate(model, input_ids=torch.tensor([prompt]), method="window", budget=32, local_window=4,
                                   max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert outs[rid].error is None and outs[rid].generated_tokens == reference.sequences[0].tolist()


def test_penalties_push_generated_tokens_down():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    assert sample({"a": SamplingParams()}, logits) == [3]
    assert sample({"a": SamplingParams(frequency_penalty=0.6)}, logits, {"a": [3, 3]}) == [0]
    assert sample({"a": SamplingParams(presence_penalty=2.0)}, logits, {"a": [3, 3, 3]}) == [0]
    assert sample({"a": SamplingParams(frequency_penalty=0.6)}, logits, {"a": [3]}) == [3]


def test_sampling_rule_follows_the_model_config_and_the_request():
    model = tiny_model("llama")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    manager = init_evicting_batching(model, EvictionSettings("full"), per_request_sampling=True,
                                     continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, page_size=PAGE))
    assert manager.default_sampling == SamplingParams(temperature=0.7)  # top_p, top_k unset: off
    assert not manager.generation_config.do_sample and manager.generation_config.temperature is None
    with pytest.raises(ValueError, match="per_request_sampling=True"):
        init_evicting_batching(model, EvictionSettings("full")).add_request([5, 6], sampling=SamplingParams())


# ---------------------------------------------------------------------------------------------- pool
def test_default_pool_from_free_memory(monkeypatch):
    model = tiny_model("llama")  # fp32, 2 layers x 2 KV heads x head 16: 512 B per token, 4 KiB per block of 8
    per_block = 2 * 2 * 2 * 16 * 4 * PAGE
    gib = 1024**3
    monkeypatch.setattr(pool_module, "free_memory", lambda device: (100 * gib, "test"))
    plan = plan_pool(model, EvictionSettings("window", 64, 8), PAGE)
    assert plan.num_blocks == 256 * 8 and "256 requests x 64 tokens" in plan.describe()
    assert plan.bytes_per_block == per_block
    monkeypatch.setattr(pool_module, "free_memory", lambda device: (2 * gib + 40 * per_block, "test"))
    plan = plan_pool(model, EvictionSettings("window", 64, 8), PAGE)
    assert plan.num_blocks == 40 and "minus 2.00 GiB headroom" in plan.describe()
    with pytest.raises(MemoryError, match="one request of 1024 tokens needs 128"):
        plan_pool(model, EvictionSettings("full"), PAGE)  # the full cache at max_position_embeddings=1024


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_render_as_prometheus_text():
    parser = pytest.importorskip("prometheus_client.parser")
    stats = {m.key: i for i, m in enumerate(METRICS)}
    stats["generation_tokens_per_second"] = 12.5
    text = render_prometheus(stats, {"model": 'a "quoted" \\ name'})
    samples = {s.name: s for f in parser.text_string_to_metric_families(text) for s in f.samples}
    assert len(samples) == len(METRICS)
    assert samples["dynts_evictions_total"].value == stats["evictions"]
    assert samples["dynts_generation_tokens_per_second"].value == 12.5
    assert samples["dynts_kv_blocks_in_use"].labels == {"model": 'a "quoted" \\ name'}
    assert render_prometheus({}) == "\n"
    assert usage_dynts([{"peak_slots": 5, "evictions": 2}, {"peak_slots": 9, "evictions": 1, "evicted_tokens": 4}]) == \
        {"peak_slots": 9, "evictions": 3, "evicted_tokens": 4, "freed_blocks": 0}
