"""Kept sets made by the methods' own mechanisms (trainers/eviction_mechanisms.py): the h2o, snapkv
and rkv simulations match explicit reference loops (rkv: dynts's own R-KV evictor, event by event),
respect their budgets, evict for good and only when their mechanism says so; rows that lose the asked value come at the configured rate; the
attention-ranked and mechanism rows share one forward; bad options name the field and the fix."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from data_pipeline.testbed import task
from dynts.evictors.base import Segment, TokenInfo
from dynts.evictors.rkv import RKV
from trainers.eviction_masks import MECHANISM_SHAPES, SHAPES, add_attention_ranked, attention_mask
from trainers.eviction_mechanisms import (
    PER_HEAD_SHAPES,
    h2o_until,
    received_attention,
    received_attention_and_keys,
    rkv_until,
    snapkv_until,
    until_visibility,
)
from trainers.layer_head_masks import ATTENTION, layer_head_masks
from trainers.testbed_lm import LMConfig, LMModule, TraceStream, build_model

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32}
Q = 3  # a short "question" for the hand-made matrices
TOKEN_SHAPES = [s for s in MECHANISM_SHAPES if s not in PER_HEAD_SHAPES]


def _attention(R: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(R, T, T, generator=g).tril()
    return a / a.sum(-1, keepdim=True)  # rows sum to one, as softmax rows do


def _h2o_reference(A: torch.Tensor, n: int, W: int, C: int, question: int = Q) -> torch.Tensor:
    """H2O, one query at a time, with Python lists."""
    vis = torch.zeros(n, n, dtype=torch.bool)
    heavy: list[int] = []
    for t in range(n):
        if t >= 1:  # after query t - 1: key t - W leaves the window and joins the heavy set
            j = t - W
            if j >= question:
                heavy.append(j)
            if len(heavy) > C:
                score = {k: float(A[:t, k].sum()) for k in heavy}  # queries <= t - 1
                heavy.remove(min(heavy, key=lambda k: (score[k], k)))
        for k in range(t + 1):
            vis[t, k] = k < question or t - k < W or k in heavy
    return vis


def _snapkv_reference(A: torch.Tensor, n: int, W: int, C: int, K: int, w: int) -> torch.Tensor:
    vis = torch.zeros(n, n, dtype=torch.bool)
    evicted: set[int] = set()
    for t in range(n):
        e = t - 1  # an event after query e decides query t
        if e >= Q - 1 + K and (e - (Q - 1)) % K == 0:
            candidates = [j for j in range(Q, t - W + 1) if j not in evicted]
            votes = {j: float(A[max(0, e - w + 1) : e + 1, j].sum()) for j in candidates}
            kept = sorted(candidates, key=lambda j: (-votes[j], j))[:C]
            evicted |= set(candidates) - set(kept)
        for k in range(t + 1):
            vis[t, k] = k < Q or t - k < W or k not in evicted
    return vis


def _keys(R: int, T: int, heads: int = 2, dim: int = 8, seed: int = 0) -> torch.Tensor:
    """``[R, heads, T, dim]`` keys drawn around 4 directions, so that many pairs pass R-KV's 0.5 cosine."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(heads, 4, dim, generator=g)
    pick = torch.randint(0, 4, (R, heads, T), generator=g)
    return base[torch.arange(heads)[None, :, None], pick] + 0.8 * torch.randn(R, heads, T, dim, generator=g)


def _rkv_reference(
    A: torch.Tensor, keys: torch.Tensor, n: int, W: int, C: int, K: int, w: int, lam: float, question: int = Q
) -> torch.Tensor:
    """dynts's R-KV evictor run as a cache runs it: at each event it sees the cached slots (question,
    kept keys, the W - 1 most recent as its protected window), their attention rows and keys, and keeps
    question + C + W - 1 of them; its choice is applied for good."""
    evictor = RKV(mix_lambda=lam, observation_window=w, kernel_size=1, keep_question=True)
    vis = torch.zeros(n, n, dtype=torch.bool)
    evicted: set[int] = set()
    for t in range(n):
        e = t - 1
        if e >= question - 1 + K and (e - (question - 1)) % K == 0:
            cache = [j for j in range(e + 1) if j not in evicted]
            if len([j for j in cache if question <= j <= e + 1 - W]) > C:
                slots = torch.tensor(cache)
                info = TokenInfo(
                    positions=slots[None], segments=torch.where(slots < question, int(Segment.QUESTION), int(Segment.THINKING))[None],
                    token_ids=torch.zeros(1, len(cache), dtype=torch.long), n_keep=question + C + W - 1, local_window=W - 1,
                    question_length=question, window_attention=A[max(0, e - w + 1) : e + 1][:, slots][None], keys=keys[:, slots][None],
                )
                kept = set(slots[evictor(info)[0]].tolist())
                evicted |= set(cache) - kept
        for k in range(t + 1):
            vis[t, k] = k < question or t - k < W or k not in evicted
    return vis


ROWS = {"lengths": [40, 33, 40, 40], "windows": [3, 5, 1, 4], "counts": [4, 2, 0, 40]}


def _until(kind: str, A: torch.Tensor, every: int = 4, observe: int = 3, keys: torch.Tensor | None = None, lam: float = 0.1) -> torch.Tensor:
    args = [torch.tensor(ROWS[k]) for k in ("lengths", "windows", "counts")]
    if kind == "h2o":
        return h2o_until(A, *args, question=Q)
    if kind == "rkv":
        keys = _keys(A.shape[0], A.shape[1]) if keys is None else keys
        return rkv_until(A, keys, *args, every=every, observe=observe, mix_lambda=lam, question=Q)
    return snapkv_until(A, *args, every=every, observe=observe, question=Q)


def test_h2o_keeps_the_heavy_hitters_of_a_hand_made_matrix():
    # 8 tokens, question 0..0, W = 2, C = 1: key 3 gets most of every later query's attention.
    T = 8
    A = torch.full((T, T), 0.01).tril()
    A[3:, 3] = 1.0
    A[5:, 2] = 0.5
    until = h2o_until(A[None], torch.tensor([T]), torch.tensor([2]), torch.tensor([1]), question=1)[0]
    vis = until_visibility(until, T, question=1)
    assert vis[7].nonzero().flatten().tolist() == [0, 3, 6, 7]  # question + heavy {3} + window
    assert vis[3:, 3].all()  # the heavy hitter is never evicted
    assert until[2] < T and until[4] < T  # 2 (some attention, but later than 3) and 4 are gone
    assert torch.equal(vis, _h2o_reference(A, T, 2, 1, question=1))


@pytest.mark.parametrize("kind", TOKEN_SHAPES)
def test_the_simulations_match_explicit_reference_loops(kind):
    A = _attention(4, 40)
    until = _until(kind, A)
    for r, n in enumerate(ROWS["lengths"]):
        W, C = ROWS["windows"][r], ROWS["counts"][r]
        if kind == "h2o":
            ref = _h2o_reference(A[r], n, W, C)
        elif kind == "rkv":
            ref = _rkv_reference(A[r], _keys(4, 40)[r], n, W, C, 4, 3, 0.1)
        else:
            ref = _snapkv_reference(A[r], n, W, C, 4, 3)
        assert torch.equal(until_visibility(until[r], n, question=Q), ref), (kind, r)


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.5, 1.0])
def test_rkv_keeps_what_dynts_rkv_evictor_keeps(lam):
    # Several events per row, every budget regime of ROWS, importance alone (1.0), redundancy alone (0.0).
    for seed in range(3):
        A, keys = _attention(4, 40, seed=10 + seed), _keys(4, 40, seed=seed)
        until = _until("rkv", A, every=5, observe=4, keys=keys, lam=lam)
        for r, n in enumerate(ROWS["lengths"]):
            W, C = ROWS["windows"][r], ROWS["counts"][r]
            ref = _rkv_reference(A[r], keys[r], n, W, C, 5, 4, lam)
            assert torch.equal(until_visibility(until[r], n, question=Q), ref), (lam, seed, r)


def test_rkv_evicts_the_older_copies_of_a_repeated_key():
    # 12 tokens, question = token 0, W = 1, C = 6, one event after query 8 (K = 8, 8 observed queries):
    # candidates are keys 1..8, two of them go. Keys 2, 5 and 7 are one direction, every other key is
    # orthogonal. R-KV spares the most recent similar copy in each row of the similarity, so key 2 is
    # repeated by 5 and 7, key 5 by 2, key 7 by none: the redundancy of 2 and 5 outweighs the importance
    # of the old keys (uniform attention: older keys collect more), and the two older copies go; key 8,
    # the least attended, stays.
    T = 12
    A = torch.ones(T, T).tril()
    A = A / A.sum(-1, keepdim=True)
    keys = torch.eye(T)[None, None].clone()  # [1 row, 1 head, T, d = T]
    keys[0, 0, [5, 7]] = keys[0, 0, 2].clone()
    until = rkv_until(A[None], keys, torch.tensor([T]), torch.tensor([1]), torch.tensor([6]), every=8, observe=8,
                      mix_lambda=0.1, question=1)[0]
    assert until.tolist() == [T, T, 9, T, T, 9, T, T, T, T, T, T]
    assert torch.equal(until_visibility(until, T, question=1), _rkv_reference(A, keys[0], T, W=1, C=6, K=8, w=8, lam=0.1, question=1))


@pytest.mark.parametrize("kind", TOKEN_SHAPES)
def test_budget_window_and_permanent_eviction(kind):
    A = _attention(4, 40, seed=1)
    until = _until(kind, A)
    for r, n in enumerate(ROWS["lengths"]):
        W, C = ROWS["windows"][r], ROWS["counts"][r]
        vis = until_visibility(until[r], n, question=Q)
        q = torch.arange(n)[:, None]
        k = torch.arange(n)[None, :]
        assert (vis <= (k <= q)).all() and vis[:, :Q].tril().equal((k[:, :Q] <= q).expand(n, Q))  # causal; question always
        assert vis[(k <= q) & (q - k < W)].all()  # the local window is always seen
        slack = 0 if kind == "h2o" else 4 - 1  # snapkv and rkv hold up to K - 1 keys that left the window since the last event
        assert (vis[:, Q:].sum(1) <= C + W + slack).all()
        if C + W + slack < n - Q:
            assert not vis[n - 1, Q:].all()  # something was evicted
        else:
            assert torch.equal(vis, (k <= q))  # room for everything: nothing evicted
        # Permanent: once a key outside the window is invisible, it stays invisible.
        outside = (q - k >= W - 1)[:-1]
        assert (vis[1:] <= vis[:-1] | ~outside).all()


@pytest.mark.parametrize("kind", ["snapkv", "rkv"])
def test_snapkv_and_rkv_change_their_kept_set_only_at_events(kind):
    A = _attention(4, 40, seed=2)
    every = 5
    until = _until(kind, A, every=every, observe=2)
    events = {Q - 1 + every * i for i in range(1, 40)}
    removed_at = set()
    for r, n in enumerate(ROWS["lengths"]):
        vis = until_visibility(until[r], n, question=Q)
        for t in range(n - 1):
            if (vis[t, : t + 1] & ~vis[t + 1, : t + 1]).any():
                removed_at.add(t)
    assert removed_at and removed_at <= events


def test_mask_builder_takes_per_query_visibility():
    vis = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    mask = attention_mask([3, 2], 5, [vis, (torch.tensor([True, False]), 1)])
    assert torch.equal(mask[0, 0, :3, :3], vis) and not mask[0, 0, :3, 3:].any()
    assert torch.equal(mask[0, 0, 3:], torch.ones(5, 5, dtype=torch.bool).tril()[3:])  # padded queries: causal
    with pytest.raises(ValueError, match=r"bool \[n, n\]"):
        attention_mask([4], 5, [vis])


def _stream(data: dict, size: int = 8) -> TraceStream:
    base = {"min_think": 40, "max_think": 80, "long_batch": size, "short_steps": 0, "drill_frac": 0.0, "evict_frac": 1.0}
    return TraceStream(LMConfig.from_dict({"model": TINY, "seed": 2, "data": {**base, **data},
                                           "stages": [{"steps": 50, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}]}), 0)


def _answer_sees_value(batch: dict, r: int) -> bool:
    tokens = [task.VOCAB[i] for i in batch["input_ids"][r].tolist()]
    value = task.find_critical_positions(tokens[: int(batch["probe_pos"][r]) + 2])[0]
    return bool(batch["attention_mask"][r, 0, batch["probe_pos"][r], value])


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_rows_lose_the_asked_value_at_the_configured_rate(rate):
    # keep 0 and W = 1: a row keeps the asked value only if it is forced.
    stream = _stream({"evict_shapes": {"steps": 1, "tokens": 1, "values": 1}, "evict_keep": 0.0, "evict_window": [1, 1],
                      "evict_lose_asked": rate})
    lost, seen = [], []
    for step in range(30):
        batch = stream.batch(step)
        lost += batch["lost_asked"].tolist()
        seen += [_answer_sees_value(batch, r) for r in range(len(batch["lost_asked"]))]
    assert lost == [not s for s in seen]  # exactly the lost rows miss the value
    assert abs(sum(lost) / len(lost) - rate) < 0.08, sum(lost) / len(lost)


def test_mechanism_rows_share_one_forward_and_follow_their_simulation():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    stream = _stream({"evict_shapes": {"attention": 1, "h2o": 1, "snapkv": 1}, "evict_window": [4, 16], "evict_every": 8,
                      "evict_observe": 4, "evict_keep": 0.5}, size=12)
    batch = stream.batch(0)
    assert "rank_rows" in batch and "mech_rows" in batch
    add_attention_ranked(model, batch)
    assert len(calls) == 1 and model.config._attn_implementation == "sdpa"
    rows = batch["mech_rows"]
    attention = received_attention(model, batch["input_ids"][rows], batch["lengths"][rows])
    for m, row in enumerate(rows.tolist()):
        n, W, C = int(batch["lengths"][row]), int(batch["mech_window"][m]), int(batch["mech_count"][m])
        kind = MECHANISM_SHAPES[int(batch["mech_kind"][m])]
        assert SHAPES[int(batch["evict_shape"][row])] == kind
        args = (attention[m : m + 1], batch["lengths"][row : row + 1], batch["mech_window"][m : m + 1], batch["mech_count"][m : m + 1])
        until = h2o_until(*args) if kind == "h2o" else snapkv_until(*args, every=8, observe=4)
        mask = batch["attention_mask"][row, 0]
        assert torch.equal(mask[:n, :n], until_visibility(until[0], n))
        end = [task.VOCAB[i] for i in batch["input_ids"][row].tolist()].index(task.END_THINK)
        assert 0 <= C <= end - task.QUESTION_TOKENS
        slack = 0 if kind == "h2o" else 8 - 1
        assert (mask[:n, task.QUESTION_TOKENS : n].sum(1) <= C + W + slack).all()


def test_rkv_rows_use_the_forwards_last_layer_keys_and_their_lambda():
    torch.manual_seed(0)
    model = build_model({**TINY, "num_hidden_layers": 2}).eval()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    stream = _stream({"evict_shapes": {"attention": 1, "snapkv": 1, "rkv": 2}, "evict_window": [4, 16], "evict_every": 8,
                      "evict_observe": 4, "evict_keep": 0.5, "evict_rkv_lambda": 0.3}, size=12)
    batch = stream.batch(0)
    kinds = [MECHANISM_SHAPES[k] for k in batch["mech_kind"].tolist()]
    assert "rkv" in kinds and float(batch["mech_lambda"]) == pytest.approx(0.3)
    add_attention_ranked(model, batch)
    assert len(calls) == 1 and model.config._attn_implementation == "sdpa"
    rows = batch["mech_rows"]
    attention, keys = received_attention_and_keys(model, batch["input_ids"][rows], batch["lengths"][rows])
    assert keys.shape[:3] == (len(rows), 2, batch["input_ids"].shape[1])
    assert torch.allclose(attention, received_attention(model, batch["input_ids"][rows], batch["lengths"][rows]))
    checked = 0
    for m, row in enumerate(rows.tolist()):
        if kinds[m] != "rkv":
            continue
        n, W, C = int(batch["lengths"][row]), int(batch["mech_window"][m]), int(batch["mech_count"][m])
        until = rkv_until(attention[m : m + 1], keys[m : m + 1], batch["lengths"][row : row + 1], batch["mech_window"][m : m + 1],
                          batch["mech_count"][m : m + 1], every=8, observe=4, mix_lambda=0.3)
        mask = batch["attention_mask"][row, 0]
        assert torch.equal(mask[:n, :n], until_visibility(until[0], n))
        assert (mask[:n, task.QUESTION_TOKENS : n].sum(1) <= C + W + 8 - 1).all()
        checked += 1
    assert checked == kinds.count("rkv")


def test_configs_without_rkv_add_no_lambda_to_their_batches():
    batch = _stream({"evict_shapes": {"h2o": 1, "snapkv": 1}}).batch(0)
    assert "mech_rows" in batch and "mech_lambda" not in batch


@pytest.mark.parametrize(
    ("config", "digest"),
    [
        ("lrm-fair", "a71b994062cfac87f6055fb39cc5a99a647e972300aea3e350df00c82b223547"),
        ("chain-lrm-fair", "72e5207e07187cbad6c2dea5203ffccb5a63cfbf9692c0f1ca764d86bda80107"),
    ],
)
def test_the_committed_fair_configs_draw_the_batches_they_drew_before_rkv(config, digest):
    # Every tensor of three batches, by key (the digests of the stream before the rkv shape existed).
    cfg = LMConfig.from_dict(yaml.safe_load((ROOT / f"configs/testbed/{config}.yaml").read_text()))
    stream, h = TraceStream(cfg, 0), hashlib.sha256()
    for step in (0, 7, 1500):
        batch = stream.batch(step)
        for key in sorted(batch):
            h.update(key.encode())
            h.update(batch[key].numpy().tobytes())
    assert h.hexdigest() == digest


def test_default_configs_add_no_mechanism_rows():
    batch = _stream({}).batch(0)
    assert "mech_rows" not in batch and "rank_rows" not in batch and not batch["lost_asked"].any()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("evict_every", 0, r"data\.evict_every=0: give an int >= 1 .*evict_every: 32"),
        ("evict_every", 2.5, r"data\.evict_every=2\.5"),
        ("evict_observe", True, r"data\.evict_observe=True: give an int >= 1 .*evict_observe: 8"),
        ("evict_lose_asked", 1.5, r"data\.evict_lose_asked=1\.5: give a probability in \[0, 1\].*evict_lose_asked: 0\.3"),
        ("evict_rkv_lambda", 1.2, r"data\.evict_rkv_lambda=1\.2: give a weight in \[0, 1\].*evict_rkv_lambda: 0\.1"),
        ("evict_rkv_lambda", "0.1", r"data\.evict_rkv_lambda='0\.1'"),
        ("evict_shapes", {"h2o_fast": 1}, r"unknown shapes \['h2o_fast'\]; choose from .*'h2o', 'snapkv', 'rkv'"),
    ],
)
def test_bad_mechanism_options_name_the_field_and_the_fix(field, value, match):
    with pytest.raises(ValueError, match=match):
        LMConfig.from_dict({"model": TINY, "data": {field: value}, "stages": []})


GQA = {**TINY, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # 2 query heads per KV head


def test_per_head_rows_run_each_layer_and_heads_own_cache():
    # Every per-head row's mask holds, per (layer, KV head), the token-level simulation on that pair's own
    # attention (its group's query heads summed) and, for rkv-head, its own keys; other rows are the same in
    # every slice; the pairs really differ.
    torch.manual_seed(0)
    model = build_model(GQA).eval()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    stream = _stream({"evict_shapes": {"attention": 1, "rkv": 1, "h2o-head": 1, "snapkv-head": 1, "rkv-head": 1},
                      "evict_window": [4, 16], "evict_every": 8, "evict_observe": 4, "evict_keep": 0.5}, size=12)
    batch = stream.batch(0)
    kinds = [MECHANISM_SHAPES[k] for k in batch["mech_kind"].tolist()]
    assert set(PER_HEAD_SHAPES) <= set(kinds) and "rkv" in kinds and "mech_lambda" in batch
    add_attention_ranked(model, batch)
    assert len(calls) == 1 and model.config._attn_implementation == "sdpa"
    mask, T = batch["attention_mask"], batch["input_ids"].shape[1]
    assert mask.shape == (12, 2 * 2, T, T) and mask.dtype == torch.bool
    rows = batch["mech_rows"]
    real = (torch.arange(T)[None, :] < batch["lengths"][rows][:, None]).long()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"][rows], attention_mask=real, output_attentions=True, use_cache=True)
    model.set_attn_implementation("sdpa")
    differ = 0
    for m, row in enumerate(rows.tolist()):
        n = int(batch["lengths"][row])
        if kinds[m] not in PER_HEAD_SHAPES:
            assert all(torch.equal(mask[row, g], mask[row, 0]) for g in range(4)), kinds[m]
            continue
        args = (batch["lengths"][row : row + 1], batch["mech_window"][m : m + 1], batch["mech_count"][m : m + 1])
        for layer in range(2):
            for head in range(2):
                A = out.attentions[layer][m : m + 1, 2 * head : 2 * head + 2].float().sum(1) * real[m : m + 1, :, None]
                if kinds[m] == "h2o-head":
                    until = h2o_until(A, *args)
                elif kinds[m] == "snapkv-head":
                    until = snapkv_until(A, *args, every=8, observe=4)
                else:
                    keys = out.past_key_values.layers[layer].keys[m : m + 1, head : head + 1].float()
                    until = rkv_until(A, keys, *args, every=8, observe=4, mix_lambda=0.1)
                assert torch.equal(mask[row, 2 * layer + head, :n, :n], until_visibility(until[0], n)), (kinds[m], layer, head)
                assert not mask[row, 2 * layer + head, :n, n:].any()
        differ += any(not torch.equal(mask[row, g], mask[row, 0]) for g in range(1, 4))
    assert differ >= 2  # the pairs keep different sets


def _layer_reference(model, ids, mask):
    """Logits with layer l's attention under ``mask[:, l * h_kv : (l + 1) * h_kv]`` (repeated over each
    group's query heads), swapped into each attention call by a hook, under plain SDPA."""
    h_kv = model.config.num_key_value_heads
    rep = model.config.num_attention_heads // h_kv
    hooks = []
    for layer in model.model.layers:
        part = mask[:, layer.self_attn.layer_idx * h_kv : (layer.self_attn.layer_idx + 1) * h_kv].repeat_interleave(rep, 1)
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, part=part: (args, {**kwargs, "attention_mask": part}), with_kwargs=True))
    try:
        return model(input_ids=ids, attention_mask=mask[:, :1]).logits
    finally:
        for hook in hooks:
            hook.remove()


def test_layer_head_masks_give_each_layer_and_head_its_own_slice():
    torch.manual_seed(1)
    model = build_model(GQA).eval()
    B, T = 3, 14
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal & (torch.rand(B, 4, T, T) < 0.6) | torch.eye(T, dtype=torch.bool)  # [B, L * h_kv, T, T], each query sees itself
    with torch.no_grad():
        with layer_head_masks(model, mask):
            assert model.config._attn_implementation == ATTENTION
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert model.config._attn_implementation == "sdpa"
        reference = _layer_reference(model, ids, mask)
        uniform = model(input_ids=ids, attention_mask=mask[:, :1]).logits
        with layer_head_masks(model, mask[:, :1]):  # one mask for every layer: nothing changes
            assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(logits, reference, atol=1e-5)
    assert not torch.allclose(logits, uniform, atol=1e-3)  # the slices matter
    with pytest.raises(ValueError, match=r"num_hidden_layers x num_key_value_heads = 1 x 2 .*layer 1"):
        with torch.no_grad(), layer_head_masks(model, mask[:, :2]):
            model(input_ids=ids, attention_mask=mask[:, :2])
    assert model.config._attn_implementation == "sdpa"


def test_a_training_step_with_per_head_rows_learns_under_their_masks():
    cfg = {"model": GQA, "seed": 3, "data": {"min_think": 40, "max_think": 80, "long_batch": 6, "short_steps": 0, "drill_frac": 0.0,
                                             "evict_frac": 1.0, "evict_shapes": {"h2o-head": 1, "rkv-head": 1}, "evict_window": [4, 16],
                                             "evict_every": 8, "evict_observe": 4},
           "stages": [{"steps": 5, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}]}
    module = LMModule(cfg)
    batch = TraceStream(LMConfig.from_dict(cfg), 0).batch(0)
    loss, _, _ = module._loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and batch["attention_mask"].shape[1] == 4
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.model.parameters() if p.requires_grad)
    assert module.model.config._attn_implementation == "sdpa"
