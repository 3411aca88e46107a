"""Serving statistics in one vocabulary for every engine: Prometheus names and ``usage.dynts``.

Engine-neutral on purpose (no transformers or vLLM import): :data:`METRICS` names every exported
series. The transformers server fills a plain dict keyed by its ``key`` column and
:func:`render_prometheus` writes the text format (version 0.0.4) that ``GET /metrics`` serves; the
vLLM plugin registers ``prometheus_client`` counters under the same names (:mod:`dynts.vllm.metrics`).
:func:`usage_dynts` builds the ``dynts`` object of a response's ``usage`` from its engine requests'
statistics. The metric names live here and nowhere else.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["METRICS", "USAGE_FIELDS", "Metric", "ServerCounters", "render_prometheus", "usage_dynts"]


@dataclass(frozen=True)
class Metric:
    """One exported series: ``key`` in the stats dict -> ``dynts_<name>`` of Prometheus ``kind``."""

    key: str
    kind: str  # "gauge" | "counter"
    help: str

    @property
    def name(self) -> str:
        return f"dynts_{self.key}_total" if self.kind == "counter" else f"dynts_{self.key}"


METRICS: tuple[Metric, ...] = (
    Metric("requests_running", "gauge", "Requests in the engine (prefilling or decoding)."),
    Metric("requests_waiting", "gauge", "Requests queued, not yet admitted."),
    Metric("kv_blocks_in_use", "gauge", "KV cache blocks held by requests."),
    Metric("kv_blocks_free", "gauge", "KV cache blocks free in the pool."),
    Metric("kv_blocks", "gauge", "KV cache blocks in the pool."),
    Metric("kv_block_tokens", "gauge", "Tokens per KV cache block."),
    Metric("evictions", "counter", "Eviction events (one per request per event)."),
    Metric("evicted_tokens", "counter", "KV entries evicted."),
    Metric("freed_blocks", "counter", "KV blocks returned to the pool by eviction events."),
    Metric("preemptions", "counter", "Requests preempted by the engine (offloaded or re-prefilled)."),
    Metric("requests", "counter", "Requests finished (any outcome)."),
    Metric("requests_failed", "counter", "Requests that ended with an engine error."),
    Metric("requests_cancelled", "counter", "Requests cancelled (client gone, stop string, cancellation)."),
    Metric("prompt_tokens", "counter", "Prompt tokens admitted."),
    Metric("generation_tokens", "counter", "Tokens generated."),
    Metric("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s."),
)

# usage.dynts of a response: per-request statistics, the same names for every engine
USAGE_FIELDS = ("peak_slots", "evictions", "evicted_tokens", "freed_blocks")


def _value(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(stats: Mapping[str, float], labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition of ``stats`` (keys of :data:`METRICS`; missing keys are left out)."""
    label = ""
    if labels:
        label = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"
    lines = []
    for metric in METRICS:
        if metric.key not in stats or stats[metric.key] is None:
            continue
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}",
                  f"{metric.name}{label} {_value(stats[metric.key])}"]
    return "\n".join(lines) + "\n"


def usage_dynts(per_request: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """``usage.dynts`` over the engine requests of one response: ``peak_slots`` the largest, the rest summed."""
    out = dict.fromkeys(USAGE_FIELDS, 0)
    for stats in per_request:
        out["peak_slots"] = max(out["peak_slots"], int(stats.get("peak_slots", 0)))
        for key in USAGE_FIELDS[1:]:
            out[key] += int(stats.get(key, 0))
    return out


class ServerCounters:
    """Counters a server accumulates across requests (thread-safe), merged into the stats dict."""

    WINDOW = 10.0  # seconds of the tokens/s gauge

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(("evictions", "evicted_tokens", "freed_blocks", "requests", "requests_failed",
                                     "requests_cancelled", "prompt_tokens", "generation_tokens"), 0)
        self._recent: deque[tuple[float, int]] = deque()

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                self.totals[key] += int(value)
            if counts.get("generation_tokens"):
                self._recent.append((time.monotonic(), int(counts["generation_tokens"])))

    def snapshot(self) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.WINDOW:
                self._recent.popleft()
            rate = sum(n for _, n in self._recent) / self.WINDOW
            return {**self.totals, "generation_tokens_per_second": rate}
