"""dynts inside vLLM: a ``vllm.general_plugins`` plugin that bounds every request's KV cache.

Installed with ``pip install 'dynts-lrm[vllm]'`` (entry point ``dynts = dynts.vllm:register``); vLLM
calls :func:`register` in each of its processes. Inert unless the engine is configured. On vLLM 0.34 (the V2
model runner, async scheduling on: vLLM's defaults, nothing else to pass)::

    vllm serve MODEL --additional-config '{"dynts": {"method": "dynts", "budget": 4096, "local_window": 512,
                                                     "retention": 0.4, "predictor": "DIR"}}'

or ``vllm.LLM(MODEL, additional_config={"dynts": {...}})``. On vLLM 0.32 (the V1 runner, synchronous scheduling)
also ``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment and ``--no-async-scheduling`` (``async_scheduling=False``);
vLLM 0.34 rejects both (it has no V1 runner). ``dynts serve MODEL --engine vllm`` sets what the installed release
needs. Settings the plugin is not exact under are refused before the model loads, or when the KV cache is set up
(:mod:`dynts.vllm.checks`). A request may bring its own ``method``/``budget``/``local_window``/``retention`` in
``SamplingParams.extra_args`` (``{"dynts": {...}}``; over HTTP ``vllm_xargs`` ``dynts_method``, ``dynts_budget``,
...). See ``docs/vllm.md``.
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
