"""The worker-hooks bench on the stand-in V2 runner (eval/perf/vllm_v2_standin.py: vLLM 0.34's persistent input
buffers, block tables and device slot mappings) drives the real dynts.vllm RunnerV2Hooks, bound by the plugin's
own V2 binder; no vLLM needed. After every round each row's stored K/V must hold the positions the evictor kept
followed by the new tokens; the graph-safety driver (eval/perf/vllm_graph_check.py) runs eagerly here, its
attention over the stored slots against a reference from the K/V each row should hold (tests/test_cuda.py
replays it in a CUDA graph)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval.perf.vllm_graph_check import GraphCheckSettings, run_graph_check
from eval.perf.vllm_hooks_bench import HooksBench, HooksBenchSettings, format_table, run_hooks_bench

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_v2_bench_runs_the_real_hooks_and_the_kept_slots_are_the_evictors(async_scheduling):
    result = run_hooks_bench(HooksBenchSettings(rows=4, shape="tiny", dtype="float32", runner="v2", reps=2,
                                                plain_steps=3, verify=True, async_scheduling=async_scheduling))
    assert result["runner"] == "v2" and result["hooks_class"] == "RunnerV2Hooks"
    assert result["hooks"] == ["before_step", "before_attention", "after_execute", "after_sample"]
    assert result["verified"]["event_rounds"] == 4 and result["verified"]["rows_checked"] > 0
    assert result["cycles_timed"] == 2 and result["moved_slots_per_round"] > 0
    for kind in ("plain", "event"):
        assert set(result[kind]) == {"before_step", "before_attention", "after_execute", "after_sample", "step", "runner_step"}
        assert result[kind]["step"]["host_us"] > 0
    assert result["syncs"]["plain_steps"] == 3 and result["syncs"]["event_rounds"] == 1  # one counted cycle
    assert result["syncs_per_plain_step"] == 0  # a decode step without an event reads nothing back
    assert result["syncs_per_event_round"] == 0  # nothing read back: the stale-score flags wait for the next round
    assert "RunnerV2Hooks" in format_table(result) and "before_attention" in format_table(result)
    json.dumps(result)


def test_v2_hooks_lower_seq_lens_in_the_persistent_buffer_and_restore_them():
    """The hooks write where a captured graph reads: after a plain step's ``prepare_attn`` the persistent ``seq_lens``
    hold the stored lengths (logical minus shift), the slot mapping points at the stored slots, and after the round
    ``seq_lens`` are logical again."""
    bench = HooksBench(HooksBenchSettings(rows=3, shape="tiny", dtype="float32", runner="v2", reps=1, plain_steps=2,
                                          verify=True, count_syncs=False))
    runner = bench.runner
    persistent = runner.input_buffers.seq_lens
    seen = {}
    prepare = runner.prepare_attn  # the plugin's wrapper around the stand-in's own

    def spy(batch):
        out = prepare(batch)
        seen["seq_lens"] = batch.seq_lens.clone()
        seen["same_storage"] = batch.seq_lens.data_ptr() == persistent.data_ptr()
        seen["slots"] = runner.block_tables.slot_mappings[0, : batch.num_tokens].clone()
        return out

    runner.prepare_attn = spy
    with torch.no_grad():
        bench.fill()
        bench.step(1)  # the eviction round
        bench.step(1)  # a plain step of shifted rows
    stored = torch.tensor([row.stored for row in bench.rows], dtype=torch.int32)
    assert all(row.shift > 0 for row in bench.rows) and seen["same_storage"]
    assert torch.equal(seen["seq_lens"], stored)  # lowered for attention, in place
    assert torch.equal(persistent[:3], torch.tensor([row.computed for row in bench.rows], dtype=torch.int32))
    bs = bench.block
    want = [row.blocks[(row.stored - 1) // bs] * bs + (row.stored - 1) % bs for row in bench.rows]
    assert seen["slots"].tolist() == want


def test_a_broken_v2_slot_move_is_caught(monkeypatch):
    """The check can fail on V2 too: with the hooks' eviction moves dropped, the kept K/V stay where they were."""
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    evict = RunnerV2Hooks._evict

    def blocks_cut_only(self, events):  # the block lists are cut as usual, no K/V moves
        caches = [kv.clone() for kv in self.runner.kv_caches]
        evict(self, events)
        for kv, saved in zip(self.runner.kv_caches, caches):
            kv.copy_(saved)

    monkeypatch.setattr(RunnerV2Hooks, "_evict", blocks_cut_only)
    with pytest.raises(AssertionError, match="holds position"):
        run_hooks_bench(HooksBenchSettings(rows=2, shape="tiny", dtype="float32", runner="v2", reps=1, plain_steps=2,
                                           verify=True, count_syncs=False))


def test_a_request_the_v2_worker_fails_stops_the_bench(monkeypatch):
    """The V2 worker ends a request on a broken invariant instead of raising inside vLLM; the bench does not time
    such a run: it stops with the worker's reason."""
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    monkeypatch.setattr(RunnerV2Hooks, "_receive", lambda self, rid, start, ids: self._fail(rid, "ids out of step"))
    with pytest.raises(AssertionError, match="ids out of step"):
        run_hooks_bench(HooksBenchSettings(rows=2, shape="tiny", dtype="float32", runner="v2", reps=1, plain_steps=2,
                                           count_syncs=False))


def test_v2_streamingllm_runs_without_a_predictor():
    result = run_hooks_bench(HooksBenchSettings(rows=2, shape="tiny", dtype="bfloat16", runner="v2",
                                                method="streamingllm", reps=1, plain_steps=2, verify=True,
                                                count_syncs=False))
    assert result["predictor_dtype"] is None and result["verified"]["event_rounds"] == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_driver_eager_attention_over_the_stored_slots_matches_the_reference(dtype):
    out = run_graph_check(GraphCheckSettings(rows=6, shape="tiny", dtype=dtype, cycles=2, plain_steps=3))
    assert out["ok"] and not out["graphs"] and "graph_vs_eager" not in out  # no CUDA here: eager only
    assert out["rounds"] == {"event": 2, "plain": 6} and out["verified"]["event_rounds"] == 2
    assert out["reference_max_abs_diff"] <= 1e-4
    json.dumps(out)


def test_graph_driver_never_reads_unwritten_slots(monkeypatch):
    """Slots past a row's stored ones (and never-written blocks) may hold anything, NaN included: the stand-in
    forward, like an attention kernel, does not let them into its output."""
    from eval.perf import vllm_standin

    allocate = vllm_standin.vllm_kv_caches

    def nan_filled(*args, **kwargs):
        caches = allocate(*args, **kwargs)
        for kv in caches:
            kv.fill_(float("nan"))
        return caches

    monkeypatch.setattr(vllm_standin, "vllm_kv_caches", nan_filled)
    out = run_graph_check(GraphCheckSettings(rows=4, shape="tiny", dtype="bfloat16", cycles=1, plain_steps=2))
    assert out["ok"] and out["reference_max_abs_diff"] <= 1e-4


def test_graph_driver_catches_seq_lens_left_logical(monkeypatch):
    """Attention that reads logical ``seq_lens`` (a hook that forgot to lower them) reads past the stored slots: the
    reference comparison fails."""
    from dynts.vllm.worker_v2 import RunnerV2Hooks

    before = RunnerV2Hooks.before_attention

    def forgetful(self, batch):
        logical = batch.seq_lens.clone()
        positions = before(self, batch)
        batch.seq_lens.copy_(logical)
        self.lowered = None
        return positions

    monkeypatch.setattr(RunnerV2Hooks, "before_attention", forgetful)
    out = run_graph_check(GraphCheckSettings(rows=4, shape="tiny", cycles=1, plain_steps=2))
    assert not out["ok"] and out["reference_max_abs_diff"] > 1


def test_cli_runner_v2_prints_the_table_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_vllm_hooks

    out = tmp_path / "hooks.json"
    assert bench_vllm_hooks.main(["--runner", "v2", "--device", "cpu", "--rows", "3", "--dtype", "float32", "--shape",
                                  "tiny", "--reps", "1", "--plain-steps", "2", "--verify", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["runner"] == "v2" and result["rows"] == 3 and result["verified"]["event_rounds"] >= 2
    assert result["syncs_per_plain_step"] == 0 and result["plain"]["step"]["done_us"] > 0


def test_v2_scores_after_sample_tokens_queued_its_work(monkeypatch):
    """The predictor runs after vLLM's ``sample_tokens`` (its copy of the sampled tokens to the host queued first),
    never between the forward and the sampling, on every round; the scores land all the same."""
    from eval.perf.vllm_v2_standin import StandInV2Runner

    order = []
    sample = StandInV2Runner.sample_tokens

    def sampling(self, *args, **kwargs):
        order.append("sample")
        return sample(self, *args, **kwargs)

    monkeypatch.setattr(StandInV2Runner, "sample_tokens", sampling)  # before the plugin's binder wraps it
    bench = HooksBench(HooksBenchSettings(rows=3, shape="tiny", dtype="float32", runner="v2", reps=1, plain_steps=2,
                                          count_syncs=False))
    hooks, predictor = bench.hooks, bench.hooks.predictor

    def scoring(hidden):
        order.append("score")
        return predictor(hidden)

    hooks.predictor = scoring
    with torch.no_grad():
        bench.fill()
        bench.step(1)
    assert len(order) >= 4 and order == ["sample", "score"] * (len(order) // 2)
    row = bench.rows[0]
    assert not hooks.tracker.table.scores[hooks.tracker.slots[row.rid].row, : row.stored].isnan().any()


def test_graph_driver_reads_nothing_back_while_the_rounds_run(monkeypatch):
    """The drive is asynchronous, as vLLM's: no round reads the device on the host (the bench logs the decisions,
    the outputs are copied off), so a hook's write that lands late shows in the check after the drive. Reads counted
    by the dispatch counter over every round (the stand-in runner's own uploads are vLLM's, not counted here)."""
    from eval.perf.syncs import SyncCounter

    counter, step, rounds = SyncCounter(), HooksBench.step, []

    def counted_step(self, *args, **kwargs):
        with counter.counting():
            rounds.append(args[0] if args else kwargs["q"])
            return step(self, *args, **kwargs)

    monkeypatch.setattr(HooksBench, "step", counted_step)
    out = run_graph_check(GraphCheckSettings(rows=4, shape="tiny", dtype="float32", cycles=2, plain_steps=2))
    assert out["ok"] and not out["graphs"] and rounds.count(1) == 2 * (1 + 2)  # one eager drive on CPU
    assert counter.now - counter.uploads == 0  # reads of the device, over every round of the drive
