"""What the plugin installs on a vLLM release it does not support: only refusals where dynts is asked for.

vLLM calls :func:`dynts.vllm.register` in every engine process of every environment dynts is installed in,
whether or not the engine asks for dynts. On a release outside :data:`~dynts.vllm.compat.SUPPORTED_RELEASES`
none of the eviction wrappers is installed, so an engine without dynts runs stock; the refusals below say
why when dynts *is* asked for. Each is installed only where the release still has the method (a release
that renamed it simply runs without that refusal):

| process | method | refuses |
|---|---|---|
| front end | ``EngineArgs.create_engine_config`` | an engine with ``additional_config["dynts"]``, before any model load (any other engine: one log line saying why dynts is off) |
| engine core | ``Scheduler.__init__`` | the same, for an engine core started on its own |
| front end | ``InputProcessor.process_inputs`` | a request with ``dynts`` fields (``VLLMValidationError``: HTTP 400; the server keeps serving) |
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from .config import asks_for_dynts, engine_asks_for_dynts
from .wrapping import wrap

__all__ = ["install_refusals", "refuse_engine", "refuse_request"]

logger = logging.getLogger("vllm.dynts")  # under vLLM's logger: its format, its level


def refuse_engine(reason: str) -> ValueError:
    """The error an engine that asks for dynts gets on an unsupported vLLM."""
    return ValueError(f"{reason}. Start vLLM without additional_config['dynts'] to serve without eviction")


def refuse_request(reason: str) -> Exception:
    """vLLM's validation error (HTTP 400) for a request's dynts fields: an engine that cannot evict, or fields
    it cannot serve (:func:`dynts.vllm.patches.check_request`)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # a release without it: vLLM answers a ValueError with 400 too
        return ValueError(f"dynts: {reason}")
    return VLLMValidationError(f"dynts: {reason}", parameter="vllm_xargs")


def _wrap_if_present(module: str, cls: str, method: str, make: Callable[[Callable], Callable]) -> bool:
    try:
        owner = getattr(importlib.import_module(module), cls)
        getattr(owner, method)
    except (ImportError, AttributeError):
        return False
    wrap(owner, method, make)
    return True


def install_refusals(reason: str) -> list[str]:
    """Install the refusals this release has room for; returns ``Class.method`` of each installed. Says
    once per engine, in the front end, why dynts is off (once per process where that method is gone)."""

    def engine_config(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            vllm_config = original(self, *args, **kwargs)
            if engine_asks_for_dynts(vllm_config):
                raise refuse_engine(reason)
            logger.info("%s; this engine runs without dynts", reason)
            return vllm_config
        return create_engine_config

    def scheduler(original: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if engine_asks_for_dynts(vllm_config):
                raise refuse_engine(reason)
            original(self, *args, **kwargs)
        return __init__

    def inputs(original: Callable) -> Callable:
        def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            request = original(self, *args, **kwargs)
            params = getattr(request, "sampling_params", None)
            if asks_for_dynts(getattr(params, "extra_args", None)):
                raise refuse_request(reason)
            return request
        return process_inputs

    targets = [("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", engine_config),
               ("vllm.v1.core.sched.scheduler", "Scheduler", "__init__", scheduler),
               ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs", inputs)]
    installed = [f"{cls}.{method}" for module, cls, method, make in targets if _wrap_if_present(module, cls, method, make)]
    if "EngineArgs.create_engine_config" not in installed:
        logger.warning("%s; vLLM runs without dynts", reason)
    return installed
