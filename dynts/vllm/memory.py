"""What the plugin's worker hooks hold on the device, made once inside vLLM's memory profile, and what a worker
without that profile charges against its KV cache.

vLLM sizes the KV cache from a profiling run (``profile_run`` inside ``determine_available_memory``): whatever the
run leaves allocated, and its peak, is memory the cache does not get. The plugin's ``profile_run`` wrapper
(:mod:`dynts.vllm.runners`) therefore makes the hooks' persistent state there -- the engine's tokenizer and evictor,
the slot table (:func:`slot_table_shape`: a row per request the engine may run and a scratch row, ``max_budget``
slots each, reserved ``fixed``: it never grows while serving) and DynTS's predictor -- as a :class:`HookState`
that ``initialize_kv_cache`` hands to the hooks, and runs one dummy eviction round at the engine's limits
(:func:`profile_round`): the predictor over ``max_num_batched_tokens`` hidden states, the evictor over every row at
the table's width, the compaction and the paged move's inputs. Their peak is then vLLM's measured peak.

Where vLLM measures nothing (the CPU worker's fixed KV space, an explicit ``kv_cache_memory_bytes``) the worker's
``determine_available_memory`` wrapper subtracts :func:`hooks_bytes`, the same memory from the shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core import SlotTable
from ..core.slots import EvictorCall, select_kept
from ..evictors.base import Segment
from ..kernels.paged import physical_slots
from .config import PluginConfig

__all__ = ["EVENT_BYTES_PER_SLOT", "PREDICTOR_BYTES_PER_TOKEN_AND_DIM", "TABLE_CELL_BYTES", "HookState",
           "hooks_bytes", "predictor_bytes", "profile_round", "slot_table_bytes", "slot_table_shape"]

TABLE_CELL_BYTES = 3 * 8 + 4  # positions, segments, token ids (int64) and a score (fp32) per slot
PREDICTOR_BYTES_PER_TOKEN_AND_DIM = 5 * 4  # fp32: the hidden state's copy, the first layer's 2d outputs and activation
EVENT_BYTES_PER_SLOT = 64  # an eviction round's per-slot temporaries: the evictor's view, priorities, kept, the plan


@dataclass
class HookState:
    """What the worker hooks hold for the engine's life, made once (inside vLLM's memory profile where it runs).

    Attributes:
        config: the plugin's configuration (its evictor bound to ``tokenizer``).
        tokenizer: the served model's tokenizer.
        table: the slot table, ``fixed`` at :func:`slot_table_shape`.
        predictor: DynTS's importance predictor on the model's device (``None`` for a method without scores).
    """

    config: PluginConfig
    tokenizer: Any
    table: SlotTable
    predictor: torch.nn.Module | None


def slot_table_shape(config: PluginConfig, vllm_config: Any) -> tuple[int, int]:
    """``(rows, width)`` of the slot table a worker reserves: a row per request the engine may run and the scratch
    row (:attr:`dynts.core.SlotTracker.scratch_row`), ``max_budget`` slots per row (the most a request may store:
    its budget, at most ``max_model_len``; one slot when no request may have a budget)."""
    rows = int(vllm_config.scheduler_config.max_num_seqs) + 1
    return rows, max(1, min(config.max_budget or 1, int(vllm_config.model_config.max_model_len)))


def slot_table_bytes(config: PluginConfig, vllm_config: Any) -> int:
    """Device bytes of the reserved slot table."""
    rows, width = slot_table_shape(config, vllm_config)
    return rows * width * TABLE_CELL_BYTES


def predictor_bytes(hidden_size: int) -> int:
    """Device bytes of DynTS's predictor weights (``d -> 2d -> d/2 -> 1``, fp32, as :func:`dynts.load_predictor`
    loads them)."""
    d = int(hidden_size)
    return 4 * (d * 2 * d + 2 * d + 2 * d * (d // 2) + d // 2 + d // 2 + 1)


def hooks_bytes(config: PluginConfig, vllm_config: Any) -> int:
    """Device bytes the worker hooks may hold at once beyond vLLM's own, from the shapes (for a worker whose KV
    cache is not sized by a profiling run): the slot table, an eviction round of every row at the table's width
    (the evictor's view of the slots, its priorities, the kept slots and the copy plan) and, for DynTS, the
    predictor's weights and its activations at a full batch of ``max_num_batched_tokens`` tokens (the final-norm
    states in fp32, the first layer's ``2 d`` outputs and their activation)."""
    rows, width = slot_table_shape(config, vllm_config)
    total = slot_table_bytes(config, vllm_config) + rows * width * EVENT_BYTES_PER_SLOT
    if config.settings.needs_scores:
        hidden = int(vllm_config.model_config.get_hidden_size())
        tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        total += predictor_bytes(hidden) + tokens * hidden * PREDICTOR_BYTES_PER_TOKEN_AND_DIM
    return total


def profile_round(state: HookState, vllm_config: Any, dtype: torch.dtype) -> None:
    """One eviction round at the engine's limits, on dummy data, so that its peak is in vLLM's measured peak: the
    predictor over ``max_num_batched_tokens`` hidden states (``dtype``: the model's), the engine's evictor over every
    request row of the table at its full width, the compaction, and the paged move's inputs and physical plan
    (``kept`` ``[rows, n_keep]``, ``blocks`` ``[rows, width / block_size]``). The table is left empty."""
    table, settings = state.table, state.config.settings
    with torch.no_grad():
        if state.predictor is not None:
            tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
            hidden = torch.zeros(tokens, int(vllm_config.model_config.get_hidden_size()), dtype=dtype,
                                 device=table.device)
            state.predictor(hidden)
            del hidden
        if settings.bounds is not None and table.width > 1:
            _dummy_round(table, settings, int(vllm_config.cache_config.block_size))
        for name, column in table.columns():
            column.fill_(SlotTable.FILL[name])


def _dummy_round(table: SlotTable, settings: Any, block_size: int) -> None:
    """The evictor, the compaction and the move's physical plan over every request row of ``table`` (all but the
    scratch row), each storing the table's width, with a one-token question."""
    rows, width, device = table.rows - 1, table.width, table.device
    try:
        n_keep = min(settings.bounds.n_keep(1), width - 1)
    except ValueError:  # a local window too wide for a one-token question: half the row
        n_keep = width // 2
    table.positions[:rows] = torch.arange(width, device=device)
    table.segments[:rows] = int(Segment.THINKING)
    table.segments[:rows, 0] = int(Segment.QUESTION)
    table.scores[:rows] = torch.linspace(0, 1, width, device=device)
    call = EvictorCall(settings.evictor, settings.bounds.local_window, 1, width, n_keep, owner=settings)
    for selection in select_kept(table, [(None, row, call) for row in range(rows)], check="defer"):
        table.compact(selection.rows, selection.kept)
        blocks = torch.zeros(rows, math.ceil(width / block_size), dtype=torch.int64, device=device)
        destinations = torch.arange(n_keep, device=device).expand(rows, n_keep)
        plan = physical_slots(blocks, selection.kept, block_size), physical_slots(blocks, destinations, block_size)
        del plan, blocks, destinations, selection
