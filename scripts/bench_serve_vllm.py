"""The vLLM half of ``scripts/bench_serve.py --engine vllm``: stock vLLM vs the dynts plugin at one pool.

Each engine runs in its own process (``python scripts/bench_serve_vllm.py SPEC.json``; vLLM keeps
process-wide state) over the same prompts with ``ignore_eos`` and greedy decoding, at a fixed
``num_gpu_blocks_override`` pool, and reports what ``bench_serve.run`` reports for transformers: requests in
flight per step, generated tokens/s, preemptions, peak blocks in use, evictions and the blocks-in-use trace.

``--cost`` (``bench_serve.py --engine vllm --cost``) runs the plugin's cost table instead: stock vLLM, the plugin
with a budget above every length (nothing evicted: the plugin's bookkeeping alone), DynTS with its predictor
and StreamingLLM at ``--budgets``'s first budget (on vLLM 0.34, at vLLM's defaults: the V2 runner, async scheduling;
there also the nothing-evicted and the StreamingLLM run with async scheduling off), ``--repeats`` times in interleaved order (the machine's load
drifts: each repeat compares the engines a few seconds apart). Timed runs count nothing; one extra run of
each plugin configuration counts the host syncs its worker hooks would make on a GPU (:class:`eval.perf.syncs.SyncCounter`,
a dispatch mode that slows every op it sees), per decode step without an event and per eviction round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

from eval.perf.syncs import V1_HOOKS, V2_HOOKS, SyncCounter  # noqa: E402  (shared with scripts/bench_vllm_hooks.py)
from eval.perf.vllm_gpu_bundle import count_preemptions  # noqa: E402  (shared with the GPU bundle's cost engines)


SCHEDULER_HOOKS = ("before_schedule", "admissible", "after_schedule", "shift", "cache_limit", "on_preempt", "forget")
WORKER_HOOKS = {"v1": V1_HOOKS, "v2": V2_HOOKS}  # per model runner


class HookClock:
    """Wall time spent inside the plugin's hooks (scheduler and worker), summed over a run: the plugin's own share
    of each step, which the machine's load moves far less than a tokens/s ratio."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self, hooks, names) -> None:
        for name in names:
            method = getattr(hooks, name)

            def timed(*a, _m=method, **k):
                t = time.perf_counter()
                try:
                    return _m(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t
            setattr(hooks, name, timed)


def cost_configs(args) -> list[dict | None]:
    """Stock, the plugin with nothing to evict, DynTS + predictor, StreamingLLM (at the first budget)."""
    from dynts.models import checkpoints_dir

    from dynts.vllm.compat import runner_of

    budget, w = args.budgets[0], args.local_window
    above = args.prompt + args.generate + 1
    configs = [None, {"method": "streamingllm", "budget": above, "local_window": w, "label": f"plugin@{above} (no eviction)"},
               {"method": "dynts", "budget": budget, "local_window": w, "predictor": args.predictor or str(checkpoints_dir() / "testbed-predictor")},
               {"method": "streamingllm", "budget": budget, "local_window": w}]
    if runner_of() == "v2":  # vLLM's default there is async scheduling: the plugin with it off beside it
        configs += [{**configs[1], "async_scheduling": False, "label": f"plugin@{above} (no eviction), async off"},
                    {**configs[3], "async_scheduling": False, "label": f"streamingllm@{budget}, async off"}]
    return configs


def run_all(args, num_blocks: int) -> list[dict]:
    """Stock vLLM, then ``args.method`` at every budget in ``args.budgets`` (or the ``--cost`` runs), at one pool of
    ``num_blocks``."""
    if args.page % 32:
        raise ValueError(f"--page {args.page}: vLLM's CPU attention needs a block size that is a multiple of 32")
    model = args.model or "testbed"
    configs = [None] + [{"method": args.method, "budget": b, "local_window": args.local_window,
                         **({"predictor": args.predictor} if args.predictor else {})} for b in args.budgets]
    if getattr(args, "cost", False):
        configs = cost_configs(args)
    spec = {"model": model, "requests": args.requests, "prompt": args.prompt, "generate": args.generate,
            "block_size": args.page, "num_blocks": num_blocks, "max_batch_tokens": args.max_batch_tokens}
    if not getattr(args, "cost", False):
        return [engine_run({**spec, "dynts": dynts}) for dynts in configs]
    repeats = max(1, getattr(args, "repeats", 1))
    timed = [[engine_run({**spec, "dynts": dynts}) for dynts in configs] for _ in range(repeats)]  # interleaved
    runs = []
    for i, dynts in enumerate(configs):
        series = [rep[i] for rep in timed]
        speeds = [r["tokens_per_s"] for r in series]
        median = statistics.median(speeds)
        run = dict(min(series, key=lambda r: abs(r["tokens_per_s"] - median)))  # the repeat nearest the median
        run["tokens_per_s_runs"], run["tokens_per_s"] = speeds, median
        # paired: this engine against the stock run of the same repeat, a few seconds apart
        run["x_stock_runs"] = [r["tokens_per_s"] / rep[0]["tokens_per_s"] for r, rep in zip(series, timed)]
        run["x_stock"] = statistics.median(run["x_stock_runs"])
        run["x_stock_cpu"] = statistics.median(rep[0]["cpu_seconds"] / r["cpu_seconds"] for r, rep in zip(series, timed))
        run["hook_share"] = statistics.median(r["hook_share"] for r in series)
        run["hook_us_per_step"] = statistics.median(1e6 * r["hook_seconds"] / r["steps"] for r in series)
        if dynts is not None and dynts.get("async_scheduling", True):  # an untimed run with the sync counter
            counted = engine_run({**spec, "dynts": dynts, "count_syncs": True})
            run.update({k: counted[k] for k in SYNC_FIELDS})
        runs.append(run)
    return runs


SYNC_FIELDS = ("syncs_per_plain_step", "syncs_per_event_round", "uploads_per_plain_step", "uploads_per_event_round",
               "event_rounds", "plain_steps")


def engine_run(spec: dict) -> dict:
    """One engine over the prompts, in its own process (vLLM keeps process-wide state)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f.name], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the engine run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def one_engine(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process: its counters are readable
    import torch
    from vllm import LLM, SamplingParams

    from dynts.models import resolve_path
    from dynts.vllm.metrics import request_stats

    from dynts.vllm.compat import runner_of

    runner = runner_of()
    dynts = dict(spec["dynts"]) if spec["dynts"] else None
    label = dynts.pop("label", None) if dynts else None
    # 0.32 (V1): eager and synchronous, what the plugin drives there; 0.34 (V2): vLLM's defaults (async scheduling)
    defaults = {"enforce_eager": True, "async_scheduling": False} if runner == "v1" else {}
    if dynts and "async_scheduling" in dynts:
        defaults["async_scheduling"] = dynts.pop("async_scheduling")
    if dynts and "predictor" in dynts and not os.path.isdir(dynts["predictor"]):
        dynts["predictor"] = str(resolve_path(dynts["predictor"]))
    extra = {"additional_config": {"dynts": dynts}} if dynts else {}
    llm = LLM(model=str(resolve_path(spec["model"])), dtype="float32", block_size=spec["block_size"],
              num_gpu_blocks_override=spec["num_blocks"], max_model_len=spec["prompt"] + spec["generate"],
              max_num_batched_tokens=max(spec["max_batch_tokens"], spec["prompt"] + spec["generate"]),
              max_num_seqs=spec["requests"], seed=0, **defaults, **extra)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = count_preemptions(scheduler)
    syncs, clock = None, HookClock()
    if dynts:
        executor = engine.engine_core.engine_core.model_executor
        worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
        if spec.get("count_syncs"):
            syncs = SyncCounter()
            syncs.install(worker.model_runner._dynts, WORKER_HOOKS[runner])
        else:
            clock.install(scheduler._dynts, SCHEDULER_HOOKS)
            clock.install(worker.model_runner._dynts, WORKER_HOOKS[runner])
    vocab = llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=spec["generate"], ignore_eos=True)
    for i in range(spec["requests"]):
        prompt = torch.randint(4, vocab, (spec["prompt"],), generator=g).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    pool = scheduler.kv_cache_manager.block_pool
    trace, tokens, evictions, start, cpu = [], 0, 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                evictions += sum(s["evictions"] for s in request_stats(out.kv_transfer_params) or ())
        trace.append((time.perf_counter() - start, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                      len(scheduler.running)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    flight = [a for _, _, a in trace]
    d = dynts
    return {
        "name": "vllm" if d is None else label or f"{d['method']}@{d['budget']}",
        **(syncs.summary() if syncs else {}),
        "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
        "steps": len(trace), "hook_seconds": clock.seconds, "hook_share": clock.seconds / seconds,
        "in_flight_max": max(flight), "in_flight_mean": sum(flight) / len(flight),
        "preemptions": preemptions[0], "peak_blocks": max(b for _, b, _ in trace), "pool_blocks": spec["num_blocks"],
        "evictions": evictions, "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "trace": trace,
    }


if __name__ == "__main__":
    print("BENCH " + json.dumps(one_engine(json.load(open(sys.argv[1])))), flush=True)
