"""Training under a different attention mask per layer and KV head, as a per-head evicting cache shows.

A per-head evictor (``per_head=true`` H2O, SnapKV, R-KV) keeps its own slots for every (layer, KV
head) pair. A testbed row trained under such a kept set needs one mask per pair, which transformers'
4-D masks (one ``[B, 1 | H, T, T]`` tensor for every layer) cannot express. The batch's
``attention_mask`` is then ``[B, L * h_kv, T, T]`` bool, ordered (layer, KV head), and the forward runs
under :data:`ATTENTION`, a transformers attention function (registered with
``transformers.AttentionInterface``) that hands each layer its own ``h_kv`` slice, repeated over the
query heads of each KV group, to the stock SDPA function. A ``[B, 1, T, T]`` mask passes through unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["ATTENTION", "layer_head_masks", "per_layer_head"]

ATTENTION = "testbed_layer_head_masks"


def per_layer_head(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` holds one slice per (layer, KV head) rather than one for every layer."""
    return mask is not None and mask.dim() == 4 and mask.shape[1] > 1


def _layer_head_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA with layer ``module.layer_idx``'s slice of a ``[B, L * h_kv, Tq, Tk]`` mask."""
    if per_layer_head(attention_mask):
        h_kv, layers = key.shape[1], attention_mask.shape[1] // key.shape[1]
        if attention_mask.shape[1] != layers * h_kv or not 0 <= module.layer_idx < layers:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} slices; a per-(layer, head) mask needs num_hidden_layers x "
                f"num_key_value_heads = {layers} x {h_kv} slices ordered (layer, head), and layer {module.layer_idx} must be among them"
            )
        attention_mask = attention_mask[:, module.layer_idx * h_kv : (module.layer_idx + 1) * h_kv]
        if query.shape[1] != h_kv:
            attention_mask = attention_mask.repeat_interleave(query.shape[1] // h_kv, dim=1)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, _layer_head_sdpa)


@contextmanager
def layer_head_masks(model: torch.nn.Module, mask: torch.Tensor | None) -> Iterator[None]:
    """Run ``model``'s forwards under :data:`ATTENTION` while ``mask`` is per (layer, KV head);
    otherwise change nothing. The previous attention implementation is restored afterwards."""
    if not per_layer_head(mask):
        yield
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
