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


pytest.importorskip("vllm", reason="needs vLLM's CPU build (make test builds .venv-vllm)")
try:  # vLLM 0.34 moved the CPU attention ops to their own module
    import vllm._cpu_ops as vllm_ops
except ImportError:
    import vllm._custom_ops as vllm_ops


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


def _vllm_flash_attn_caches(layout_name: str, layers: int, blocks: int, heads: int, head: int, dtype):
    """FLASH_ATTN's per-layer KV caches exactly as vLLM builds them: the engine core's KVCacheConfig
    (``get_kv_cache_config_from_groups``: ``kv_cache_utils`` on 0.32, ``kv_cache_planning`` on 0.34) and the
    worker's ``allocate_kv_cache`` (one allocation, per-layer views)."""
    from types import SimpleNamespace

    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, prefix_cache_retention_interval=None,
                                     num_gpu_blocks_override=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(names, spec)],
                                             available_memory=blocks * layers * spec.page_size_bytes)
    assert config.num_blocks == blocks
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    return [caches[n] for n in names]


def test_flash_attn_default_layout_is_lbnhc():
    """FLASH_ATTN (and TRITON_ATTN) declare no KV layout, so vLLM resolves the default preference, LBNHC first."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    for backend in (FlashAttentionBackend, TritonAttentionBackend):
        assert backend.supported_kv_cache_layouts() is None
        assert get_supported_kv_cache_layouts([backend])[0] is KVCacheLayout.LBNHC


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_copy_on_the_cache_vllm_allocates(layout, dtype):
    """On the views vLLM allocates for FLASH_ATTN (logical ``[blocks, kv_heads, block_size, 2 * head]``): the
    bench's emulation (eval.perf.vllm_hooks_bench.vllm_kv_caches) has their exact strides, and K/V written
    through FlashAttention's own split (``kv.transpose(1, 2).split(head, -1)``) and moved with the plugin's copy
    equal K/V written straight into the destination slots, every other layer untouched."""
    from eval.perf.vllm_hooks_bench import vllm_kv_caches

    layers, blocks, heads, head = 3, 4, 2, 64
    caches = _vllm_flash_attn_caches(layout, layers, blocks, heads, head, dtype)
    ours = vllm_kv_caches(layers, blocks, heads, BLOCK, 2 * head, dtype, "cpu", layout)
    for theirs, mine in zip(caches, ours):
        assert theirs.shape == mine.shape == (blocks, heads, BLOCK, 2 * head)
        assert theirs.stride() == mine.stride()
    assert caches[1].data_ptr() - caches[0].data_ptr() == (ours[1].data_ptr() - ours[0].data_ptr())
    src, dst = _slots_case()
    torch.manual_seed(2)
    key = torch.randn(len(src), heads, head).to(dtype)
    value = torch.randn(len(src), heads, head).to(dtype)

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:  # FlashAttentionImpl.do_kv_cache_update's view
        key_cache, value_cache = kv.transpose(1, 2).split(head, dim=-1)  # [blocks, block_size, heads, head]
        key_cache[slots // BLOCK, slots % BLOCK] = key
        value_cache[slots // BLOCK, slots % BLOCK] = value

    for kv in caches:
        kv.zero_()
    write(caches[1], src)
    others = [caches[0].clone(), caches[2].clone()]
    expected = caches[1].clone()  # sources that are not overwritten keep their K/V
    write(expected, dst)
    layout_for("FLASH_ATTN")(caches[1], src, dst, BLOCK)
    assert torch.equal(caches[1], expected)
    assert torch.equal(caches[0], others[0]) and torch.equal(caches[2], others[1])
