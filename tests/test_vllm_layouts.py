"""The KV slot copies of dynts.vllm against vLLM's own cache writers, on tensors of the exact layout."""

from __future__ import annotations

import pytest
import torch

from dynts.vllm.layouts import copy_slots_cpu_vec, copy_slots_paged, layout_for

BLOCK = 32


def _slots_case(blocks: int = 4):
    src = torch.tensor([3, 40, 41, 70, 100, 127])
    dst = torch.tensor([1, 2, 33, 35, 36, 64])
    return src, dst


def test_paged_view_moves_whole_slots_and_keeps_others():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(4, 2, BLOCK, 2 * 64).to(dtype)
        # a permuted physical layout (as KVCacheLayout allows): the logical view must not care
        kv = kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        before = kv.clone()
        src, dst = _slots_case()
        copy_slots_paged(kv, src, dst, BLOCK)
        flat_before = before.permute(0, 2, 1, 3).reshape(-1, 2, 128)
        flat = kv.permute(0, 2, 1, 3).reshape(-1, 2, 128)
        assert torch.equal(flat[dst], flat_before[src])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(flat[untouched], flat_before[untouched])


def test_unknown_backend_is_refused_with_the_supported_list():
    with pytest.raises(NotImplementedError, match="no tested KV slot layout.*FLASHINFER"):
        layout_for("FLASHINFER")
    with pytest.raises(NotImplementedError, match="CPU kernel 'amx'"):
        layout_for("CPU_ATTN", "amx")
    assert layout_for("CPU_ATTN", "vec") is copy_slots_cpu_vec


vllm_ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (make test builds .venv-vllm)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [64, 128, 80])
def test_cpu_vec_copy_matches_the_kernels_own_writes(dtype, head):
    """Write K/V with vLLM's CPU kernel, move slots with dynts, and compare with the kernel writing
    the same K/V straight into the destination slots: byte-identical caches."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BLOCK, head)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"this CPU runs the {isa!r} kernel")
    heads, blocks = 2, 4
    src, dst = _slots_case()
    torch.manual_seed(1)
    key = torch.randn(len(src), heads, head).to(dtype)
    value = torch.randn(len(src), heads, head).to(dtype)

    def write(slots: torch.Tensor) -> torch.Tensor:
        kv = torch.zeros(blocks, heads, BLOCK, 2 * head, dtype=dtype)
        k_cache, v_cache = kv.view(blocks, heads, 2 * BLOCK, head).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa,
                                            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return kv

    moved = write(src)
    layout_for("CPU_ATTN", isa)(moved, src, dst, BLOCK)
    expected = write(dst)
    # source slots that were not overwritten still hold their old K/V: zero them through the kernel
    keep_src = torch.tensor([s for s in src.tolist() if s not in dst.tolist()])
    zeros_k = torch.zeros(len(keep_src), heads, head, dtype=dtype)
    for kv in (moved, expected):
        k_cache, v_cache = kv.view(blocks, heads, 2 * BLOCK, head).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(zeros_k, zeros_k, k_cache, v_cache, keep_src, isa,
                                            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(moved, expected)
