"""A ``torch.compile``'d decode step for a model driven with a static :class:`~dynts.cache.BoundedCache`.

Only single-token forwards (decode steps) go through the compiled function; prefills and other
multi-token forwards stay eager (their shapes differ every call). ``dynts.attach``'s hooks on the
model run outside the compiled function (eviction events, the slot table), because the compiled
function is the model's ``forward``, not its ``__call__`` (transformers' ``get_compiled_call``
compiles ``__call__`` and would trace the hooks). Inside the step: the layers' ``index_copy_`` into the
static buffers, the 4-D slot mask, attention recording (H2O, SnapKV, R-KV) and the predictor's
final-norm hook (DynTS), all on tensors whose shapes never change.

Modes (``torch.compile``'s ``mode``): ``"default"`` on CPU; ``"reduce-overhead"`` (CUDA graphs) is
the default on CUDA, where per-step launch overhead dominates a decode step. ``dynamic=False``:
one graph per (batch, capacity), compiled on the first decode step of a new shape.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .predictor import final_norm

__all__ = ["COMPILE_MODES", "check_single_device", "compiled_decode", "default_compile_mode", "scoring_slot"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_ATTRIBUTE = "_dynts_compiled_forwards"  # per model: mode -> compiled forward (compile once, reuse)


def default_compile_mode(device: torch.device) -> str:
    """``"reduce-overhead"`` (CUDA graphs) on CUDA, ``"default"`` elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


def check_single_device(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when ``model`` is dispatched over several devices (accelerate's
    ``hf_device_map``): the compiled decode step, its CUDA graphs and the static cache buffers live
    on one device."""
    devices = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()})
    if len(devices) > 1:
        raise ValueError(
            f"compile=True is single-device, but the model is dispatched over {devices} (device_map); "
            "load it on one GPU (device='cuda', no device_map) to compile, or keep device_map and pass compile=False"
        )


def _compiled_forward(model: torch.nn.Module, eager: Callable, mode: str) -> Callable:
    cache = model.__dict__.setdefault(_ATTRIBUTE, {})
    if mode not in cache:
        # one graph per (method hooks, batch, capacity): an eval loop over methods and budgets needs
        # more than dynamo's default 8 before it would silently fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        cache[mode] = torch.compile(eager, mode=mode, dynamic=False)
    return cache[mode]


def _query_length(args: tuple, kwargs: dict[str, Any]) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    return ref.shape[1] if ref is not None else 0


_SLOT = "_dynts_scoring_slot"


def _score_from_slot(module: torch.nn.Module, args, output: torch.Tensor) -> None:
    cache = getattr(module, _SLOT)[0]  # read through the module: a deep copy gets its own slot
    if cache is not None:
        cache.score_hidden(output)


def scoring_slot(model: torch.nn.Module) -> list:
    """The one-element list naming the cache whose predictor scores ``model``'s final hidden states.

    One forward hook per model, registered on first use and kept: ``torch.compile`` does not guard on
    a module's hooks, so a hook added or removed per call would be silently kept or dropped by a
    compiled decode step traced earlier; a permanent hook that reads this slot is traced once and
    guarded on what the slot holds (``None``: the hook does nothing)."""
    norm = final_norm(model)
    slot = getattr(norm, _SLOT, None)
    if slot is None:
        slot = [None]
        setattr(norm, _SLOT, slot)
        norm.register_forward_hook(_score_from_slot)
    return slot


@contextmanager
def compiled_decode(model: torch.nn.Module, mode: str | None = None) -> Iterator[Callable]:
    """Within the block, ``model``'s single-token forwards run through ``torch.compile``.

    Args:
        model: a Hugging Face causal LM; its class ``forward`` is compiled (once per ``mode``, kept
            on the model for later calls).
        mode: one of :data:`COMPILE_MODES`; default :func:`default_compile_mode` of the model's device.

    Use with a ``static=True`` :class:`~dynts.cache.BoundedCache` (``dynts.generate(..., compile=True)``
    builds one): with the default dynamic layout every step has a new shape and would recompile.
    """
    check_single_device(model)
    if mode is None:
        mode = default_compile_mode(next(model.parameters()).device)
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} must be one of {COMPILE_MODES}")
    if "forward" in model.__dict__:
        raise ValueError("model.forward is already patched (nested compiled_decode?); leave the outer block first")
    scoring_slot(model)  # the predictor hook exists before any trace (see scoring_slot)
    eager = type(model).forward.__get__(model)
    compiled = _compiled_forward(model, eager, mode)

    @functools.wraps(eager)  # generate inspects forward's signature (position_ids, cache)
    def forward(*args: Any, **kwargs: Any):
        return (compiled if _query_length(args, kwargs) == 1 else eager)(*args, **kwargs)

    model.forward = forward
    try:
        yield compiled
    finally:
        del model.forward
