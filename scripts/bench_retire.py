"""A batch of reasoning traces with and without its finished rows leaving the forwards (``retire_finished``).

Side by side in one run, on a testbed LRM as ``dynts eval`` runs it (one batch of ``--rows`` rows: the first
``--rows / k`` dev problems, ``k`` samples each, T 0.6, top-p 0.95, top-k 20, sorted by prompt length), each method
generates twice from the same seed: every row to the batch's end, then with the rows that emitted EOS leaving
(:mod:`dynts.cache.retire`). Prints per method both times, their ratio, the rows that left, how much of the batch's
decode the finished rows took (1 - the generated tokens over rows x the longest trace), and whether the sequences
and the cache statistics are the same.

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_retire.py            # chain LRM, B = 121
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_retire.py --family copy --model checkpoints/testbed-fair-scratch-s1-lrm \\
        --predictor checkpoints/testbed-fair-scratch-s1-predictor --budget 86
"""

from __future__ import annotations

import argparse
import time

import torch

import dynts
from dynts.predictor import load_predictor
from dynts.prompts import pad_id, pad_rows
from eval.harness.benchmarks import load_benchmark
from eval.harness.prompts import encode_prompts, user_message
from eval.harness.cell_run import load_model

STATS = ("lengths", "evictions", "evicted_tokens", "peak_cache_tokens", "peak_kv_bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/testbed-chain-fair-s1-lrm")
    parser.add_argument("--predictor", default="checkpoints/testbed-chain-fair-s1-predictor")
    parser.add_argument("--family", default="chain", choices=["chain", "copy"])
    parser.add_argument("--methods", default="full,dynts,h2o,snapkv:per_head=true,rkv")
    parser.add_argument("--budget", type=int, default=121)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=1100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    predictor = load_predictor(args.predictor, model)
    bench = load_benchmark(f"testbed:n={-(-args.rows // args.k)},family={args.family},set=dev")
    prompts = encode_prompts(tokenizer, [user_message(e, bench) for e in bench.examples])
    rows = sorted([p for p in prompts for _ in range(args.k)][: args.rows], key=len)
    ids, mask = pad_rows(rows, pad_id(tokenizer))
    print(f"{args.model}: {len(rows)} rows, B = {args.budget}, {args.threads} thread(s)")
    print(f"{'method':26s} {'every row s':>11s} {'retiring s':>10s} {'x':>5s} {'left':>5s} {'finished share':>14s}  same")
    for spec in args.methods.split(","):
        name, _, opts = spec.partition(":")
        options = {k: v == "true" if v in ("true", "false") else v for k, v in (o.split("=") for o in opts.split(";") if o)}
        runs = []
        for retire in (False, True):
            torch.manual_seed(7)
            start = time.perf_counter()
            result = dynts.generate(
                model, tokenizer, input_ids=ids, attention_mask=mask, method=name, method_options=options,
                budget=None if name == "full" else args.budget, local_window=32, retention=0.4,
                predictor=predictor if name == "dynts" else None, max_new_tokens=args.max_new_tokens,
                do_sample=True, temperature=0.6, top_p=0.95, top_k=20, retire_finished=retire,
            )
            runs.append((result, time.perf_counter() - start))
        (whole, t_whole), (retired, t_retired) = runs
        lengths = whole.stats["lengths"]
        finished_share = 1 - sum(lengths) / (len(lengths) * max(lengths))
        same = torch.equal(whole.sequences, retired.sequences) and all(whole.stats[k] == retired.stats[k] for k in STATS)
        print(f"{spec:26s} {t_whole:11.1f} {t_retired:10.1f} {t_whole / t_retired:5.2f} {retired.stats['retired_rows']:5d} "
              f"{finished_share:14.2f}  {same}", flush=True)


if __name__ == "__main__":
    main()
