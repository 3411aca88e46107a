"""Per-head selection (``per_head=True`` on H2O, SnapKV and R-KV): each KV head of each layer keeps its
own ``n_keep`` slots.

The reference here is independent of the cache: the model runs with a plain full ``DynamicCache`` and an
attention function that masks, per layer and KV head, the slots that head has evicted, records that
head's statistics over everything it still holds, and evicts at the same events by calling the evictor
on one row per (batch row, layer, KV head). Masking a head's evicted keys is what compacting them away
computes, so the compacted cache must generate the same tokens and keep the same positions per head.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import dynts
from conftest import padded_batch, tiny_model
from dynts.evictors import Segment, TokenInfo
from dynts.rescue.rows import RaggedCache

REFERENCE = "dynts_test_per_head_reference"
STATE: list["MaskedHeads"] = []


class MaskedHeads:
    """Full K/V; every (batch row, layer, KV head) attends only to the slots it has not evicted."""

    def __init__(self, evictor, budget: dynts.Budget, layers: int, kv_heads: int, prompt_mask: torch.Tensor,
                 window: int = 8, capacity: int = 256):
        b = prompt_mask.shape[0]
        self.evictor, self.budget, self.window = evictor, budget, window
        self.prompt_mask = prompt_mask.bool()
        self.alive = torch.zeros(b, layers, kv_heads, capacity, dtype=torch.bool)
        self.attention = torch.zeros(b, layers, kv_heads, capacity)
        self.window_attention = torch.zeros(b, layers, kv_heads, window, capacity)
        self.segments = torch.full((b, capacity), int(Segment.PAD), dtype=torch.long)
        self.keys: dict[int, torch.Tensor] = {}
        self.events = 0

    def begin(self, q: int, total: int) -> None:
        """A forward of ``q`` new tokens after ``total - q`` (at its first layer): evict if due, admit them."""
        seen = total - q
        if seen == 0:
            self.question = q
            self.n_keep = self.budget.n_keep(q)
            self.segments[:, :q] = torch.where(self.prompt_mask, int(Segment.QUESTION), int(Segment.PAD))
        else:
            stored = int(self.alive[0, 0, 0, :seen].sum())
            if self.budget.due(stored, q, self.n_keep):
                self.evict(seen)
            self.segments[:, seen:total] = int(Segment.THINKING)
        self.alive[..., seen:total] = True
        keep = max(0, self.window - q)
        self.window_attention[..., :keep, :] = self.window_attention[..., self.window - keep :, :].clone()
        self.window_attention[..., keep:, :] = 0.0

    def evict(self, seen: int) -> None:
        b, layers, heads, _ = self.alive.shape
        alive = self.alive[..., :seen].reshape(b * layers * heads, seen)
        n = int(alive[0].sum())
        slots = alive.nonzero()[:, 1].view(-1, n)  # [rows, n] ascending positions each head still holds
        rows = torch.arange(b * layers * heads)[:, None]
        batch = rows // (layers * heads)
        layer, head = (rows // heads) % layers, rows % heads
        keys = torch.stack([self.keys[i][:, :, :seen] for i in range(layers)], 1).flatten(0, 2)  # [rows, n_all, d]
        info = TokenInfo(
            positions=slots, segments=self.segments[batch, slots], token_ids=torch.zeros_like(slots),
            n_keep=self.n_keep, local_window=self.budget.local_window, question_length=self.question,
            attention=self.attention[batch, layer, head, slots],
            window_attention=self.window_attention.flatten(0, 2)[rows[:, :, None], torch.arange(self.window)[None, :, None],
                                                                 slots[:, None, :]],
            keys=keys[rows, slots][:, None],
        )
        kept = slots.gather(1, self.evictor(info))
        self.alive[..., :seen] = False
        self.alive.view(b * layers * heads, -1)[rows, kept] = True
        self.events += 1

    def record(self, layer: int, probs: torch.Tensor, key: torch.Tensor) -> None:
        """``probs`` ``[b, h_kv, group, q, total]`` float32, as the cache reduces them."""
        q, total = probs.shape[3], probs.shape[4]
        self.keys[layer] = key.float()
        self.attention[:, layer, :, :total] += probs.sum(dim=(2, 3))
        rows = min(q, self.window)
        self.window_attention[:, layer, :, self.window - rows :, :total] += probs[:, :, :, q - rows :].sum(dim=2)


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state = STATE[-1]
    layer = module.layer_idx
    b, hq, q, d = query.shape
    hk, total = key.shape[1], key.shape[2]
    if layer == 0:
        state.begin(q, total)
    group = hq // hk
    scale = scaling if scaling is not None else d**-0.5
    logits = ((query * scale).reshape(b, hk, group * q, d) @ key.transpose(-1, -2)).view(b, hq, q, total).float()
    if attention_mask is None:
        allowed = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
        allowed = allowed[None, None].expand(b, 1, q, total)
    else:
        allowed = attention_mask[..., -total:].bool()
    allowed = allowed & state.alive[:, layer, :, :total].repeat_interleave(group, 1)[:, :, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    state.record(layer, probs.view(b, hk, group, q, total), key)
    weights = torch.softmax(
        (query @ key.repeat_interleave(group, 1).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf")), dim=-1
    ).nan_to_num(0.0)
    out = weights @ value.repeat_interleave(group, 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(REFERENCE, reference_attention)
AttentionMaskInterface.register(REFERENCE, sdpa_mask)

CASES = [
    ("h2o", {}),
    ("h2o", {"keep_question": True}),
    ("snapkv", {}),
    ("snapkv", {"keep_question": True, "pooling": "avg", "kernel_size": 3}),
    ("rkv", {}),
    ("rkv", {"keep_question": True, "normalize": "non_window"}),
]


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    """A tiny float64 Qwen2 (4 query heads on 2 KV heads) with sharpened queries: random init attends almost
    uniformly, so every head would rank the slots alike (oldest first) and per-head sets would not differ."""
    model = tiny_model("qwen2", seed=3, dtype=torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return model


def masked_reference(model, ids, mask, evictor, budget, new):
    config = model.config
    state = MaskedHeads(evictor, budget, config.num_hidden_layers, config.num_key_value_heads, mask)
    STATE.append(state)
    previous = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                             cache=DynamicCache(config=config))
    finally:
        model.set_attn_implementation(previous)
        STATE.pop()
    return out[:, ids.shape[1] :], state


@pytest.mark.parametrize("method,options", CASES, ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o in CASES])
def test_per_head_cache_equals_masking_each_head(model64, method, options):
    ids, mask = padded_batch([7, 12, 4])
    budget = dynts.Budget(24, local_window=4, retention=0.5)
    new = 40
    evictor = dynts.make_evictor(method, per_head=True, **options)
    expected, state = masked_reference(model64, ids, mask, evictor, budget, new)
    cache = dynts.build_cache(model64, evictor, budget)
    with torch.no_grad(), dynts.attach(model64, cache):
        out = model64.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                               cache=cache)
    assert state.events > 1 and cache.stats.evictions == state.events
    assert torch.equal(out[:, ids.shape[1] :], expected)
    layers, heads = model64.config.num_hidden_layers, model64.config.num_key_value_heads
    differ = 0
    for row in range(ids.shape[0]):
        for layer in range(layers):
            for head in range(heads):
                want = state.alive[row, layer, head].nonzero()[:, 0]
                want = want[want >= ids.shape[1] - int(mask[row].sum())]  # real tokens only
                got = cache.kept_positions(row, layer, head)
                assert torch.equal(got, want), (row, layer, head)
                differ += not torch.equal(got, cache.kept_positions(row, 0, 0))
    assert differ, "every head kept the same set: the test does not exercise per-head selection"


def test_per_head_compacts_each_heads_own_slots(model64):
    """The buffers hold, per head, the K/V the full cache computed at that head's kept positions (layer 0's
    keys depend only on the token and its position, so they match exactly)."""
    ids, mask = padded_batch([9, 5])
    cache = dynts.build_cache(model64, dynts.make_evictor("h2o", per_head=True), dynts.Budget(16, local_window=4, retention=0.5))
    with torch.no_grad(), dynts.attach(model64, cache):
        out = model64.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                               cache=cache)
    full = DynamicCache(config=model64.config)
    with torch.no_grad():
        full_mask = torch.cat([mask, torch.ones(2, 19, dtype=mask.dtype)], 1)
        model64(input_ids=out[:, :-1], attention_mask=full_mask, position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
                cache=full)
    keys = full.layers[0].keys  # [b, h_kv, T, d]
    for row in range(2):
        for head in range(model64.config.num_key_value_heads):
            index = row * cache.groups + head
            n = cache.length
            valid = cache.segments[index, :n] != Segment.PAD
            positions = cache.positions[index, :n][valid]
            stored = cache.layers[0].keys[row, head, :n][valid]
            assert torch.allclose(stored, keys[row, head, positions], atol=1e-12)


def test_per_head_reference_keys_copy_only_the_rows_asked(model64):
    """R-KV's per-head keys: table row ``r * G + l * h + i`` reads layer ``l``'s head ``i`` of batch row ``r``,
    for a partial event (one batch row) as for all; rows not in whole batch-row blocks are refused."""
    ids, mask = padded_batch([9, 5, 7])
    cache = dynts.build_cache(model64, dynts.make_evictor("rkv", per_head=True), dynts.Budget(64, local_window=4))
    with torch.no_grad(), dynts.attach(model64, cache):
        model64(input_ids=ids, attention_mask=mask, cache=cache)
    n, G, h = cache.length, cache.groups, model64.config.num_key_value_heads
    for batch_rows in ([1], [0, 2], [0, 1, 2]):
        rows = torch.tensor([r * G + g for r in batch_rows for g in range(G)])
        keys = cache.reference_keys(rows, n)
        assert keys.shape == (len(rows), 1, n, cache.layers[0].keys.shape[-1])
        for i, row in enumerate(rows.tolist()):
            r, layer, head = row // G, row % G // h, row % h
            assert torch.equal(keys[i, 0], cache.layers[layer].keys[r, head, :n])
    with pytest.raises(ValueError, match="whole batch rows"):
        cache.reference_keys(torch.arange(G - 1), n)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv"])
def test_per_head_no_eviction_is_exact(family_model, method):
    ids, mask = padded_batch([5, 12, 3, 8])
    new = 16
    expected = family_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    result = dynts.generate(family_model, input_ids=ids, attention_mask=mask, method=method, method_options={"per_head": True},
                            budget=ids.shape[1] + new + 4, local_window=4, max_new_tokens=new, pad_token_id=0,
                            do_sample=False, think_end=None)
    assert result.stats["evictions"] == 0
    assert torch.equal(result.sequences, expected[:, ids.shape[1] :])


def test_per_head_static_layout_matches_dynamic(model64):
    ids, mask = padded_batch([6, 10])
    budget = dynts.Budget(20, local_window=4, retention=0.5)
    runs = []
    for static in (False, True):
        evictor = dynts.make_evictor("snapkv", per_head=True)
        options = {"static": True, "max_length": ids.shape[1] + 30} if static else {}
        cache = dynts.build_cache(model64, evictor, budget, **options)
        with torch.no_grad(), dynts.attach(model64, cache):
            out = model64.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   pad_token_id=0, cache=cache)
        runs.append((out, [cache.kept_positions(r, 1, 1) for r in range(2)]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_ragged_cache_per_head_stack_and_evict(model64):
    """Forked rows of a per-head ragged cache evict as the row would alone, head by head."""
    evictor = dynts.make_evictor("h2o", per_head=True)
    budget = dynts.Budget(14, local_window=3, retention=0.5)
    config = model64.config
    prompt = torch.tensor([[5, 9, 11, 17, 23, 31]])

    def decode(cache, ids, steps):
        tokens = []
        with torch.no_grad(), dynts.attach(model64, cache):
            for _ in range(steps):
                valid = torch.ones_like(ids, dtype=torch.bool)
                logits = model64(input_ids=ids, position_ids=cache.position_ids(valid), cache=cache).logits
                ids = logits[:, -1:].argmax(-1)
                tokens.append(ids)
        return torch.cat(tokens, 1), ids

    alone = RaggedCache(config.num_hidden_layers, evictor, budget, kv_heads=config.num_key_value_heads)
    first, last = decode(alone, prompt, 12)
    assert alone.rows[0].evictions >= 1
    forks = RaggedCache.stack([(alone, [0, 0])])
    assert forks.groups == alone.groups and forks.segments.shape[0] == 2 * alone.groups
    for layer, head in ((0, 0), (1, 1)):
        assert torch.equal(forks.kept_positions(1, layer, head), alone.kept_positions(0, layer, head))
    more, _ = decode(forks, last.repeat(2, 1), 14)
    again, _ = decode(alone, last, 14)
    assert forks.rows[0].evictions > alone.rows[0].evictions - 1
    assert torch.equal(more[0], again[0]) and torch.equal(more[1], again[0])
    for layer in range(config.num_hidden_layers):
        for head in range(config.num_key_value_heads):
            assert torch.equal(forks.kept_positions(1, layer, head), alone.kept_positions(0, layer, head))


def test_per_head_needs_kv_heads_and_refuses_a_predictor(model64):
    with pytest.raises(ValueError, match="kv_heads"):
        dynts.BoundedCache(2, dynts.make_evictor("h2o", per_head=True), dynts.Budget(16, local_window=4))
    with pytest.raises(ValueError, match="per_head"):
        dynts.make_evictor("snapkv", per_head="yes")
    cache = dynts.build_cache(model64, dynts.make_evictor("h2o", per_head=True), dynts.Budget(16, local_window=4))
    with pytest.raises(ValueError, match="predictor=None"):
        with dynts.attach(model64, cache, dynts.ImportancePredictor(model64.config.hidden_size)):
            pass


@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv"])
def test_per_head_bf16_batch_keeps_its_budget(method):
    """bf16, a left-padded batch: every head of every layer holds ``n_keep`` slots after each event, the
    question and local window at the same slots in every head, and the K/V stay bf16."""
    model = tiny_model("qwen2", seed=1, dtype=torch.bfloat16)
    ids, mask = padded_batch([11, 6, 9], seed=2)
    budget = dynts.Budget(22, local_window=5, retention=0.4)
    cache = dynts.build_cache(model, dynts.make_evictor(method, per_head=True, keep_question=True), budget)
    with torch.no_grad(), dynts.attach(model, cache):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, cache=cache)
    assert cache.stats.evictions >= 2 and cache.layers[0].keys.dtype == torch.bfloat16
    n = cache.length
    per_row = cache.head_rows(cache.positions[:, :n])  # [b, G, n]
    valid = cache.head_rows(cache.segments[:, :n]) != Segment.PAD
    assert torch.equal(valid, valid[:, :1].expand_as(valid))  # one validity mask serves every head
    window = budget.local_window
    assert torch.equal(per_row[:, :, -window:], per_row[:, :1, -window:].expand_as(per_row[:, :, -window:]))
    for row in range(ids.shape[0]):
        real = int(mask[row].sum())
        kept = per_row[row][valid[row]].view(cache.groups, -1)
        question = torch.arange(ids.shape[1] - real, ids.shape[1])
        assert torch.equal(kept[:, :real], question.expand(cache.groups, real))  # the question, in every head
        assert bool((kept.diff(dim=-1) > 0).all())  # arrival order in every head
