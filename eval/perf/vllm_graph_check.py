"""Graph safety of the V2 worker hooks without vLLM: the stand-in V2 runner's forward
(:class:`.vllm_standin_forward.StandInForward`: reads positions, ``seq_lens``, ``query_start_loc``, the slot mapping
and the block tables from the runner's persistent buffers, writes K/V at the mapped slots, attends over the stored
slots) captured in a CUDA graph and replayed across plain decode steps and eviction rounds, with
:class:`dynts.vllm.worker_v2.RunnerV2Hooks` running between the replays as vLLM runs them.

:func:`run_graph_check` drives :class:`.vllm_hooks_bench.HooksBench` (``runner="v2"``, ``verify``) through
``cycles`` cycles (refill to ``B``, one eviction round for every row, ``plain_steps`` plain steps) asynchronously, as
vLLM drives its runner: nothing of the device is read while the rounds run (the bench logs each round's decisions
on the device; each decode round's attention outputs are copied off on a side stream into pinned memory on CUDA),
so an ordering fault -- a hook's write that lands after the replay that should read it -- shows. After the drive
it checks every round:

* every row's stored K/V, read through its block list: the positions the evictor kept, then the new tokens
  (the bench's own check);
* after every decode round, every row's attention output against :func:`.vllm_standin_forward.reference_attention`
  computed from the K/V the row should hold (``reference_max_abs_diff``, within ``tolerance``).

With ``graphs`` (CUDA only) the decode rounds replay the captured graph, and the same drive runs again eagerly:
the per-round attention outputs and every row's stored K/V of the two runs must be equal (``graph_vs_eager``: the
largest difference and whether they are bitwise equal). On CPU the drive is eager only (``make test``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .vllm_hooks_bench import HooksBench, HooksBenchSettings
from .vllm_standin import kv_views
from .vllm_standin_forward import GraphedForward, StandInForward, reference_attention

__all__ = ["GraphCheckSettings", "run_graph_check"]


@dataclass
class GraphCheckSettings:
    """``rows`` requests of ``shape`` in ``dtype`` on ``device``, ``method`` evicting; ``cycles`` cycles of one
    eviction round and ``plain_steps`` plain steps; ``graphs``: capture and replay (``None``: on CUDA)."""

    rows: int = 8
    shape: str | dict = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    method: str = "dynts"
    cycles: int = 2
    plain_steps: int = 3
    layout: str = "LBNHC"
    tolerance: float = 1e-4
    seed: int = 0
    graphs: bool | None = None


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|``; ``inf`` where either holds a NaN or an infinity (a max would skip a NaN)."""
    diff = (a.float() - b.float()).abs()
    return float(diff.max()) if bool(torch.isfinite(diff).all()) else float("inf")


class _OutputCopies:
    """Each one-token round's attention outputs copied off the forward's persistent buffer without a read-back: on
    CUDA into pinned host memory on a side stream (ordered after the round's forward; the next forward waits for the
    copy on the device, the host never does), elsewhere a clone. :meth:`host` hands them back once, at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies: dict[int, torch.Tensor] = {}

    def take(self, index: int, out: torch.Tensor) -> None:
        if self.side is None:
            self.copies[index] = out.clone()
            return
        main = torch.cuda.current_stream(self.device)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self.side.wait_stream(main)  # after the round's forward wrote ``out``
        with torch.cuda.stream(self.side):
            host.copy_(out, non_blocking=True)
        main.wait_stream(self.side)  # the next forward rewrites ``out`` only after the copy (a device-side wait)
        self.copies[index] = host

    def host(self) -> dict[int, torch.Tensor]:
        if self.side is not None:
            self.side.synchronize()  # the drive's one wait, after its last round
        return {i: t.cpu() for i, t in self.copies.items()}


def _drive(settings: GraphCheckSettings, graphs: bool) -> dict:
    """One drive (see the module docstring): the rounds run without reading anything of the device (the bench logs
    them, the attention outputs are copied off on a side stream); then, once, per decode round the attention outputs
    ``[layers, rows, heads, head]`` and the largest difference from the reference, and every row's stored K/V."""
    s = settings
    bench = HooksBench(HooksBenchSettings(rows=s.rows, shape=s.shape, dtype=s.dtype, device=s.device, runner="v2",
                                          method=s.method, reps=s.cycles, warmup=0, plain_steps=s.plain_steps,
                                          layout=s.layout, count_syncs=False, verify=True, seed=s.seed))
    runner, shape = bench.runner, bench.shape
    forward = StandInForward(runner, attend=True)
    runner.model_forward = GraphedForward(forward, s.rows) if graphs else forward
    copies = _OutputCopies(bench.device)
    bench.log = []  # nothing read back per round: checked by replay() after the drive

    def on_round(bench: HooksBench, q: int) -> None:
        if q == 1:  # a multi-token refill: eager, K/V written, no attention
            copies.take(len(bench.log) - 1, forward.out[:, : s.rows])

    bench.on_round = on_round
    kinds = {"event": 0, "plain": 0}
    with torch.no_grad():
        for _ in range(s.cycles):
            bench.fill()
            for kind, steps in (("event", 1), ("plain", s.plain_steps)):
                for _ in range(steps):
                    _, events = bench.step(1)
                    if (events == len(bench.rows)) != (kind == "event"):
                        raise AssertionError(f"a {kind} round ran {events} events for {len(bench.rows)} rows")
                    kinds[kind] += 1
        got = copies.host()
        outputs, diffs = [], []
        for index in bench.replay():  # the rows' expected slots round by round, then the stored K/V of the end
            if index not in got:
                continue
            outputs.append(got[index])
            worst = 0.0
            for i, row in enumerate(bench.rows):
                want = reference_attention(row.expected, i, shape["kv_heads"], shape["head"], shape["layers"],
                                           bench.dtype, bench.device).cpu()  # the forward's device: the same sin
                worst = max(worst, _max_abs_diff(got[index][:, i], want))
            diffs.append(worst)
    views = kv_views(runner.kv_caches, shape["head"])
    stored = []
    for row in bench.rows:
        j = torch.arange(row.stored)
        blocks = torch.tensor(row.blocks)[j // bench.block].to(bench.device)
        offsets = (j % bench.block).to(bench.device)
        stored.append([(k[blocks, offsets].cpu(), v[blocks, offsets].cpu()) for k, v in views])
    return dict(outputs=outputs, diffs=diffs, stored=stored, verified=dict(bench.verified), rounds=kinds,
                replays=getattr(runner.model_forward, "replays", 0), one_token_rounds=len(outputs))


def run_graph_check(settings: GraphCheckSettings) -> dict:
    """The verdict (JSON-able): ``ok`` when every check of the module docstring holds."""
    s = settings
    graphs = torch.device(s.device).type == "cuda" if s.graphs is None else s.graphs
    started = time.perf_counter()
    eager = _drive(s, graphs=False)
    worst = max(eager["diffs"]) if eager["diffs"] else float("inf")
    out = dict(device=s.device, rows=s.rows, dtype=s.dtype, method=s.method, rounds=eager["rounds"],
               verified=eager["verified"], reference_max_abs_diff=worst, graphs=graphs,
               settings={k: v for k, v in asdict(s).items() if k != "shape"},
               shape=s.shape if isinstance(s.shape, str) else dict(s.shape))
    ok = worst <= s.tolerance and eager["rounds"]["event"] == eager["verified"]["event_rounds"] == s.cycles
    if graphs:
        graphed = _drive(s, graphs=True)
        pairs = list(zip(graphed["outputs"], eager["outputs"]))
        diff = max((_max_abs_diff(a, b) for a, b in pairs), default=float("inf"))
        kv_equal = all(torch.equal(ga, ea) and torch.equal(gb, eb)
                       for g_row, e_row in zip(graphed["stored"], eager["stored"])
                       for (ga, gb), (ea, eb) in zip(g_row, e_row))
        bitwise = kv_equal and all(torch.equal(a, b) for a, b in pairs)
        out["graph_vs_eager"] = dict(max_abs_diff=diff, stored_kv_equal=kv_equal, bitwise=bitwise,
                                     replays=graphed["replays"], reference_max_abs_diff=max(graphed["diffs"]),
                                     verified=graphed["verified"])
        ok = (ok and kv_equal and len(pairs) == len(eager["outputs"]) and diff <= s.tolerance
              and graphed["replays"] == graphed["one_token_rounds"] >= sum(graphed["rounds"].values())
              and max(graphed["diffs"]) <= s.tolerance)
    out["ok"] = bool(ok)
    out["seconds"] = time.perf_counter() - started
    return out
