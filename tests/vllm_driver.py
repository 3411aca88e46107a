"""Run one vLLM engine (CPU build) over a list of requests and print the outcome as JSON.

``python tests/vllm_driver.py SPEC.json`` -- SPEC: ``{"model", "engine": {LLM kwargs}, "requests":
[{"prompt_token_ids", "max_tokens", "extra_args", "arrive_at_step"}]}``. Requests arrive at their step
(``arrive_at_step``: 0 = before the first step), so later ones join while others decode.
``"admit_all": true`` switches the plugin's admission control off (vLLM then preempts under a tight pool);
``"force_unsupported": true`` makes the plugin treat the installed vLLM as outside its supported range;
``"check_buffers": true`` reports, per V2 step with a shifted request, whether ``seq_lens`` was lowered in the
runner's persistent buffer and the slot mappings landed in vLLM's persistent buffer (what a FULL CUDA graph
reads at replay), and whether any K/V copy ran inside the model's forward (``"buffers"``).
``"stale_shift": true`` makes the V2 worker use each request's shift one round late (the async bug the protocol
must not have: the test that catches it). ``"lose_shipment": [rid, k]`` makes the V2 worker lose request ``rid``'s
``k``-th shipment of token ids (a fault confined to one request); ``"forget_request": [rid, k]`` makes the worker
lose its record of request ``rid`` before its ``k``-th event; ``"unscore_request": [rid, k]`` clears the score of one
of its thinking tokens before its ``k``-th event (a stale score); ``"log_warnings"`` lists the plugin's warnings; ``"slot_table"`` reports the worker's slot table (shape, reserved
in the profiling run, reallocated since start-up). Async scheduling is vLLM's default unless ``"engine"`` sets
``async_scheduling`` (on vLLM 0.34's CPU test bed, tests/support/vllm_cpu_testbed keeps vLLM's default, on).
Prints ``{"outputs": {rid: {"token_ids", "finish_reason"} or {"error"}}, "max_stored": {rid: n},
"prefix_hits": {rid: tokens}, "stats": ..., "request_stats": ..., "wrapped": [...]}`` (``wrapped``: the
per-step methods of this engine's scheduler and runner that are dynts wrappers), or
``{"engine_error": message}`` when the engine refuses to start.
(``request_stats``: what each finished ``RequestOutput`` carries, :func:`dynts.vllm.metrics.request_stats`).
Used by tests/test_vllm_plugin.py (an engine per process: vLLM keeps process-wide state).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process: its statistics are readable


def main(spec_path: str) -> None:  # noqa: C901
    from vllm import LLM

    from dynts.vllm.metrics import request_stats
    from dynts.vllm.selfcheck import drive, model_runner

    spec = json.load(open(spec_path))
    if spec.get("stale_shift"):
        from vllm_faults import make_shift_stale

        make_shift_stale()
    if spec.get("lose_shipment"):
        from vllm_faults import make_lost_shipment

        make_lost_shipment(*spec["lose_shipment"])
    if spec.get("forget_request"):
        from vllm_faults import make_forgotten_request

        make_forgotten_request(*spec["forget_request"])
    if spec.get("unscore_request"):
        from vllm_faults import make_unscored_request

        make_unscored_request(*spec["unscore_request"])
    if spec.get("force_unsupported"):  # before vLLM loads its plugins (at the engine's construction)
        import dynts.vllm.compat

        dynts.vllm.compat.SUPPORTED_RELEASES = (("0.0.1", "0.0.2", "v1"),)
    # async scheduling: vLLM's choice unless the spec sets it (0.32's CPU platform turns it off; the 0.34 test bed
    # keeps vLLM's default, on, as on a GPU)
    engine = dict(dtype="float32", block_size=32, enforce_eager=True, seed=0, max_num_seqs=16, max_model_len=1024)
    engine.update(spec.get("engine", {}))
    try:
        llm = LLM(model=spec["model"], **engine)
    except (ValueError, ImportError, NotImplementedError) as err:
        print("DYNTS_RESULT " + json.dumps({"engine_error": f"{type(err).__name__}: {err}"}))
        return
    log_lines = watch_log()  # after the engine's start, which re-applies vLLM's logging config
    core = llm.llm_engine.engine_core.engine_core
    buffers = watch_buffers(model_runner(llm)) if spec.get("check_buffers") else None
    scheduler = core.scheduler
    hooks = getattr(scheduler, "_dynts", None)
    if spec.get("admit_all"):  # switch admission control off: let vLLM preempt
        hooks.admissible = lambda waiting: len(waiting)
    hits: dict[str, int] = {}  # prefix-cache hit tokens per request (its first lookup)
    if hooks is not None:
        lookup = scheduler.kv_cache_manager.get_computed_blocks

        def counted(request, *a, **k):
            out = lookup(request, *a, **k)
            hits.setdefault(request.request_id, out[1])
            return out

        scheduler.kv_cache_manager.get_computed_blocks = counted
    max_stored: dict[str, int] = {}
    shared_blocks = [0]

    def after_step() -> None:
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        for request in scheduler.running:
            shift = hooks.shift(request) if hooks is not None else 0
            stored = request.num_computed_tokens - shift
            max_stored[request.request_id] = max(max_stored.get(request.request_id, 0), stored)
            for block in manager.req_to_blocks[request.request_id]:
                shared_blocks[0] = max(shared_blocks[0], block.ref_cnt)
        steps[0] += 1

    steps = [0]
    table_before = slot_table_state(model_runner(llm))
    outputs = drive(llm, spec["requests"], after_step)
    per_request = {}
    for rid, out in outputs.items():
        stats = request_stats(out.pop("kv_transfer_params", None))
        if stats is not None:
            per_request[rid] = stats[0]
    pool = scheduler.kv_cache_manager.block_pool

    def external(rid: str) -> str:  # vLLM may suffix the id it was given
        return rid if rid in outputs else rid.rsplit("-", 1)[0]

    result = {
        "outputs": outputs,
        "max_stored": {external(k): v for k, v in max_stored.items()},
        "max_block_refcount": shared_blocks[0],
        "prefix_hits": {external(k): v for k, v in hits.items()},
        "free_blocks_at_end": pool.get_num_free_blocks(),
        "num_blocks": pool.num_gpu_blocks,
        "steps": steps[0],
        "stats": hooks.engine_stats() if hooks is not None else None,
        "request_stats": per_request,
        "wrapped": wrapped_methods(llm, scheduler, core),
        "engine_classes": engine_classes(llm, scheduler, core),
        "buffers": buffers,
        "log_warnings": log_lines,
        "slot_table": slot_table_report(model_runner(llm), table_before),
    }
    print("DYNTS_RESULT " + json.dumps(result))


def slot_table_state(runner) -> dict | None:
    """Where each column of the worker's slot table lives (``None`` without dynts hooks)."""
    hooks = getattr(runner, "_dynts", None)
    if hooks is None:
        return None
    return {name: (column.data_ptr(), tuple(column.shape)) for name, column in hooks.tracker.table.columns()}


def slot_table_report(runner, before: dict | None) -> dict | None:
    """The slot table after the run: its shape, whether it is the one reserved in vLLM's profiling run, and whether
    any column was reallocated since start-up."""
    if before is None:
        return None
    table = runner._dynts.tracker.table
    state = getattr(runner, "_dynts_state", None)
    return {"rows": table.rows, "width": table.width, "fixed": table.fixed,
            "from_profile": state is not None and state.table is table,
            "reallocated": slot_table_state(runner) != before}


def watch_log() -> list[str]:
    """The plugin's warnings (logger ``vllm.dynts``), collected as they are logged (attach after the engine
    started: vLLM's logging config, applied at its start, clears the handlers of ``vllm.*`` loggers)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("vllm.dynts").addHandler(Collect(level=logging.WARNING))
    return lines


def watch_buffers(runner) -> dict:
    """Count, on the V2 runner of a dynts engine, the steps whose shifted ``seq_lens`` and slot mappings are the
    persistent buffers a captured graph reads, and K/V copies made while the model's forward runs."""
    counts = {"shifted_steps": 0, "seq_lens_in_place": 0, "slot_mappings_in_place": 0, "copies_in_forward": 0,
              "copies": 0}
    state = {"in_forward": False}
    seq_lens_storage = runner.input_buffers.seq_lens.untyped_storage().data_ptr()
    slots_storage = runner.block_tables.slot_mappings.untyped_storage().data_ptr()
    prepare_attn = runner.prepare_attn  # the plugin's bound wrapper

    def watched_prepare_attn(input_batch):
        block_tables, slot_mappings = prepare_attn(input_batch)
        if runner._dynts.lowered is not None:
            counts["shifted_steps"] += 1
            counts["seq_lens_in_place"] += input_batch.seq_lens.untyped_storage().data_ptr() == seq_lens_storage
            counts["slot_mappings_in_place"] += slot_mappings.untyped_storage().data_ptr() == slots_storage
        return block_tables, slot_mappings

    model = runner.model
    forward = model.forward

    def watched_forward(*args, **kwargs):
        state["in_forward"] = True
        try:
            return forward(*args, **kwargs)
        finally:
            state["in_forward"] = False

    paged = runner._dynts.kv  # the eviction round's slot move (dynts.kernels.PagedKV)
    move = paged.move_

    def watched_move(kept, blocks):
        counts["copies"] += 1
        counts["copies_in_forward"] += state["in_forward"]
        return move(kept, blocks)

    runner.prepare_attn = watched_prepare_attn
    model.forward = watched_forward
    paged.move_ = watched_move
    return counts


def engine_classes(llm, scheduler, core) -> dict:
    """What this engine runs: the scheduler class, the model runner's class chain, async scheduling."""
    from dynts.vllm.selfcheck import model_runner

    runner = model_runner(llm)
    return {"scheduler": type(scheduler).__name__,
            "runner_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__] if runner else [],
            "async_scheduling": bool(core.vllm_config.scheduler_config.async_scheduling),
            "batch_queue": getattr(core, "batch_queue", None) is not None}


def wrapped_methods(llm, scheduler, core) -> list[str]:
    """The per-step methods of this engine's scheduler, model runner and output processor that are dynts
    wrappers (an engine without dynts has none)."""
    from dynts.vllm.selfcheck import model_runner
    from dynts.vllm.wrapping import is_wrapped

    objects = {"Scheduler": (scheduler, ["schedule", "_preempt_request", "_free_request", "update_from_output"]),
               "ModelRunner": (model_runner(llm),
                               ["execute_model", "_prepare_inputs", "_model_forward", "prepare_attn", "sample_tokens"]),
               "OutputProcessor": (llm.llm_engine.output_processor, ["process_outputs"])}
    return [f"{label}.{name}" for label, (obj, names) in objects.items() if obj is not None for name in names
            if is_wrapped(getattr(obj, name, None))]


if __name__ == "__main__":
    main(sys.argv[1])
