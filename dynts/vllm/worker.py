"""Worker side of the plugin (every model-runner process, each tensor-parallel rank): slot metadata,
DynTS scores, the eviction copies, and attention that reads only the stored slots.

Per round, in vLLM's ``GPUModelRunner`` (the CPU runner subclasses it):

1. first thing in ``execute_model`` -- before ``_update_states`` zeroes newly allocated blocks, which
   may be the tail blocks the scheduler just freed -- every event of the round's
   :class:`~dynts.vllm.scheduler.StepPlan` runs the :class:`~dynts.evictors.Evictor` over the request's
   slot metadata (:class:`dynts.core.SlotTracker`), the kept K/V of every request move to the front slots
   of its blocks in every layer (:class:`dynts.kernels.PagedKV`: the physical plan built on the device from
   one upload of the round's block lists, one Triton launch on CUDA) and its block lists are cut to the
   scheduler's;
2. after ``_prepare_inputs``: the scheduled tokens' positions, ids and segments are recorded; RoPE
   positions stay logical while ``seq_lens`` and the slot mapping use ``position - shift`` (the kept
   keys sit contiguously at the front of the request's blocks);
3. after the model forward: the predictor scores the final-norm hidden states of every scheduled token
   (prefill included), on the device, outside any captured graph.

No hook makes the host wait for the device: every upload goes through the tracker's pinned
:class:`~dynts.core.upload.HostStaging` (``non_blocking``), nothing is read back on a plain step, and an
eviction round reads back one flag (the stale-score check of :func:`dynts.core.slots.select_kept`). Counted on
CPU by ``eval.perf.syncs.SyncCounter`` (``tests/test_vllm_hook_syncs.py``), on CUDA by torch's sync debug mode
(``scripts/bench_vllm_hooks.py``).

The hooks are built when the worker allocates its KV cache (``initialize_kv_cache``), before the first
request: the attention backend's layout, the one KV-cache group, the kernel block size, the tokenizer and
the predictor (bound to the served model by its fingerprint) are checked there, so a misfit stops the
engine at startup. The slot table (:class:`dynts.core.SlotTable`) is allocated there too, for
``max_num_seqs`` rows (and a scratch row) of ``min(max_model_len, max(B, 256))`` slots; it, the predictor's
activations at a full batch and an eviction round's temporaries are charged against the KV cache
(:func:`dynts.vllm.memory.hooks_bytes` is subtracted from the memory the worker reports for it).

Under tensor parallelism every rank runs the evictor, and the kept slots of the first rank are broadcast
to the others (one collective per eviction group, at events only): every rank keeps the same slots by
construction, whatever rounding its own all-reduce produced.
"""

from __future__ import annotations

import math
import os
from itertools import repeat
from typing import Any

import numpy as np
import torch

from ..core import Forward, SlotTable, SlotTracker
from ..core.readback import HostReadback
from ..kernels.paged import PagedKV
from ..thinking import think_end_ids
from .checks import check_worker
from .config import PluginConfig
from .layouts import geometry_for
from .memory import HookState, slot_table_shape
from .recording import DecodeRecording

__all__ = ["WorkerHooks"]

class _FirstRankDecides:
    """An evictor whose kept slots are the first tensor-parallel rank's, broadcast to every rank."""

    def __init__(self, inner: Any, group: Any) -> None:
        self.inner, self.group = inner, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, info: Any) -> torch.Tensor:
        kept = self.inner(info).contiguous()
        return self.group.broadcast(kept, src=0)


class WorkerHooks(DecodeRecording):
    """The plugin's state in one model runner; built and checked when its KV cache is allocated."""

    def __init__(self, runner: Any, config: PluginConfig, kernel_block_sizes: Any = None,
                 state: HookState | None = None) -> None:
        state = state if state is not None else self.reserve(runner, config)  # made in vLLM's profile where it runs
        self.runner = runner
        self.config = config = state.config
        self.block_size = check_worker(runner.kv_cache_config, kernel_block_sizes)
        self.kv = self._paged_kv(runner, self.block_size)
        self.tokenizer = state.tokenizer
        self.tp_group = self._tp_group()
        self.tracker = SlotTracker(config.settings, runner.device,
                                   think_end_ids(state.tokenizer, config.settings.think_end), table=state.table)
        self.scratch_row = self.tracker.scratch_row  # taken now: the table's last spare row
        self.staging = self.tracker.staging
        self._place(config.settings.evictor)
        # the stale-score flags of an eviction round, read on the host a round later (never waited on)
        self.stale_flags = HostReadback(runner.device, capacity=state.table.rows)
        self.predictor = state.predictor
        self.shifts: dict[str, int] = {}
        self.untracked: set[str] = set()  # requests that can never evict (no scores needed): nothing recorded
        self.failed: set[str] = set()  # requests ended for a broken invariant, until vLLM finishes them (_fail)
        self.faults: dict[str, str] = {}  # why, per failed request not yet reported to the scheduler (take_faults)

    # ------------------------------------------------------------------ setup
    @classmethod
    def reserve(cls, runner: Any, config: PluginConfig) -> HookState:
        """What the hooks hold for the engine's life (:class:`~dynts.vllm.memory.HookState`): the tokenizer, the
        engine's evictor bound to it, the slot table reserved ``fixed`` at
        :func:`~dynts.vllm.memory.slot_table_shape` and the predictor checked against the served model."""
        tokenizer = cls._tokenizer(runner)
        config.settings.evictor.bind(tokenizer)
        rows, width = slot_table_shape(config, runner.vllm_config)
        table = SlotTable(torch.device(runner.device), rows=rows, width=width, fixed=True)
        predictor = cls._predictor(runner, config) if config.settings.needs_scores else None
        return HookState(config, tokenizer, table, predictor)

    @staticmethod
    def _tokenizer(runner: Any) -> Any:
        from transformers import AutoTokenizer

        from ..models import load_tokenizer

        mc = runner.model_config
        if os.path.isdir(mc.tokenizer):  # dynts' one loading rule (a word-level tokenizer.json loads as saved)
            return load_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        return AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                             trust_remote_code=mc.trust_remote_code)

    @staticmethod
    def _tp_group() -> Any:
        """vLLM's tensor-parallel group when it has more than one rank (``None`` otherwise)."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return group if group.world_size > 1 else None

    @staticmethod
    def _paged_kv(runner: Any, block_size: int) -> PagedKV:
        """Every attention layer's KV cache tensor, with the slot geometry of its backend's layout."""
        groups = runner.kv_cache_config.kv_cache_groups
        context = runner.compilation_config.static_forward_context
        caches, geometries = [], set()
        for name in groups[0].layer_names:
            layer = context[name]
            kv = layer.kv_cache
            if isinstance(kv, (list, tuple)):  # older vLLM kept one tensor per virtual engine
                kv = kv[0]
            caches.append(kv)
            geometries.add(geometry_for(layer.attn_backend.get_name(), getattr(layer, "isa", None), kv))
        if len(geometries) != 1:
            raise NotImplementedError(f"dynts.vllm needs one KV slot layout for every layer; found {len(geometries)}")
        return PagedKV(caches, block_size, geometries.pop())

    @staticmethod
    def _predictor(runner: Any, config: PluginConfig) -> torch.nn.Module:
        """The engine's predictor, checked against the served model (config + final-norm weight fingerprint)."""
        from ..predictor import load_predictor

        body = getattr(runner.get_model(), "model", None)
        norm = getattr(body, "norm", None)
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise NotImplementedError(
                f"dynts.vllm cannot find the final norm of {type(runner.get_model()).__name__} (model.model.norm); "
                "DynTS scores its output. Serve a method without a predictor (window, streamingllm, sepllm)"
            )
        mc = runner.model_config
        return load_predictor(config.predictor, mc.hf_text_config, final_norm_weight=weight.detach(),
                              name_or_path=mc.model)

    # ------------------------------------------------------------------ the runner's request state
    def sampling_params(self, rid: str) -> Any:
        """The request's ``SamplingParams`` (``None`` for a pooling request)."""
        return self.runner.requests[rid].sampling_params

    def block_ids(self, rid: str) -> list[int]:
        """The request's block ids in its one KV-cache group, in order."""
        return self.runner.requests[rid].block_ids[0]

    def holds_blocks(self, rid: str) -> bool:
        """Whether the runner holds the request's block lists (a failed request's are cut all the same)."""
        return rid in self.runner.requests

    # ------------------------------------------------------------------ per round
    def settings_of(self, rid: str) -> Any:
        params = self.sampling_params(rid)
        settings = self.config.for_request(params.extra_args if params else None)
        if not getattr(settings, "_dynts_bound", False):
            settings.evictor.bind(self.tokenizer)
            self._place(settings.evictor)
            if self.tp_group is not None:
                settings.evictor = _FirstRankDecides(settings.evictor, self.tp_group)
            settings._dynts_bound = True
        return settings

    def _place(self, evictor: Any) -> None:
        """The evictor's constant ids (SepLLM's separators, ...) on the device once, through the pinned staging: no
        eviction round uploads them (:meth:`dynts.evictors.Evictor.place`)."""
        evictor.place(self.tracker.table.device, lambda ids: self.staging.upload(np.asarray(ids, dtype=np.int64)))

    # ------------------------------------------------------------------ one request's fault
    def _fail(self, rid: str, reason: str) -> None:
        """End one request for a broken invariant instead of the engine: nothing is raised inside vLLM's
        ``execute_model``. The reason rides on the round's output to the scheduler (:meth:`take_faults`,
        :func:`dynts.vllm.runners.report_faults`), which finishes the request with ``finish_reason="error"`` in
        that round and frees its blocks; until then its blocks follow the scheduler's count, so its forward writes
        only into its own blocks."""
        if rid not in self.failed:
            self.failed.add(rid)
            self.faults[rid] = reason

    def _drop_failed(self) -> None:
        """Release the slot-table rows of failed requests; they are never recorded again (their tokens' scores go
        to the scratch row until vLLM finishes them)."""
        for rid in self.failed:
            if rid in self.tracker.slots:
                self.tracker.release(rid)
            self.untracked.add(rid)

    def _read_stale(self) -> None:
        """Fail every request whose eviction ranked a thinking token without a predictor score: the flags of earlier
        rounds whose copy to the host has run (:class:`~dynts.core.readback.HostReadback`; never waited on)."""
        for rids, flags in self.stale_flags.ready():
            for rid in np.asarray(rids, dtype=object)[flags].tolist():
                if rid in self.tracker.slots:  # still in flight (a finished request is gone)
                    self._fail(rid, "its eviction ranked thinking tokens that had no predictor score yet (the "
                                    "worker's scores are out of step with its slots)")

    def take_faults(self) -> dict[str, str]:
        """The requests failed since the last call, with why (handed to the scheduler with the round's output)."""
        faults, self.faults = self.faults, {}
        return faults

    # ------------------------------------------------------------------ per round
    def before_step(self, scheduler_output: Any) -> None:
        """Forget finished requests; run the round's eviction events (before any block is rewritten)."""
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ())
        for rid in [*scheduler_output.finished_req_ids, *resumed]:  # a resumed request re-prefills from scratch
            if rid in self.tracker.slots:
                self.tracker.release(rid)
            self.shifts.pop(rid, None)
            self.untracked.discard(rid)
            self.failed.discard(rid)
            self.faults.pop(rid, None)
        self._read_stale()
        self._drop_failed()
        plan = getattr(scheduler_output, "dynts_plan", None)
        if plan is None:
            return
        if plan.shifts != self.shifts:  # (the same mapping while they repeat: DecodeBatch)
            self.shifts = dict(plan.shifts)
        if plan.events:
            self._evict(plan.events)

    def _evict(self, events: list[tuple[str, int, int]]) -> None:
        """Run the round's events: the evictor once per group of equal calls, then every request's kept K/V to the
        front of its blocks in every layer (one move over all requests; its physical plan is built on the device
        from one upload of the requests' block lists), then the block lists cut to the scheduler's. An event for a
        request the worker does not track fails that request (:meth:`_fail`): its blocks are cut all the same,
        nothing of it moves."""
        bs = self.block_size
        entries, due = {}, []
        for rid, stored, n_keep in events:
            entry = None if rid in self.failed else self.tracker.slots.get(rid)
            if entry is None:
                self._fail(rid, "it evicts but the worker does not track it")  # a request failed before keeps its reason
                if self.holds_blocks(rid):  # the scheduler freed its tail blocks all the same
                    self._truncate_blocks(rid, math.ceil(n_keep / bs))
                continue
            entries[id(entry)] = rid
            due.append((entry, stored, n_keep))
        if not due:
            return
        groups = self.tracker.evict(due, defer_stale=True)
        rids = [entries[id(e)] for group in groups for e in group.entries]
        flagged = [group for group in groups if group.stale is not None]
        if flagged:  # read a round later (_read_stale): the round never waits for its evictor's inputs
            self.stale_flags.post(torch.cat([group.stale for group in flagged]),
                                  [entries[id(e)] for group in flagged for e in group.entries])
        width = max(group.n_keep for group in groups)
        kept = torch.arange(width, device=self.kv.device).repeat(len(rids), 1)  # padding: kept[r, i] = i moves nothing
        blocks = np.zeros((len(rids), max(math.ceil(group.stored / bs) for group in groups)), dtype=np.int64)
        row = 0
        for group in groups:
            used, keep = math.ceil(group.stored / bs), math.ceil(group.n_keep / bs)
            kept[row : row + len(group.entries), : group.n_keep] = group.kept
            for rid in rids[row : row + len(group.entries)]:
                blocks[row, :used] = self.block_ids(rid)[:used]  # read before the cut below
                self._truncate_blocks(rid, keep)
                row += 1
        self.kv.move_(kept, self.staging.upload(blocks))

    def _truncate_blocks(self, rid: str, keep: int) -> None:
        """Cut the worker's block lists of a request to its first ``keep`` blocks (the scheduler freed the rest)."""
        runner = self.runner
        del runner.requests[rid].block_ids[0][keep:]
        index = runner.input_batch.req_id_to_index.get(rid)
        if index is not None:
            table = runner.input_batch.block_table[0]
            if table.num_blocks_per_row[index] > keep:
                table.block_table.np[index, keep : table.num_blocks_per_row[index]] = 0
                table.num_blocks_per_row[index] = keep

    def after_prepare_inputs(self, num_scheduled_tokens: np.ndarray) -> None:
        """Point attention at the stored slots (``seq_lens``, slot mapping: right after vLLM's own, whose work it
        repeats at the stored positions), then record the scheduled tokens."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        scheduled = num_scheduled_tokens[:num_reqs]
        total = int(scheduled.sum())
        req_ids = batch.req_ids[:num_reqs]
        decode = num_reqs > 0 and total == num_reqs and scheduled.max() == 1  # one token each
        requests = self._decode_requests(req_ids) if decode else None
        if requests is not None:
            shift_rows = requests.shifts
        else:
            shift_rows = np.fromiter(map(self.shifts.get, req_ids, repeat(0)), dtype=np.int64, count=num_reqs)
        if self._fail_overflowing(req_ids, batch.num_computed_tokens_cpu[:num_reqs] - shift_rows + scheduled):
            requests = None  # a request failed: recorded no more
        if shift_rows.any():
            self._lower_shifts(shift_rows, scheduled, total)
        if requests is not None:
            self._record_decode(batch, requests)
        elif not (decode and self._record_decode_partly(batch, req_ids, shift_rows)):
            self._record_forward(batch, num_scheduled_tokens, shift_rows)

    def _lower_shifts(self, shift_rows: np.ndarray, scheduled: np.ndarray, total: int) -> None:
        """``seq_lens`` (device and host copy) lowered by each request's shift in place; the slot mapping computed again
        at the stored positions (``position - shift``; RoPE keeps the logical ones)."""
        runner = self.runner
        num_reqs = len(shift_rows)
        rows, tokens, host = self.device_shifts(shift_rows, scheduled, total, runner.seq_lens.dtype,
                                                runner.positions.dtype, runner.optimistic_seq_lens_cpu.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= host
        runner.seq_lens[:num_reqs] -= rows
        stored_positions = runner.positions[:total] - tokens
        runner.input_batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1],
                                                            stored_positions)

    def _record_forward(self, batch: Any, num_scheduled_tokens: np.ndarray, shift_rows: np.ndarray) -> None:
        """Record any step (prefill chunks, requests seen first, prefix-cache hits); ``shift_rows``: each request's."""
        forwards, cached, rows = [], [], []
        num_reqs = batch.num_reqs
        computed_rows = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        for i, rid in enumerate(batch.req_ids[:num_reqs]):
            q = int(num_scheduled_tokens[i])
            computed = int(computed_rows[i])
            shift = int(shift_rows[i])
            entry, opened = self.entry_of(rid, int(batch.num_prompt_tokens[i]))
            rows.append(None if entry is None else entry.row)
            if entry is None:
                continue
            if opened and computed > 0:  # a prefix-cache hit: the shared prompt blocks hold these tokens already
                cached.append(Forward(entry, 0, 0, batch.token_ids_cpu[i, :computed].tolist()))
            forwards.append(Forward(entry, computed, computed - shift, batch.token_ids_cpu[i, computed : computed + q].tolist()))
        if cached:
            self.tracker.record(cached)  # metadata only: these tokens are not in this forward's hidden states
        every = len(forwards) == num_reqs  # every token of the batch recorded: its rows and slots are the scored ones
        if forwards:
            self.tracker.record(forwards, score=every and self.predictor is not None)
        if self.predictor is not None and not every and num_reqs:
            self._expect_scores(rows, computed_rows - shift_rows, num_scheduled_tokens[:num_reqs].astype(np.int64))

    def entry_of(self, rid: str, prompt_length: int) -> tuple[Any, bool]:
        """``(entry, opened now)`` of a scheduled request; ``(None, False)`` for one that is not recorded (no
        predictor and no event possible: :meth:`_never_evicts`; or failed, :meth:`_fail`)."""
        if rid in self.untracked or rid in self.failed:  # a failed one is never reopened: vLLM finishes it
            return None, False
        entry = self.tracker.slots.get(rid)
        if entry is not None:
            return entry, False
        settings = self.settings_of(rid)
        if self._never_evicts(rid, settings, prompt_length):  # its tokens' scores, if any, go to the scratch row
            self.untracked.add(rid)
            return None, False
        return self.tracker.open(rid, prompt_length, settings=settings), True

    def _never_evicts(self, rid: str, settings: Any, prompt_length: int) -> bool:
        """True when the request can never have an event (:meth:`EvictionSettings.may_evict`, the scheduler's rule
        too). Its slot metadata would never be read, so it is not recorded (nor does it take a table row, which
        holds only a budget's slots)."""
        params = self.sampling_params(rid)
        return not settings.may_evict(prompt_length, params.max_tokens if params is not None else None)

    def after_forward(self, output: Any) -> None:
        """Score the recorded tokens from the model's final-norm hidden states ``[T', h]``."""
        if self.predictor is None or self.tracker.pending_scores is None:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        if not isinstance(hidden, torch.Tensor):  # an intermediate pipeline stage: not the last rank
            self.tracker.pending_scores = None
            return
        with torch.no_grad():
            self.tracker.write_scores(hidden, self.predictor)
