"""A stand-in for vLLM 0.34's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``; no vLLM needed) and one
round of it around the real :class:`dynts.vllm.worker_v2.RunnerV2Hooks`, bound as vLLM binds them.

:class:`StandInV2Runner` has what the hooks read of the V2 runner, with the same persistence:

* ``input_buffers`` (:class:`InputBuffers`): persistent device ``positions``, ``seq_lens``, ``query_start_loc``,
  ``input_ids``; each round's :class:`InputBatch` holds *views* of them (as ``prepare_inputs`` builds it), so the
  hooks' in-place ``seq_lens`` writes land where a captured graph reads;
* ``req_states`` (:class:`RequestStates`): ``req_id_to_index``, ``prompt_len.np``, ``num_computed_tokens_np`` and
  the device ``num_computed_tokens.gpu`` that positions and ``seq_lens`` are derived from, on the device;
* ``block_tables`` (:class:`BlockTables`): the device block table (staged writes applied by one upload per round),
  ``num_blocks.np`` / ``.gpu``, ``input_block_tables`` gathered per round, ``slot_mappings`` computed on the
  device from the positions (padding tokens ``-1``, as vLLM's ``PAD_SLOT_ID``);
* ``execute_model(scheduler_output)`` in vLLM's order: finished and preempted requests removed,
  ``add_requests``, ``update_requests`` (the round's new blocks appended after ``num_blocks``), ``prepare_inputs``,
  ``prepare_attn`` (block tables, slot mappings), the forward (``model_forward(num_tokens, num_reqs)``: by default
  the final-norm hidden states only, random; :mod:`.vllm_standin_forward` writes K/V and attends), its hidden
  states left in ``execute_model_state.hidden_states``; ``sample_tokens()`` advances ``num_computed_tokens`` on
  the device.

The hooks are bound by :mod:`dynts.vllm.runners`' own V2 binder (``execute_model``, ``prepare_attn`` and
``sample_tokens`` wrapped on this object), so ``before_step`` / ``before_attention`` / ``after_execute`` /
``after_sample`` run exactly where vLLM runs them.
:class:`V2Round` builds each round's ``SchedulerOutput`` (``scheduled_new_reqs`` with ``req_id`` / ``block_ids`` /
``sampling_params``, ``scheduled_cached_reqs`` with ``req_ids`` / ``new_block_ids``, ``finished_req_ids``,
``preempted_req_ids``, ``dynts_plan`` with the ids the scheduler learned: under async scheduling the id of a
decoded token comes with the next round's plan, a prefill's with its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from .vllm_standin import blocks_per_row, runner_parts

__all__ = ["BlockTables", "InputBatch", "InputBuffers", "RequestStates", "SchedulerOutput", "StandInV2Runner",
           "V2Round"]

PAD_SLOT_ID = -1


class InputBuffers:
    """The runner's persistent device inputs (``vllm.v1.worker.gpu.input_batch.InputBuffers``)."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)


class HostMirrored:
    """A host array (the source of truth, ``np``) and its device copy ``gpu`` (vLLM: ``UvaBackedTensor``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)

    def copy_to_device(self) -> None:
        self.gpu.copy_(self.cpu, non_blocking=True)


class RequestStates:
    """Per request state index: ids, prompt lengths, computed tokens (host mirror and device counter)."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.req_id_to_index: dict[str, int] = {}
        self.free = list(range(max_num_reqs - 1, -1, -1))
        self.prompt_len = HostMirrored((max_num_reqs,), torch.int32, device)
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32, device=device))

    def add_request(self, req_id: str, prompt_len: int, num_computed_tokens: int) -> int:
        index = self.free.pop()
        self.req_id_to_index[req_id] = index
        self.prompt_len.np[index] = prompt_len
        self.num_computed_tokens_np[index] = num_computed_tokens
        self.num_computed_tokens.gpu[index] = num_computed_tokens  # vLLM: a staged write, applied below
        return index

    def remove_request(self, req_id: str) -> None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self.free.append(index)


class BlockTables:
    """One KV-cache group's block tables (``vllm.v1.worker.gpu.block_table.BlockTables``)."""

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks: int, max_num_tokens: int,
                 device: torch.device) -> None:
        self.block_sizes = [block_size]
        self.device = device
        table = torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=device)
        self.block_tables = [SimpleNamespace(gpu=table)]  # vLLM: a StagedWriteTensor
        self.num_blocks = HostMirrored((1, max_num_reqs), torch.int32, device)
        self.input_block_tables = [torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=device)]
        self.slot_mappings = torch.zeros(1, max_num_tokens, dtype=torch.int64, device=device)
        self.staged: list[tuple[int, int, list[int]]] = []
        self.columns = torch.arange(max_num_blocks, device=device)

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        start = 0 if overwrite else int(self.num_blocks.np[0, req_index])
        ids = list(new_block_ids[0])
        if start + len(ids) > self.block_tables[0].gpu.shape[1]:
            raise RuntimeError(f"block table row {req_index} overflows: {start + len(ids)} blocks")
        self.staged.append((req_index, start, ids))
        self.num_blocks.np[0, req_index] = start + len(ids)

    def apply_staged_writes(self) -> None:
        """The round's staged block ids in one upload (vLLM: a UVA buffer and one kernel), then ``num_blocks``."""
        if self.staged:
            rows = np.concatenate([np.full(len(ids), i) for i, _, ids in self.staged])
            cols = np.concatenate([np.arange(start, start + len(ids)) for _, start, ids in self.staged])
            vals = np.concatenate([np.asarray(ids, dtype=np.int64) for _, _, ids in self.staged])
            coords = torch.from_numpy(np.stack([rows, cols, vals]).astype(np.int64)).to(self.device, non_blocking=True)
            self.block_tables[0].gpu[coords[0], coords[1]] = coords[2].to(torch.int32)
            self.staged.clear()
        self.num_blocks.copy_to_device()

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int) -> tuple[torch.Tensor, ...]:
        """The batch's rows of the block table (entries past a row's ``num_blocks`` zero) into the persistent
        ``input_block_tables``; rows past the batch zero."""
        num_reqs, out = idx_mapping.shape[0], self.input_block_tables[0]
        rows = self.block_tables[0].gpu[idx_mapping]
        live = self.columns[None, :] < self.num_blocks.gpu[0, idx_mapping][:, None]
        out[:num_reqs] = torch.where(live, rows, 0)
        out[num_reqs:] = 0
        return (out[:num_reqs_padded],)

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                              num_tokens_padded: int) -> torch.Tensor:
        """``slot = block_table[req, pos // bs] * bs + pos % bs`` per token into the persistent ``slot_mappings``;
        tokens past the batch's ``query_start_loc[num_reqs]`` and the rest of the buffer ``PAD_SLOT_ID``."""
        bs, num_reqs, n = self.block_sizes[0], idx_mapping.shape[0], positions.shape[0]
        token = torch.arange(n, device=positions.device)
        ends = query_start_loc[1 : num_reqs + 1].to(torch.int64)
        req = torch.searchsorted(ends, token, right=True).clamp_(max=num_reqs - 1)
        pos = positions.to(torch.int64).clamp(min=0)
        table = self.block_tables[0].gpu
        column = torch.div(pos, bs, rounding_mode="floor").clamp_(max=table.shape[1] - 1)
        block = table[idx_mapping[req], column].to(torch.int64)
        slots = torch.where(token < ends[-1], block * bs + pos % bs, PAD_SLOT_ID)
        self.slot_mappings[0, :n] = slots
        self.slot_mappings[0, n:] = PAD_SLOT_ID
        return self.slot_mappings[:, :num_tokens_padded]


@dataclass
class InputBatch:
    """One round's batch (``vllm.v1.worker.gpu.input_batch.InputBatch``, what the hooks read of it); the tensors are
    views of :class:`InputBuffers`."""

    req_ids: list[str]
    num_reqs: int
    idx_mapping: torch.Tensor  # [num_reqs] request state index of each batch row (device)
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]
    num_computed_tokens_np: np.ndarray  # [num_reqs]
    positions: torch.Tensor  # [num_tokens_after_padding] logical positions
    input_ids: torch.Tensor


@dataclass
class SchedulerOutput:
    """What the runner and the hooks read of vLLM's ``SchedulerOutput``."""

    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    dynts_plan: Any = None


class StandInV2Runner:
    """What :class:`~dynts.vllm.worker_v2.RunnerV2Hooks` reads of vLLM 0.34's V2 ``GPUModelRunner`` (see the
    module docstring), for up to ``rows`` requests and ``max_tokens`` tokens per round."""

    def __init__(self, shape: dict, rows: int, dtype: torch.dtype, device: torch.device | str, num_blocks: int,
                 max_len: int, max_tokens: int, layout: str, tokenizer: str) -> None:
        self.device = torch.device(device)
        self.shape = shape
        runner_parts(self, shape, rows, dtype, num_blocks, max_len, layout, tokenizer)
        self.kernel_block_sizes = [shape["block"]]
        self.max_num_reqs, self.max_num_tokens = rows, max_tokens
        self.input_buffers = InputBuffers(rows, max_tokens, self.device)
        self.req_states = RequestStates(rows, self.device)
        self.block_tables = BlockTables(shape["block"], rows, blocks_per_row(shape) + 1, max_tokens, self.device)
        g = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(max_tokens, shape["hidden"], generator=g).to(self.device, dtype)  # final-norm output
        self.model_forward: Callable[[int, int], torch.Tensor] = lambda num_tokens, num_reqs: self.hidden[:num_tokens]
        self.execute_model_state: Any = None
        self.batch: InputBatch | None = None

    # ------------------------------------------------------------------ execute_model
    def execute_model(self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None,
                      dummy_run: bool = False) -> None:
        for rid in [*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids]:
            self.req_states.remove_request(rid)
        self.add_requests(scheduler_output)
        self.update_requests(scheduler_output)
        batch = self.prepare_inputs(scheduler_output)
        self.prepare_attn(batch)
        hidden = self.model_forward(batch.num_tokens_after_padding, batch.num_reqs)
        self.execute_model_state = SimpleNamespace(hidden_states=hidden, input_batch=batch)
        self.batch = batch

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self.req_states.remove_request(new.req_id)
            index = self.req_states.add_request(new.req_id, new.prompt_len, new.num_computed_tokens)
            self.block_tables.append_block_ids(index, new.block_ids, overwrite=True)

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        for rid, computed, new_blocks in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            index = self.req_states.req_id_to_index[rid]
            self.req_states.num_computed_tokens_np[index] = computed
            if new_blocks is not None:
                self.block_tables.append_block_ids(index, new_blocks, overwrite=False)
        self.block_tables.apply_staged_writes()

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> InputBatch:
        """``query_start_loc`` uploaded; positions and ``seq_lens`` derived on the device from
        ``num_computed_tokens.gpu`` into the persistent buffers (vLLM: ``prepare_pos_seq_lens``)."""
        buffers, states = self.input_buffers, self.req_states
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_reqs = len(req_ids)
        idx_np = np.array([states.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        num_tokens = int(scheduled.sum())
        qsl = np.full(self.max_num_reqs + 1, num_tokens, dtype=np.int32)
        qsl[0] = 0
        np.cumsum(scheduled, out=qsl[1 : num_reqs + 1])
        idx = torch.from_numpy(idx_np).to(self.device, non_blocking=True)
        buffers.query_start_loc.copy_(torch.from_numpy(qsl), non_blocking=True)
        starts = buffers.query_start_loc[:num_reqs].to(torch.int64)
        computed = states.num_computed_tokens.gpu[idx]
        token = torch.arange(num_tokens, device=self.device)
        req = torch.searchsorted(buffers.query_start_loc[1 : num_reqs + 1].to(torch.int64), token, right=True)
        buffers.positions[:num_tokens] = computed.to(torch.int64)[req] + token - starts[req]
        buffers.seq_lens[:num_reqs] = computed + torch.from_numpy(scheduled).to(self.device, non_blocking=True)
        buffers.seq_lens[num_reqs:] = 0
        return InputBatch(req_ids=req_ids, num_reqs=num_reqs, idx_mapping=idx, idx_mapping_np=idx_np,
                          num_scheduled_tokens=scheduled, num_tokens=num_tokens, num_tokens_after_padding=num_tokens,
                          query_start_loc=buffers.query_start_loc[: num_reqs + 1], seq_lens=buffers.seq_lens[:num_reqs],
                          num_computed_tokens_np=states.num_computed_tokens_np[idx_np],
                          positions=buffers.positions[:num_tokens], input_ids=buffers.input_ids[:num_tokens])

    def prepare_attn(self, input_batch: InputBatch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        tables = self.block_tables.gather_block_tables(input_batch.idx_mapping, input_batch.num_reqs)
        slots = self.block_tables.compute_slot_mappings(input_batch.idx_mapping, input_batch.query_start_loc,
                                                        input_batch.positions, input_batch.num_tokens_after_padding)
        return tables, slots

    def sample_tokens(self) -> None:
        """After the forward: every scheduled request's ``num_computed_tokens`` advanced on the device."""
        batch = self.batch
        q = torch.from_numpy(batch.num_scheduled_tokens).to(self.device, non_blocking=True)
        self.req_states.num_computed_tokens.gpu.index_add_(0, batch.idx_mapping, q)


class V2Round:
    """The V2 runner around the real hooks (bound by ``dynts.vllm.runners``), for a
    :class:`~.vllm_hooks_bench.HooksBench`; ``async_scheduling``: a decoded token's id ships one round late.

    Args:
        bench: the bench (its ``rows``, ``settings``, ``shape``).
        token_ids: ``[rows, max_len]`` the id of every token of every row.
    """

    names = ("before_step", "before_attention", "after_execute", "after_sample")  # eval.perf.syncs.V2_HOOKS

    def __init__(self, bench: Any, token_ids: np.ndarray, hooks_class: type, config: Any, num_blocks: int,
                 max_len: int, tokenizer: str) -> None:
        from dynts.vllm.runners import RUNNERS

        s = bench.settings
        self.bench, self.token_ids = bench, token_ids
        self.runner = runner = StandInV2Runner(bench.shape, s.rows, bench.dtype, bench.device, num_blocks, max_len,
                                               bench.max_tokens, s.layout, tokenizer)
        runner._dynts = self.hooks = hooks_class(runner, config, runner.kernel_block_sizes)
        RUNNERS["v2"][3](runner)  # as the plugin's initialize_kv_cache wrapper: execute_model, prepare_attn bound
        self.shipped: dict[str, int] = {}  # per request: tokens whose ids the worker has been sent
        self.params = SimpleNamespace(extra_args=None, max_tokens=None)
        if s.verify:
            from .vllm_standin_forward import StandInForward

            runner.model_forward = StandInForward(runner, attend=False)

    def worker_blocks(self, rid: str) -> list[int]:
        return self.hooks.blocks[rid]

    def round(self, q: int, plan: Any, fill: bool) -> None:
        """One round of ``q`` tokens per row; ``fill``: tokens whose ids the scheduler knows (a prefill's)."""
        rows, late = self.bench.rows, self.bench.settings.async_scheduling and not fill
        new, cached = [], SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
        for i, row in enumerate(rows):
            if row.rid not in self.shipped:
                new.append(SimpleNamespace(req_id=row.rid, prompt_len=row.prompt, block_ids=(list(row.new_blocks),),
                                           sampling_params=self.params, num_computed_tokens=row.computed))
            else:
                cached.req_ids.append(row.rid)
                cached.new_block_ids.append((list(row.new_blocks),) if row.new_blocks else None)
                cached.num_computed_tokens.append(row.computed)
            start = self.shipped.get(row.rid)
            known = row.computed + (0 if late else q)  # async: this round's token was sampled by the round in flight
            if start is None or known > start:
                start = start or 0
                plan.token_ids[row.rid] = (start, self.token_ids[i, start:known].tolist())
                self.shipped[row.rid] = known
        out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                              num_scheduled_tokens={row.rid: q for row in rows},
                              total_num_scheduled_tokens=q * len(rows),
                              dynts_plan=plan)
        self.runner.execute_model(out)
        self.runner.sample_tokens()
        if self.hooks.failed and not self.bench.allow_faults:  # a broken invariant ends a request, not expected here
            raise AssertionError(f"the worker failed requests: {self.hooks.faults or sorted(self.hooks.failed)}")
