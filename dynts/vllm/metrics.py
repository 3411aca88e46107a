"""The plugin's statistics across vLLM's processes: ``usage.dynts`` in responses and ``dynts_*`` counters
on the API server's ``GET /metrics``, under the names of :mod:`dynts.core.metrics`.

The numbers arise in the EngineCore process (:class:`~dynts.vllm.scheduler.SchedulerHooks`); responses
and ``/metrics`` are built in the API server. The one per-request field vLLM carries from the scheduler to
the ``RequestOutput`` -- through its IPC, in-process or not -- is ``kv_transfer_params``, the dict a KV
connector fills when a request finishes. So:

1. engine core, a request finishes (``Scheduler._free_request``): its statistics join its
   ``kv_transfer_params`` under ``"dynts"``, a list with one entry per engine request (:func:`attach`);
2. front end, every engine output (``OutputProcessor.process_outputs``): a finished request's statistics
   go into the Prometheus counters (:class:`Counters`); the children of an ``n > 1`` request pass their
   lists on, so the one finishing last carries every choice's (:func:`pass_on`);
3. front end, the non-streaming response builders of ``/v1/completions`` and ``/v1/chat/completions``: the
   lists become ``usage.dynts`` (:func:`dynts.core.metrics.usage_dynts`) and leave ``kv_transfer_params``
   (:func:`move_to_usage`).

vLLM's own ``vllm:*`` series count requests running and waiting, KV cache usage, preemptions, tokens and
finished requests: the plugin exports only what vLLM has no series for (:data:`EXPORTED`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..core.metrics import METRICS, usage_dynts

__all__ = ["EXPORTED", "KEY", "Counters", "attach", "move_to_usage", "pass_on", "request_stats"]

KEY = "dynts"  # the entry of kv_transfer_params that carries a request's statistics
EXPORTED = ("evictions", "evicted_tokens", "freed_blocks", "requests_failed")  # keys of METRICS vLLM lacks
_COUNTED = EXPORTED[:3]


def attach(kv_transfer_params: Mapping[str, Any] | None, stats: Mapping[str, int]) -> dict[str, Any]:
    """A finished request's ``kv_transfer_params`` with its statistics added (a new dict)."""
    return {**(kv_transfer_params or {}), KEY: [dict(stats)]}


def request_stats(kv_transfer_params: Mapping[str, Any] | None) -> list[dict[str, int]] | None:
    """The statistics a ``RequestOutput.kv_transfer_params`` carries (one per engine request), or ``None``."""
    if not kv_transfer_params or KEY not in kv_transfer_params:
        return None
    return list(kv_transfer_params[KEY])


def without_stats(kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``kv_transfer_params`` as the KV connector made it (``None`` if the plugin's entry was all)."""
    if not kv_transfer_params:
        return None
    rest = {k: v for k, v in kv_transfer_params.items() if k != KEY}
    return rest or None


def pass_on(parent: Any, output: Any) -> None:
    """An ``n > 1`` child's finished engine output: its statistics join its siblings' (kept on vLLM's
    ``ParentRequest``), so the output of the last child to finish carries every choice's."""
    own = request_stats(output.kv_transfer_params)
    if own is None:
        return
    parent.dynts_stats = [*getattr(parent, "dynts_stats", ()), *own]
    output.kv_transfer_params = {**output.kv_transfer_params, KEY: list(parent.dynts_stats)}


class Counters:
    """The plugin's Prometheus counters of one served model, in ``prometheus_client``'s default registry
    (the one vLLM's ``/metrics`` serves; with several API servers vLLM's multiprocess mode sums them)."""

    _families: dict[str, Any] = {}  # one per process: prometheus_client refuses a name registered twice

    def __init__(self, model: str) -> None:
        from prometheus_client import Counter

        if not Counters._families:
            for metric in METRICS:
                if metric.key in EXPORTED:
                    Counters._families[metric.key] = Counter(metric.name, metric.help, ["model"])
        self.series = {key: family.labels(model=model) for key, family in Counters._families.items()}

    def finished(self, stats: Iterable[Mapping[str, int]] | None, failed: bool) -> None:
        """Count one finished engine request: its statistics (``None``: none arrived) and whether it failed."""
        for one in stats or ():
            for key in _COUNTED:
                if one.get(key):
                    self.series[key].inc(one[key])
        if failed:
            self.series["requests_failed"].inc()


def move_to_usage(response: Any, outputs: Iterable[Any]) -> Any:
    """Put the statistics the ``RequestOutput``s carry into ``response.usage.dynts``; strip them from its
    ``kv_transfer_params``. A response without them (no dynts engine) is left as it is."""
    found = [request_stats(getattr(o, "kv_transfer_params", None)) for o in outputs]
    stats = [s for one in found if one is not None for s in one]
    usage = getattr(response, "usage", None)
    if usage is None or all(one is None for one in found):
        return response
    usage.dynts = usage_dynts(stats)  # UsageInfo allows extra fields (OpenAI's does)
    response.kv_transfer_params = without_stats(response.kv_transfer_params)
    return response
