"""Baselines H2O, SnapKV, SepLLM and R-KV: each kept set equals a brute-force evaluation of the
method's rule; the attention statistics the cache records equal eager attention; bad options fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dynts
from dynts.evictors import Segment, TokenInfo
from dynts.evictors.h2o import H2O
from dynts.evictors.rkv import RKV
from dynts.evictors.sepllm import SepLLM, separator_ids
from dynts.evictors.snapkv import SnapKV
from dynts.hf_compat import cache_keyword
from conftest import decode_with_cache, padded_batch, tiny_model

PADS = (0, 4, 9)  # left pads per row of the random cache
N, QUESTION, N_KEEP, LOCAL, WINDOW, HEADS, DIM, VOCAB = 34, 12, 20, 5, 6, 2, 8, 10


def random_info(seed: int) -> TokenInfo:
    """A cache of ``N`` slots in 3 rows (pads at the front of rows 1-2) with every statistic filled.

    Token ids come from a tiny vocabulary (separators recur); keys cluster around a few directions so
    that some pairs pass R-KV's similarity threshold; window attention is zero on slots newer than
    each query and on pads.
    """
    g = torch.Generator().manual_seed(seed)
    b = len(PADS)
    slot = torch.arange(N)
    positions = torch.stack([torch.sort(torch.randperm(3 * N, generator=g)[:N]).values for _ in range(b)])
    segments = torch.where(slot < QUESTION, int(Segment.QUESTION), int(Segment.THINKING)).repeat(b, 1)
    for r, p in enumerate(PADS):
        segments[r, :p] = int(Segment.PAD)
    valid = segments != Segment.PAD
    token_ids = torch.randint(3, VOCAB, (b, N), generator=g)
    attention = torch.rand(b, N, generator=g, dtype=torch.float64).float() * valid
    window = torch.rand(b, WINDOW, N, generator=g) * valid.unsqueeze(1)
    newest = N - WINDOW + torch.arange(WINDOW)  # query i saw slots <= newest[i]
    window = window.masked_fill(slot.view(1, 1, N) > newest.view(1, WINDOW, 1), 0.0)
    window[0, 0] = 0.0  # a query row never filled (fewer queries seen than the window)
    base = torch.randn(4, DIM, generator=g)
    which = torch.randint(0, 4, (b, HEADS, N), generator=g)
    noise = torch.randn(b, HEADS, N, DIM, generator=g)
    clustered = torch.rand(b, HEADS, N, 1, generator=g) < 0.5
    keys = torch.where(clustered, base[which] + 0.2 * noise, noise)
    return TokenInfo(
        positions=positions, segments=segments, token_ids=token_ids, n_keep=N_KEEP, local_window=LOCAL,
        question_length=QUESTION, attention=attention, window_attention=window, keys=keys,
    )


# ---------------------------------------------------------------------------- brute force
def evict_one_by_one(info: TokenInfo, row: int, protected: list[bool], victim_key) -> list[int]:
    """Drop the unprotected real slot with the smallest ``victim_key(slot)`` until ``n_keep`` remain;
    rows with fewer real slots than ``n_keep`` fill up with their most recent pads."""
    valid = (info.segments[row] != Segment.PAD).tolist()
    kept = [j for j in range(N) if valid[j]]
    while len(kept) > info.n_keep:
        victims = [j for j in kept if not protected[j]]
        assert victims, "test setup: protected slots alone exceed n_keep"
        kept.remove(min(victims, key=victim_key))
    pads = [j for j in range(N) if not valid[j]]
    while len(kept) < info.n_keep:
        kept.append(pads.pop())  # most recent pad first
    return sorted(kept)


def local_and_question(info: TokenInfo, row: int, keep_question: bool) -> list[bool]:
    seg = info.segments[row].tolist()
    return [j >= N - info.local_window or (keep_question and seg[j] == Segment.QUESTION) for j in range(N)]


def pool_plain(values: list[float], m: int, kernel: int, pooling: str) -> list[float]:
    """Pool the first ``m`` values with a centred window (zero outside ``[0, m)``); keep the rest."""
    out = list(values)
    half = kernel // 2
    for j in range(m):
        inside = [values[i] for i in range(j - half, j + half + 1) if 0 <= i < m]
        out[j] = max(inside + [0.0]) if pooling == "max" else sum(inside) / kernel
    return out


def brute_h2o(info, keep_question=False):
    att = info.attention.double().tolist()
    return [
        evict_one_by_one(info, r, local_and_question(info, r, keep_question), lambda j, r=r: (att[r][j], j))
        for r in range(len(PADS))
    ]


def brute_snapkv(info, w, kernel, pooling, keep_question=False):
    out = []
    for r in range(len(PADS)):
        votes = [sum(float(info.window_attention[r, q, j]) for q in range(WINDOW - w, WINDOW)) for j in range(N)]
        score = pool_plain(votes, N - info.local_window, kernel, pooling)
        out.append(evict_one_by_one(info, r, local_and_question(info, r, keep_question), lambda j, s=score: (s[j], j)))
    return out


def brute_sepllm(info, separators, sink_size, keep_question):
    out = []
    for r in range(len(PADS)):
        ids = info.token_ids[r].tolist()
        real = [j for j in range(N) if info.segments[r, j] != Segment.PAD]
        sinks = set(real[:sink_size])
        protected = [p or j in sinks for j, p in enumerate(local_and_question(info, r, keep_question))]
        # the oldest non-separator goes first; separators only once no other token is left
        out.append(evict_one_by_one(info, r, protected, lambda j, ids=ids: (ids[j] in separators, j)))
    return out


def brute_rkv(info, lam, w, kernel, pooling, threshold, keep_question=False):
    wa = info.window_attention.double().numpy()
    keys = info.keys.double().numpy()
    out = []
    for r in range(len(PADS)):
        real = [j for j in range(N) if info.segments[r, j] != Segment.PAD]
        importance, rows = np.zeros(N), 0
        for q in range(WINDOW - w, WINDOW):
            total = wa[r, q].sum()
            if total > 0:
                importance += wa[r, q] / total
                rows += 1
        importance = pool_plain(list(importance / max(rows, 1)), N - info.local_window, kernel, pooling)
        redundancy = np.zeros(N)
        for h in range(HEADS):
            unit = {j: keys[r, h, j] / (np.linalg.norm(keys[r, h, j]) + 1e-8) for j in real}
            sim = {(i, j): (0.0 if i == j else float(unit[i] @ unit[j])) for i in real for j in real}
            for i in real:
                similar = [j for j in real if j != i and sim[i, j] > threshold]
                if similar:
                    sim[i, max(similar)] = 0.0  # the most recent similar key is spared
            col = {j: sum(sim[i, j] for i in real) / len(real) for j in real}
            top = max(col.values())
            z = sum(math.exp(v - top) for v in col.values())
            for j in real:
                redundancy[j] += math.exp(col[j] - top) / z / HEADS
        score = [lam * importance[j] - (1 - lam) * redundancy[j] for j in range(N)]
        out.append(evict_one_by_one(info, r, local_and_question(info, r, keep_question), lambda j, s=score: (s[j], j)))
    return out


def kept_lists(evictor, info) -> list[list[int]]:
    kept = evictor(info)
    assert kept.shape == (len(PADS), N_KEEP)
    return kept.tolist()


# ---------------------------------------------------------------------------- rule == brute force
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep_question", [False, True])
def test_h2o_matches_brute_force(seed, keep_question):
    info = random_info(seed)
    assert kept_lists(H2O(keep_question=keep_question), info) == brute_h2o(info, keep_question)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("w,kernel,pooling,keep_question", [(6, 7, "max", False), (3, 5, "avg", False), (4, 1, "max", True)])
def test_snapkv_matches_brute_force(seed, w, kernel, pooling, keep_question):
    info = random_info(seed)
    evictor = SnapKV(observation_window=w, kernel_size=kernel, pooling=pooling, keep_question=keep_question)
    assert kept_lists(evictor, info) == brute_snapkv(info, w, kernel, pooling, keep_question)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("separators,sink_size,keep_question", [((4, 7), 4, True), ((3, 5, 6, 8, 9), 2, False), ((4,), 0, False)])
def test_sepllm_matches_brute_force(seed, separators, sink_size, keep_question):
    info = random_info(seed)
    evictor = SepLLM(separator_token_ids=separators, sink_size=sink_size, keep_question=keep_question)
    assert kept_lists(evictor, info) == brute_sepllm(info, set(separators), sink_size, keep_question)


def test_sepllm_drops_oldest_separators_only_when_they_overflow():
    info = random_info(0)
    everything = tuple(range(VOCAB))  # every token is a separator: SepLLM degrades to sinks + recent
    kept = SepLLM(separator_token_ids=everything, sink_size=2, keep_question=False)(info)
    for r, p in enumerate(PADS):
        assert kept[r].tolist() == [p, p + 1] + list(range(N - N_KEEP + 2, N))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "lam,w,kernel,pooling,threshold,keep_question",
    [(0.1, 6, 7, "max", 0.5, False), (0.5, 4, 3, "avg", 0.3, True), (0.0, 6, 7, "max", 0.5, False), (1.0, 2, 1, "max", 0.9, False)],
)
def test_rkv_matches_brute_force(seed, lam, w, kernel, pooling, threshold, keep_question):
    info = random_info(seed)
    evictor = RKV(mix_lambda=lam, observation_window=w, kernel_size=kernel, pooling=pooling,
                  similarity_threshold=threshold, keep_question=keep_question)
    assert kept_lists(evictor, info) == brute_rkv(info, lam, w, kernel, pooling, threshold, keep_question)


def test_rkv_redundancy_prefers_the_most_recent_copy():
    """Three identical keys: R-KV spares the newest copy, so the older ones score lower."""
    info = random_info(1)
    info.keys[:, :, 20] = info.keys[:, :, 22] = info.keys[:, :, 24] = 5.0 * torch.ones(DIM)
    info.window_attention.zero_()
    z = RKV(mix_lambda=0.0).scores(info)
    assert bool((z[:, 24] > z[:, 20]).all()) and bool((z[:, 24] > z[:, 22]).all())


# ---------------------------------------------------------------------------- recorded statistics
class H2OWithWindow(H2O):
    """H2O that also makes the cache record window attention and keys (to check all three at once)."""

    requires = frozenset({"attention", "window_attention", "keys"})


def test_recorded_statistics_equal_eager_attention(family_model):
    """Under real eviction with pads and GQA: the accumulated attention of every kept slot equals
    the eager attention it received (summed over layers, heads and every query that saw it), and the
    window rows equal the last queries' attention; compaction moves both with their slots."""
    model = family_model
    ids, mask = padded_batch([10, 6], seed=7)
    budget, steps, window = 22, 30, 5
    seq, _, visible, _, cache = decode_with_cache(model, ids, mask, H2OWithWindow(), budget, steps, observation_window=window)
    assert cache.stats.evictions >= 3

    b, m = ids.shape
    total = seq.shape[1]  # every token was fed (the loop feeds each sampled token)
    allowed = torch.zeros(b, 1, total, total, dtype=torch.bool)
    query_real = torch.zeros(b, total, dtype=torch.bool)
    for r in range(b):
        for q in range(m):
            allowed[r, 0, q, : q + 1] = mask[r, : q + 1].bool()
            query_real[r, q] = bool(mask[r, q])
        for t, rows in enumerate(visible):
            allowed[r, 0, m + t, rows[r]] = True
        query_real[r, m:] = True
    pos = (torch.cat([mask, torch.ones(b, steps, dtype=mask.dtype)], 1).cumsum(-1) - 1).clamp(min=0)[:, :total]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            attn = model(input_ids=seq[:, :total], attention_mask=additive, position_ids=pos, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    # eager adds 4-D masks as they are (hence additive) and gives fully masked (pad) query rows a
    # uniform row; the cache records no row for them
    per_query = sum(a.sum(1) for a in attn) * query_real.unsqueeze(-1)  # [b, T, T], layers+heads summed
    n = cache.length
    for r in range(b):
        slots = cache.positions[r, :n]
        real = cache.segments[r, :n] != Segment.PAD
        expected = per_query[r].sum(0)[slots]
        torch.testing.assert_close(cache.attention[r, :n][real], expected[real], atol=1e-4, rtol=1e-4)
        expected_window = per_query[r, total - window :][:, slots]
        torch.testing.assert_close(cache.ordered_window_attention()[r, :, :n], expected_window * real, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("static", "prompt", "per_head"), [(False, 2, False), (False, 7, False), (True, 3, False), (True, 9, True)])
def test_observation_window_is_the_last_query_rows_in_time_order(static, prompt, per_head):
    """The cache keeps the observation rows as a ring (no shift per step); evictors read the last ``w``
    query rows oldest first, through prefills shorter and longer than ``w``, chunked rows, decode
    steps (the static layout's too), a multi-token forward that wraps the ring and a read mid-run."""
    w, b, steps = 5, 2, 12
    model = tiny_model("qwen2")  # 2 layers, 4 query heads on 2 KV heads
    cache = dynts.build_cache(model, SnapKV(per_head=per_head), dynts.Budget(64, 4, 0.5), observation_window=w,
                              static=static)
    g = torch.Generator().manual_seed(prompt)
    groups = 4 if per_head else 1  # table rows per batch row (layers x KV heads)
    history: list[torch.Tensor] = []  # every query row, [b * groups, width]
    for step in range(steps):
        q = prompt if step == 0 else 4 if step == 6 else 1  # a multi-token forward mid-run wraps the ring
        cache.begin_forward(torch.randint(3, 100, (b, q)), None, b, q, torch.device("cpu"))
        n = cache.length + q
        width = cache.capacity if cache.static_step else n
        rows = torch.zeros(b, groups, q, 64)
        for layer in range(2):
            probs = torch.softmax(torch.randn(b, 4, q, width, generator=g), -1)
            probs[..., n:] = 0.0  # a static step's unfilled slots are masked
            if per_head:
                cache.record_attention(probs, 0, layer)
                rows[:, 2 * layer : 2 * layer + 2, :, :width] += probs.unflatten(1, (2, 2)).sum(2)
            else:  # a prefill in two chunks of rows, as the memory-safe recording hands them over
                for first, chunk in ((0, probs[:, :, :1]), (1, probs[:, :, 1:])):
                    if chunk.shape[2]:
                        cache.record_attention(chunk, first, layer)
                rows[:, 0, :, :width] += probs.sum(1)
        cache.end_forward()
        history += list(rows.flatten(0, 1).unbind(1))
        if step in (8, steps - 1):  # the evictor's view, mid-run and at the end
            expected = torch.stack(history[-w:], 1)[..., : cache.length]
            torch.testing.assert_close(cache.ordered_window_attention()[..., : cache.length], expected)


def test_cache_takes_the_evictors_observation_window(qwen2):
    cache = dynts.build_cache(qwen2, RKV(observation_window=5), dynts.Budget(40, 4, 0.5))
    ids, mask = padded_batch([6])
    with torch.no_grad(), dynts.attach(qwen2, cache):
        # generate checks its keywords against forward's: `cache` on transformers 5.24, `past_key_values` before
        qwen2.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, **{cache_keyword(qwen2): cache})
    assert cache.window_attention.shape[1] == 5
    with pytest.raises(ValueError, match="observation_window"):
        dynts.build_cache(qwen2, RKV(), dynts.Budget(40, 4, 0.5), observation_window=0)


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "method,options,field",
    [
        ("snapkv", {"kernel_size": -1}, "kernel_size"),
        ("snapkv", {"kernel_size": 4}, "kernel_size"),
        ("snapkv", {"pooling": "median"}, "pooling"),
        ("snapkv", {"observation_window": 0}, "observation_window"),
        ("rkv", {"mix_lambda": 1.5}, "mix_lambda"),
        ("rkv", {"mix_lambda": -0.1}, "mix_lambda"),
        ("rkv", {"similarity_threshold": 2.0}, "similarity_threshold"),
        ("rkv", {"kernel_size": 0}, "kernel_size"),
        ("sepllm", {"separators": ()}, "separators"),
        ("sepllm", {"separators": ("", ".")}, "separators"),
        ("sepllm", {"separator_token_ids": []}, "separator_token_ids"),
        ("sepllm", {"separator_token_ids": [3, -1]}, "separator_token_ids"),
        ("sepllm", {"sink_size": -2}, "sink_size"),
        ("h2o", {"keep_question": "yes"}, "keep_question"),
        ("h2o", {"heavy_ratio": 0.5}, "heavy_ratio"),
    ],
)
def test_bad_options_name_the_field(method, options, field):
    with pytest.raises(ValueError, match=field):
        dynts.make_evictor(method, **options)


def test_sepllm_without_ids_says_how_to_get_them():
    with pytest.raises(ValueError, match="tokenizer"):
        SepLLM()(random_info(0))


# ---------------------------------------------------------------------------- SmolLM2 (real tokenizer)
@pytest.mark.slow
def test_separator_ids_from_a_real_vocabulary(smollm2):
    _, tokenizer = smollm2
    ids = set(separator_ids(tokenizer))
    for text in [".", ",", "\n", "?", " ."]:
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        assert token in ids, text
    for text in [" the", " cat", "7"]:
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        assert token not in ids, text
    assert not set(tokenizer.all_special_ids) & ids
    assert set(separator_ids(tokenizer, ["!"])) < ids


@pytest.mark.slow
def test_smollm2_baselines_exact_without_eviction(smollm2):
    model, tokenizer = smollm2
    prompts = ["The capital of France is", "Hi", "Count: 1, 2, 3,"]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    new = 5
    expected = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for method in ["h2o", "snapkv", "sepllm", "rkv"]:
        result = dynts.generate(model, tokenizer, prompts, method=method, budget=64, local_window=8, max_new_tokens=new,
                                do_sample=False)
        assert result.stats["evictions"] == 0
        assert torch.equal(result.sequences, expected[:, enc["input_ids"].shape[1] :]), method


@pytest.mark.slow
def test_smollm2_sepllm_finds_separators_itself_and_keeps_them(smollm2):
    """``method="sepllm"`` with only a tokenizer: ids come from ``bind``; separators outlive the other
    generated tokens (one is evicted only once every kept unprotected token is a separator)."""
    model, tokenizer = smollm2
    prompt = "Once upon a time, a little cat"
    local = 4
    result = dynts.generate(
        model, tokenizer, prompt, method="sepllm", budget=40, local_window=local, max_new_tokens=60,
        eos_token_id=None,
    )
    cache = result.cache
    assert result.stats["evictions"] >= 2
    separators = set(separator_ids(tokenizer))
    assert set(cache.evictor.separator_token_ids) == separators
    m = cache.question_length
    generated = result.sequences[0, :-1].tolist()  # the last token is never fed back
    kept = set(cache.kept_positions(0).tolist())
    assert set(range(m)) <= kept  # the prompt is protected
    seen = m + len(generated)
    middle = range(m, seen - local)  # generated, outside the local window
    kept_middle = [p for p in middle if p in kept]
    kept_separators = [p for p in kept_middle if generated[p - m] in separators]
    evicted_separators = [p for p in middle if p not in kept and generated[p - m] in separators]
    assert kept_separators, "no separator survived outside the local window"
    if evicted_separators:
        assert kept_separators == kept_middle
    others = [p for p in middle if generated[p - m] not in separators]
    kept_others = [p for p in others if p in kept]
    assert len(kept_others) < len(others), "expected some non-separators evicted"
    assert kept_others == others[len(others) - len(kept_others) :]  # the oldest went first


@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv"])
def test_question_protected_variant_keeps_the_prompt_and_says_so(method):
    """``+q``: the attention baselines with DynTS's question protection; a paged engine may then share
    the prompt's full blocks (``protected_prefix``)."""
    plain, protected = dynts.make_evictor(method), dynts.make_evictor(method, keep_question=True)
    assert plain.protected_prefix(14) == 0 and protected.protected_prefix(14) == 14
    from eval.harness.methods import parse_method

    spec = parse_method(f"{method}+q")
    assert spec.label == f"{method}+q" and dict(spec.options) == {"keep_question": True}
