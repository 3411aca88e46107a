"""The per-step cost of dynts' vLLM worker hooks, on a stand-in for vLLM's ``GPUModelRunner`` (no vLLM needed).

:class:`FakeRunner` has what :class:`dynts.vllm.worker.WorkerHooks` reads of a model runner (``requests`` with
``block_ids`` and ``sampling_params``; ``input_batch`` with ``req_ids`` / ``num_reqs`` /
``num_computed_tokens_cpu`` / ``num_prompt_tokens`` / ``token_ids_cpu`` / ``req_id_to_index`` / ``block_table``;
``positions``, ``seq_lens``, ``optimistic_seq_lens_cpu``, ``query_start_loc``; ``kv_cache_config``;
``compilation_config.static_forward_context`` with one FLASH_ATTN layer per model layer; ``get_model()`` with
``model.norm.weight``; ``model_config``, ``vllm_config``), and :class:`HooksBench` plays vLLM's scheduler and
``execute_model`` around the real hooks: the events and shifts of every round (``StepPlan``, by the event rule
``Budget.due``), blocks from a shuffled pool, the freed tail blocks back to it, ``_update_states`` (new blocks
into the worker's lists and the block table), ``_prepare_inputs`` (logical positions, ``seq_lens``, the slot
mapping) and the forward (final-norm hidden states: random, of the model's hidden size).

The hooks are built as vLLM's ``initialize_kv_cache`` wrapper builds them (``WorkerHooks(runner, PluginConfig,
kernel_block_sizes)``: the layout check, the KV-cache group check, the tokenizer -- the testbed's, from
``checkpoints/testbed-lrm`` -- and the predictor through ``load_predictor``, a random-init
:class:`~dynts.ImportancePredictor` of the model's hidden size). Only ``_tp_group`` (vLLM's tensor-parallel
group) is replaced: one rank. ``dynts.vllm.worker`` imports nothing from vLLM at import time, so this module
runs in any dynts environment (the GPU image has no vLLM).

Each KV cache is FLASH_ATTN's as vLLM 0.32 allocates it (:func:`vllm_kv_caches`): the logical per-layer view
``[blocks, kv_heads, block_size, 2 * head]`` over one allocation of every layer in the resolved physical layout,
by default ``LBNHC`` (what vLLM picks for FLASH_ATTN, which declares no layout of its own:
``vllm.v1.attention.backends.utils._DEFAULT_LAYOUT_PREFERENCE``).

What is timed (:func:`run_hooks_bench`): every row holds ``B`` slots, so the next decode step is an **eviction
round** for all of them at once (one evictor call over ``[rows, B]``, the K/V copies of every layer, the block
lists cut), then ``plain_steps`` **plain decode steps** (one token per row, each row shifted: the slot mapping is
recomputed), then the rows are refilled to ``B`` by untimed multi-token forwards and the cycle repeats. Each of
``before_step``, ``after_prepare_inputs`` and ``after_forward`` is timed on its own: ``host`` (until it returns)
and ``done`` (until the device finished: a synchronize; on CPU the same). Reported: medians over the timed
cycles after ``warmup`` cycles, and the syncs of one more cycle (:mod:`eval.perf.syncs`: torch's sync debug
mode on CUDA, the dispatch-mode counter elsewhere).

With ``verify`` the forward writes every token's K/V (its position, row and head, through FlashAttention's own
``kv_cache.transpose(1, 2).split(head, -1)`` view at the slot mapping the hooks left), and after every round
each row's stored slots, read through its block list, must hold what the scheduler side expects: the positions
the evictor kept (its decision, recorded as it is made) followed by the new tokens -- the real code path, end
to end (``tests/test_worker_hooks_bench.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

__all__ = ["LAYOUT_ORDERS", "SHAPES", "FakeRunner", "HooksBench", "HooksBenchSettings", "run_hooks_bench",
           "vllm_kv_caches"]

# vLLM's KVCacheLayout (vllm/v1/kv_cache_layout.py): the stride permutation of the logical [L, B, H, N, C]
# (layers, blocks, kv heads, slots in a block, content = keys then values) into memory order.
LAYOUT_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
FLASH_ATTN_DEFAULT_LAYOUT = "LBNHC"

# model / cache shapes: hidden size (predictor input), layers, KV heads, head dim, block size, B, W_l, prompt
SHAPES = {
    "r1-7b": dict(hidden=3584, layers=28, kv_heads=4, head=128, block=16, budget=4096, local_window=512, prompt=256),
    "small": dict(hidden=512, layers=4, kv_heads=2, head=64, block=16, budget=512, local_window=64, prompt=64),
    "tiny": dict(hidden=32, layers=2, kv_heads=2, head=8, block=4, budget=48, local_window=8, prompt=8),
}
HOOKS = ("before_step", "after_prepare_inputs", "after_forward")


def vllm_kv_caches(layers: int, blocks: int, heads: int, block_size: int, content: int, dtype: torch.dtype,
                   device: torch.device | str, layout: str = FLASH_ATTN_DEFAULT_LAYOUT) -> list[torch.Tensor]:
    """Per-layer KV caches as vLLM 0.32 views its one allocation (``create_kv_cache_views``): logical
    ``[blocks, heads, block_size, content]`` views of ``[L, B, H, N, C]`` stored in ``layout``'s memory order
    (uninitialised)."""
    order = LAYOUT_ORDERS[layout]
    logical = (layers, blocks, heads, block_size, content)
    physical = torch.empty([logical[d] for d in order], dtype=dtype, device=device)
    view = physical.permute([order.index(d) for d in range(5)])  # logical axis d back in place d
    return [view[i] for i in range(layers)]


# ---------------------------------------------------------------------------------------------- the runner
class _FlashAttn:
    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"


class FakeBlockTable:
    """One KV-cache group's block table: ``block_table.np`` / ``.gpu``, ``num_blocks_per_row``, ``slot_mapping``."""

    def __init__(self, rows: int, max_blocks: int, block_size: int, max_tokens: int, device: torch.device) -> None:
        self.block_size = block_size
        self.block_table = SimpleNamespace(np=np.zeros((rows, max_blocks), dtype=np.int32),
                                           gpu=torch.zeros(rows, max_blocks, dtype=torch.int32, device=device))
        self.num_blocks_per_row = np.zeros(rows, dtype=np.int32)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    def commit_block_table(self, num_reqs: int) -> None:
        self.block_table.gpu[:num_reqs].copy_(torch.from_numpy(self.block_table.np[:num_reqs]), non_blocking=True)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        """``slot = block_table[req, pos // bs] * bs + pos % bs`` per token (vLLM: a Triton kernel; no sync here)."""
        bs, total = self.block_size, positions.shape[0]
        token = torch.arange(total, device=positions.device)
        req = torch.searchsorted(query_start_loc[1 : num_reqs + 1].to(torch.int64), token, right=True)
        pos = positions.to(torch.int64)
        block = self.block_table.gpu[req, torch.div(pos, bs, rounding_mode="floor")].to(torch.int64)
        self.slot_mapping[:total] = block * bs + pos % bs


class FakeMultiGroupBlockTable:
    def __init__(self, table: FakeBlockTable) -> None:
        self.block_tables = [table]

    def __getitem__(self, index: int) -> FakeBlockTable:
        return self.block_tables[index]

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        for table in self.block_tables:
            table.compute_slot_mapping(num_reqs, query_start_loc, positions)

    def commit_block_table(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit_block_table(num_reqs)


class FakeRunner:
    """What :class:`~dynts.vllm.worker.WorkerHooks` reads of vLLM's ``GPUModelRunner``, for ``rows`` requests."""

    def __init__(self, shape: dict, rows: int, dtype: torch.dtype, device: torch.device | str, num_blocks: int,
                 max_len: int, max_tokens: int, layout: str, tokenizer: str) -> None:
        self.device = torch.device(device)
        self.shape = shape
        names = [f"model.layers.{i}.self_attn.attn" for i in range(shape["layers"])]
        caches = vllm_kv_caches(shape["layers"], num_blocks, shape["kv_heads"], shape["block"], 2 * shape["head"],
                                dtype, self.device, layout)
        self.compilation_config = SimpleNamespace(static_forward_context={
            name: SimpleNamespace(attn_backend=_FlashAttn, kv_cache=kv) for name, kv in zip(names, caches)})
        self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
            SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(block_size=shape["block"]))])
        self.model = SimpleNamespace(model=SimpleNamespace(norm=SimpleNamespace(
            weight=torch.ones(shape["hidden"], dtype=dtype, device=self.device))))
        text = SimpleNamespace(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], vocab_size=None)
        self.model_config = SimpleNamespace(model="random-init", tokenizer=tokenizer, tokenizer_revision=None,
                                            trust_remote_code=False, hf_text_config=text, max_model_len=max_len)
        self.vllm_config = SimpleNamespace(model_config=self.model_config,
                                           scheduler_config=SimpleNamespace(max_num_seqs=rows))
        self.requests: dict[str, Any] = {}
        max_blocks = math.ceil(max_len / shape["block"])
        self.input_batch = SimpleNamespace(
            req_ids=[], num_reqs=0, req_id_to_index={},
            num_computed_tokens_cpu=np.zeros(rows, dtype=np.int32), num_prompt_tokens=np.zeros(rows, dtype=np.int32),
            token_ids_cpu=np.zeros((rows, max_len), dtype=np.int32),
            block_table=FakeMultiGroupBlockTable(FakeBlockTable(rows, max_blocks, shape["block"], max_tokens, self.device)))
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.optimistic_seq_lens_cpu = torch.zeros(rows, dtype=torch.int32)
        self.query_start_loc = SimpleNamespace(gpu=torch.zeros(rows + 1, dtype=torch.int32, device=self.device))

    def get_model(self) -> Any:
        return self.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return [layer.kv_cache for layer in self.compilation_config.static_forward_context.values()]


def _hooks_class():
    from dynts.vllm.worker import WorkerHooks

    class BenchHooks(WorkerHooks):
        """The real hooks on one rank, with the testbed's tokenizer (``dynts.models.load_tokenizer``: the
        worker's ``AutoTokenizer`` maps the testbed's word-level ``tokenizer.json`` to a byte-level BPE)."""

        @staticmethod
        def _tp_group() -> None:
            return None

        @staticmethod
        def _tokenizer(runner: Any) -> Any:
            from dynts.models import load_tokenizer

            return load_tokenizer(runner.model_config.tokenizer)

    return BenchHooks


class _Recording:
    """An evictor that records each decision (``TokenInfo.positions`` and the kept slots) as it makes it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, info: Any) -> torch.Tensor:
        kept = self.inner(info)
        self.calls.append((info.positions.clone(), kept.clone()))
        return kept


# ---------------------------------------------------------------------------------------------- the bench
@dataclass
class HooksBenchSettings:
    """One measurement: ``rows`` requests of ``shape`` (a :data:`SHAPES` name or a dict) in ``dtype`` on ``device``,
    ``method`` at the shape's ``B`` / ``W_l`` and ``retention``; ``reps`` timed cycles (one eviction round and
    ``plain_steps`` plain steps each) after ``warmup``; refills of at most ``chunk_tokens`` tokens per forward;
    ``count_syncs``: one more cycle counted; ``max_seconds``: no further cycle once exceeded (at least one timed)."""

    rows: int = 256
    shape: str | dict = "small"
    dtype: str = "bfloat16"
    device: str = "cpu"
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


class HooksBench:
    """vLLM's scheduler and ``execute_model`` around the real :class:`~dynts.vllm.worker.WorkerHooks` on a
    :class:`FakeRunner` (see the module docstring)."""

    def __init__(self, settings: HooksBenchSettings) -> None:
        import dynts
        from dynts.models import checkpoints_dir
        from dynts.vllm.config import PluginConfig

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
        self.n_keep = self.config.settings.n_keep(shape["prompt"])
        self.volume = self.budget - self.n_keep
        if s.plain_steps >= self.volume:
            raise ValueError(f"plain_steps={s.plain_steps} must stay below B - n_keep = {self.volume}")
        max_len = shape["prompt"] + self.budget + cycles * self.volume + 8
        blocks_per_row = math.ceil(self.budget / self.block)
        self.max_tokens = max(s.rows, min(s.chunk_tokens, s.rows * self.budget))
        self.runner = FakeRunner(shape, s.rows, self.dtype, self.device, s.rows * blocks_per_row + 1, max_len,
                                 self.max_tokens, s.layout, str(checkpoints_dir() / "testbed-lrm"))
        self.recording = None
        if s.verify:
            self.recording = self.config.settings.evictor = _Recording(self.config.settings.evictor)
        self.hooks = _hooks_class()(self.runner, self.config, [self.block])
        g = torch.Generator().manual_seed(s.seed)
        pool = torch.randperm(s.rows * blocks_per_row, generator=g) + 1  # scattered blocks; block 0 is vLLM's null block
        self.free = pool.tolist()
        vocab = len(self.hooks.tokenizer)
        delimiter = set(self.hooks.tracker.delimiter.ids) if self.hooks.tracker.delimiter is not None else set()
        allowed = np.array([t for t in range(4, vocab) if t not in delimiter], dtype=np.int32)  # thinking tokens only
        rng = np.random.default_rng(s.seed)
        batch = self.runner.input_batch
        batch.token_ids_cpu[:] = allowed[rng.integers(0, len(allowed), size=batch.token_ids_cpu.shape)]
        self.hidden = torch.randn(self.max_tokens, shape["hidden"], generator=g).to(self.device, self.dtype)
        self.rows: list[_Row] = []
        for i in range(s.rows):
            row = _Row(f"req-{i}", shape["prompt"])
            self.rows.append(row)
            self.runner.requests[row.rid] = SimpleNamespace(
                block_ids=[[]], sampling_params=SimpleNamespace(extra_args=None, max_tokens=None))
            batch.req_ids.append(row.rid)
            batch.req_id_to_index[row.rid] = i
            batch.num_prompt_tokens[i] = row.prompt
        batch.num_reqs = s.rows
        self.counter = None
        self.moved_slots: list[int] = []
        self.verified = {"event_rounds": 0, "rows_checked": 0}

    # ------------------------------------------------------------------ one round
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _call(self, fn, arg, times: dict, name: str) -> None:
        if self.counter is not None:
            with self.counter.counting():
                fn(arg)
            return
        self._sync()
        t0 = time.perf_counter()
        fn(arg)
        t1 = time.perf_counter()
        self._sync()
        times[name] = (t1 - t0, time.perf_counter() - t0)

    def step(self, q: int) -> tuple[dict, int]:
        """One round of ``q`` tokens per row; returns the per-hook ``(host, done)`` seconds and the events run."""
        from dynts.vllm.scheduler import StepPlan

        runner, hooks, bs = self.runner, self.hooks, self.block
        batch, table = runner.input_batch, runner.input_batch.block_table[0]
        settings = self.config.settings
        plan = StepPlan()
        for row in self.rows:  # the scheduler: events by the one rule, blocks back to the pool, new blocks
            if settings.bounds.due(row.stored, q, self.n_keep):
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
        out = SimpleNamespace(finished_req_ids=set(), scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                              dynts_plan=plan)
        calls = len(self.recording.calls) if self.recording is not None else 0
        times: dict = {}
        self._call(hooks.before_step, out, times, "before_step")
        if plan.events:
            self._after_event(plan.events, calls)
        for i, row in enumerate(self.rows):  # _update_states: the new blocks into the worker's lists and the table
            worker_blocks = runner.requests[row.rid].block_ids[0]
            worker_blocks += row.new_blocks
            if self.settings.verify and worker_blocks != row.blocks:
                raise AssertionError(f"{row.rid}: the worker's blocks {worker_blocks} != the scheduler's {row.blocks}")
            n = table.num_blocks_per_row[i]
            table.block_table.np[i, n : n + len(row.new_blocks)] = row.new_blocks
            table.num_blocks_per_row[i] = n + len(row.new_blocks)
            batch.num_computed_tokens_cpu[i] = row.computed
        num_reqs, total = len(self.rows), q * len(self.rows)
        batch.block_table.commit_block_table(num_reqs)
        # _prepare_inputs: logical positions, seq_lens, query_start_loc, the slot mapping
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        scheduled = np.full(num_reqs, q, dtype=np.int32)
        positions = (np.repeat(computed, q) + np.tile(np.arange(q), num_reqs)) if q > 1 else computed
        runner.positions[:total].copy_(torch.from_numpy(positions))
        runner.seq_lens[:num_reqs].copy_(torch.from_numpy((computed + q).astype(np.int32)))
        runner.optimistic_seq_lens_cpu[:num_reqs] = torch.from_numpy((computed + q).astype(np.int32))
        runner.query_start_loc.gpu[: num_reqs + 1].copy_(
            torch.from_numpy(np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)))
        batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], runner.positions[:total])
        self._call(hooks.after_prepare_inputs, scheduled, times, "after_prepare_inputs")
        if self.settings.verify:
            self._write_kv(torch.from_numpy(positions), q)
        self._call(hooks.after_forward, self.hidden[:total], times, "after_forward")
        for row in self.rows:
            row.expected += range(row.computed, row.computed + q)
            row.computed += q
        if self.settings.verify:
            self._check_stored()
        return times, len(plan.events)

    def fill(self) -> None:
        """Untimed multi-token forwards until every row stores ``B`` slots (the next decode step evicts)."""
        counter, self.counter = self.counter, None
        per_row = max(1, self.max_tokens // len(self.rows))
        while self.rows[0].stored < self.budget:
            self.step(min(per_row, self.budget - self.rows[0].stored))
        self.counter = counter

    # ------------------------------------------------------------------ verification
    def _after_event(self, events: list, calls: int) -> None:
        """The scheduler side's view of the kept slots: the evictor's decisions recorded during ``before_step``
        (one call per group of equal settings, prompt length and stored count; rows in event order)."""
        if self.recording is None:
            return
        decisions = self.recording.calls[calls:]
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

    def _kv_views(self):
        head = self.shape["head"]
        return [kv.transpose(1, 2).split(head, dim=-1) for kv in self.runner.kv_caches]  # FlashAttention's own view

    def _write_kv(self, positions: torch.Tensor, q: int) -> None:
        """The forward's cache write: every token's K/V encode its position, row and head."""
        heads, head, bs = self.shape["kv_heads"], self.shape["head"], self.block
        total = positions.numel()
        slots = self.runner.input_batch.block_table[0].slot_mapping[:total]
        rows = torch.arange(len(self.rows)).repeat_interleave(q)
        code = torch.zeros(total, heads, head)
        code[:, :, 0] = (positions % 128).float()[:, None]
        code[:, :, 1] = torch.div(positions, 128, rounding_mode="floor").float()[:, None]
        code[:, :, 2] = rows.float()[:, None]
        code[:, :, 3] = torch.arange(heads).float()
        code = code.to(self.device, self.dtype)
        block, offset = torch.div(slots, bs, rounding_mode="floor"), slots % bs
        for layer, (key, value) in enumerate(self._kv_views()):
            key[block, offset] = code
            value[block, offset] = code + layer + 1

    def _check_stored(self) -> None:
        """Every row's stored slots, read through its block list, hold the positions the scheduler side expects."""
        bs, heads = self.block, self.shape["kv_heads"]
        views = self._kv_views()
        for i, row in enumerate(self.rows):
            blocks = torch.tensor(self.runner.requests[row.rid].block_ids[0], dtype=torch.long)
            j = torch.arange(row.stored)
            block, offset = blocks[j // bs].to(self.device), (j % bs).to(self.device)
            for layer, (key, value) in enumerate(views):
                k = key[block, offset].float().cpu()  # [stored, heads, head]
                v = value[block, offset].float().cpu() - (layer + 1)
                for name, t in (("keys", k), ("values", v)):
                    got = (t[:, :, 0] + 128 * t[:, :, 1]).long()
                    if not (got == torch.tensor(row.expected)[:, None]).all():
                        bad = int((got[:, 0] != torch.tensor(row.expected)).nonzero()[0])
                        raise AssertionError(f"{row.rid} layer {layer} {name}: slot {bad} holds position "
                                             f"{int(got[bad, 0])}, expected {row.expected[bad]}")
                    if not ((t[:, :, 2] == i).all() and (t[:, :, 3] == torch.arange(heads).float()).all()):
                        raise AssertionError(f"{row.rid} layer {layer} {name}: a slot holds another row's or head's K/V")
        self.verified["rows_checked"] += len(self.rows)


def _median_us(samples: list[dict]) -> dict:
    if not samples:
        return {}
    out = {}
    for name in HOOKS:
        out[name] = {"host_us": 1e6 * statistics.median(t[name][0] for t in samples),
                     "done_us": 1e6 * statistics.median(t[name][1] for t in samples)}
    out["step"] = {"host_us": 1e6 * statistics.median(sum(t[n][0] for n in HOOKS) for t in samples),
                   "done_us": 1e6 * statistics.median(sum(t[n][1] for n in HOOKS) for t in samples)}
    return out


def run_hooks_bench(settings: HooksBenchSettings) -> dict:
    """Time the hooks per plain decode step and per eviction round (see the module docstring); a JSON-able dict."""
    from eval.perf.syncs import sync_counter

    started = time.perf_counter()
    with torch.no_grad():
        bench = HooksBench(settings)
        built = time.perf_counter() - started
        bench.fill()
        samples = {"event": [], "plain": []}
        counts = {"event": [], "plain": []}
        counter = sync_counter(bench.device) if settings.count_syncs else None
        cycles, timed = settings.warmup + settings.reps, 0
        for cycle in range(cycles + int(counter is not None)):
            counting = cycle == cycles
            if not counting and timed and settings.max_seconds and time.perf_counter() - started > settings.max_seconds:
                if counter is None:
                    break
                counting = True
            bench.counter = counter if counting else None
            for kind, q_steps in (("event", 1), ("plain", settings.plain_steps)):
                for _ in range(q_steps):
                    if counting:
                        counter.now = 0
                    times, events = bench.step(1)
                    if (events > 0) != (kind == "event") or (events and events != len(bench.rows)):
                        raise AssertionError(f"a {kind} round ran {events} events for {len(bench.rows)} rows")
                    if counting:
                        counts[kind].append(counter.now)
                    elif cycle >= settings.warmup:
                        samples[kind].append(times)
            bench.counter = None
            if counting:
                break
            timed += cycle >= settings.warmup
            bench.fill()
    s = settings
    return {
        "device": str(bench.device), "dtype": s.dtype, "rows": s.rows, "method": s.method, "layout": s.layout,
        "shape": bench.shape, "budget": bench.budget, "n_keep": bench.n_keep, "eviction_volume": bench.volume,
        "predictor_dtype": "float32" if s.method == "dynts" else None,
        "cycles_timed": timed, "warmup": s.warmup, "plain_steps_per_cycle": s.plain_steps,
        "event": _median_us(samples["event"]), "plain": _median_us(samples["plain"]),
        "syncs_counter": getattr(counter, "kind", None),
        "syncs_per_event_round": statistics.mean(counts["event"]) if counts["event"] else None,
        "syncs_per_plain_step": statistics.mean(counts["plain"]) if counts["plain"] else None,
        "moved_slots_per_round": statistics.mean(bench.moved_slots) if bench.moved_slots else None,
        "verified": bench.verified if s.verify else None,
        "setup_seconds": built, "seconds": time.perf_counter() - started,
        "settings": {k: v for k, v in asdict(s).items() if k != "shape"},
    }


def format_table(result: dict) -> str:
    """The small table ``scripts/bench_vllm_hooks.py`` prints."""
    head = (f"dynts.vllm worker hooks: {result['method']}, {result['rows']} rows x 1 token, {result['dtype']} on "
            f"{result['device']}, B={result['budget']} (n_keep {result['n_keep']}), {result['shape']['layers']} layers, "
            f"hidden {result['shape']['hidden']}, {result['layout']}; median of {result['cycles_timed']} cycles (us)")
    lines = [head, f"{'':<22}{'before_step':>14}{'after_prepare':>15}{'after_forward':>15}{'step':>10}{'step done':>11}{'syncs':>7}"]
    for kind, label in (("plain", "plain decode step"), ("event", f"eviction round ({result['rows']})")):
        r = result[kind]
        if not r:
            continue
        syncs = result[f"syncs_per_{'plain_step' if kind == 'plain' else 'event_round'}"]
        lines.append(f"{label:<22}{r['before_step']['host_us']:>14.0f}{r['after_prepare_inputs']['host_us']:>15.0f}"
                     f"{r['after_forward']['host_us']:>15.0f}{r['step']['host_us']:>10.0f}{r['step']['done_us']:>11.0f}"
                     f"{'' if syncs is None else f'{syncs:.0f}':>7}")
    return "\n".join(lines)
