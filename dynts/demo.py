"""``dynts demo`` and ``dynts generate``: bounded-cache generation from the command line."""

from __future__ import annotations

import argparse

import torch

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
    parser = argparse.ArgumentParser(prog="dynts demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--local-window", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="full,window,streamingllm,dynts")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load(args.model)
    chats = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    predictor = ImportancePredictor(model.config.hidden_size)  # untrained: shows the mechanics only
    generate(model, tokenizer, chats, method="full", max_new_tokens=2)  # warm-up: first calls pay one-off costs
    rows = []
    for method in args.methods.split(","):
        result = generate(
            model, tokenizer, chats, method=method, budget=args.budget, local_window=args.local_window,
            predictor=predictor, max_new_tokens=args.max_new_tokens,
        )
        label = method + (" (untrained predictor)" if method == "dynts" else "")
        rows.append({**result.stats, "method": label})
        print(f"\n== {label}: {result.texts[0][:160]!r}")
    print()
    print(f"model={args.model} batch={len(chats)} budget={args.budget} local_window={args.local_window}")
    print(_table(rows))
    return 0


def generate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynts generate")
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="window")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--local-window", type=int, default=32)
    parser.add_argument("--retention", type=float, default=0.4)
    parser.add_argument("--predictor", default=None, help="directory written by ImportancePredictor.save_pretrained")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--compile", action="store_true",
                        help="static-layout cache + torch.compile'd decode step (the first steps compile)")
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model)
    prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat else args.prompt
    result = generate(
        model, tokenizer, prompts, method=args.method, budget=args.budget, local_window=args.local_window,
        retention=args.retention, predictor=args.predictor, max_new_tokens=args.max_new_tokens, compile=args.compile,
    )
    for text in result.texts:
        print(text)
    print({k: v for k, v in result.stats.items() if k != "lengths"})
    return 0
