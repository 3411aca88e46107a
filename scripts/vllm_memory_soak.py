"""A long run of the dynts plugin in vLLM: resident memory and the plugin's per-request state stay flat.

``python scripts/vllm_memory_soak.py --requests 2000`` (the vLLM venv) runs a tiny random Llama (2 layers,
hidden 64, the testbed tokenizer) in one process -- front end, engine core and worker
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1) -- over ``--requests`` short requests, ``--in-flight`` at a
time, every one evicting (``window``, ``B = 64``) and each with its own per-request budget (more distinct
settings than the plugin keeps variants of). Every ``--every`` finished requests it prints the process's
RSS and the sizes of the plugin's state: scheduler requests/peaks/trace, worker slots/finished/table,
per-request variants. ``--json PATH`` writes the samples.

Resident memory counts what the allocator holds, not what is live: ``--trim`` returns glibc's free heap to the
system (``malloc_trim(0)``) before each reading, and ``--tracemalloc`` traces Python's allocations from the first
sample on and prints, at the end, the growth of what is still allocated by the package that allocated it
(``dynts``, ``vllm``, ``torch``, other): a leak shows up there, by file and line, whatever the allocator does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
import tracemalloc

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def trim_heap() -> None:
    """Give glibc's free heap back to the system (RSS then counts what is allocated)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def growth_by_package(first, last, top: int = 8) -> dict:
    """Bytes still allocated at ``last`` minus at ``first`` (tracemalloc snapshots), by package, and the largest
    growths by line."""
    stats = last.compare_to(first, "lineno")
    packages: dict[str, int] = {}
    for stat in stats:
        name = stat.traceback[0].filename
        package = next((p for p in ("dynts", "vllm", "torch", "transformers") if f"/{p}/" in name), "other")
        packages[package] = packages.get(package, 0) + stat.size_diff
    lines = [f"{s.traceback[0].filename}:{s.traceback[0].lineno} {s.size_diff / 1024:+.1f} KiB ({s.count_diff:+d} blocks)"
             for s in sorted(stats, key=lambda s: -s.size_diff)[:top]]
    return {"kib_by_package": {k: round(v / 1024, 1) for k, v in sorted(packages.items())}, "top_lines": lines}


def tiny_model(root: str) -> str:
    from eval.perf.random_models import random_llama

    return str(random_llama(root, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, max_position_embeddings=1024))


def worker_hooks(llm):
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
    return worker.model_runner._dynts


def state_sizes(scheduler_hooks, worker, config) -> dict:
    table = worker.tracker.table
    policy = scheduler_hooks.policy
    return {"sched_requests": len(policy.requests), "block_trace": len(policy.block_trace),
            "worker_slots": len(worker.tracker.slots), "table": f"{table.rows}x{table.width}",
            "variants": config.variants}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--json", default=None)
    p.add_argument("--stock", action="store_true", help="stock vLLM (no plugin) over the same requests, to compare")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each RSS reading")
    p.add_argument("--tracemalloc", action="store_true", help="trace Python allocations after the first sample; "
                   "print their growth by package at the end")
    args = p.parse_args(argv)

    import torch
    from vllm import LLM, SamplingParams

    model = tiny_model(tempfile.mkdtemp(prefix="dynts-soak-"))
    llm = LLM(model=model, dtype="float32", block_size=32, enforce_eager=True, async_scheduling=False, seed=0,
              max_num_seqs=args.in_flight, max_model_len=256, enable_prefix_caching=True,
              **({} if args.stock else
                 {"additional_config": {"dynts": {"method": "window", "budget": 64, "local_window": 16,
                                                  "max_budget": 48 + 96}}}))  # the requests' own budgets: send()
    engine = llm.llm_engine
    scheduler_hooks = engine.engine_core.engine_core.scheduler._dynts
    worker = None if args.stock else worker_hooks(llm)
    g = torch.Generator().manual_seed(0)
    sent = done = 0
    samples, start = [], time.perf_counter()
    snapshots: list = []

    def send() -> None:
        nonlocal sent
        prompt = torch.randint(4, 80, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
        budget = 48 + sent % 97  # a distinct per-request setting for most requests
        params = SamplingParams(temperature=0, max_tokens=args.generate, ignore_eos=True,
                                extra_args=None if args.stock else {"dynts": {"budget": budget}})
        engine.add_request(str(sent), {"prompt_token_ids": prompt}, params)
        sent += 1

    while done < args.requests:
        while sent < args.requests and sent - done < args.in_flight:
            send()
        for out in engine.step():
            if out.finished:
                done += 1
                if done % args.every == 0:
                    if args.trim:
                        trim_heap()
                    sample = {"finished": done, "rss_mib": round(rss_mib(), 1),
                              "seconds": round(time.perf_counter() - start, 1),
                              **(state_sizes(scheduler_hooks, worker, scheduler_hooks.config) if worker else {})}
                    samples.append(sample)
                    print(json.dumps(sample), flush=True)
                    if args.tracemalloc:
                        if not tracemalloc.is_tracing():
                            tracemalloc.start(1)
                            snapshots = [tracemalloc.take_snapshot()]
                        else:
                            snapshots[1:] = [tracemalloc.take_snapshot()]
    growth = None
    if args.tracemalloc and len(snapshots) == 2:
        growth = growth_by_package(*snapshots)
        print(f"Python allocations still live, growth after the first sample: {json.dumps(growth, indent=1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples, "tracemalloc": growth}, f, indent=1)
    after_warmup = [s["rss_mib"] for s in samples[1:]]
    if after_warmup:
        print(f"RSS after warm-up: {min(after_warmup):.1f} .. {max(after_warmup):.1f} MiB "
              f"(+{max(after_warmup) - after_warmup[0]:.1f} over {samples[-1]['finished'] - samples[1]['finished']} "
              "requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
