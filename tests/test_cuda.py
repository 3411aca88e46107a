"""CUDA-only checks (``pytest -m cuda``; skipped without a GPU, run by ``scripts/gpu_check.py``).

* the Triton kernels (keep-top selection up to 64k slots, in-place compaction) against the torch reference on
  the hardware, not the interpreter; after the start-up warm-up, rounds of any budget or width compile nothing;
* a bounded cache that never evicts: bf16 logits within 4 ulps of a plain forward, float32 tokens
  identical to plain ``generate``; the compiled decode step (CUDA graphs) is token-identical to the
  eager bounded cache;
* the vLLM V2 worker hooks between CUDA graph replays (:mod:`eval.perf.vllm_graph_check`, no vLLM): a stand-in
  forward that reads the runner's persistent buffers, captured once and replayed across plain decode steps and
  eviction rounds, leaves every row's stored K/V and attention output equal to the eager run's;
* finished rows leaving a bf16 decode (`retire_finished`) write the same tokens;
* a model split across two GPUs decodes with eviction (only with more than one GPU).
"""

from __future__ import annotations

import pytest
import torch

import dynts
from conftest import decode_with_cache, padded_batch, tiny_model
from dynts.kernels import compact_torch_, keep_top_torch, triton_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _priorities(g: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.randint(-3, 3, (b, n), generator=g).float()
    for value in (float("inf"), float("-inf"), float("nan"), -0.0):
        p[torch.rand(b, n, generator=g) < 0.1] = value
    return p, torch.rand(b, n, generator=g) > 0.2


@needs_triton
@pytest.mark.parametrize("n", [17, 1000, 5000, 65536])
def test_triton_keep_top_matches_torch_on_gpu(n):
    from dynts.kernels.triton_select import keep_top_triton

    g = torch.Generator().manual_seed(n)
    p, valid = _priorities(g, 6, n)
    for n_keep in (1, n // 3, n):
        expected = keep_top_torch(p, valid, n_keep)
        got = keep_top_triton(p.cuda(), valid.cuda(), n_keep)
        assert torch.equal(got.cpu(), expected)


@needs_triton
def test_after_the_warm_up_rounds_of_any_budget_or_width_compile_nothing():
    """The warm-up compiles the paged move and keep-top once; rounds of other budgets, row lengths and kept widths
    (divisible by 16 or not) reuse them."""
    from dynts.kernels import compiled_variants, keep_top_indices, warm_up_kernels
    from dynts.kernels.paged import PagedKV
    from dynts.vllm.layouts import geometry_paged
    from eval.perf.vllm_hooks_bench import vllm_kv_caches

    block = 16
    caches = vllm_kv_caches(3, 2 * 80 + 1, 2, block, 2 * 128, torch.bfloat16, "cuda", "LBNHC")
    for kv in caches:
        kv.normal_()
    paged = PagedKV(caches, block, geometry_paged(caches[0]))
    before = [kv.clone() for kv in caches]
    assert warm_up_kernels(paged)["kernels"] == ["paged_move", "keep_top"]
    assert all(torch.equal(a, b) for a, b in zip(caches, before))  # the warm-up moved nothing
    warmed = compiled_variants()
    assert warmed["paged_move"] and warmed["keep_top"], warmed
    g = torch.Generator().manual_seed(0)
    for n, n_keep in [(17, 1), (100, 33), (1024, 512), (4097, 2049), (70000, 65536)]:
        p, valid = _priorities(g, 3, n)
        assert torch.equal(keep_top_indices(p.cuda(), valid.cuda(), n_keep).cpu(), keep_top_torch(p, valid, n_keep))
    blocks = torch.randperm(2 * 80, generator=g).view(2, 80).cuda() + 1
    for width in (17, 32, 100, 1000):
        kept = (torch.arange(width) + 3).repeat(2, 1).cuda()  # every slot moves 3 back
        paged.move_(kept, blocks)
    torch.cuda.synchronize()
    assert compiled_variants() == warmed


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_compact_matches_torch_on_gpu(dtype):
    from dynts.kernels.triton_kernels import compact_triton_

    g = torch.Generator().manual_seed(0)
    b, h, cap, d, length, k = 3, 4, 700, 128, 650, 260
    buffers = [torch.randn(b, h, cap, d, generator=g).to(dtype) for _ in range(4)]
    kept = torch.stack([torch.randperm(length, generator=g)[:k].sort().values for _ in range(b)])
    expected = [t.clone() for t in buffers]
    compact_torch_(expected, kept, length)
    on_gpu = [t.cuda() for t in buffers]
    compact_triton_(on_gpu, kept.cuda(), length)
    for got, ref in zip(on_gpu, expected):
        assert torch.equal(got[:, :, :k].cpu(), ref[:, :, :k])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_per_head_compact_matches_torch_on_gpu(dtype):
    from dynts.kernels.triton_kernels import compact_triton_

    g = torch.Generator().manual_seed(1)
    b, layers, h, cap, d, length, k = 2, 3, 4, 700, 128, 650, 260
    buffers = [torch.randn(b, h, cap, d, generator=g).to(dtype) for _ in range(2 * layers)]
    kept = torch.stack([torch.randperm(length, generator=g)[:k].sort().values for _ in range(b * layers * h)])
    kept = kept.view(b, layers, h, k)
    owners = [i // 2 for i in range(2 * layers)]
    expected = [t.clone() for t in buffers]
    compact_torch_(expected, kept, length, owners)
    on_gpu = [t.cuda() for t in buffers]
    compact_triton_(on_gpu, kept.cuda(), length, owners)
    for got, ref in zip(on_gpu, expected):
        assert torch.equal(got[:, :, :k].cpu(), ref[:, :, :k])


def _bf16_model(seed: int = 0) -> torch.nn.Module:
    return tiny_model("qwen2", seed=seed).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_paged_move_matches_torch_on_gpu(layout, dtype):
    """The vLLM eviction round's one-launch slot move equals the torch path bitwise on the GPU, in vLLM's layouts."""
    from dynts.kernels.paged import PagedKV
    from dynts.vllm.layouts import geometry_paged
    from eval.perf.vllm_hooks_bench import vllm_kv_caches

    g = torch.Generator().manual_seed(0)
    rows, per_row, block = 8, 64, 16
    blocks = (torch.randperm(rows * per_row, generator=g) + 1).view(rows, per_row)
    keeps = [600 + 37 * r for r in range(rows)]
    kept = torch.arange(max(keeps)).repeat(rows, 1)
    for r, k in enumerate(keeps):
        kept[r, :k] = torch.cat([torch.arange(64), (torch.randperm(per_row * block - 64, generator=g)[: k - 64] + 64).sort().values])
    caches = vllm_kv_caches(4, rows * per_row + 1, 4, block, 256, dtype, "cuda", layout)
    for kv in caches:
        kv.normal_()
    expected = [kv.clone() for kv in caches]
    PagedKV(expected, block, geometry_paged(expected[0])).move_torch_(kept.cuda(), blocks.cuda())
    paged = PagedKV(caches, block, geometry_paged(caches[0]))
    assert paged.triton
    paged.move_(kept.cuda(), blocks.cuda())
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


def test_bf16_bounded_cache_logits_within_tolerance_and_fp32_tokens_identical():
    """SDPA over the cache's strided views and over contiguous tensors may sum in another order, so
    bf16 is held to a tolerance (4 ulps of the largest logit, per decode step, vs one plain forward
    over the same tokens) and float32 to token identity with ``model.generate``."""
    model = _bf16_model()
    ids, mask = padded_batch([20, 13, 17], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    new = 40
    seq, logits, _, _, cache = decode_with_cache(model, ids, mask, "window", 256, new)
    assert cache.stats.evictions == 0
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype, device=mask.device)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain = model(input_ids=seq[:, :-1], attention_mask=full_mask[:, :-1], position_ids=positions[:, :-1]).logits
    ref = plain[:, ids.shape[1] :].float()
    atol = 4 * torch.finfo(torch.bfloat16).eps * float(ref.abs().max())
    torch.testing.assert_close(logits[:, :-1].float(), ref, atol=atol, rtol=0)
    model = tiny_model("qwen2", seed=0).cuda()
    with torch.no_grad():
        reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    for method in ("full", "window", "dynts"):
        out = dynts.generate(model, input_ids=ids, attention_mask=mask, method=method, budget=256, local_window=8,
                             max_new_tokens=new, predictor=dynts.ImportancePredictor(64), pad_token_id=0,
                             eos_token_id=None)
        assert out.stats["evictions"] == 0
        assert torch.equal(out.sequences, reference), method


@pytest.mark.parametrize("method", ["window", "h2o", "dynts"])
def test_compiled_decode_with_cuda_graphs_matches_eager(method):
    model = tiny_model("qwen2", seed=1).cuda()  # fp32: compiled kernels reorder sums; keep greedy margins wide
    ids, mask = padded_batch([19, 12], seed=2)
    kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), method=method, budget=40, local_window=8,
              max_new_tokens=48, predictor=dynts.ImportancePredictor(64), pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    eager = dynts.generate(model, **kw)
    compiled = dynts.generate(model, compile="reduce-overhead", **kw)
    assert eager.stats["evictions"] >= 2 and compiled.stats["evictions"] == eager.stats["evictions"]
    assert torch.equal(compiled.sequences, eager.sequences)


def test_vllm_v2_hooks_between_cuda_graph_replays_match_eager():
    """RunnerV2Hooks lower ``seq_lens`` and point the slot mapping at the stored slots in the persistent buffers a
    captured graph reads, and move the kept K/V between replays: every decode round replays the graph, and the
    stored K/V and attention outputs equal the eager drive's and the per-row reference."""
    from eval.perf.vllm_graph_check import GraphCheckSettings, run_graph_check

    out = run_graph_check(GraphCheckSettings(rows=16, shape="small", dtype="bfloat16", device="cuda", cycles=2,
                                             plain_steps=4))
    graphed = out["graph_vs_eager"]
    assert out["graphs"] and out["ok"], out
    assert graphed["replays"] == 2 * (1 + 4) and graphed["stored_kv_equal"] and graphed["verified"]["event_rounds"] == 2
    assert graphed["max_abs_diff"] <= 1e-4 and out["reference_max_abs_diff"] <= 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_model_split_across_two_gpus_decodes_with_eviction():
    from accelerate import dispatch_model

    model = tiny_model("qwen2", seed=4)
    ids, mask = padded_batch([18, 11], seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, method="window", budget=32, local_window=8, max_new_tokens=40,
              pad_token_id=0, eos_token_id=None)
    single = dynts.generate(model.to("cuda:0"), **kw)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                  "model.norm": 1, "lm_head": 1}
    split = dispatch_model(tiny_model("qwen2", seed=4), device_map=device_map)
    out = dynts.generate(split, **kw)
    assert out.stats["evictions"] >= 2
    assert torch.equal(out.sequences.cpu(), single.sequences.cpu())


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_finished_rows_leave_a_bf16_decode_on_gpu(method):
    """``retire_finished`` on the GPU in bf16: the rows left write the same tokens (a GPU matmul of fewer rows
    may round differently; the default keeps 16 rows in every forward) with one host read per 8 steps."""
    model = tiny_model("qwen2", dtype=torch.bfloat16).cuda()
    ids, mask = padded_batch([7 + (5 * r) % 11 for r in range(40)], seed=2)
    runs = []
    for retire in (False, True):
        torch.manual_seed(3)
        runs.append(dynts.generate(model, input_ids=ids.cuda(), attention_mask=mask.cuda(), method=method, budget=40,
                                   local_window=8, max_new_tokens=80, pad_token_id=0, eos_token_id=[5, 17, 33, 60],
                                   do_sample=True, temperature=1.0, retire_finished=retire))
    assert runs[1].stats["retired_rows"] >= 10
    assert torch.equal(runs[0].sequences, runs[1].sequences)
