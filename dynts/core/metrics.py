"""The serving statistics' names under the name :mod:`dynts.vllm.metrics` imports them by: a re-export of
:mod:`dynts.metrics`, where they live."""

from ..metrics import METRICS, USAGE_FIELDS, Metric, ServerCounters, render_prometheus, usage_dynts

__all__ = ["METRICS", "USAGE_FIELDS", "Metric", "ServerCounters", "render_prometheus", "usage_dynts"]
