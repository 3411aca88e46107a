"""The per-step cost of dynts' vLLM worker hooks, on a stand-in for vLLM's model runner (no vLLM needed): vLLM
0.32's V1 runner with :class:`dynts.vllm.worker.WorkerHooks` (``runner="v1"``, :mod:`.vllm_v1_standin`) or vLLM
0.34's V2 runner with :class:`dynts.vllm.worker_v2.RunnerV2Hooks` (``runner="v2"``, :mod:`.vllm_v2_standin`).

:class:`HooksBench` plays vLLM's scheduler around the real hooks: the events and shifts of every round
(``StepPlan``, by the event rule ``Budget.due``), blocks from a shuffled pool, the freed tail blocks back to it, and
the round on the stand-in runner (its ``execute_model``, which calls the hooks where vLLM calls them).

The hooks are built as vLLM's ``initialize_kv_cache`` wrapper builds them (``hooks(runner, PluginConfig,
kernel_block_sizes)``: the layout check, the KV-cache group check, the tokenizer -- the testbed's, from
``checkpoints/testbed-lrm`` -- and the predictor through ``load_predictor``, a random-init
:class:`~dynts.ImportancePredictor` of the model's hidden size). Only ``_tp_group`` (vLLM's tensor-parallel
group) is replaced: one rank. ``dynts.vllm`` imports nothing from vLLM at import time, so this module runs in
any dynts environment (the GPU image has no vLLM).

What is timed (:func:`run_hooks_bench`): every row holds ``B`` slots, so the next decode step is an **eviction
round** for all of them at once (one evictor call over ``[rows, B]``, the K/V moves of every layer, the block
lists cut), then ``plain_steps`` **plain decode steps** (one token per row, each row shifted: ``seq_lens`` and the
slot mapping lowered), then the rows are refilled to ``B`` by untimed multi-token forwards and the cycle repeats.
Each hook is timed on its own: ``host`` (until it returns) and ``done`` (until the device finished: a
synchronize; on CPU the same). Reported: medians over the timed cycles after ``warmup`` cycles, and the syncs of
one more cycle (:mod:`eval.perf.syncs`' counter installed on the hooks: torch's sync debug mode on CUDA, the
dispatch-mode counter elsewhere; its per-round summary).

With ``verify`` the forward writes every token's K/V (:func:`.vllm_standin.kv_content` of its position, row and
head, through FlashAttention's own view at the slot mapping the hooks left), and after every round each row's
stored slots, read through its block list, must hold what the scheduler side expects: the positions the evictor
kept (its decision, recorded as it is made) followed by the new tokens -- the real code path, end to end
(``tests/test_worker_hooks_bench.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .vllm_standin import (FLASH_ATTN_DEFAULT_LAYOUT, LAYOUT_ORDERS, SHAPES, Recording, bench_hooks_class,
                           blocks_per_row, kv_views, stored_problem, vllm_kv_caches)
from .vllm_v1_standin import FakeRunner, V1Round
from .vllm_v2_standin import V2Round

__all__ = ["LAYOUT_ORDERS", "RUNNERS", "SHAPES", "FakeRunner", "HooksBench", "HooksBenchSettings", "format_table",
           "run_hooks_bench", "vllm_kv_caches"]

RUNNERS = {"v1": V1Round, "v2": V2Round}  # runner -> its round (its hooks: Round.names)


@dataclass
class HooksBenchSettings:
    """One measurement: ``rows`` requests of ``shape`` (a :data:`SHAPES` name or a dict) in ``dtype`` on ``device``,
    on the stand-in ``runner`` (``"v1"``, ``"v2"``), ``method`` at the shape's ``B`` / ``W_l`` and ``retention``;
    ``reps`` timed cycles (one eviction round and ``plain_steps`` plain steps each) after ``warmup``; refills of at
    most ``chunk_tokens`` tokens per forward; ``count_syncs``: one more cycle counted; ``max_seconds``: no further
    cycle once exceeded (at least one timed); ``async_scheduling`` (V2): a decoded token's id reaches the worker
    with the next round's plan, as under vLLM 0.34's default."""

    rows: int = 256
    shape: str | dict = "small"
    dtype: str = "bfloat16"
    device: str = "cpu"
    runner: str = "v1"
    method: str = "dynts"
    retention: float = 0.4
    reps: int = 5
    warmup: int = 1
    plain_steps: int = 8
    chunk_tokens: int = 16384
    layout: str = FLASH_ATTN_DEFAULT_LAYOUT
    count_syncs: bool = True
    verify: bool = False
    seed: int = 0
    max_seconds: float | None = None
    async_scheduling: bool = True

    @property
    def shape_dict(self) -> dict:
        return dict(SHAPES[self.shape]) if isinstance(self.shape, str) else dict(self.shape)


@dataclass
class _Row:
    rid: str
    prompt: int
    computed: int = 0  # logical tokens computed (RoPE positions, vLLM's num_computed_tokens)
    shift: int = 0  # tokens evicted so far
    blocks: list = field(default_factory=list)  # the scheduler's block list
    new_blocks: list = field(default_factory=list)  # allocated this round, not yet in the worker's list
    expected: list = field(default_factory=list)  # position held by each stored slot (the scheduler side's view)

    @property
    def stored(self) -> int:
        return self.computed - self.shift


class HookTimer:
    """Times each of the hooks' ``names`` (instance attributes over the methods while :attr:`on`): ``times[name] =
    (host seconds, done seconds)`` of its last call."""

    def __init__(self, hooks: Any, names: tuple[str, ...], device: torch.device) -> None:
        self.hooks, self.names, self.device = hooks, names, device
        self.times: dict[str, tuple[float, float]] = {}
        self.on = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, name: str, method: Callable) -> Callable:
        def run(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = method(*args, **kwargs)
            t1 = time.perf_counter()
            self._sync()
            self.times[name] = (t1 - t0, time.perf_counter() - t0)
            return out
        return run

    def install(self) -> None:
        for name in self.names:
            setattr(self.hooks, name, self._timed(name, getattr(type(self.hooks), name).__get__(self.hooks)))
        self.on = True

    def remove(self) -> None:
        """The hooks' own methods back (any instance attribute over them dropped: a counter's too)."""
        for name in self.names:
            self.hooks.__dict__.pop(name, None)
        self.on = False


class HooksBench:
    """vLLM's scheduler around the real worker hooks on a stand-in runner (see the module docstring).

    ``on_round(bench, q)``, when set, is called after every round (the rows' ``expected`` already updated)."""

    def __init__(self, settings: HooksBenchSettings) -> None:
        import dynts
        from dynts.models import checkpoints_dir
        from dynts.vllm.config import PluginConfig
        from dynts.vllm.runners import RUNNERS as HOOKS

        self.settings = s = settings
        self.shape = shape = s.shape_dict
        self.device = torch.device(s.device)
        self.dtype = getattr(torch, s.dtype)
        self.block = shape["block"]
        self.budget = shape["budget"]
        cycles = s.warmup + s.reps + int(s.count_syncs) + 1
        engine = {"method": s.method, "budget": self.budget, "local_window": shape["local_window"],
                  "retention": s.retention}
        if s.method == "dynts":
            torch.manual_seed(s.seed)
            engine["predictor"] = dynts.ImportancePredictor(shape["hidden"])  # random init, float32
        self.config = PluginConfig(engine)
        self.n_keep = self.config.settings.n_keep(shape["prompt"])  # None: a method that never evicts (full)
        self.volume = self.budget - self.n_keep if self.n_keep is not None else s.plain_steps + 1
        # the length a refill brings every row to: B (the next step evicts), or without events short enough that
        # every plain step of the run still fits in B's blocks
        self.fill_to = self.budget if self.n_keep is not None else self.budget - cycles * s.plain_steps - 1
        if self.fill_to < shape["prompt"]:
            raise ValueError(f"{cycles} cycles of {s.plain_steps} plain steps do not fit B = {self.budget}")
        if s.plain_steps >= self.volume:
            raise ValueError(f"plain_steps={s.plain_steps} must stay below B - n_keep = {self.volume}")
        max_len = shape["prompt"] + self.budget + cycles * self.volume + 8
        per_row = blocks_per_row(shape)
        self.max_tokens = max(s.rows, min(s.chunk_tokens, s.rows * self.budget))
        # every decision recorded as it is made (two small device copies): the kept slots the rows should hold
        self.recording = self.config.settings.evictor = Recording(self.config.settings.evictor)
        g = torch.Generator().manual_seed(s.seed)
        # scattered blocks; block 0 is vLLM's null block
        self.free = (torch.randperm(s.rows * per_row, generator=g) + 1).tolist()
        self.hidden = torch.randn(self.max_tokens, shape["hidden"], generator=g).to(self.device, self.dtype)
        self.rows = [_Row(f"req-{i}", shape["prompt"]) for i in range(s.rows)]
        hooks_class = bench_hooks_class(HOOKS[s.runner][1])
        tokenizer = str(checkpoints_dir() / "testbed-lrm")
        token_ids = np.zeros((s.rows, max_len), dtype=np.int32)
        self.driver = RUNNERS[s.runner](self, token_ids, hooks_class, self.config, s.rows * per_row + 1, max_len,
                                        tokenizer)
        self.runner, self.hooks = self.driver.runner, self.driver.hooks
        vocab = len(self.hooks.tokenizer)
        delimiter = set(self.hooks.tracker.delimiter.ids) if self.hooks.tracker.delimiter is not None else set()
        allowed = np.array([t for t in range(4, vocab) if t not in delimiter], dtype=np.int32)  # thinking tokens only
        token_ids[:] = allowed[np.random.default_rng(s.seed).integers(0, len(allowed), size=token_ids.shape)]
        self.timer = HookTimer(self.hooks, self.driver.names, self.device)
        self.on_round: Callable[[HooksBench, int], None] | None = None
        # a list: every round logged (its decisions kept on the device) and checked only by replay(), so a drive
        # reads nothing of the device per round; None: each round checked as it runs
        self.log: list | None = None
        self.moved_slots: list[int] = []
        self.verified = {"event_rounds": 0, "rows_checked": 0}
        self.allow_faults = False  # True: a request the worker fails stays scheduled (a fault test), else an error

    def step(self, q: int, fill: bool = False) -> tuple[dict, int]:
        """One round of ``q`` tokens per row (``fill``: a refill, whose token ids the scheduler knows); returns the
        per-hook ``(host, done)`` seconds (while the timer is on) and the events run."""
        from dynts.vllm.scheduler import StepPlan

        bs, settings = self.block, self.config.settings
        plan = StepPlan()
        for row in self.rows:  # the scheduler: events by the one rule, blocks back to the pool, new blocks
            if self.n_keep is not None and settings.bounds.due(row.stored, q, self.n_keep):
                plan.events.append((row.rid, row.stored, self.n_keep))
                keep = math.ceil(self.n_keep / bs)
                self.free.extend(reversed(row.blocks[keep:]))
                del row.blocks[keep:]
                row.shift += row.stored - self.n_keep
            need = math.ceil((row.stored + q) / bs) - len(row.blocks)
            row.new_blocks = [self.free.pop() for _ in range(need)]
            row.blocks += row.new_blocks
            if row.shift:
                plan.shifts[row.rid] = row.shift
        self.timer.times = {}
        started = time.perf_counter()
        self.driver.round(q, plan, fill)
        if self.timer.on:  # the whole round: the hooks and the stand-in runner's own work (vLLM's, on these rows)
            self.timer.times["round"] = (time.perf_counter() - started,) * 2
        if self.settings.verify:
            for row in self.rows:
                if self.driver.worker_blocks(row.rid) != row.blocks:
                    raise AssertionError(f"{row.rid}: the worker's blocks {self.driver.worker_blocks(row.rid)} != "
                                         f"the scheduler's {row.blocks}")
        if self.log is not None:  # checked later (replay): nothing of the device is read now
            self.log.append((q, list(plan.events), self._take_decisions()))
            for row in self.rows:
                row.computed += q
            if self.on_round is not None:
                self.on_round(self, q)
            return dict(self.timer.times), len(plan.events)
        if plan.events:
            self._after_event(plan.events, self._take_decisions())
        for row in self.rows:
            row.expected += range(row.computed, row.computed + q)
            row.computed += q
        if self.settings.verify:
            self._check_stored()
        if self.on_round is not None:
            self.on_round(self, q)
        return dict(self.timer.times), len(plan.events)

    def fill(self) -> None:
        """Untimed multi-token forwards until every row stores ``B`` slots (the next decode step evicts)."""
        on = self.timer.on
        self.timer.remove()
        per_row = max(1, self.max_tokens // len(self.rows))
        while self.rows[0].stored < self.fill_to:
            self.step(min(per_row, self.fill_to - self.rows[0].stored), fill=True)
        if on:
            self.timer.install()

    # ------------------------------------------------------------------ verification
    def _take_decisions(self) -> list:
        """The evictor's decisions of the round (device tensors), taken from the recording."""
        decisions = list(self.recording.calls)
        self.recording.calls.clear()
        return decisions

    def replay(self) -> Iterator[int]:
        """With :attr:`log` (rounds logged instead of checked as they ran): the rows' ``expected`` rebuilt round by
        round from the logged decisions, read on the host only now; yields each round's index once its ``expected``
        holds (the :meth:`_after_event` checks included), then checks the stored K/V of the end (with ``verify``)."""
        log, self.log = self.log, None
        computed = {row.rid: 0 for row in self.rows}
        for row in self.rows:
            row.expected = []
        for index, (q, events, decisions) in enumerate(log):
            if events:
                self._after_event(events, decisions)
            for row in self.rows:
                row.expected += range(computed[row.rid], computed[row.rid] + q)
                computed[row.rid] += q
            yield index
        if self.settings.verify:
            self._check_stored()

    def _after_event(self, events: list, decisions: list) -> None:
        """The scheduler side's view of the kept slots: the evictor's ``decisions`` recorded during ``before_step``
        (one call per group of equal settings, prompt length and stored count; rows in event order)."""
        events = [e for e in events if e[0] not in self.hooks.failed]  # a failed request's event selects nothing
        kept_rows = [k for _, kept in decisions for k in kept.cpu().tolist()]
        seen = [p for positions, _ in decisions for p in positions.cpu().tolist()]
        if len(kept_rows) != len(events):
            raise AssertionError(f"{len(events)} events but the evictor chose for {len(kept_rows)} rows")
        by_rid = {row.rid: row for row in self.rows}
        moved = 0
        for (rid, stored, n_keep), kept, positions in zip(events, kept_rows, seen):
            row = by_rid[rid]
            if positions != row.expected[:stored]:
                raise AssertionError(f"{rid}: the evictor saw positions that are not the stored ones")
            if len(kept) != n_keep:
                raise AssertionError(f"{rid}: the evictor kept {len(kept)} slots, not n_keep={n_keep}")
            row.expected = [row.expected[k] for k in kept]
            moved += sum(k != j for j, k in enumerate(kept))
        self.moved_slots.append(moved)
        self.verified["event_rounds"] += 1

    def _check_stored(self) -> None:
        """Every row's stored slots, read through its block list, hold the positions the scheduler side expects."""
        views = kv_views(self.runner.kv_caches, self.shape["head"])
        for i, row in enumerate(self.rows):
            problem = stored_problem(views, row.blocks, row.expected, i, self.block)
            if problem is not None:
                raise AssertionError(f"{row.rid} {problem}")
        self.verified["rows_checked"] += len(self.rows)


def _median_us(samples: list[dict], names: tuple[str, ...]) -> dict:
    if not samples:
        return {}
    out = {}
    for name in names:
        out[name] = {"host_us": 1e6 * statistics.median(t[name][0] for t in samples),
                     "done_us": 1e6 * statistics.median(t[name][1] for t in samples)}
    out["step"] = {"host_us": 1e6 * statistics.median(sum(t[n][0] for n in names) for t in samples),
                   "done_us": 1e6 * statistics.median(sum(t[n][1] for n in names) for t in samples)}
    # the reference: what the stand-in runner itself does on the host in the same round (vLLM's own step on these
    # rows, without a model: inputs, block tables, slot mappings, sampling's bookkeeping), the hooks' time taken out
    out["runner_step"] = {"host_us": 1e6 * statistics.median(t["round"][0] - sum(t[n][1] for n in names)
                                                           for t in samples)}
    return out


def _cycle(bench: HooksBench, samples: dict | None) -> None:
    """One eviction round for every row, then the plain steps; ``samples``: where the timings go. A method that
    never evicts (``full``) runs the plain steps only."""
    for kind, steps in (("event", int(bench.n_keep is not None)), ("plain", bench.settings.plain_steps)):
        for _ in range(steps):
            times, events = bench.step(1)
            if (events > 0) != (kind == "event") or (events and events != len(bench.rows)):
                raise AssertionError(f"a {kind} round ran {events} events for {len(bench.rows)} rows")
            if samples is not None:
                samples[kind].append(times)


def run_hooks_bench(settings: HooksBenchSettings) -> dict:
    """Time the hooks per plain decode step and per eviction round (see the module docstring); a JSON-able dict."""
    from .syncs import sync_counter

    started = time.perf_counter()
    s = settings
    syncs = None
    with torch.no_grad():
        bench = HooksBench(s)
        built = time.perf_counter() - started
        bench.fill()
        samples: dict = {"event": [], "plain": []}
        timed = 0
        bench.timer.install()
        for cycle in range(s.warmup + s.reps):
            if timed and s.max_seconds and time.perf_counter() - started > s.max_seconds:
                break
            _cycle(bench, samples if cycle >= s.warmup else None)
            timed += cycle >= s.warmup
            bench.fill()
        bench.timer.remove()
        if s.count_syncs:
            counter = sync_counter(bench.device)
            counter.install(bench.hooks, bench.driver.names)
            try:
                _cycle(bench, None)
            finally:
                bench.timer.remove()  # the counter's wrappers off as well
            syncs = {"counter": counter.kind, **counter.summary()}
    names = bench.driver.names
    event = _median_us(samples["event"], names)
    plain = _median_us(samples["plain"], names)
    moved = statistics.mean(bench.moved_slots) if bench.moved_slots else None
    return {
        "runner": s.runner, "hooks": list(names), "hooks_class": type(bench.hooks).__mro__[1].__name__,
        "device": str(bench.device), "dtype": s.dtype, "rows": s.rows, "method": s.method, "layout": s.layout,
        "shape": bench.shape, "budget": bench.budget, "n_keep": bench.n_keep, "eviction_volume": bench.volume,
        "predictor_dtype": "float32" if s.method == "dynts" else None,
        "cycles_timed": timed, "warmup": s.warmup, "plain_steps_per_cycle": s.plain_steps,
        "event": event, "plain": plain,
        # per plain step: the hooks that record and point attention (all but the predictor's), and the reference
        "recording_us_per_plain_step": sum(plain[n]["host_us"] for n in names[:-1]) if plain else None,
        "runner_step_us": plain["runner_step"]["host_us"] if plain else None,
        "syncs_counter": syncs["counter"] if syncs else None,
        "syncs_per_event_round": syncs["syncs_per_event_round"] if syncs else None,
        "syncs_per_plain_step": syncs["syncs_per_plain_step"] if syncs else None,
        "syncs": syncs,
        "moved_slots_per_round": moved,  # slots whose K/V moved, every row of the round
        "moved_slots_per_ms": 1e3 * moved / event["before_step"]["done_us"] if moved and event else None,  # before_step
        "verified": bench.verified if s.verify else None,
        "setup_seconds": built, "seconds": time.perf_counter() - started,
        "settings": {k: v for k, v in asdict(s).items() if k != "shape"},
    }


def format_table(result: dict) -> str:
    """The small table ``scripts/bench_vllm_hooks.py`` prints."""
    names = result["hooks"]
    head = (f"dynts.vllm worker hooks ({result['runner']}: {result['hooks_class']}): {result['method']}, "
            f"{result['rows']} rows x 1 token, {result['dtype']} on {result['device']}, B={result['budget']} "
            f"(n_keep {result['n_keep']}), {result['shape']['layers']} layers, hidden {result['shape']['hidden']}, "
            f"{result['layout']}; median of {result['cycles_timed']} cycles (us)")
    width = [max(14, len(n) + 2) for n in names]
    lines = [head, f"{'':<22}" + "".join(f"{n:>{w}}" for n, w in zip(names, width))
             + f"{'step':>10}{'step done':>11}{'syncs':>7}"]
    for kind, label in (("plain", "plain decode step"), ("event", f"eviction round ({result['rows']})")):
        r = result[kind]
        if not r:
            continue
        syncs = result[f"syncs_per_{'plain_step' if kind == 'plain' else 'event_round'}"]
        lines.append(f"{label:<22}" + "".join(f"{r[n]['host_us']:>{w}.0f}" for n, w in zip(names, width))
                     + f"{r['step']['host_us']:>10.0f}{r['step']['done_us']:>11.0f}"
                     + f"{'' if syncs is None else f'{syncs:.0f}':>7}")
    plain = result["plain"]
    if plain:
        recording = sum(plain[n]["host_us"] for n in names[:-1])
        lines.append(f"plain step: recording hooks (all but {names[-1]}) {recording:.0f} us, the predictor's hook "
                     f"{plain[names[-1]]['host_us']:.0f} us; the stand-in runner's own step on the same rows (vLLM's "
                     f"work, no model) {plain['runner_step']['host_us']:.0f} us")
    return "\n".join(lines)
