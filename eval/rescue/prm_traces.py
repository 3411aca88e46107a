"""Policy traces for the step PRM: ``python -m eval.rescue.prm_traces --config CONFIG``.

Each :class:`~trainers.testbed_prm_traces.TracePolicy` of a PRM config's ``traces:`` block (a model, an eviction
method with its tuned settings, a budget) generates ``k`` traces per problem with
:func:`trainers.testbed_report.run_policy` (``dynts.generate``); every step is labelled by the testbed's oracle
(:func:`trainers.testbed_prm_traces.process_labels`) and each shard is written atomically and skipped when present,
so a run resumes after a kill and stops itself after ``--max-minutes``. The PRM trainer reads the shards
(``PRMConfig.trace_prob``); ``--namespace dev`` writes the held-out traces :mod:`eval.rescue.step_auroc` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

import dynts
from dynts.io import write_atomic
from eval.harness.methods import parse_method
from trainers.testbed import load_config
from trainers.testbed_prm_traces import IGNORE, TraceConfig, shard_path, trace_row
from trainers.testbed_report import run_policy

__all__ = ["generate_traces", "main"]


def generate_traces(cfg: TraceConfig, max_seconds: float | None = None, threads: int = 1, log=print) -> dict[str, Any]:
    """Generate the missing shards of ``cfg`` (each written atomically), policy by policy; after the first
    shard, start none once ``max_seconds`` have passed. Returns counts of what is done and left."""
    torch.set_num_threads(threads)
    start = time.monotonic()
    models: dict[str, Any] = {}
    done = left = made = 0
    for policy, shards in cfg.policies():
        for shard in range(shards):
            path = shard_path(cfg, policy, shard)
            if path.exists():
                done += 1
                continue
            if made and max_seconds is not None and time.monotonic() - start > max_seconds:
                left += 1
                continue
            if policy.model not in models:
                models[policy.model] = dynts.load(cfg.base if policy.model == "base" else cfg.helper)
            model, tokenizer = models[policy.model]
            spec = parse_method(policy.method)
            kw: dict[str, Any] = {}
            if policy.budget is not None:
                kw = {"budget": policy.budget, "local_window": spec.local_window_at(policy.budget) or cfg.local_window,
                      "eviction": {"retention": spec.retention or cfg.retention,
                                   **({"predictor": cfg.predictor} if spec.name == "dynts" else {})}}
            problems = cfg.problems(policy, shard)
            seed = cfg.seed + 1000 * shard + sum(map(ord, policy.name))
            tick = time.monotonic()
            texts, result = run_policy(model, tokenizer, problems, spec.name, dict(spec.options) or None, seed=seed,
                                       batch_size=cfg.batch_size, max_new_tokens=cfg.max_think + 200, k=cfg.k, **kw)
            rows = [trace_row(p, t, policy) for p, t in zip([p for p in problems for _ in range(cfg.k)], texts)]
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
            made += 1
            steps = [lab for r in rows for lab in r["labels"] if lab != IGNORE]
            log(f"{path}: {len(rows)} traces, accuracy {result['accuracy']:.3f}, {len(steps)} labelled steps "
                f"({steps.count(0)} wrong), {time.monotonic() - tick:.0f} s")
    return {"shards_done": done + made, "shards_made": made, "shards_left": left, "seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rescue.prm_traces",
                                description="a PRM config's policy traces with process labels (resumable shards)")
    p.add_argument("--config", required=True, help="a PRM config with a traces: block, e.g. configs/testbed/chain-fair-step-prm.yaml")
    p.add_argument("--max-minutes", type=float, default=None, help="start no shard after this many minutes (resume later)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--namespace", default=None, help="held-out traces: dev (or test); default: the config's train namespace")
    p.add_argument("--out-dir", default=None, help="default: the config's traces.out_dir")
    p.add_argument("--shards", type=int, default=None, help="shards per policy (every policy; default: the config's)")
    p.add_argument("--shard-problems", type=int, default=None, help="problems per shard (default: the config's)")
    p.add_argument("--k", type=int, default=None, help="traces per problem (default: the config's)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    block = load_config(args.config).get("traces")
    if not block:
        p.error(f"--config {args.config} has no traces: block (see configs/testbed/chain-fair-step-prm.yaml)")
    overrides = {"namespace": args.namespace, "out_dir": args.out_dir, "shard_problems": args.shard_problems, "k": args.k}
    if args.shards is not None:
        overrides.update(shards=args.shards, full_shards=args.shards, helper_shards=args.shards)
    cfg = TraceConfig(**{**block, **{k: v for k, v in overrides.items() if v is not None}})
    max_seconds = None if args.max_minutes is None else 60 * args.max_minutes
    print(json.dumps(generate_traces(cfg, max_seconds=max_seconds, threads=args.threads)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
