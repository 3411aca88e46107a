"""The default KV pool: sized from the memory actually free on the model's device and what the model needs.

transformers' engine sizes its pool from a fraction of the device's total memory (60% of the
machine's RAM on CPU) whatever else runs there, so a second process on the same machine swaps for
minutes. :func:`plan_pool` instead reads the memory free now (``torch.cuda.mem_get_info`` on CUDA,
``MemAvailable`` of ``/proc/meminfo`` on CPU), keeps a stated headroom for activations, batch tensors
and everything else on the machine (:data:`HEADROOM`), and never sizes more blocks than
:data:`SIZED_REQUESTS` requests of the longest length a request may reach (``B`` when evicting,
``max_position_embeddings`` for the full cache).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cost import ModelShape
from ..core import EvictionSettings

__all__ = ["HEADROOM", "SIZED_REQUESTS", "PoolPlan", "free_memory", "plan_pool"]

GIB = 1024**3
# device type -> (fraction of the free memory left free, at least this many bytes)
HEADROOM = {"cuda": (0.10, 2 * GIB), "cpu": (0.50, 2 * GIB)}
SIZED_REQUESTS = 256  # the default pool holds at most this many requests at their longest


@dataclass(frozen=True)
class PoolPlan:
    """A KV pool of ``num_blocks`` blocks of ``page_size`` tokens and where its size came from."""

    num_blocks: int
    page_size: int
    bytes_per_block: int
    source: str

    def describe(self) -> str:
        gib = self.num_blocks * self.bytes_per_block / GIB
        return f"KV pool {self.num_blocks} blocks x {self.page_size} tokens ({gib:.2f} GiB): {self.source}"


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free on ``device`` now and how that was read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"{device} free memory (torch.cuda.mem_get_info)"
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * size), "free physical pages (sysconf)"


def plan_pool(model: torch.nn.Module, settings: EvictionSettings, page_size: int, *,
              sized_requests: int = SIZED_REQUESTS, longest: int | None = None) -> PoolPlan:
    """The default pool for ``model`` served with ``settings``: ``sized_requests`` requests of ``longest``
    tokens (default: ``B`` when evicting, else ``max_position_embeddings``), or what the free memory holds
    after the headroom if less. Raise ``MemoryError`` when not even one such request fits."""
    config = model.config.get_text_config()
    cache_dtype = next(model.parameters()).dtype
    per_token = ModelShape.from_config(config, bytes_per_element=cache_dtype.itemsize).kv_bytes_per_token
    bytes_per_block = per_token * page_size
    if longest is None:
        longest = settings.budget if settings.bounded else getattr(config, "max_position_embeddings", None) or 32768
    per_request = math.ceil(longest / page_size)
    device = next(model.parameters()).device
    free, how = free_memory(device)
    fraction, floor = HEADROOM.get(device.type, HEADROOM["cpu"])
    headroom = max(floor, int(fraction * free))
    fit = max(0, free - headroom) // bytes_per_block
    if fit < per_request:
        raise MemoryError(
            f"the KV pool does not fit: {free / GIB:.2f} GiB free ({how}) minus {headroom / GIB:.2f} GiB headroom "
            f"holds {fit} blocks of {page_size} tokens, and one request of {longest} tokens needs {per_request}; "
            "free memory, lower the budget, or pass --num-blocks / num_blocks explicitly"
        )
    cap = sized_requests * per_request
    num_blocks = min(fit, cap)
    if num_blocks == cap:
        source = f"{sized_requests} requests x {longest} tokens (less than {free / GIB:.2f} GiB free, {how})"
    else:
        source = (f"{free / GIB:.2f} GiB free ({how}) minus {headroom / GIB:.2f} GiB headroom "
                  f"(max({fraction:.0%} of free, {floor / GIB:.0f} GiB))")
    return PoolPlan(int(num_blocks), page_size, bytes_per_block, source)
