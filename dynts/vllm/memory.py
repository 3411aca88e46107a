"""What the plugin's worker hooks hold on the device, sized at start-up and charged against vLLM's KV cache.

The worker's ``determine_available_memory`` (wrapped in :mod:`dynts.vllm.runners`) reports :func:`hooks_bytes` less
than vLLM measured, so vLLM sizes its KV cache without the hooks' memory: the slot table
(:func:`slot_table_shape`, allocated when the worker allocates its KV cache), an eviction round of every row at the
table's width, and DynTS's predictor activations at a full batch. The last two are estimates from the shapes.
"""

from __future__ import annotations

from typing import Any

from .config import PluginConfig

__all__ = ["EVENT_BYTES_PER_SLOT", "PREDICTOR_BYTES_PER_TOKEN_AND_DIM", "TABLE_CELL_BYTES", "hooks_bytes",
           "slot_table_bytes", "slot_table_shape"]

TABLE_CELL_BYTES = 3 * 8 + 4  # positions, segments, token ids (int64) and a score (fp32) per slot


def slot_table_shape(config: PluginConfig, vllm_config: Any) -> tuple[int, int]:
    """``(rows, width)`` of the slot table a worker reserves: a row per request the engine may run and the
    scratch row (:attr:`dynts.core.SlotTracker.scratch_row`), the engine budget's slots (at least 256, at most
    ``max_model_len``) per row."""
    rows = int(vllm_config.scheduler_config.max_num_seqs) + 1
    width = max(256, config.settings.budget or 0)
    return rows, min(width, int(vllm_config.model_config.max_model_len))


def slot_table_bytes(config: PluginConfig, vllm_config: Any) -> int:
    """Device bytes of the reserved slot table (charged against the KV cache)."""
    rows, width = slot_table_shape(config, vllm_config)
    return rows * width * TABLE_CELL_BYTES


PREDICTOR_BYTES_PER_TOKEN_AND_DIM = 5 * 4  # fp32: the hidden state's copy, the first layer's 2d outputs and activation
EVENT_BYTES_PER_SLOT = 64  # an eviction round's per-slot temporaries: the evictor's view, priorities, kept, the plan


def hooks_bytes(config: PluginConfig, vllm_config: Any) -> int:
    """Device bytes the worker hooks may hold at once beyond vLLM's own, charged against the KV cache at start-up so
    that vLLM sizes its cache without them: the slot table, the predictor's activations at a full batch of
    ``max_num_batched_tokens`` tokens (DynTS: the final-norm states in fp32, the first layer's ``2 d`` outputs and
    their activation), and an eviction round of every row at the table's width (the evictor's view of the slots,
    its priorities, the kept slots and the copy plan)."""
    rows, width = slot_table_shape(config, vllm_config)
    total = slot_table_bytes(config, vllm_config) + rows * width * EVENT_BYTES_PER_SLOT
    if config.settings.needs_scores:
        tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        total += tokens * int(vllm_config.model_config.get_hidden_size()) * PREDICTOR_BYTES_PER_TOKEN_AND_DIM
    return total
