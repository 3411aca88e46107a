"""Eviction-event kernels: the torch path is chosen on CPU, and the Triton path (run in Triton's
interpreter, in a subprocess so that ``TRITON_INTERPRET=1`` is set before ``triton`` is imported)
returns the same indices bit for bit and the same values as the torch path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dynts
from dynts.evictors import TokenInfo, keep_top
from dynts.kernels import BACKEND_ENV, backend_for, compact_, compact_torch_, keep_top_indices, keep_top_torch, triton_available

ROOT = Path(__file__).resolve().parents[1]


def random_priorities(g: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Priorities full of ties, +-inf, NaN and -0.0 (the cases an order must settle), and pads."""
    p = torch.randint(-3, 3, (b, n), generator=g).float()
    for value in (float("inf"), float("-inf"), float("nan"), -0.0):
        p[torch.rand(b, n, generator=g) < 0.1] = value
    valid = torch.rand(b, n, generator=g) > 0.2
    return p, valid


def test_torch_path_chosen_on_cpu(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cuda-please")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        backend_for(torch.zeros(1))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_forcing_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend_for(torch.zeros(1))


def test_warm_up_compiles_nothing_on_the_torch_path(monkeypatch):
    from dynts.kernels import warm_up_kernels

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert warm_up_kernels(device="cpu")["kernels"] == []
    with pytest.raises(ValueError, match="paged="):
        warm_up_kernels()


def test_keep_top_order_ties_to_recent_pads_first():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[1.0, 5.0, 1.0, float("inf"), 1.0, -0.0, 0.0, 2.0]])
    valid = torch.tensor([[True, True, True, True, True, True, True, False]])
    # inf(3) > 5(1) > three 1.0 ties -> the two most recent (4, 2); the pad (7) is never preferred
    assert keep_top_indices(p, valid, 4).tolist() == [[1, 2, 3, 4]]
    # 0.0 and -0.0 tie: the more recent (6) wins
    assert keep_top_indices(p, valid, 6).tolist() == [[0, 1, 2, 3, 4, 6]]
    p, valid = random_priorities(g, 4, 50)
    info = TokenInfo(
        positions=torch.arange(50).expand(4, 50), segments=torch.where(valid, 1, 3), token_ids=torch.zeros(4, 50, dtype=torch.long),
        n_keep=17, local_window=4, question_length=0,
    )
    kept = keep_top(p, info)
    assert torch.equal(kept, keep_top_torch(p, valid, 17))
    assert kept.shape == (4, 17) and bool((kept.diff(dim=1) > 0).all())


def test_compact_torch_moves_kept_slots_to_front():
    buf = torch.arange(2 * 3 * 10 * 2, dtype=torch.float32).reshape(2, 3, 10, 2)
    before = buf.clone()
    kept = torch.tensor([[0, 3, 4, 8], [2, 5, 6, 7]])
    compact_([buf], kept, 9)
    for row in range(2):
        assert torch.equal(buf[row, :, :4], before[row, :, kept[row]])
    assert torch.equal(buf[:, :, 4:], before[:, :, 4:])  # slots past k are left alone


def test_compact_per_head_moves_each_heads_slots():
    layers, heads = 2, 3
    buffers = [torch.randn(2, heads, 10, 4) for _ in range(2 * layers)]
    before = [t.clone() for t in buffers]
    g = torch.Generator().manual_seed(1)
    kept = torch.stack([torch.randperm(9, generator=g)[:5].sort().values for _ in range(2 * layers * heads)]).view(2, layers, heads, 5)
    compact_(buffers, kept, 9, [0, 0, 1, 1])
    for i, (t, old) in enumerate(zip(buffers, before)):
        for row in range(2):
            for head in range(heads):
                assert torch.equal(t[row, head, :5], old[row, head, kept[row, i // 2, head]])
    with pytest.raises(ValueError, match="layers="):
        compact_(buffers, kept, 9)


def interpreter_report() -> dict:
    """Run both paths on tiny random inputs (called in a subprocess with TRITON_INTERPRET=1)."""
    import triton  # noqa: F401  (imported after TRITON_INTERPRET was set by the parent)

    os.environ[BACKEND_ENV] = "triton"
    g = torch.Generator().manual_seed(0)
    report = {"keep_top": [], "compact": []}
    for n, n_keep in [(9, 1), (33, 12), (40, 40), (64, 30), (70, 69)]:
        p, valid = random_priorities(g, 3, n)
        ref, got = keep_top_torch(p, valid, n_keep), keep_top_indices(p, valid, n_keep)
        report["keep_top"].append({"n": n, "n_keep": n_keep, "equal": torch.equal(ref, got), "ref": ref.tolist(), "got": got.tolist()})
    # tiled keep-top: rows across tile boundaries (a 16-slot tile walks up to 7 tiles), bfloat16 and float32
    # priorities, a row over one default tile and a 64k budget; one compiled kernel serves every length
    from dynts.kernels.triton_select import KEEP_TOP_TILE, keep_top_triton

    report["keep_top_tiles"] = []
    cases = [(3, n, n_keep, 16, dtype) for n, n_keep in [(15, 7), (16, 16), (17, 1), (33, 20), (100, 69)]
             for dtype in (torch.float32, torch.bfloat16)]
    cases += [(2, 2 * KEEP_TOP_TILE + 904, 4100, KEEP_TOP_TILE, torch.bfloat16), (1, 65536, 40000, KEEP_TOP_TILE, torch.float32)]
    for b, n, n_keep, tile, dtype in cases:
        p, valid = random_priorities(g, b, n)
        p = p.to(dtype)
        equal = torch.equal(keep_top_torch(p, valid, n_keep), keep_top_triton(p, valid, n_keep, tile))
        report["keep_top_tiles"].append({"n": n, "n_keep": n_keep, "tile": tile, "dtype": str(dtype), "equal": equal})
    report["keep_top_refusals"] = []
    for n_keep, tile in [(9, 16), (4, 24)]:
        try:
            keep_top_triton(torch.zeros(2, 8), torch.ones(2, 8, dtype=torch.bool), n_keep, tile)
        except ValueError as err:
            report["keep_top_refusals"].append(str(err))
    for dtype, length, k in [(torch.float32, 17, 9), (torch.bfloat16, 70, 66), (torch.float16, 12, 12)]:
        buffers = [torch.randn(2, 2, 72, 24, generator=g).to(dtype) for _ in range(3)]
        buffers.append(torch.randn(2, 2, 72, 8, generator=g).to(dtype))  # a second layout (other head_dim)
        ref = [t.clone() for t in buffers]
        kept = torch.stack([torch.randperm(length, generator=g)[:k].sort().values for _ in range(2)])
        compact_torch_(ref, kept, length)
        compact_(buffers, kept, length)
        error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, buffers))
        report["compact"].append({"dtype": str(dtype), "length": length, "k": k, "max_abs_error": error})
    # per-head kept sets [b, L, h, k]: each buffer moves with its layer's indices, each head with its own
    for dtype, length, k in [(torch.float32, 20, 11), (torch.bfloat16, 70, 64)]:
        layers, heads = 3, 2
        buffers = [torch.randn(2, heads, 72, 16, generator=g).to(dtype) for _ in range(2 * layers)]
        ref = [t.clone() for t in buffers]
        kept = torch.stack([torch.randperm(length, generator=g)[:k].sort().values for _ in range(2 * layers * heads)])
        kept = kept.view(2, layers, heads, k)
        owners = [i // 2 for i in range(2 * layers)]
        compact_torch_(ref, kept, length, owners)
        compact_(buffers, kept, length, owners)
        error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, buffers))
        report["compact"].append({"dtype": str(dtype), "length": length, "k": k, "per_head": True, "max_abs_error": error})
    # the fused path inside a real cache: a bounded decode with the Triton kernels equals the torch one
    from conftest import tiny_model
    from conftest import decode_with_cache

    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    runs = {}
    for backend in ("torch", "triton"):
        os.environ[BACKEND_ENV] = backend
        seq, logits, *_ , cache = decode_with_cache(model, ids, mask, "dynts", 16, 24, predictor)
        runs[backend] = (seq, logits, cache.stats.evictions)
        evictor = dynts.make_evictor("h2o", per_head=True)
        out = dynts.generate(model, input_ids=ids, method=evictor, budget=16, local_window=4, max_new_tokens=24,
                             do_sample=False, think_end=None)
        runs[backend + "-per-head"] = (out.sequences, out.stats["evictions"])
    report["per_head_decode"] = {"tokens_equal": torch.equal(runs["torch-per-head"][0], runs["triton-per-head"][0]),
                                 "evictions": runs["triton-per-head"][1]}
    report["decode"] = {
        "tokens_equal": torch.equal(runs["torch"][0], runs["triton"][0]),
        "logits_max_abs_error": float((runs["torch"][1] - runs["triton"][1]).abs().max()),
        "evictions": runs["triton"][2],
    }
    return report


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_interpreter_matches_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop(BACKEND_ENV, None)
    proc = subprocess.run(
        [sys.executable, __file__, "--interpreter-report"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in report["keep_top"]:
        assert case["equal"], case
    assert len(report["keep_top_tiles"]) == 12 and max(c["n"] for c in report["keep_top_tiles"]) == 65536
    for case in report["keep_top_tiles"]:
        assert case["equal"], case
    assert [r.split()[0] for r in report["keep_top_refusals"]] == ["n_keep=9", "tile=24"], report["keep_top_refusals"]
    for case in report["compact"]:
        assert case["max_abs_error"] == 0.0, case  # a gather moves values, it never rounds them
    assert any(case.get("per_head") for case in report["compact"])
    assert report["per_head_decode"]["evictions"] >= 2 and report["per_head_decode"]["tokens_equal"], report["per_head_decode"]
    assert report["decode"]["evictions"] >= 2
    assert report["decode"]["tokens_equal"], report["decode"]
    assert report["decode"]["logits_max_abs_error"] == 0.0, report["decode"]


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-report"]:
    torch.set_num_threads(1)
    print(json.dumps(interpreter_report()))


def test_padding_flag_is_tracked_on_the_host(qwen2):
    """Decode steps decide "no mask needed" from a host flag (no per-step device read on CUDA)."""
    from conftest import padded_batch
    from conftest import decode_with_cache

    ids, mask = padded_batch([8, 5], seed=7)
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size)
    _, _, _, _, cache = decode_with_cache(qwen2, ids, mask, "window", 16, 2, predictor)
    assert cache.holds_pads and cache.stats.evictions == 0  # prefill padding is remembered
    _, _, _, _, cache = decode_with_cache(qwen2, ids, mask, "window", 16, 30, predictor)
    assert cache.stats.evictions >= 2 and not cache.holds_pads  # evicted first, re-checked once per event
    unpadded, ones = padded_batch([8, 8], seed=7)
    _, _, _, _, cache = decode_with_cache(qwen2, unpadded, ones, "window", 16, 30, predictor)
    assert not cache.holds_pads
