"""Serving with eviction (dynts.serving): exactness inside transformers' continuous batching, budgets,
blocks returned to the pool, admission without preemption, clear errors."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

import dynts
from conftest import TINY, tiny_model
from dynts.evictors.base import Segment
from dynts.core.budget import fixed_budget
from dynts.evictors.fixed import FixedPositions
from dynts.serving import EvictionSettings, init_evicting_batching, missing_internals, serving_methods
from dynts.serving.batch import encode_prompt
from dynts.serving.compat import check_transformers_version

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 8


def cb_config(num_blocks: int = 64, max_batch_tokens: int = 64) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(num_blocks=num_blocks, page_size=PAGE, max_batch_tokens=max_batch_tokens)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, method, budget, local_window, max_new_tokens, predictor=None) -> list[int]:
    """Reference: dynts.generate on one request alone (greedy)."""
    out = dynts.generate(
        model, input_ids=torch.tensor([prompt]), method=method, budget=budget, local_window=local_window,
        predictor=predictor, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out.sequences[0].tolist()


def test_internals_used_still_exist():
    assert missing_internals() == []
    check_transformers_version("5.24.0")
    check_transformers_version("5.25.0")
    for bad in ("5.23.1", "5.26.0", "6.0.0"):
        with pytest.raises(ImportError, match="transformers>=5.24.0,<5.26.0"):
            check_transformers_version(bad)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_budget_above_every_length_matches_stock_generate_batch(family, attn):
    model = tiny_model(family)
    model.set_attn_implementation(attn)
    prompts = prompts_of([9, 4, 14], seed=3)
    gen = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=-1, pad_token_id=0)
    stock = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config())
    stock = [out.generated_tokens for out in stock.values()]
    assert model.config._attn_implementation == attn  # the stock manager restored it
    ours = dynts.generate_batch(
        model, None, prompts, method="window", budget=200, local_window=8, max_new_tokens=30,
        continuous_batching_config=cb_config(), eos_token_id=None,
    )
    assert [r.sequence for r in ours] == stock
    assert all(r.stats["evictions"] == 0 for r in ours)


SEPLLM = dynts.make_evictor("sepllm", separator_token_ids=tuple(range(3, 128, 4)))


@pytest.mark.parametrize("method", ["window", "streamingllm", "sepllm", "dynts"])
def test_each_request_equals_generate_alone(method):
    model = tiny_model("qwen2")
    evictor = SEPLLM if method == "sepllm" else method
    predictor = dynts.ImportancePredictor(model.config.hidden_size) if method == "dynts" else None
    prompts = prompts_of([8, 13, 5, 11], seed=1)
    budget, local_window, new = 24, 4, 50
    results = dynts.generate_batch(
        model, None, prompts, method=evictor, budget=budget, local_window=local_window, predictor=predictor,
        max_new_tokens=new, continuous_batching_config=cb_config(), eos_token_id=None,
    )
    for prompt, result in zip(prompts, results):
        assert result.sequence == alone(model, prompt, evictor, budget, local_window, new, predictor)
        assert result.stats["evictions"] >= 3
        assert result.stats["peak_slots"] <= budget


def test_fixed_set_equals_generate_alone():
    model = tiny_model("llama")
    prompts = prompts_of([6, 6], seed=4)
    keep = FixedPositions(keep=[list(range(6)) + [7, 9, 11, 13]])
    bounds = fixed_budget(kept=10, question_length=6, capacity=20)
    kw = dict(method=keep, budget=bounds.budget, local_window=bounds.local_window, retention=bounds.retention)
    results = dynts.generate_batch(
        model, None, prompts, **kw, max_new_tokens=20, continuous_batching_config=cb_config(), eos_token_id=None
    )
    for prompt, result in zip(prompts, results):
        ref = dynts.generate(model, input_ids=torch.tensor([prompt]), **kw, max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        assert result.sequence == ref.sequences[0].tolist()
        assert result.stats["evictions"] == 1


def test_staggered_arrivals_chunked_prefill_small_pool():
    """Requests of different lengths arrive while others decode; prompts longer than a batch are
    prefilled in chunks; the pool holds only a few reservations: admission waits, never preempts."""
    model = tiny_model("llama")
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    budget, local_window, new = 32, 4, 60
    settings = EvictionSettings("dynts", budget, local_window, predictor=predictor)
    prompts = prompts_of([20, 7, 26, 12, 17, 5], seed=2)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # 12 blocks of 8 slots; each request reserves ceil(32 / 8) = 4 blocks -> at most 3 in flight
    manager = init_evicting_batching(model, settings, generation_config=gen,
                                     continuous_batching_config=cb_config(num_blocks=12, max_batch_tokens=16))
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=new) for p in prompts[:3]]
        time.sleep(0.2)
        ids += [manager.add_request(p, max_new_tokens=new) for p in prompts[3:]]
        outputs = {}
        deadline = time.monotonic() + 120
        while len(outputs) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                outputs[out.request_id] = out
        engine = manager.engine_stats()
        stats = {rid: manager.request_stats(rid) for rid in ids}
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert len(outputs) == len(ids)
    num_blocks = engine["num_blocks"]
    assert engine["preemptions"] == 0
    assert engine["blocks_in_use"] == 0 and engine["free_blocks"] == num_blocks  # all blocks back in the pool
    assert engine["peak_blocks_in_use"] <= num_blocks
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].error is None
        assert outputs[rid].generated_tokens == alone(model, prompt, "dynts", budget, local_window, new, predictor)
        assert stats[rid]["peak_slots"] <= budget
        assert stats[rid]["peak_blocks"] <= stats[rid]["reserved_blocks"] == 4
        assert stats[rid]["evictions"] >= 2
    assert sum(s["freed_blocks"] for s in stats.values()) > 0  # tail blocks went back at eviction events


def test_blocks_freed_at_eviction_events():
    """Blocks in use drop after events: the pool holds fewer blocks than the same run without eviction."""
    model = tiny_model("qwen2")
    prompts = prompts_of([6, 6, 6], seed=5)
    kw = dict(max_new_tokens=70, continuous_batching_config=cb_config(), eos_token_id=None)
    settings = EvictionSettings("window", 24, 2, retention=0.2)
    manager = init_evicting_batching(model, settings, generation_config=GenerationConfig(
        max_new_tokens=70, do_sample=False, eos_token_id=-1), continuous_batching_config=cb_config())
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=70) for p in prompts]
        done = 0
        while done < len(ids):
            out = manager.get_result(timeout=30)
            assert out is not None
            done += out.is_finished()
        trace = [n for _, n, _ in manager.engine_stats()["block_trace"]]
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert max(trace) <= 3 * 3  # ceil(24 / 8) blocks per request
    assert any(b < a for a, b in zip(trace, trace[1:]))  # blocks went back mid-run, not only at the end
    full = dynts.generate_batch(model, None, prompts, method="full", **kw)
    assert all(r.stats["peak_slots"] == 6 + 70 - 1 for r in full)


def test_request_larger_than_the_pool_fails_clearly():
    model = tiny_model("qwen2")
    with pytest.raises(RuntimeError, match="reserves 20 KV blocks .* the pool holds 12"):
        dynts.generate_batch(model, None, [[5] * 5], method="window", budget=200, local_window=4, max_new_tokens=155,
                             continuous_batching_config=cb_config(num_blocks=12), eos_token_id=None)


def test_unsupported_methods_and_bad_input_raise():
    served = set(serving_methods())  # other packages may register more budget-only methods (testbed-oracle)
    assert {"full", "window", "streamingllm", "sepllm", "fixed", "dynts"} <= served
    assert not served & {"h2o", "snapkv", "rkv"}
    model = tiny_model("qwen2")
    for method in ("h2o", "snapkv", "rkv"):
        with pytest.raises(ValueError, match=r"attention statistics.*choose one of \['dynts'"):
            dynts.generate_batch(model, None, [[5, 6]], method=method, budget=32, local_window=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompts\\[1\\]: budget=16 is smaller than question"):
        dynts.generate_batch(model, None, [[5] * 4, [5] * 14], method="window", budget=16, local_window=4,
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="needs predictor"):
        EvictionSettings("dynts", 32, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dynts.generate_batch(model, None, [[5, 6]], method="window", budget=32, local_window=4, max_new_tokens=-1)
    with pytest.raises(ValueError, match="unknown"):
        EvictionSettings("nope", 32, 4)
    with pytest.raises(ValueError, match="one row to every request"):
        EvictionSettings(FixedPositions(keep=[[0, 1], [0, 2]]), 32, 4).check_served()


def test_sliding_window_models_are_rejected():
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    model = Qwen2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="full-attention models only"):
        init_evicting_batching(model, EvictionSettings("window", 32, 4))


def test_mla_models_are_rejected():
    """Multi-head latent attention (DeepSeek-V3's): transformers 5.25's engine caches a latent row per token,
    no per-head K/V to gather; refused before any engine is built, on every supported release."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)
    model = DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="multi-head latent attention"):
        init_evicting_batching(model, EvictionSettings("window", 32, 4))


@pytest.mark.slow
def test_smollm2_chats_equal_generate_alone_and_stock(smollm2):
    model, tokenizer = smollm2
    chats = [[{"role": "user", "content": text}] for text in
             ("What is 7 times 8?", "Name a prime number.<|im_end|> Then stop.", "Say hi")]
    kw = dict(method="streamingllm", local_window=8, max_new_tokens=40)
    prompt_lengths = [len(encode_prompt(tokenizer, c)) for c in chats]
    budget = max(prompt_lengths) + 8 + 12
    results = dynts.generate_batch(model, tokenizer, chats, budget=budget, **kw,
                                   continuous_batching_config=cb_config(num_blocks=128, max_batch_tokens=128))
    for chat, result in zip(chats, results):
        ref = dynts.generate(model, tokenizer, [chat], budget=budget, **kw, do_sample=False)
        n = ref.stats["lengths"][0]
        assert result.sequence == ref.sequences[0, :n].tolist()
        assert result.stats["peak_slots"] <= budget
    assert sum(r.stats["evictions"] for r in results) >= 3
    ids = [r.prompt_ids for r in results]
    gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=model.generation_config.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    stock = model.generate_batch(ids, generation_config=gen, continuous_batching_config=cb_config(128, 128))
    ours = dynts.generate_batch(model, tokenizer, chats, budget=4096, **kw,
                                continuous_batching_config=cb_config(num_blocks=128, max_batch_tokens=128))
    assert [r.sequence for r in ours] == [o.generated_tokens for o in stock.values()]


def test_without_admission_control_preempted_requests_fail_or_stay_exact(monkeypatch):
    """Bypass the reservation gate so the stock scheduler over-admits and preempts (soft reset: prompt +
    generated tokens are re-prefilled). A request that had not evicted yet must still equal generate alone
    (its question window stays its own prompt); one that had must fail with a clear error."""
    from dynts.serving.processor import EvictingBatchProcessor

    monkeypatch.setattr(EvictingBatchProcessor, "_admissible", lambda self, waiting: waiting)
    model = tiny_model("llama")
    # n_keep = 7 (one block), B = 16 (two blocks): every request frees and re-claims a block per event
    budget, local_window, retention, new = 16, 2, 0.1, 60
    prompts = prompts_of([5, 5, 4, 5, 3, 5, 4, 5], seed=7)  # the engine preempts the newest requests
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    settings = EvictionSettings("window", budget, local_window, retention)
    manager = init_evicting_batching(model, settings, generation_config=gen,
                                     continuous_batching_config=cb_config(num_blocks=9, max_batch_tokens=64))
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=new) for p in prompts]
        outputs = {}
        while len(outputs) < len(ids):
            out = manager.get_result(timeout=60)
            assert out is not None
            if out.is_finished():
                outputs[out.request_id] = out
        preemptions = manager.engine_stats()["preemptions"]
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert preemptions > 0
    failed = [o for o in outputs.values() if o.error]
    assert all("was preempted after" in o.error and "eviction events" in o.error for o in failed)
    assert len(failed) < len(outputs)
    for rid, prompt in zip(ids, prompts):
        if outputs[rid].error is None:
            ref = dynts.generate(model, input_ids=torch.tensor([prompt]), method="window", budget=budget,
                                 local_window=local_window, retention=retention, max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            assert outputs[rid].generated_tokens == ref.sequences[0].tolist()


def test_soft_reset_after_eviction_fails_the_request_clearly():
    """Drive the engine step by step; once a request has evicted, soft-reset it exactly as the engine's
    offloading manager does (re-prefill prompt + generated): the guard must fail it with a clear error."""
    model = tiny_model("qwen2")
    gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = init_evicting_batching(model, EvictionSettings("window", 16, 2), generation_config=gen,
                                     continuous_batching_config=cb_config())
    processor = manager._create_batch_processor()
    manager.batch_processor = processor
    try:
        rid = manager.add_request(prompts_of([5])[0], max_new_tokens=40)
        with torch.no_grad():
            while not processor.policy.get(rid) or processor.policy.get(rid).evictions == 0:
                assert processor.prepare_next_batch()
                processor._generation_step(model)
                processor.update_batch()
        scheduler = processor.scheduler
        state = scheduler.active_requests[rid]
        scheduler.finish_request(rid)
        scheduler.add_waiting_request(state.create_equivalent_initial_request())
        processor._after_preemption([rid])
        out = manager.output_router.output_queue.get(timeout=5)
    finally:
        manager.destroy()
    assert out.request_id == rid and out.error is not None
    assert "was preempted after 1 eviction events" in out.error
    assert rid not in processor.scheduler.waiting_requests and rid not in processor.slots



def test_split_delimiter_segments_and_kept_slots_equal_generate_alone(monkeypatch):
    """A 3-token thinking delimiter the tiny model emits on its own (greedy) in two of four requests, after
    eviction events. Under ``dynts`` (answer protection: the kept set depends on the segments) every
    eviction event of a request sees the same positions and segments and keeps the same slots as
    ``dynts.generate`` on that request alone with the same delimiter; tokens and final slots agree too."""
    from dynts.serving.processor import EvictingBatchProcessor

    events = defaultdict(list)  # question length (unique per prompt) -> [(positions, segments, kept)]
    evictor_cls = type(dynts.make_evictor("dynts"))
    call = evictor_cls.__call__

    def recording(self, info):
        kept = call(self, info)
        for r in range(kept.shape[0]):
            events[info.question_length].append(
                (info.positions[r].tolist(), info.segments[r].tolist(), kept[r].tolist()))
        return kept

    finals = {}
    release = EvictingBatchProcessor._release

    def snapshot(self, rid):
        entry, table = self.slots[rid], self.table
        finals[rid] = (self.policy.get(rid).shift, entry.in_answer, table.positions[entry.row].clone(),
                       table.segments[entry.row].clone(), table.token_ids[entry.row].clone())
        release(self, rid)

    monkeypatch.setattr(evictor_cls, "__call__", recording)
    monkeypatch.setattr(EvictingBatchProcessor, "_release", snapshot)
    model = tiny_model("qwen2")
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    prompts = prompts_of([8, 13, 5, 11], seed=1)
    delimiter = (11, 46, 52)  # greedy emits it at generated tokens 18-20 of request 1 and 36-38 of request 3
    budget, local_window, new = 24, 4, 50
    kw = dict(method="dynts", budget=budget, local_window=local_window, predictor=predictor, max_new_tokens=new,
              think_end=delimiter)
    results = dynts.generate_batch(model, None, prompts, **kw, continuous_batching_config=cb_config(), eos_token_id=None)
    served, events = dict(events), defaultdict(list)
    answered = 0
    for prompt, result in zip(prompts, results):
        ref = dynts.generate(model, input_ids=torch.tensor([prompt]), **kw, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert result.sequence == ref.sequences[0].tolist()
        assert served[len(prompt)] == events[len(prompt)] and len(events[len(prompt)]) >= 3
        cache = ref.cache
        shift, in_answer, positions, segments, token_ids = finals[result.request_id]
        n = len(prompt) + new - 1 - shift
        assert n == cache.length
        assert positions[:n].tolist() == cache.positions[0, :n].tolist()
        assert segments[:n].tolist() == cache.segments[0, :n].tolist()
        assert token_ids[:n].tolist() == cache.token_ids[0, :n].tolist()
        assert in_answer == bool(cache.in_answer[0])
        if in_answer:  # at every later event, the delimiter's stored tokens and everything after them are answer
            answered += 1
            start = next(i for i in range(new) if tuple(result.sequence[i : i + 3]) == delimiter) + len(prompt)
            later = [(p, s) for p, s, _ in served[len(prompt)] if p[-1] >= start + 2]
            assert later and any(start in p for p, _ in later)  # a delimiter piece was stored at an event
            for p, s in later:
                assert all(seg == (Segment.ANSWER if pos >= start else Segment.THINKING)
                           for pos, seg in zip(p, s) if pos >= len(prompt))
    assert answered == 2


def test_generate_batch_follows_the_generation_config_unless_overridden(monkeypatch):
    """Like dynts.generate: the model's generation_config decides sampling; keyword arguments override it."""
    import dynts.serving.batch as batch

    seen = []

    class Stop(Exception):
        pass

    def capture(model, settings, *, generation_config, **kwargs):
        seen.append(generation_config)
        raise Stop

    monkeypatch.setattr(batch, "init_evicting_batching", capture)
    model = tiny_model("qwen2")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    for overrides in ({}, {"do_sample": False}):
        with pytest.raises(Stop):
            dynts.generate_batch(model, None, [[5, 6]], method="window", budget=32, local_window=4, max_new_tokens=4,
                                 **overrides)
    assert seen[0].do_sample is True and seen[0].temperature == 0.7 and seen[0].max_new_tokens == 4
    assert seen[1].do_sample is False
    assert model.generation_config.max_new_tokens != 4  # the model's own config is left as it was
