"""The engine-neutral core of eviction: what every cache and engine shares.

| module | job |
|---|---|
| :mod:`~dynts.core.budget` | ``B = W_q + W_s + W_l``, ``n_keep`` and the event rule (:meth:`Budget.due`) |
| :mod:`~dynts.core.settings` | the one parser of the eviction keywords (:class:`EvictionSettings`) and their plain-data form (:class:`EvictionSpec`) |
| :mod:`~dynts.core.segments` | the one labelling rule: question / thinking / answer / pad |
| :mod:`~dynts.core.slots` | the per-request records (:class:`RequestBudget` on the scheduler side, :class:`RequestRow` on the worker side), the slot table, the one :class:`~dynts.TokenInfo` builder, the stale-score check and the one evictor-call loop (:func:`select_kept`) |
| :mod:`~dynts.core.tracker` | the worker side of a paged engine: metadata, scores, evictor calls, the copy plan |
| :mod:`~dynts.core.upload` | host index lists to the device in one asynchronous copy (pinned on CUDA) |
| :mod:`~dynts.core.policy` | the scheduler side of a paged engine: reservations, admission, events, preemption, statistics |

The dense cache (:mod:`dynts.cache`), the ragged KV-Rescue cache (:mod:`dynts.rescue.rows`) and both
paged engines (:mod:`dynts.serving`, :mod:`dynts.vllm`) are adapters over it.
"""

from .budget import Budget
from .policy import Event, EvictionPolicy
from .settings import (EVICTION_FIELDS, SERVED_STATISTICS, EvictionSettings, EvictionSpec, add_eviction_arguments,
                       eviction_fields, eviction_spec, serving_methods)
from .slots import EvictorCall, RequestBudget, RequestRow, Selection, SlotTable, build_token_info, check_scored, select_kept
from .tracker import EvictionGroup, Forward, SlotTracker, copy_plan

__all__ = [
    "EVICTION_FIELDS",
    "SERVED_STATISTICS",
    "Budget",
    "Event",
    "EvictionGroup",
    "EvictionPolicy",
    "EvictionSettings",
    "EvictionSpec",
    "EvictorCall",
    "Forward",
    "RequestBudget",
    "RequestRow",
    "Selection",
    "SlotTable",
    "SlotTracker",
    "add_eviction_arguments",
    "build_token_info",
    "check_scored",
    "copy_plan",
    "select_kept",
    "eviction_fields",
    "eviction_spec",
    "serving_methods",
]
