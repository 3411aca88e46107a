"""The transformers releases dynts supports, checked once at ``import dynts``, and the one thing they differ in.

Supported: ``transformers>=5.17,<5.26`` (:data:`SUPPORTED_TRANSFORMERS`; ``tests/test_transformers_range.py``
fails when the core dependency in ``pyproject.toml`` says otherwise). Outside it ``import dynts`` raises
``ImportError`` naming the release found and the fix, for every path (``dynts.generate``, ``dynts.attach``,
KV-Rescue, the CLI...): the bounded cache relies on transformers' cache-layer contract, and a release where it
changed would give wrong tokens without an error. :mod:`dynts.serving` (transformers' continuous batching,
private internals) keeps its own stricter pin in :mod:`dynts.serving.compat`.

What the bounded cache relies on, release by release (read in the sources of 5.17.0 ... 5.25.0 and
tested: ``make check-transformers`` runs the core tests on 5.17.0, 5.19.0 and 5.25.0, the venv runs 5.25):

============================  ===========================  ===================================
contract                      5.17 - 5.23                  5.24 - 5.25
============================  ===========================  ===================================
cache keyword of ``forward``  ``past_key_values``          ``cache`` (``past_key_values``: a
and ``generate``                                           deprecated alias until 5.40)
a ``cache=`` keyword          swallowed by ``forward``'s   the cache
                              ``**kwargs`` (the model
                              runs on its own
                              DynamicCache: wrong logits,
                              no error); ``generate``
                              raises ValueError
``get_mask_sizes``            ``Cache.get_mask_sizes(q, layer_idx)`` calls
                              ``layer.get_mask_sizes(q)``: same in all
``get_query_offset``          ``get_seq_length(layer_idx)`` (tokens seen): same in all; 5.25 reads
                              ``layers[layer_idx]`` directly (5.24 skipped a linear layer to the
                              first attention layer; every ``BoundedLayer`` is an attention
                              layer) and ``generate`` asks it of every cache
2-D / 4-D ``attention_mask``  2-D is ``[b, seen + q]`` indexed at ``kv_offset + j``; 4-D
                              passes through unchanged: same in all (5.25's mask builders also
                              list the deprecated ``past_key_values`` in their signature)
full-attention layer lookup   ``is_sliding`` (to 5.22), with ``is_linear`` / ``is_dummy``
                              (5.23+): all False for ``BoundedLayer``, same layer 0
attention registration        ``AttentionInterface`` / ``AttentionMaskInterface.register``,
                              ``sdpa_attention_forward``: same in all
============================  ===========================  ===================================

So the only adapter is the cache keyword: :func:`cache_keyword` detects it from the model's
``forward`` signature (feature detection, not the version string: a remote-code model may keep
``past_key_values`` on any release), and :func:`dynts.attach` routes a ``cache=`` given to a model that
takes ``past_key_values`` (``model(..., cache=bounded)`` runs the same on every supported release).
``model.generate`` validates its keywords before any hook runs: pass ``**{cache_keyword(model): cache}``.
"""

from __future__ import annotations

import inspect
import re

import transformers

__all__ = ["INSTALL_HINT", "SUPPORTED_TRANSFORMERS", "cache_keyword", "check_transformers_version", "route_cache_keyword"]

# Inclusive lower bound, exclusive upper bound (pyproject.toml's core dependency says the same).
SUPPORTED_TRANSFORMERS = ("5.17.0", "5.26.0")
INSTALL_HINT = "pip install 'transformers>=5.17,<5.26'"


def _release(version: str) -> tuple[int, int, int]:
    """``(major, minor, micro)`` of a version string (pre/dev/local suffixes dropped: ``5.26.0.dev0`` ->
    ``(5, 26, 0)``, above the range, as it should be)."""
    match = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        raise ImportError(f"dynts cannot read the transformers version {version!r}; {INSTALL_HINT}")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless ``transformers`` (or ``version``) lies in :data:`SUPPORTED_TRANSFORMERS`."""
    found = transformers.__version__ if version is None else version
    low, high = SUPPORTED_TRANSFORMERS
    if not (_release(low) <= _release(found) < _release(high)):
        raise ImportError(
            f"dynts supports transformers>={low},<{high} (its bounded KV cache relies on transformers' cache-layer "
            f"contract, which changes between releases, and an untested release could decode wrong tokens without "
            f"an error); found transformers {found} at {getattr(transformers, '__file__', '?')}. "
            f"Fix: `{INSTALL_HINT}`"
        )


def cache_keyword(model) -> str:
    """The keyword ``model``'s ``forward`` (and so ``model.generate``) takes its cache under:
    ``"cache"`` (transformers 5.24+) or ``"past_key_values"`` (5.17-5.23, remote-code models)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def route_cache_keyword(kwargs: dict, keyword: str) -> dict:
    """``kwargs`` of a forward with a ``cache=`` entry moved to ``keyword`` when the model takes
    ``past_key_values`` (in place; returns ``kwargs``)."""
    if keyword != "cache" and "cache" in kwargs and kwargs.get(keyword) is None:
        kwargs[keyword] = kwargs.pop("cache")
    return kwargs


check_transformers_version()
