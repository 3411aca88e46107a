"""Stock continuous batching vs per-request eviction at the same KV block pool (one run, side by side).

A fixed pool of KV blocks holds ``--full-requests`` requests at full length (prompt + generation).
``--requests`` requests with long generations go through transformers' continuous batching:
- ``full``: the engine as shipped (the cache of every request grows; the scheduler preempts and
  re-prefills requests when the pool runs out),
- ``<method>@B``: each request bounded to ``B`` KV entries (dynts.serving), which reserves
  ``ceil(B / page)`` blocks per request and frees tail blocks at eviction events.
Reported per run: requests in flight (max, mean over rounds), generated tokens/s, preemptions, peak
blocks in use, and ratios against ``full``; ``--plot`` draws blocks in use over time (PNG).

Example (short CPU config, the one in docs/serving.md):
    python scripts/bench_serve.py --requests 16 --prompt 32 --generate 384 --page 16 --full-requests 4 \\
        --budgets 64 128 --plot docs/serving_blocks.png

``--engine vllm`` (run it with the vLLM venv's python) does the same inside vLLM: stock vLLM vs the dynts
plugin at one ``num_gpu_blocks_override`` pool, each engine in its own process (scripts/bench_serve_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch


def random_model(hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """A random-init Llama (speed does not depend on the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=16384, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def run(model, prompts, settings, args, num_blocks: int) -> dict:
    """One transformers continuous-batching engine (``settings``: :class:`dynts.serving.EvictionSettings`)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from dynts.serving import init_evicting_batching

    gen = GenerationConfig(max_new_tokens=args.generate, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=args.page, num_blocks=num_blocks, max_batch_tokens=args.max_batch_tokens)
    manager = init_evicting_batching(model, settings, generation_config=gen, continuous_batching_config=cb)
    manager.start()
    start = time.perf_counter()
    try:
        ids = [manager.add_request(p, max_new_tokens=args.generate) for p in prompts]
        done, tokens = 0, 0
        while done < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("engine stopped before all requests finished")
            if out.is_finished():
                done += 1
                tokens += len(out.generated_tokens)
                if out.error:
                    raise RuntimeError(out.error)
        seconds = time.perf_counter() - start
        engine = manager.engine_stats()
        stats = [manager.request_stats(r) for r in ids]
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    flight = [a for _, _, a in engine["block_trace"]]
    return {
        "name": settings.evictor.name if not settings.bounded else f"{settings.evictor.name}@{settings.budget}",
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "in_flight_max": max(flight),
        "in_flight_mean": sum(flight) / len(flight),
        "preemptions": engine["preemptions"],
        "peak_blocks": engine["peak_blocks_in_use"],
        "pool_blocks": engine["num_blocks"],
        "peak_slots_max": max(s.get("peak_slots", 0) for s in stats),
        "evictions": sum(s.get("evictions", 0) for s in stats),
        "trace": engine["block_trace"],
    }


def plot(runs: list[dict], requests: int, generate: int, num_blocks: int, path: str) -> None:
    """Blocks in use over time, one line per run (PNG)."""
    try:
        import matplotlib
    except ImportError:  # the vLLM venv has no matplotlib: draw from --json with the main venv
        print(f"no matplotlib here: draw it with `python scripts/bench_serve.py --replot JSON --plot {path}`")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")  # room for every label (eval/harness/figures.py)
    for r in runs:
        ax.plot([t for t, _, _ in r["trace"]], [b for _, b, _ in r["trace"]], label=r["name"])
    ax.axhline(num_blocks, color="gray", ls="--", lw=0.8, label="pool")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks in use")
    ax.set_title(f"{requests} requests x {generate} tokens, pool of {num_blocks} blocks")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="dynts.load name/dir; default: a random-init Llama (--hidden/--layers)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--generate", type=int, default=384)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--full-requests", type=int, default=4, help="the pool holds this many full-length requests")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--method", default="streamingllm", help="budget-only method (dynts needs --predictor)")
    p.add_argument("--predictor", default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128])
    p.add_argument("--local-window", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, help="PNG path for blocks in use over time")
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--cost", action="store_true", help="vllm: the plugin's cost table (stock, nothing evicted, "
                   "dynts + predictor, streamingllm at the first budget) with host syncs counted")
    p.add_argument("--repeats", type=int, default=3, help="vllm --cost: interleaved runs of every engine (medians)")
    p.add_argument("--replot", default=None, help="draw --plot from a --json of an earlier run, run nothing")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.load(open(args.replot))
        runs, a = saved["runs"], saved["args"]
        plot(runs, a["requests"], a["generate"], runs[0]["pool_blocks"], args.plot)
        return 0
    num_blocks = args.full_requests * math.ceil((args.prompt + args.generate) / args.page)
    print(f"engine: {args.engine}; pool: {num_blocks} blocks of {args.page} tokens (= {args.full_requests} full-length "
          f"requests); {args.requests} requests x ({args.prompt} prompt + {args.generate} generated); "
          f"load avg {os.getloadavg()}")
    if args.engine == "vllm":
        from bench_serve_vllm import run_all

        runs = run_all(args, num_blocks)
    else:
        from dynts import load
        from dynts.serving import EvictionSettings

        torch.set_num_threads(args.threads)
        model = load(args.model)[0] if args.model else random_model(args.hidden, args.layers)
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
        runs = [run(model, prompts, EvictionSettings("full"), args, num_blocks)]
        for budget in args.budgets:
            settings = EvictionSettings(args.method, budget, args.local_window, predictor=args.predictor)
            runs.append(run(model, prompts, settings, args, num_blocks))
    base = runs[0]
    if args.cost:
        print(f"{'run':<38}{'tok/s':>9}{'x stock':>9}{'x (cpu)':>9}{'hooks us/step':>15}{'hooks %':>9}{'preempt':>9}"
              f"{'evictions':>11}{'syncs/step':>12}{'syncs/event':>13}{'uploads/step':>14}{'uploads/event':>15}")
        for r in runs:  # x stock: the median over repeats of the ratio to the same repeat's stock run (wall, CPU time)
            print(f"{r['name']:<38}{r['tokens_per_s']:>9.1f}{r['x_stock']:>9.3f}{r['x_stock_cpu']:>9.3f}"
                  f"{r['hook_us_per_step']:>15.0f}{100 * r['hook_share']:>9.2f}"
                  f"{r['preemptions']:>9}{r['evictions']:>11}{r.get('syncs_per_plain_step', float('nan')):>12.2f}"
                  f"{r.get('syncs_per_event_round', float('nan')):>13.2f}"
                  f"{r.get('uploads_per_plain_step', float('nan')):>14.2f}{r.get('uploads_per_event_round', float('nan')):>15.2f}")
    header = f"{'run':<18}{'tok/s':>9}{'x':>7}{'in-flight max':>15}{'mean':>8}{'x':>7}{'preempt':>9}{'peak blk':>10}{'evictions':>11}"
    print(header)
    for r in runs:
        print(f"{r['name']:<18}{r['tokens_per_s']:>9.1f}{r['tokens_per_s'] / base['tokens_per_s']:>7.2f}"
              f"{r['in_flight_max']:>15}{r['in_flight_mean']:>8.2f}{r['in_flight_mean'] / base['in_flight_mean']:>7.2f}"
              f"{r['preemptions']:>9}{r['peak_blocks']:>10}{r['evictions']:>11}")
    print(f"load avg after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f)
    if args.plot:
        plot(runs, args.requests, args.generate, num_blocks, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
