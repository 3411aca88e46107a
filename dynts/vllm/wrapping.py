"""How the plugin wraps a vLLM method: on the class (once per process) or on one object (only an engine
that asked for dynts pays for it). Each wrapper keeps the wrapped method as ``__dynts_original__``."""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

__all__ = ["bind", "is_wrapped", "wrap"]


def wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)`` for every instance of ``owner``."""
    original = getattr(owner, name)
    wrapped = functools.wraps(original)(make(original))
    wrapped.__dynts_original__ = original
    setattr(owner, name, wrapped)


def bind(instance: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``instance.name`` by ``make(original)`` for this one object (``original`` is the class's
    function, called with the instance first); other instances of its class stay stock."""
    original = getattr(type(instance), name)
    wrapped = functools.wraps(original)(make(original))
    wrapped.__dynts_original__ = original
    setattr(instance, name, types.MethodType(wrapped, instance))


def is_wrapped(method: Any) -> bool:
    """Whether a method (bound or not) is one of the plugin's wrappers."""
    return hasattr(getattr(method, "__func__", method), "__dynts_original__")
