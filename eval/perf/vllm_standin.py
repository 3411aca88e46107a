"""What the vLLM stand-in runners share (:mod:`.vllm_v1_standin`, :mod:`.vllm_v2_standin`): the model shapes, the KV
caches as vLLM allocates them, the parts of a model runner the worker hooks read at construction, the hooks with
the testbed's tokenizer on one rank, and the K/V content a stand-in forward writes and a check reads back.

Each KV cache is FLASH_ATTN's as vLLM allocates it (:func:`vllm_kv_caches`): the logical per-layer view
``[blocks, kv_heads, block_size, 2 * head]`` over one allocation of every layer in the resolved physical layout,
by default ``LBNHC`` (what vLLM picks for FLASH_ATTN, which declares no layout of its own:
``vllm.v1.attention.backends.utils._DEFAULT_LAYOUT_PREFERENCE``).

The K/V content (:func:`kv_content`) is a function of the token's logical position, its row in the batch, the KV
head and the layer: dimensions 0-3 hold ``position % 128``, ``position // 128``, the row and the head (integers,
exact in bf16), the rest smooth functions of the position (so attention over them is not uniform); values are
the keys plus ``layer + 1``. :func:`stored_problem` reads a row's stored slots back through its block list and
says what is wrong, if anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["FLASH_ATTN_DEFAULT_LAYOUT", "LAYOUT_ORDERS", "SHAPES", "FullAttentionSpec", "Recording", "bench_hooks_class",
           "blocks_per_row", "full_attention_spec", "kv_content", "kv_views", "query_content", "runner_parts", "stored_problem",
           "vllm_kv_caches"]

# vLLM's KVCacheLayout (vllm/v1/kv_cache_layout.py): the stride permutation of the logical [L, B, H, N, C]
# (layers, blocks, kv heads, slots in a block, content = keys then values) into memory order.
LAYOUT_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
FLASH_ATTN_DEFAULT_LAYOUT = "LBNHC"

# model / cache shapes: hidden size (predictor input), layers, KV heads, head dim, block size, B, W_l, prompt
SHAPES = {
    "r1-7b": dict(hidden=3584, layers=28, kv_heads=4, head=128, block=16, budget=4096, local_window=512, prompt=256),
    "small": dict(hidden=512, layers=4, kv_heads=2, head=64, block=16, budget=512, local_window=64, prompt=64),
    "tiny": dict(hidden=32, layers=2, kv_heads=2, head=8, block=4, budget=48, local_window=8, prompt=8),
}


def vllm_kv_caches(layers: int, blocks: int, heads: int, block_size: int, content: int, dtype: torch.dtype,
                   device: torch.device | str, layout: str = FLASH_ATTN_DEFAULT_LAYOUT) -> list[torch.Tensor]:
    """Per-layer KV caches as vLLM views its one allocation (``create_kv_cache_views``): logical
    ``[blocks, heads, block_size, content]`` views of ``[L, B, H, N, C]`` stored in ``layout``'s memory order
    (zeroed, as vLLM allocates them: ``vllm.v1.worker.utils._allocate_kv_cache_buffer``)."""
    order = LAYOUT_ORDERS[layout]
    logical = (layers, blocks, heads, block_size, content)
    physical = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    view = physical.permute([order.index(d) for d in range(5)])  # logical axis d back in place d
    return [view[i] for i in range(layers)]


def kv_views(caches: list[torch.Tensor], head: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention's own view of each layer: keys and values ``[blocks, block_size, kv_heads, head]``."""
    return [tuple(kv.transpose(1, 2).split(head, dim=-1)) for kv in caches]


class _FlashAttn:
    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"


def runner_parts(runner: Any, shape: dict, rows: int, dtype: torch.dtype, num_blocks: int, max_len: int,
                 layout: str, tokenizer: str) -> None:
    """Set on ``runner`` what the worker hooks read of any vLLM model runner when they are built: one FLASH_ATTN
    layer per model layer in ``compilation_config.static_forward_context`` (its KV cache a view of one
    allocation of ``num_blocks`` blocks), ``kv_cache_config`` (one full-attention group), ``get_model()`` with
    ``model.norm.weight``, ``model_config`` and ``vllm_config`` (``max_num_seqs = rows``)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(shape["layers"])]
    caches = vllm_kv_caches(shape["layers"], num_blocks, shape["kv_heads"], shape["block"], 2 * shape["head"],
                            dtype, runner.device, layout)
    runner.compilation_config = SimpleNamespace(static_forward_context={
        name: SimpleNamespace(attn_backend=_FlashAttn, kv_cache=kv) for name, kv in zip(names, caches)})
    runner.kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        SimpleNamespace(layer_names=names, kv_cache_spec=full_attention_spec(shape, dtype))])
    runner.model = SimpleNamespace(model=SimpleNamespace(norm=SimpleNamespace(
        weight=torch.ones(shape["hidden"], dtype=dtype, device=runner.device))))
    text = SimpleNamespace(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], vocab_size=None)
    runner.model_config = SimpleNamespace(model="random-init", tokenizer=tokenizer, tokenizer_revision=None,
                                          trust_remote_code=False, hf_text_config=text, max_model_len=max_len)
    runner.vllm_config = SimpleNamespace(model_config=runner.model_config,
                                         scheduler_config=SimpleNamespace(max_num_seqs=rows))
    runner.get_model = lambda: runner.model
    runner.kv_caches = caches


@dataclass(frozen=True)
class FullAttentionSpec:
    """vLLM's plain full-attention KV-cache spec, as far as the worker's check reads it (no vLLM installed)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


def full_attention_spec(shape: dict, dtype: torch.dtype) -> Any:
    """The KV-cache group's spec: vLLM's own ``FullAttentionSpec`` where vLLM is installed (the worker's check
    accepts only that class), else :class:`FullAttentionSpec`."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmSpec
    except ImportError:
        return FullAttentionSpec(block_size=shape["block"], num_kv_heads=shape["kv_heads"], head_size=shape["head"],
                                 dtype=dtype)
    return VllmSpec(block_size=shape["block"], num_kv_heads=shape["kv_heads"], head_size=shape["head"], dtype=dtype)


def bench_hooks_class(base: type) -> type:
    """``base`` (:class:`~dynts.vllm.worker.WorkerHooks` or :class:`~dynts.vllm.worker_v2.RunnerV2Hooks`) on one
    rank (no tensor-parallel group) with the testbed's tokenizer (``dynts.models.load_tokenizer``: the worker's
    ``AutoTokenizer`` maps the testbed's word-level ``tokenizer.json`` to a byte-level BPE)."""

    class BenchHooks(base):
        @staticmethod
        def _tp_group() -> None:
            return None

        @staticmethod
        def _tokenizer(runner: Any) -> Any:
            from dynts.models import load_tokenizer

            return load_tokenizer(runner.model_config.tokenizer)

    BenchHooks.__name__ = BenchHooks.__qualname__ = f"Bench{base.__name__}"
    return BenchHooks


class Recording:
    """An evictor that records each decision (``TokenInfo.positions`` and the kept slots) as it makes it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, info: Any) -> torch.Tensor:
        kept = self.inner(info)
        self.calls.append((info.positions.clone(), kept.clone()))
        return kept


# ---------------------------------------------------------------------------------------------- K/V content
def kv_content(positions: torch.Tensor, rows: torch.Tensor, heads: int, head: int, layer: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[T, heads, head]`` in ``dtype`` of tokens at logical ``positions`` ``[T]`` in batch
    ``rows`` ``[T]`` (any device; no host read, so it runs inside a captured CUDA graph)."""
    pos = positions.to(torch.float32)[:, None, None]
    dim = torch.arange(head, device=positions.device, dtype=torch.float32)
    smooth = torch.sin(pos * (0.37 / (1.0 + dim)) + rows.to(torch.float32)[:, None, None])  # [T, 1, head]
    key = smooth.expand(-1, heads, -1).clone()
    key[:, :, 0] = torch.remainder(positions, 128).to(torch.float32)[:, None]
    key[:, :, 1] = torch.div(positions, 128, rounding_mode="floor").to(torch.float32)[:, None]
    key[:, :, 2] = rows.to(torch.float32)[:, None]
    key[:, :, 3] = torch.arange(heads, device=positions.device, dtype=torch.float32)
    return key.to(dtype), (key + (layer + 1)).to(dtype)


def query_content(positions: torch.Tensor, rows: torch.Tensor, heads: int, head: int) -> torch.Tensor:
    """Queries ``[T, heads, head]`` (float32) of tokens at logical ``positions`` in batch ``rows`` (graph-safe); zero
    on the keys' integer dimensions 0-3, so the scores come from their smooth part."""
    dim = torch.arange(head, device=positions.device, dtype=torch.float32)
    h = torch.arange(heads, device=positions.device, dtype=torch.float32)[None, :, None]
    angle = positions.to(torch.float32)[:, None, None] * (0.11 / (1.0 + dim)) + rows.to(torch.float32)[:, None, None]
    return torch.where(dim < 4, 0.0, torch.cos(angle + h))


def stored_problem(views: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int], expected: list[int], row: int,
                   block_size: int) -> str | None:
    """What is wrong with one row's stored slots (``None``: nothing): slot ``j`` of the row's block list must
    hold the K/V of logical position ``expected[j]`` of batch row ``row``, in every layer and head."""
    device = views[0][0].device
    heads = views[0][0].shape[2]
    table = torch.tensor(blocks, dtype=torch.long)
    j = torch.arange(len(expected))
    block, offset = table[j // block_size].to(device), (j % block_size).to(device)
    want = torch.tensor(expected)
    for layer, (key, value) in enumerate(views):
        keys, values = key[block, offset].float().cpu(), value[block, offset].float().cpu() - (layer + 1)
        for name, t in (("keys", keys), ("values", values)):
            got = (t[:, :, 0] + 128 * t[:, :, 1]).long()  # [stored, heads]
            if not (got == want[:, None]).all():
                bad = int((got[:, 0] != want).nonzero()[0]) if (got[:, 0] != want).any() else 0
                return f"layer {layer} {name}: slot {bad} holds position {int(got[bad, 0])}, expected {expected[bad]}"
            if not ((t[:, :, 2] == row).all() and (t[:, :, 3] == torch.arange(heads).float()).all()):
                return f"layer {layer} {name}: a slot holds another row's or head's K/V"
    return None


def blocks_per_row(shape: dict) -> int:
    """Blocks a row holds at most (``B`` slots)."""
    return math.ceil(shape["budget"] / shape["block"])
