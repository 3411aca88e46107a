"""``dynts demo-smollm2``: eviction methods side by side on SmolLM2-135M (the mechanics; an untrained predictor).

It follows the model's ``generation_config`` for sampling unless a sampling flag is given
(``--greedy``, ``--do-sample``, ``--temperature``, ``--top-p``, ``--top-k``)."""

from __future__ import annotations

import argparse

import torch

from .cli_options import add_load_arguments, add_sampling_arguments, load_kwargs, sampling_kwargs
from .generate import generate
from .models import load
from .predictor import ImportancePredictor

DEMO_PROMPTS = [
    "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left? Think step by step.",
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "List three prime numbers larger than 20 and say how you checked each one.",
]


def _table(rows: list[dict]) -> str:
    head = ["method", "peak cache tokens", "KV MiB (peak)", "evictions", "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['peak_cache_tokens']} | {r['peak_kv_bytes'] / 2**20:.2f} | "
            f"{r['evictions']} | {r['tokens_per_second']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynts demo-smollm2", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--local-window", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="full,window,streamingllm,dynts")
    add_load_arguments(parser)
    add_sampling_arguments(parser)
    args = parser.parse_args(argv)
    sampling = sampling_kwargs(args)
    torch.manual_seed(0 if args.seed is None else args.seed)
    model, tokenizer = load(args.model, **load_kwargs(args))
    chats = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    device = next(model.parameters()).device
    # untrained: shows the mechanics only
    predictor = ImportancePredictor(model.config.get_text_config().hidden_size).to(device)
    generate(model, tokenizer, chats, method="full", max_new_tokens=2, **sampling)  # warm-up: one-off costs
    rows = []
    for method in args.methods.split(","):
        result = generate(
            model, tokenizer, chats, method=method, budget=args.budget, local_window=args.local_window,
            predictor=predictor, max_new_tokens=args.max_new_tokens, **sampling,
        )
        label = method + (" (untrained predictor)" if method == "dynts" else "")
        rows.append({**result.stats, "method": label})
        print(f"\n== {label}: {result.texts[0][:160]!r}")
    print()
    print(f"model={args.model} batch={len(chats)} budget={args.budget} local_window={args.local_window}")
    print(_table(rows))
    return 0
