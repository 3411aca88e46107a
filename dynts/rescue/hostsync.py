"""Count device-to-host reads: the points where a CUDA program waits for the GPU.

A decode loop runs ahead of the GPU until Python needs a value computed there: ``t.item()``,
``t.tolist()``, ``t.cpu()``, ``bool(t)`` (``if t.any():``), ``int(t)``, ``float(t)``, ``t.numpy()``,
``torch.equal`` / ``torch.allclose``. :func:`count_host_reads` wraps exactly those entry points and
records every call with the shape read, whatever the device -- so on a CPU-only machine it counts
what *would* synchronise on a GPU, as long as host-side bookkeeping is kept in Python objects rather
than CPU tensors (the rescue engine keeps it so). Reads made from inside another counted read
(``tolist`` calling ``item``) count once.

    with count_host_reads() as reads:
        ...
    reads.count, reads.shapes  # [(name, shape), ...]
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["HostReads", "count_host_reads"]

_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_FUNCTIONS = ("equal", "allclose", "is_nonzero")


@dataclass
class HostReads:
    """What :func:`count_host_reads` saw: ``shapes`` lists ``(entry point, tensor shape)`` per read."""

    shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    _depth: int = 0

    @property
    def count(self) -> int:
        return len(self.shapes)

    def largest(self) -> int:
        """Most elements read by one call (0 if none)."""
        return max((int(torch.Size(s).numel()) for _, s in self.shapes), default=0)


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Within the block, count every tensor-to-Python read (see the module docstring). Not thread-safe."""
    reads = HostReads()
    saved: list[tuple[object, str, object]] = []

    def wrap(owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if reads._depth == 0:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                reads.shapes.append((name, tuple(t.shape) if t is not None else ()))
            reads._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                reads._depth -= 1

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in _METHODS:
        wrap(torch.Tensor, name)
    for name in _FUNCTIONS:
        wrap(torch, name)
    try:
        yield reads
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
