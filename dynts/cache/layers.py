"""One layer's K/V buffers of a :class:`~dynts.cache.BoundedCache`, in transformers' cache-layer shape.

:class:`BoundedLayer` (the dynamic layout) owns its buffers ``[b, h_kv, capacity, d]``, writes each
forward's K/V in place after the stored slots and returns views of the live ones;
:class:`StaticBoundedLayer` (``static=True``) writes a decode step at a device index and returns the
whole fixed buffers, so every decode step has the same shapes (module docstring of
:mod:`dynts.cache.bounded`). Where to write comes from the cache's counters (one per cache, shared by
every layer: one eviction compacts all layers at once).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .layout import Layout

__all__ = ["BoundedLayer", "StaticBoundedLayer", "incoming_tokens", "mark_static"]


class BoundedLayer(CacheLayerMixin):
    """One layer's K/V buffers (dynamic layout); writes in place and returns views of the live entries."""

    is_compileable = False
    is_sliding = False

    def __init__(self, layout: Layout, layer_idx: int, kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.layout = layout
        self.layer_idx = layer_idx
        if kv is not None:  # buffers made elsewhere (RaggedCache.stack)
            self._hold(*kv)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take ``keys`` / ``values`` ``[b, h_kv, capacity, d]`` as this layer's buffers."""
        self.device, self.dtype = keys.device, keys.dtype
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        cap = self.layout.capacity
        self._hold(key_states.new_zeros(b, h, cap, d), value_states.new_zeros(b, h, cap, value_states.shape[-1]))

    def grow(self, capacity: int) -> None:
        """Reallocate the buffers to ``capacity`` slots (amortised doubling; never per step)."""
        if not self.is_initialized or self.keys.shape[2] >= capacity:
            return
        n = self.layout.length
        keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[3])
        values = self.values.new_zeros(*self.values.shape[:2], capacity, self.values.shape[3])
        keys[:, :, :n] = self.keys[:, :, :n]
        values[:, :, :n] = self.values[:, :, :n]
        self.keys, self.values = keys, values

    def prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the forward is tracked by the cache; allocate or grow the buffers to its capacity."""
        if key_states.shape[2] != self.layout.pending:
            raise RuntimeError(
                "BoundedCache was updated outside a tracked forward; drive the model through "
                "`with dynts.attach(model, cache): ...` (dynts.generate does this for you)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.grow(self.layout.capacity)  # static layout: a no-op unless max_length was too small (then: a new graph)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.prepare(key_states, value_states)
        q = key_states.shape[2]
        start = self.layout.length
        self.keys[:, :, start : start + q] = key_states
        self.values[:, :, start : start + q] = value_states
        return self.keys[:, :, : start + q], self.values[:, :, : start + q]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.layout.length
        return stored + query_length, self.layout.seen - stored

    def get_seq_length(self) -> int:
        return self.layout.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported with a bounded cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` ``[r]`` of the buffers (new, smaller buffers)."""
        if self.is_initialized:
            indices = indices.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, indices), self.values.index_select(0, indices)


class StaticBoundedLayer(BoundedLayer):
    """The static layout's layer: fixed buffer addresses, and a decode step that writes at the layout's
    device ``write_index`` and returns the whole buffers (no host integer read inside the step)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        mark_static(self.keys, self.values)  # fixed addresses: CUDA graphs replay in-place writes without copies

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        layout = self.layout
        if not layout.static_step:  # prefills and multi-token forwards run eagerly, as in the dynamic layout
            return super().update(key_states, value_states, *args, **kwargs)
        self.prepare(key_states, value_states)
        self.keys.index_copy_(2, layout.write_index, key_states)
        self.values.index_copy_(2, layout.write_index, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        layout = self.layout
        if layout.static_step and torch.compiler.is_compiling():
            return layout.seen_tensor  # a device scalar: a host int would be baked into the graph
        return layout.seen


def mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell ``torch.compile`` these buffers keep their address (as transformers' ``StaticLayer`` does)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)


def incoming_tokens(
    input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch_size: int, query_length: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[b, q]`` ids of a forward's new tokens (``-1`` when the model got embeddings) and their
    validity (``True`` = real token, ``False`` = padding) from the 2-D ``attention_mask``."""
    q = query_length
    if input_ids is None:
        input_ids = torch.full((batch_size, q), -1, dtype=torch.long, device=device)
    if attention_mask is None:
        return input_ids, torch.ones(batch_size, q, dtype=torch.bool, device=device)
    return input_ids, attention_mask[:, -q:].bool()
