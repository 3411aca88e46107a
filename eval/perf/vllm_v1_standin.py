"""A stand-in for vLLM's V1 ``GPUModelRunner`` (vLLM 0.32; no vLLM needed) and one round of it around the real
:class:`dynts.vllm.worker.WorkerHooks`.

:class:`FakeRunner` has what the hooks read of a V1 model runner: ``requests`` with ``block_ids`` and
``sampling_params``; ``input_batch`` with ``req_ids`` / ``num_reqs`` / ``num_computed_tokens_cpu`` /
``num_prompt_tokens`` / ``token_ids_cpu`` / ``req_id_to_index`` / ``block_table``; ``positions``, ``seq_lens``,
``optimistic_seq_lens_cpu``, ``query_start_loc``; and the parts every runner has (:func:`.vllm_standin.runner_parts`).
:class:`V1Round` plays ``execute_model`` around the hooks, called as vLLM 0.32's runner calls them: ``before_step``
first, ``_update_states`` (new blocks into the worker's lists and the block table), ``_prepare_inputs`` (logical
positions, ``seq_lens``, the slot mapping), ``after_prepare_inputs``, the forward (with ``verify``: every token's
K/V written through FlashAttention's view at the slot mapping the hooks left), ``after_forward`` with the
final-norm hidden states (random, of the model's hidden size).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .vllm_standin import kv_content, kv_views, runner_parts

__all__ = ["FakeBlockTable", "FakeMultiGroupBlockTable", "FakeRunner", "V1Round"]


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
    """What :class:`~dynts.vllm.worker.WorkerHooks` reads of vLLM's V1 ``GPUModelRunner``, for ``rows`` requests."""

    def __init__(self, shape: dict, rows: int, dtype: torch.dtype, device: torch.device | str, num_blocks: int,
                 max_len: int, max_tokens: int, layout: str, tokenizer: str) -> None:
        self.device = torch.device(device)
        self.shape = shape
        runner_parts(self, shape, rows, dtype, num_blocks, max_len, layout, tokenizer)
        self.requests: dict[str, Any] = {}
        max_blocks = math.ceil(max_len / shape["block"])
        self.input_batch = SimpleNamespace(
            req_ids=[], num_reqs=0, req_id_to_index={},
            num_computed_tokens_cpu=np.zeros(rows, dtype=np.int32), num_prompt_tokens=np.zeros(rows, dtype=np.int32),
            token_ids_cpu=np.zeros((rows, max_len), dtype=np.int32),
            block_table=FakeMultiGroupBlockTable(
                FakeBlockTable(rows, max_blocks, shape["block"], max_tokens, self.device)))
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.optimistic_seq_lens_cpu = torch.zeros(rows, dtype=torch.int32)
        self.query_start_loc = SimpleNamespace(gpu=torch.zeros(rows + 1, dtype=torch.int32, device=self.device))


class V1Round:
    """The V1 runner's ``execute_model`` around the hooks, for a :class:`~.vllm_hooks_bench.HooksBench`.

    Args:
        bench: the bench (its ``rows``, ``settings``, ``shape``, ``hidden``).
        token_ids: ``[rows, max_len]`` the id of every token of every row.
    """

    names = ("before_step", "after_prepare_inputs", "after_forward")  # eval.perf.syncs.V1_HOOKS

    def __init__(self, bench: Any, token_ids: np.ndarray, hooks_class: type, config: Any, num_blocks: int,
                 max_len: int, tokenizer: str) -> None:
        s, shape = bench.settings, bench.shape
        self.bench = bench
        self.runner = runner = FakeRunner(shape, s.rows, bench.dtype, bench.device, num_blocks, max_len,
                                          bench.max_tokens, s.layout, tokenizer)
        self.hooks = hooks_class(runner, config, [shape["block"]])
        batch = runner.input_batch
        batch.token_ids_cpu = token_ids  # the bench's array (filled once the tokenizer is known)
        for i, row in enumerate(bench.rows):
            runner.requests[row.rid] = SimpleNamespace(
                block_ids=[[]], sampling_params=SimpleNamespace(extra_args=None, max_tokens=None))
            batch.req_ids.append(row.rid)
            batch.req_id_to_index[row.rid] = i
            batch.num_prompt_tokens[i] = row.prompt
        batch.num_reqs = s.rows

    def worker_blocks(self, rid: str) -> list[int]:
        return self.runner.requests[rid].block_ids[0]

    def round(self, q: int, plan: Any, fill: bool) -> None:
        """One round of ``q`` tokens per row (the scheduler's ``plan`` and the rows' ``new_blocks`` decided).
        ``fill`` changes nothing here: the V1 runner holds every token id on the host (``token_ids_cpu``)."""
        runner, hooks, bench = self.runner, self.hooks, self.bench
        batch, table = runner.input_batch, runner.input_batch.block_table[0]
        out = SimpleNamespace(finished_req_ids=set(), scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                              dynts_plan=plan)
        hooks.before_step(out)
        for i, row in enumerate(bench.rows):  # _update_states: the new blocks into the worker's lists and the table
            runner.requests[row.rid].block_ids[0].extend(row.new_blocks)
            n = table.num_blocks_per_row[i]
            table.block_table.np[i, n : n + len(row.new_blocks)] = row.new_blocks
            table.num_blocks_per_row[i] = n + len(row.new_blocks)
            batch.num_computed_tokens_cpu[i] = row.computed
        num_reqs, total = len(bench.rows), q * len(bench.rows)
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
        batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1],
                                               runner.positions[:total])
        hooks.after_prepare_inputs(scheduled)
        if bench.settings.verify:
            self._write_kv(runner.positions[:total], q)
        hooks.after_forward(bench.hidden[:total])

    def _write_kv(self, positions: torch.Tensor, q: int) -> None:
        """The forward's cache write: every token's K/V (:func:`.vllm_standin.kv_content`) at its mapped slot."""
        shape, bs = self.bench.shape, self.bench.block
        slots = self.runner.input_batch.block_table[0].slot_mapping[: positions.numel()]
        rows = torch.arange(len(self.bench.rows), device=positions.device).repeat_interleave(q)
        block, offset = torch.div(slots, bs, rounding_mode="floor"), slots % bs
        for layer, (key, value) in enumerate(kv_views(self.runner.kv_caches, shape["head"])):
            k, v = kv_content(positions, rows, shape["kv_heads"], shape["head"], layer, key.dtype)
            key[block, offset] = k
            value[block, offset] = v
