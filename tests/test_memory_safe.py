"""Memory-safe statistics: the chunked R-KV redundancy and the chunked attention
recording give the same statistics and the same kept sets as the implementation they replaced,
which is copied here verbatim as the reference."""

from __future__ import annotations

import pytest
import torch

import dynts
import dynts.attention as attention
import importlib
from dynts.attention import attention_row_chunks, attention_rows, recording_attention
from dynts.cache import BoundedCache
import dynts.evictors.rkv as rkv
from dynts.evictors import Segment, TokenInfo
from dynts.evictors.rkv import RKV, key_redundancy
from conftest import padded_batch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
attach_module = importlib.import_module("dynts.cache.attach")  # dynts.attach: where the recording is switched on


# ---------------------------------------------------------------- references (the unchunked computations)
def reference_key_redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    b, h, n, _ = keys.shape
    pair = valid.unsqueeze(2) & valid.unsqueeze(1)  # [b, n, n] both real
    pair &= ~torch.eye(n, dtype=torch.bool, device=keys.device)
    col = torch.arange(n, device=keys.device)
    count = valid.sum(-1, keepdim=True).clamp(min=1).float()
    total = torch.zeros(b, n, device=keys.device)
    for head in range(h):  # one [b, n, n] similarity at a time
        k = keys[:, head].float()
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        sim = (k @ k.transpose(-1, -2)).masked_fill(~pair, 0.0)
        similar = (sim > threshold) & pair
        last = torch.where(similar, col, -1).amax(-1)  # [b, n] most recent similar slot, -1 if none
        spare = similar & (col == last.unsqueeze(-1))
        sim = sim.masked_fill(spare, 0.0)
        mean = sim.sum(1) / count  # mean over rows i -> score of column j
        total += torch.softmax(mean.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
    return total / h


def reference_attention_rows(query, key, attention_mask, scaling):
    b, hq, q, d = query.shape
    hk, n = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    grouped = (query.float() * scale).reshape(b, hk, (hq // hk) * q, d)
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)).view(b, hq, q, n)
    if attention_mask is None:
        if q == 1:
            return torch.softmax(logits, dim=-1)
        rows = torch.arange(n - q, n, device=query.device)[:, None]
        logits = logits.masked_fill(torch.arange(n, device=query.device)[None, :] > rows, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        logits = logits.masked_fill(~attention_mask[..., -n:], float("-inf"))
    else:
        logits = logits + attention_mask[..., -n:].float()
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def reference_record_attention(self, probs, first_row=0, layer=0):  # token-level: every layer sums into one row
    assert first_row == 0
    n = self.length + self.pending
    if self.attention is not None:
        self.attention[:, :n] += probs.sum(dim=(1, 2)).float()
    if self.window_attention is not None:
        rows = probs.sum(dim=1).float()  # [b, q, n]
        w, q = self.window_attention.shape[1], rows.shape[1]
        ordered = self.window_attention.roll(-self.window_head, dims=1)  # the ring in time order (its newest rows zeroed)
        take = min(w, q)
        ordered[:, w - take :, :n] += rows[:, q - take :]
        self.window_attention.copy_(ordered.roll(self.window_head, dims=1))


@pytest.fixture
def reference_recording(monkeypatch):
    """Switch ``dynts.attach`` to the unchunked recording: every row at once, unchunked."""

    def unchunked(model, recorder, last_rows=None, chunk_rows=None):
        return recording_attention(model, lambda module, probs: recorder(module, probs, 0))

    monkeypatch.setattr(attention, "attention_rows", reference_attention_rows)
    monkeypatch.setattr(attach_module, "recording_attention", unchunked)
    monkeypatch.setattr(BoundedCache, "record_attention", reference_record_attention)


# ---------------------------------------------------------------- R-KV redundancy
def _keys(b, h, n, d, seed, copies=True):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, n, d, generator=g)
    if copies:  # near-copies so the "spare the most recent similar key" rule fires
        src = torch.randint(0, n, (n // 3,), generator=g)
        dst = torch.randint(0, n, (n // 3,), generator=g)
        keys[:, :, dst] = keys[:, :, src] + 0.1 * torch.randn(b, h, len(dst), d, generator=g)
    return keys


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 37, 64, 1000])
@pytest.mark.parametrize("threshold", [0.5, 0.0, -0.3, 0.95])
def test_key_redundancy_equals_the_unchunked_reference(chunk, threshold):
    b, h, n, d = 3, 4, 37, 8
    keys = _keys(b, h, n, d, seed=chunk)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :5] = False  # left padding
    valid[2, :36] = False  # a row with one real token
    got = key_redundancy(keys, valid, threshold, chunk_rows=chunk)
    want = reference_key_redundancy(keys, valid, threshold)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert (got[~valid] == 0).all()


def _rkv_info(b, n, seed, pads):
    g = torch.Generator().manual_seed(seed)
    segments = torch.full((b, n), int(Segment.THINKING))
    segments[:, :6] = int(Segment.QUESTION)
    for row, p in enumerate(pads):
        segments[row, :p] = int(Segment.PAD)
    window = torch.rand(b, 8, n, generator=g)
    return TokenInfo(
        positions=torch.arange(n).expand(b, n), segments=segments, token_ids=torch.zeros(b, n, dtype=torch.long),
        n_keep=n // 2, local_window=4, question_length=6, window_attention=window,
        keys=_keys(b, 2, n, 16, seed),
    )


@pytest.mark.parametrize("seed", range(4))
def test_rkv_kept_sets_unchanged(monkeypatch, seed):
    info = _rkv_info(3, 53, seed, pads=[0, 7, 2])
    evictor = RKV(mix_lambda=0.1)
    monkeypatch.setattr(rkv, "key_redundancy", lambda keys, valid, t: key_redundancy(keys, valid, t, chunk_rows=5))
    got = evictor(info)
    monkeypatch.setattr(rkv, "key_redundancy", reference_key_redundancy)
    assert torch.equal(got, evictor(info))


def test_key_redundancy_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match="chunk_rows"):
        key_redundancy(torch.randn(1, 1, 4, 2), torch.ones(1, 4, dtype=torch.bool), 0.5, chunk_rows=0)


# ---------------------------------------------------------------- attention rows
@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_attention_row_chunks_equal_all_rows(chunk, mask_kind):
    g = torch.Generator().manual_seed(chunk)
    b, hq, hk, q, n, d = 2, 6, 2, 13, 21, 8  # GQA: 3 query heads per KV head; q < n (cached prefix)
    query, key = torch.randn(b, hq, q, d, generator=g), torch.randn(b, hk, n, d, generator=g)
    causal = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
    mask = causal[None, None].expand(b, 1, q, n).clone()
    mask[1, :, :, :4] = False  # left padding of row 1
    mask[1, :, 0, :] = False  # a fully masked row (NaN -> 0)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "float":
        mask = torch.zeros(b, 1, q, n).masked_fill(~mask, torch.finfo(torch.float32).min)
    want = reference_attention_rows(query, key, mask, 0.3)
    pieces = list(attention_row_chunks(query, key, mask, 0.3, chunk))
    assert [start for start, _ in pieces] == list(range(0, q, chunk))
    assert max(p.shape[2] for _, p in pieces) <= chunk
    torch.testing.assert_close(torch.cat([p for _, p in pieces], dim=2), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_attention_rows_in_low_precision_match_float32_within_the_dtype(dtype):
    """q k^T runs in the model dtype (no float32 copy of the keys), softmax in float32: the rows
    equal the float32 computation on the same (already rounded) inputs within the logits' rounding,
    |dp| <= 4 u max|logit| p + 1e-6 (u = the dtype's unit roundoff; the query scale, the matmul
    output and the softmax's normalisation each add about u |logit|)."""
    g = torch.Generator().manual_seed(0)
    b, hq, hk, q, n, d = 2, 8, 2, 5, 300, 64
    query, key = torch.randn(b, hq, q, d, generator=g).to(dtype), torch.randn(b, hk, n, d, generator=g).to(dtype)
    got = attention_rows(query, key, None, d**-0.5)
    assert got.dtype == torch.float32
    want = reference_attention_rows(query.float(), key.float(), None, d**-0.5)
    max_logit = float((query.float() @ key.float().repeat_interleave(hq // hk, 1).transpose(-1, -2)).abs().max()) * d**-0.5
    u = torch.finfo(dtype).eps / 2
    assert ((got - want).abs() <= 4 * u * max_logit * want + 1e-6).all()
    assert (got - want).abs().max() > 0  # the matmul really ran in the low dtype
    torch.testing.assert_close(got.sum(-1), torch.ones(b, hq, q))
    # float32 inputs: exactly the float32 computation
    torch.testing.assert_close(attention_rows(query.float(), key.float(), None, d**-0.5), want, rtol=0, atol=0)


def test_recording_calls_the_recorder_per_chunk_with_row_offsets():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (2, 23))
    calls = []
    with torch.no_grad(), recording_attention(
        model, lambda module, probs, first: calls.append((first, tuple(probs.shape))), last_rows=10, chunk_rows=4
    ):
        model(input_ids=ids)
    # rows 13..22 of the forward, 4 at a time, per layer
    assert calls == [(13, (2, 4, 4, 23)), (17, (2, 4, 4, 23)), (21, (2, 4, 2, 23))] * 2
    with pytest.raises(ValueError, match="chunk_rows"):
        with recording_attention(model, lambda *a: None, chunk_rows=0):
            pass


# ---------------------------------------------------------------- through the cache
def _drive(model, method, ids, mask, first_chunk, steps):
    """Prefill, a multi-token forward of ``first_chunk`` tokens, then ``steps`` greedy steps; return the
    statistics after the prefill and the kept positions after every step."""
    evictor = dynts.make_evictor(method)
    cache = dynts.build_cache(model, evictor, dynts.Budget(40, 4, 0.5), observation_window=5)
    trace = []
    with torch.no_grad(), dynts.attach(model, cache):
        full = mask
        out = model(input_ids=ids, attention_mask=full, cache=cache)
        stats = {
            name: getattr(cache, name)[..., : cache.length].clone()
            for name in ("attention", "window_attention") if getattr(cache, name) is not None
        }
        extra = torch.randint(3, 128, (ids.shape[0], first_chunk), generator=torch.Generator().manual_seed(9))
        full = torch.cat([full, torch.ones_like(extra)], 1)
        out = model(input_ids=extra, attention_mask=full, cache=cache)
        for name in list(stats):
            stats[name + "_chunk"] = getattr(cache, name)[..., : cache.length].clone()
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            full = torch.cat([full, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=full, cache=cache)
            trace.append([cache.kept_positions(r).tolist() for r in range(ids.shape[0])])
    return stats, trace, cache.stats.evictions


@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv"])
def test_cache_statistics_and_kept_sets_unchanged(method, monkeypatch, request):
    model = tiny_model("qwen2")  # 4 query heads / 2 KV heads
    ids, mask = padded_batch([19, 13, 8])
    monkeypatch.setattr(attach_module, "RECORD_CHUNK_ROWS", 3)  # odd chunks: 19 = 6 x 3 + 1
    got_stats, got_trace, events = _drive(model, method, ids, mask, first_chunk=7, steps=30)
    request.getfixturevalue("reference_recording")
    want_stats, want_trace, _ = _drive(model, method, ids, mask, first_chunk=7, steps=30)
    assert events >= 2
    assert set(got_stats) == set(want_stats)
    for name in got_stats:
        torch.testing.assert_close(got_stats[name], want_stats[name], rtol=1e-5, atol=1e-6, msg=name)
    assert got_trace == want_trace


def test_bench_memory_script_runs(tmp_path):
    """``scripts/bench_memory.py --quick`` (tiny shapes) so the script cannot rot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_memory.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--budgets", "64", "--methods", "plain", "window", "rkv",
         "--threads", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_memory.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "window", "rkv"]
    assert all(r["peak_bytes"] > 0 for r in rows) and rows[2]["evictions"] == 1


def test_bench_memory_serving_round_runs(tmp_path):
    """``bench_memory.py --serving --quick``: the real eviction round moves only the rows that change and
    leaves the same kept K/V as the all-rows reference gather."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_memory.py"
    done = subprocess.run([sys.executable, str(script), "--serving", "--quick", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "serving_eviction.json").read_text())
    before, after = result["rows"]
    assert result["identical"] and before["digest"] == after["digest"]
    assert before["path"] == "before" and before["rows"] == before["requests"] * before["n_keep"]
    assert 0 < after["rows"] < before["rows"]  # the question's slots stay where they are
    assert before["evictions"] == after["evictions"] == before["requests"]
