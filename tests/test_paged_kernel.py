""":class:`dynts.kernels.PagedKV`, the eviction round's slot move in vLLM's paged caches: the torch path equals the
per-layout slot copies (themselves checked against vLLM's own cache writers in ``tests/test_vllm_layouts.py``) on
every layout and dtype, with requests that keep different counts; the Triton kernel (in Triton's interpreter, in
a subprocess so that ``TRITON_INTERPRET=1`` is set before ``triton`` is imported) equals the torch path bitwise;
neither reads anything back to the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynts.core import copy_plan
from dynts.kernels import BACKEND_ENV, triton_available
from dynts.kernels.paged import PagedKV, physical_slots
from dynts.vllm.layouts import copy_slots_cpu_vec, copy_slots_paged, geometry_cpu_vec, geometry_paged
from eval.perf.syncs import SyncCounter
from eval.perf.vllm_hooks_bench import vllm_kv_caches

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4
LAYOUTS = ("LBNHC", "LBHNC", "BLNHC")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def round_case(g: torch.Generator, rows: int = 3, blocks_per_row: int = 5):
    """A round of ``rows`` requests with scattered blocks: each stores some slots and keeps an ascending subset
    (its question window in place), padded to the widest with ``kept[r, i] = i``."""
    order = (torch.randperm(rows * blocks_per_row, generator=g) + 1).view(rows, blocks_per_row)
    stored = [blocks_per_row * BLOCK - int(torch.randint(0, BLOCK, (1,), generator=g)) for _ in range(rows)]
    keeps = [max(2, s * 2 // 3 - r) for r, s in enumerate(stored)]
    width = max(keeps)
    kept = torch.arange(width).repeat(rows, 1)
    for r, (s, k) in enumerate(zip(stored, keeps)):
        q = 2
        kept[r, :k] = torch.cat([torch.arange(q), (torch.randperm(s - q, generator=g)[: k - q] + q).sort().values])
    return order, stored, keeps, kept, rows * blocks_per_row + 1


def reference_(caches, copy, order, stored, keeps, kept) -> None:
    """The round through the per-layout slot copy, request by request (:func:`copy_plan`'s physical pairs)."""
    for r, (s, k) in enumerate(zip(stored, keeps)):
        physical = physical_slots(order[r : r + 1], torch.arange(s)[None], BLOCK)
        src, dst = copy_plan(kept[r : r + 1, :k], physical)
        for kv in caches:
            copy(kv, src, dst, BLOCK)


def filled(caches: list[torch.Tensor], g: torch.Generator) -> list[torch.Tensor]:
    for kv in caches:
        kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
    return caches


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_move_equals_the_flash_attn_slot_copy(layout, dtype):
    g = torch.Generator().manual_seed(0)
    order, stored, keeps, kept, num_blocks = round_case(g)
    caches = filled(vllm_kv_caches(3, num_blocks, 2, BLOCK, 2 * 8, dtype, "cpu", layout), g)
    expected = [kv.clone() for kv in caches]
    reference_(expected, copy_slots_paged, order, stored, keeps, kept)
    PagedKV(caches, BLOCK, geometry_paged(caches[0])).move_torch_(kept, order)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_move_equals_the_cpu_attn_slot_copy(dtype):
    g = torch.Generator().manual_seed(1)
    order, stored, keeps, kept, num_blocks = round_case(g)
    caches = filled([torch.empty(num_blocks, 2, BLOCK, 2 * 8, dtype=dtype) for _ in range(2)], g)
    expected = [kv.clone() for kv in caches]
    reference_(expected, copy_slots_cpu_vec, order, stored, keeps, kept)
    PagedKV(caches, BLOCK, geometry_cpu_vec(caches[0])).move_torch_(kept, order)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_a_round_reads_nothing_back_to_the_host():
    g = torch.Generator().manual_seed(2)
    order, _, _, kept, num_blocks = round_case(g)
    caches = filled(vllm_kv_caches(2, num_blocks, 2, BLOCK, 16, torch.bfloat16, "cpu", "LBNHC"), g)
    paged = PagedKV(caches, BLOCK, geometry_paged(caches[0]))
    counter = SyncCounter()
    with counter.counting():
        paged.move_(kept, order)
    assert counter.now == 0


def test_layers_of_different_layouts_are_refused():
    a = vllm_kv_caches(1, 5, 2, BLOCK, 16, torch.float32, "cpu", "LBNHC")[0]
    b = vllm_kv_caches(1, 5, 2, BLOCK, 16, torch.float32, "cpu", "LBHNC")[0]
    with pytest.raises(ValueError, match="share shape, strides"):
        PagedKV([a, b], BLOCK, geometry_paged(a))
    with pytest.raises(ValueError, match="block_size=8"):
        PagedKV([a], 8, geometry_paged(a))
    with pytest.raises(ValueError, match="share R"):
        PagedKV([a], BLOCK, geometry_paged(a)).move_(torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


def interpreter_report() -> list[dict]:
    """The Triton kernel against the torch path (called in a subprocess with TRITON_INTERPRET=1)."""
    import triton  # noqa: F401  (imported after TRITON_INTERPRET was set by the parent)

    os.environ[BACKEND_ENV] = "triton"
    report = []
    for layout in (*LAYOUTS, "cpu_vec"):
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(3)
            order, _, _, kept, num_blocks = round_case(g)
            if layout == "cpu_vec":
                caches = filled([torch.empty(num_blocks, 2, BLOCK, 2 * 8, dtype=dtype) for _ in range(2)], g)
                geometry = geometry_cpu_vec
            else:
                caches = filled(vllm_kv_caches(3, num_blocks, 2, BLOCK, 2 * 8, dtype, "cpu", layout), g)
                geometry = geometry_paged
            expected = [kv.clone() for kv in caches]  # a clone may have other strides: its own geometry
            PagedKV(expected, BLOCK, geometry(expected[0])).move_torch_(kept, order)
            paged = PagedKV(caches, BLOCK, geometry(caches[0]))
            paged.move_(kept, order)
            report.append({"layout": layout, "dtype": str(dtype), "triton": paged.triton,
                           "equal": all(torch.equal(a, b) for a, b in zip(caches, expected))})
    # wider rounds (kept widths over the move's 32-slot tile, several of them in one engine: the width is a
    # run-time value), each after a warm-up that must leave the caches untouched
    from dynts.kernels import warm_up_kernels

    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(4)
        caches = filled(vllm_kv_caches(2, 3 * 30 + 1, 2, BLOCK, 2 * 8, dtype, "cpu", "LBNHC"), g)
        before = [kv.clone() for kv in caches]
        paged = PagedKV(caches, BLOCK, geometry_paged(caches[0]))
        warmed = warm_up_kernels(paged)
        untouched = all(torch.equal(a, b) for a, b in zip(caches, before))
        for blocks_per_row in (10, 30):
            order, _, _, kept, _ = round_case(g, rows=3, blocks_per_row=blocks_per_row)
            expected = [kv.clone() for kv in caches]
            PagedKV(expected, BLOCK, geometry_paged(expected[0])).move_torch_(kept, order)
            paged.move_(kept, order)
            report.append({"layout": "LBNHC", "dtype": str(dtype), "triton": paged.triton, "width": kept.shape[1],
                           "warmed": warmed["kernels"], "aligned": paged.aligned, "untouched": untouched,
                           "equal": all(torch.equal(a, b) for a, b in zip(caches, expected))})
    return report


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernel_equals_the_torch_path_bitwise():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop(BACKEND_ENV, None)
    proc = subprocess.run([sys.executable, __file__, "--interpreter-report"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 4 * len(DTYPES) + 4
    for case in report:
        assert case["triton"] and case["equal"], case
    wide = [case for case in report if "width" in case]
    assert max(case["width"] for case in wide) > 2 * 32  # rounds over several of the move's tiles
    for case in wide:
        assert case["warmed"] == ["paged_move", "keep_top"] and case["untouched"] and case["aligned"], case


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-report"]:
    torch.set_num_threads(1)
    print(json.dumps(interpreter_report()))
