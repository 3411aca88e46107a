"""dynts inside vLLM: a ``vllm.general_plugins`` plugin that bounds every request's KV cache.

Installed with ``pip install 'dynts-lrm[vllm]'`` (entry point ``dynts = dynts.vllm:register``); vLLM
calls :func:`register` in each of its processes. Inert unless the engine is configured::

    VLLM_USE_V2_MODEL_RUNNER=0 vllm serve MODEL --no-async-scheduling \\
        --additional-config '{"dynts": {"method": "dynts", "budget": 4096, "local_window": 512,
                                        "retention": 0.4, "predictor": "DIR"}}'

or ``vllm.LLM(MODEL, async_scheduling=False, additional_config={"dynts": {...}})`` with
``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment (``dynts serve MODEL --engine vllm`` sets both). Settings the
plugin is not tested with are refused before the model loads (:mod:`dynts.vllm.checks`). A request may bring
its own ``method``/``budget``/``local_window``/``retention`` in ``SamplingParams.extra_args``
(``{"dynts": {...}}``; over HTTP ``vllm_xargs`` ``dynts_method``, ``dynts_budget``, ...). See
``docs/vllm.md``.
"""

from __future__ import annotations

from .compat import SUPPORTED_RELEASES, check_vllm_version, missing_internals, unsupported_reason

__all__ = ["SUPPORTED_RELEASES", "check_vllm_version", "missing_internals", "register"]


def register() -> None:
    """vLLM's ``general_plugins`` entry point, called in every engine process whether or not it asks for dynts.

    On a supported release it installs the wrappers (:mod:`dynts.vllm.patches`), which stay pass-throughs for
    an engine without ``additional_config["dynts"]``. On another release it installs nothing that changes
    vLLM: refusals only where dynts is asked for and one log line per engine (:mod:`dynts.vllm.refusals`).
    """
    reason = unsupported_reason()
    if reason is not None:
        from .refusals import install_refusals

        install_refusals(reason)
        return
    from .patches import install

    install()
