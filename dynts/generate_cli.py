"""``dynts generate``: bounded-cache generation from the command line (:func:`dynts.generate` behind flags).

It follows the model's ``generation_config`` for sampling unless a sampling flag is given
(``--greedy``, ``--do-sample``, ``--temperature``, ``--top-p``, ``--top-k``)."""

from __future__ import annotations

import argparse

import torch

from .cli_options import add_load_arguments, add_sampling_arguments, load_kwargs, parse_options, sampling_kwargs
from .generate import generate
from .models import load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynts generate", description=__doc__)
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--model", default="smollm2-135m", help="a bundled name, a local HF directory or a cached hub id")
    parser.add_argument("--method", default="window", help="a name from dynts.available_methods()")
    parser.add_argument("--budget", type=int, default=256, help="cache budget B (KV entries)")
    parser.add_argument("--local-window", type=int, default=32, help="W_l, recent tokens always kept")
    parser.add_argument("--retention", type=float, default=0.4, help="share of the selection window kept per eviction")
    parser.add_argument("--predictor", default=None,
                        help="directory written by ImportancePredictor.save_pretrained, or auto (dynts-predictor-<model name>)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--think-end", default="</think>", help="text closing the thinking segment")
    parser.add_argument("--method-option", action="append", default=None, metavar="KEY=VALUE",
                        help="a field of the method's dataclass, e.g. sink_size=4 (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--compile", action="store_true",
                        help="static-layout cache + torch.compile'd decode step (the first steps compile)")
    add_load_arguments(parser)
    add_sampling_arguments(parser)
    args = parser.parse_args(argv)
    try:
        sampling, options = sampling_kwargs(args), parse_options(args.method_option)
    except ValueError as err:
        parser.error(str(err))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    try:
        model, tokenizer = load(args.model, **load_kwargs(args))
        prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat else args.prompt
        result = generate(
            model, tokenizer, prompts, method=args.method, budget=args.budget, local_window=args.local_window,
            retention=args.retention, predictor=args.predictor, max_new_tokens=args.max_new_tokens,
            think_end=args.think_end, method_options=options, compile=args.compile, **sampling,
        )
    except ValueError as err:  # bad input (unknown model, dtype, method option...): say so, no traceback
        parser.error(str(err))
    for text in result.texts:
        print(text)
    print({k: v for k, v in result.stats.items() if k != "lengths"})
    return 0
