"""Counting the host-device syncs of a piece of code: a dispatch-mode counter that says on CPU what a GPU run
would pay, and torch's own sync debug mode on CUDA.

* :class:`SyncCounter` (any device; on the CPU build nothing waits, the count says what a GPU would pay): inside
  :meth:`SyncCounter.counting` it counts, in ``now``, every operation that makes the host wait for the device on a
  GPU:

  - reads: a scalar read (``item``/``bool``/``int``), ``nonzero``/``masked_select``/``unique`` and boolean-mask
    indexing, ``tolist``/``numpy``/``cpu`` of a device tensor;
  - blocking uploads (also counted apart in ``uploads``): host data made into a tensor on a given device
    (``torch.tensor(list, device=...)``, ``torch.as_tensor(data, device=...)``), and a copy of a *pageable host
    tensor* to a device (``.to(device)``, ``.cuda()``, ``device_tensor.copy_(host)``). On CPU a host tensor and a
    device tensor are both CPU tensors, so the counter tracks which are host ones: made from host data
    (``torch.from_numpy``, ``torch.tensor`` / ``torch.as_tensor`` without a device; not the result of an audited
    upload, which on CPU is the device tensor) or converted from one without naming a device. A copy of a pinned
    tensor is not counted, and neither is anything inside
    :class:`dynts.core.upload.HostStaging` (the one audited upload path: pinned buffers, ``non_blocking``, never
    waited on) or :class:`dynts.core.readback.HostReadback` (the one audited read path: a ``non_blocking`` copy
    into pinned memory, read once its event has completed).
* :class:`CudaSyncCounter`: ``torch.cuda.set_sync_debug_mode("warn")`` inside :meth:`CudaSyncCounter.counting`,
  one count per warning; it sees every synchronizing CUDA call, blocking host-to-device copies included.

Both count into ``now``; :meth:`SyncCounter.install` wraps the dynts vLLM worker hooks
(:class:`dynts.vllm.worker.WorkerHooks` on vLLM's V1 runner, :class:`dynts.vllm.worker_v2.RunnerV2Hooks` on V2) so
that every round is counted as a plain decode step or an eviction round (``scripts/bench_serve_vllm.py --cost``,
``scripts/bench_vllm_hooks.py``).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from dynts.core.upload import transfer_active

__all__ = ["CudaSyncCounter", "SyncCounter", "V1_HOOKS", "V2_HOOKS", "sync_counter"]

V1_HOOKS = ("before_step", "after_prepare_inputs", "after_forward")  # dynts.vllm.worker.WorkerHooks, per round
V2_HOOKS = ("before_step", "before_attention", "after_execute", "after_sample")  # dynts.vllm.worker_v2.RunnerV2Hooks
_ACTIVE: list["SyncCounter"] = []  # counters inside a counted call (tolist/numpy/cpu are not dispatched ops)
_HOST: dict[int, weakref.ref] = {}  # id -> tensor made from host data while counting (a host tensor on CPU)


def _mark_host(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        key = id(t)
        _HOST[key] = weakref.ref(t, lambda _, key=key: _HOST.pop(key, None))
    return t


def _is_host(t: Any) -> bool:
    ref = _HOST.get(id(t))
    return ref is not None and ref() is t


def _pageable(t: Any) -> bool:
    return _is_host(t) and not t.is_pinned()


def _audited() -> bool:
    """Inside dynts' audited host-device paths: :class:`dynts.core.upload.HostStaging` (pinned uploads, never
    waited on) or :class:`dynts.core.readback.HostReadback` (pinned reads of copies that have run)."""
    return transfer_active()


def _count(upload: bool) -> None:
    if _audited():
        return
    for counter in _ACTIVE:
        counter.now += 1
        counter.uploads += upload


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device a ``Tensor.to`` call names (``None``: a dtype-only conversion)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


@contextmanager
def _host_reads_counted() -> Iterator[None]:
    """Patch, for the active counters, what a dispatch mode cannot see: ``Tensor.tolist`` / ``numpy`` / ``cpu`` of a
    device tensor, host data made into a tensor on a device, and copies of pageable host tensors to a device; the
    originals are back when the outermost counter exits (nothing outside a count is changed)."""
    if _ACTIVE:  # an enclosing counter has patched them
        yield
        return
    make, as_tensor, from_numpy = torch.tensor, torch.as_tensor, torch.from_numpy
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to", "cuda", "copy_")}

    def made(original):
        def wrapped(data, *a, **k):
            out = original(data, *a, **k)
            if isinstance(data, torch.Tensor):
                return out
            if k.get("device") is not None and torch.device(k["device"]).type != "meta":
                _count(upload=True)  # host data to a named device: a blocking copy on a GPU
                return out
            return _mark_host(out)
        return wrapped

    def numpy_made(array):
        out = from_numpy(array)
        return out if _audited() else _mark_host(out)  # an audited upload's result is the device tensor (CPU)

    def read(method):
        def wrapped(t, *a, **k):
            if not _is_host(t):
                _count(upload=False)
            return method(t, *a, **k)
        return wrapped

    def to(t, *a, **k):
        out = methods["to"](t, *a, **k)
        if _is_host(t):
            if _target_device(a, k) is None:
                _mark_host(out)  # a dtype conversion of a host tensor is a host tensor
            elif _pageable(t):
                _count(upload=True)
        return out

    def cuda(t, *a, **k):
        if _pageable(t):
            _count(upload=True)
        return methods["cuda"](t, *a, **k)

    def copy_(t, src, *a, **k):
        if _pageable(src) and not _is_host(t):
            _count(upload=True)
        return methods["copy_"](t, src, *a, **k)

    torch.tensor, torch.as_tensor, torch.from_numpy = made(make), made(as_tensor), numpy_made
    for name in ("tolist", "numpy", "cpu"):
        setattr(torch.Tensor, name, read(methods[name]))
    torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_ = to, cuda, copy_
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor, torch.from_numpy = make, as_tensor, from_numpy
        for name, method in methods.items():
            setattr(torch.Tensor, name, method)
        _HOST.clear()


class _Rounds:
    """Counts per plain decode step and per eviction round, for :meth:`SyncCounter.install`."""

    now: int

    def __init__(self) -> None:
        self.now = self.uploads = 0  # syncs, blocking host-to-device copies (dispatch counter only) this round
        self.plain_steps = self.plain_syncs = self.event_rounds = self.event_syncs = 0
        self.plain_uploads = self.event_uploads = 0

    @contextmanager
    def counting(self) -> Iterator[None]:  # pragma: no cover - overridden
        yield

    def _counted(self, method):
        def run(*a, **k):
            with self.counting():
                return method(*a, **k)
        return run

    def install(self, hooks: Any, names: tuple[str, ...] = V1_HOOKS) -> None:
        """Count inside the worker hooks ``names`` (the round's first hook, then the others; the last one ends
        the round; instance attributes shadow the methods); a round whose ``dynts_plan`` has events is an
        eviction round. ``names``: :data:`V1_HOOKS` (``WorkerHooks``) or :data:`V2_HOOKS` (``RunnerV2Hooks``)."""
        event = [False]
        first, *middle, last = names
        counted = {name: self._counted(getattr(hooks, name)) for name in names}

        def start(scheduler_output, *a, **k):
            plan = getattr(scheduler_output, "dynts_plan", None)
            event[0], self.now, self.uploads = bool(plan is not None and plan.events), 0, 0
            return counted[first](scheduler_output, *a, **k)

        def end(*a, **k):
            out = counted[last](*a, **k)
            if event[0]:
                self.event_rounds, self.event_syncs = self.event_rounds + 1, self.event_syncs + self.now
                self.event_uploads += self.uploads
            else:
                self.plain_steps, self.plain_syncs = self.plain_steps + 1, self.plain_syncs + self.now
                self.plain_uploads += self.uploads
            return out

        setattr(hooks, first, start)
        for name in middle:
            setattr(hooks, name, counted[name])
        setattr(hooks, last, end)

    def summary(self) -> dict:
        return {"syncs_per_plain_step": self.plain_syncs / max(1, self.plain_steps),
                "syncs_per_event_round": self.event_syncs / max(1, self.event_rounds),
                "uploads_per_plain_step": self.plain_uploads / max(1, self.plain_steps),
                "uploads_per_event_round": self.event_uploads / max(1, self.event_rounds),
                "event_rounds": self.event_rounds, "plain_steps": self.plain_steps}


class SyncCounter(_Rounds):
    """Counts, inside :meth:`counting`, the operations that make the host wait for the device on a GPU (a
    torch dispatch mode): scalar reads, ``nonzero`` and boolean-mask indexing, ``tolist``/``numpy``/``cpu``."""

    kind = "dispatch"
    READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"}

    def __init__(self) -> None:
        super().__init__()
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
                if (name in counter.READS or any(getattr(i, "dtype", None) is torch.bool for i in indices or ())) \
                        and not _audited():
                    counter.now += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode

    @contextmanager
    def counting(self) -> Iterator[None]:
        with _host_reads_counted():
            _ACTIVE.append(self)
            try:
                with self.mode():
                    yield
            finally:
                _ACTIVE.remove(self)


class CudaSyncCounter(_Rounds):
    """Counts the synchronizing CUDA calls inside :meth:`counting` (``torch.cuda.set_sync_debug_mode("warn")``,
    one count per warning): scalar reads, device-to-host copies, blocking host-to-device copies."""

    kind = "cuda_sync_debug"

    @contextmanager
    def counting(self) -> Iterator[None]:
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.now += sum("synchroniz" in str(w.message) for w in caught)


def sync_counter(device: torch.device | str) -> SyncCounter | CudaSyncCounter:
    """The counter for ``device``: torch's sync debug mode on CUDA, the dispatch-mode counter elsewhere."""
    return CudaSyncCounter() if torch.device(device).type == "cuda" else SyncCounter()
