"""A soak of the dynts plugin on vLLM 0.34's V2 runner: many requests, mixed methods, shared prompts, aborts while an
eviction is in flight, preemptions under a tight pool, async scheduling on.

``TRITON_INTERPRET=1 .venv-vllm-v2/bin/python scripts/vllm_soak.py --requests 48 --json
reports/vllm-soak-v2/soak.json`` (the 0.34 CPU test bed, ``make check-vllm-v2`` builds it) runs the testbed LRM
twice, each engine in its own process (vLLM keeps process-wide state; front end, engine core and worker in that
process): stock vLLM, then the plugin (``dynts`` with its predictor at ``--budget``; per request ``dynts``,
``window``, ``streamingllm``, ``sepllm`` or ``full`` in turn). Both runs get the same requests: ``--shared``
consecutive requests share one question (prefix caching shares its blocks), one arrives every ``--every-steps``
engine steps, every ``--abort-every``-th is aborted (in the plugin run an evicting one at its second eviction event,
right after the round that carries it was scheduled, so its copy is in flight; otherwise ``--abort-after`` steps
after it arrived; one that finishes first just finishes), the pool holds ``--blocks`` blocks (tight: vLLM preempts
the requests that reserve nothing). Then every request that finished (``stop``/``length``) in the plugin run is
compared token by token with ``dynts.generate`` on it alone with the same method.

Verdict (exit 0 only if all hold): every finished request token-identical to its reference, no engine death (a step
that raised), every block free at the end, and the plugin run's resident-memory growth from warm-up (the first
quarter of the requests finished) to the end within ``--rss-slack`` MiB of stock's. A bounded request vLLM preempts
after its first event finishes with ``error`` by design (its cache cannot be rebuilt); those are counted, not
compared. ``--json`` writes both runs' readings and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm_memory_soak import rss_mib  # noqa: E402  (scripts/: the process's resident memory, MiB)

METHODS = ("dynts", "window", "streamingllm", "sepllm", "full")


def make_requests(args: argparse.Namespace) -> list[dict]:
    """The soak's requests: prompt ids, method, arrival step, whether it is aborted."""
    from data_pipeline.testbed.task import problem_set, question_tokens
    from dynts.models import load_tokenizer

    tok = load_tokenizer("testbed")
    questions = [tok.convert_tokens_to_ids(question_tokens(p.operands, p.asked))
                 for p in problem_set("vllm-soak", -(-args.requests // args.shared))]
    return [{"id": str(i), "prompt": questions[i // args.shared], "method": METHODS[i % len(METHODS)],
             "arrive": i * args.every_steps, "abort": (i + 1) % args.abort_every == 0}
            for i in range(args.requests)]


def run_engine(args: argparse.Namespace, stock: bool) -> dict:
    """One engine over the soak's requests (this process); its readings."""
    from vllm import LLM, SamplingParams

    from dynts.models import checkpoints_dir

    requests = make_requests(args)
    engine_config = {"method": "dynts", "budget": args.budget, "local_window": args.local_window,
                     "predictor": str(checkpoints_dir() / "testbed-predictor")}
    llm = LLM(model=str(checkpoints_dir() / "testbed-lrm"), dtype="float32", block_size=32, enforce_eager=True, seed=0,
              max_num_seqs=args.in_flight, max_model_len=512, num_gpu_blocks_override=args.blocks,
              **({} if stock else {"additional_config": {"dynts": engine_config}}))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    hooks = getattr(scheduler, "_dynts", None)
    counts = {"preemptions": 0, "aborted_in_event": 0}
    evicting: set[str] = set()  # requests with an eviction event in the latest plan (its copy in flight)
    events: dict[str, int] = {}  # eviction events so far, per request

    preempt = scheduler._preempt_request

    def counted_preempt(request, *a, **k):
        counts["preemptions"] += 1
        return preempt(request, *a, **k)

    scheduler._preempt_request = counted_preempt
    if hooks is not None:
        after_schedule = hooks.after_schedule

        def watched(output, plan):
            after_schedule(output, plan)
            evicting.clear()
            evicting.update(rid.rsplit("-", 1)[0] for rid, _, _ in output.dynts_plan.events)  # vLLM suffixes ids
            for rid in evicting:
                events[rid] = events.get(rid, 0) + 1

        hooks.after_schedule = watched
    pending = list(requests)
    live: dict[str, dict] = {}
    outputs: dict[str, dict] = {}
    rss: list[tuple[int, float]] = []
    step, died, t0 = 0, None, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            extra = None if stock else {"dynts": {"method": r["method"]}}
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, extra_args=extra)
            engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
            live[r["id"]] = r
        for rid, r in list(live.items()):
            if not r["abort"]:
                continue
            if stock or r["method"] == "full":  # nothing is evicted: at a fixed step
                due = step >= r["arrive"] + args.abort_after
            else:  # at its second event, while that event's copy is in flight
                due = rid in evicting and events.get(rid, 0) >= 2
            if due:
                engine.abort_request([rid])
                counts["aborted_in_event"] += rid in evicting
                outputs[rid] = {"finish_reason": "abort"}
                del live[rid]
        try:
            finished = [out for out in engine.step() if out.finished]
        except Exception as err:  # noqa: BLE001 - an engine death is what the soak counts
            died = f"{type(err).__name__}: {err}"
            break
        for out in finished:
            live.pop(out.request_id, None)
            outputs[out.request_id] = {"token_ids": list(out.outputs[0].token_ids),
                                       "finish_reason": out.outputs[0].finish_reason}
            done = len(outputs)
            if done % max(1, args.requests // 8) == 0:
                rss.append((done, rss_mib()))
        step += 1
    pool = scheduler.kv_cache_manager.block_pool
    return {"stock": stock, "outputs": outputs, "steps": step, "seconds": round(time.perf_counter() - t0, 1),
            "engine_death": died, "free_blocks_at_end": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks,
            "rss_mib": rss, "rss_end_mib": rss_mib(), **counts,
            "plugin_state_at_end": None if hooks is None else
            {k: v for k, v in hooks.engine_stats().items() if k != "block_trace"}}


def rss_growth(run: dict, requests: int) -> float | None:
    """Resident memory growth from the first sample past a quarter of the requests to the end (MiB)."""
    warm = [mib for done, mib in run["rss_mib"] if done >= requests // 4]
    return None if not warm else round(run["rss_end_mib"] - warm[0], 1)


def count(run: dict, *reasons: str) -> int:
    """Requests of a run that ended with one of ``reasons``."""
    return sum(out["finish_reason"] in reasons for out in run["outputs"].values())


def compare(args: argparse.Namespace, run: dict) -> tuple[list[str], int]:
    """Requests that finished in the plugin run and differ from dynts.generate alone; how many were compared."""
    import dynts
    from dynts.models import checkpoints_dir
    from dynts.vllm.selfcheck import reference_tokens

    model, tok = dynts.load("testbed", dtype="float32", device="cpu")
    predictor = checkpoints_dir() / "testbed-predictor"
    wrong, compared = [], 0
    for r in make_requests(args):
        out = run["outputs"].get(r["id"], {})
        if out.get("finish_reason") not in ("stop", "length"):
            continue
        method = {"method": r["method"], "budget": args.budget, "local_window": args.local_window}
        if r["method"] == "dynts":
            method["predictor"] = predictor
        want = reference_tokens(model, tok, r["prompt"], args.max_tokens, **method)
        compared += 1
        if out["token_ids"] != want:
            wrong.append(f"request {r['id']} ({r['method']})")
    return wrong, compared


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=240)
    p.add_argument("--budget", type=int, default=96)
    p.add_argument("--local-window", type=int, default=16)
    p.add_argument("--blocks", type=int, default=24,
                   help="KV blocks of 32 tokens in the pool (tight; at least 16, one request of max_model_len 512)")
    p.add_argument("--in-flight", type=int, default=12, help="max_num_seqs")
    p.add_argument("--shared", type=int, default=3, help="consecutive requests sharing one question")
    p.add_argument("--every-steps", type=int, default=6, help="engine steps between arrivals")
    p.add_argument("--abort-every", type=int, default=6)
    p.add_argument("--abort-after", type=int, default=70, help="engine steps after arrival before an abort is due")
    p.add_argument("--rss-slack", type=float, default=16.0, help="MiB the plugin's RSS growth may exceed stock's")
    p.add_argument("--json", type=Path)
    p.add_argument("--run", choices=["stock", "plugin"], help=argparse.SUPPRESS)  # one engine, this process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        args.out.write_text(json.dumps(run_engine(args, stock=args.run == "stock")))
        return 0
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("stock", "plugin"):
            out = Path(tmp) / f"{kind}.json"
            child = [a for a in (argv if argv is not None else sys.argv[1:])]
            if "--json" in child:
                at = child.index("--json")
                del child[at:at + 2]
            proc = subprocess.run([sys.executable, __file__, *child, "--run", kind, "--out", str(out)])
            if proc.returncode != 0 or not out.exists():
                print(f"vllm_soak: the {kind} engine's process exited with {proc.returncode}")
                return 1
            runs[kind] = json.loads(out.read_text())
    plugin, stock = runs["plugin"], runs["stock"]
    wrong, compared = compare(args, plugin)
    growth = {kind: rss_growth(run, args.requests) for kind, run in runs.items()}
    reasons = {kind: sorted({o["finish_reason"] for o in run["outputs"].values()}) for kind, run in runs.items()}
    summary = {
        "requests": args.requests, "compared": compared, "mismatches": wrong,
        "finished": {k: count(r, "stop", "length") for k, r in runs.items()},
        "errors": {k: count(r, "error") for k, r in runs.items()},
        "aborted": {k: count(r, "abort") for k, r in runs.items()},
        "aborted_in_event": plugin["aborted_in_event"], "finish_reasons": reasons,
        "preemptions": {k: r["preemptions"] for k, r in runs.items()},
        "engine_deaths": {k: r["engine_death"] for k, r in runs.items()},
        "blocks_free_at_end": {k: f"{r['free_blocks_at_end']} / {r['num_blocks'] - 1}" for k, r in runs.items()},
        "rss_growth_mib": growth, "seconds": {k: r["seconds"] for k, r in runs.items()},
    }
    ok = (not wrong and compared > 0 and all(r["engine_death"] is None for r in runs.values())
          and all(r["free_blocks_at_end"] == r["num_blocks"] - 1 for r in runs.values())
          and None not in growth.values() and growth["plugin"] <= growth["stock"] + args.rss_slack)
    summary["ok"] = ok
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "summary": summary,
                                         "runs": runs}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
