"""Command-line options every ``dynts`` command shares: how to load the model (``--dtype --device
--device-map --attn-implementation``) and how to sample (``--greedy`` / ``--do-sample``,
``--temperature --top-p --top-k --seed``). One definition, so every command spells them alike.

Sampling rule: with none of the sampling flags, ``model.generate`` follows the model's
``generation_config`` (an R1-distilled model samples at its shipped T=0.6, top-p 0.95);
``--greedy`` decodes greedily; any of ``--temperature/--top-p/--top-k`` overrides that field.
"""

from __future__ import annotations

import argparse
from typing import Any

from .models import DTYPES

__all__ = [
    "add_load_arguments",
    "add_sampling_arguments",
    "load_kwargs",
    "parse_option_value",
    "parse_options",
    "sampling_kwargs",
    "set_threads",
]


def add_load_arguments(parser: argparse.ArgumentParser, *, trust_remote_code: bool = True) -> argparse.ArgumentParser:
    """Add ``--dtype --device --device-map --attn-implementation --adapter --merge-adapter`` and
    (unless the command defines its own) ``--trust-remote-code``; read back with :func:`load_kwargs`."""
    group = parser.add_argument_group("model loading (dynts.load)")
    group.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                       help="weights dtype (default auto: the checkpoint's own)")
    group.add_argument("--device", default=None, help="move the model there, e.g. cuda, cuda:1, cpu (default: cpu)")
    group.add_argument("--device-map", default=None,
                       help="accelerate device map for from_pretrained, e.g. auto (shards over every GPU)")
    group.add_argument("--attn-implementation", default=None,
                       help="sdpa, eager, flash_attention_2, ... (default: transformers' choice)")
    group.add_argument("--adapter", default=None, help="a PEFT adapter directory applied on top of the model")
    group.add_argument("--merge-adapter", action="store_true", help="merge the adapter into the weights")
    if trust_remote_code:
        group.add_argument("--trust-remote-code", action="store_true", help="allow the model directory's own code")
    return parser


def load_kwargs(args: argparse.Namespace, *, given_only: bool = False) -> dict[str, Any]:
    """The ``dynts.load`` keyword arguments of a namespace parsed with :func:`add_load_arguments`;
    ``given_only``: only those that differ from the defaults (e.g. to name a run directory)."""
    options = {
        "dtype": args.dtype,
        "device": args.device,
        "device_map": args.device_map,
        "attn_implementation": args.attn_implementation,
        "adapter": args.adapter,
        "merge_adapter": args.merge_adapter,
        "trust_remote_code": getattr(args, "trust_remote_code", False),
    }
    return {k: v for k, v in options.items() if v not in (None, False, "auto")} if given_only else options


def add_sampling_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--greedy/--do-sample --temperature --top-p --top-k --seed`` (see :func:`sampling_kwargs`)."""
    group = parser.add_argument_group("sampling (default: the model's generation_config)")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="do_sample", action="store_false", default=None, help="greedy decoding")
    mode.add_argument("--do-sample", dest="do_sample", action="store_true", default=None, help="sample")
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--seed", type=int, default=None, help="torch seed for sampling")
    return parser


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the sampling fields the user gave: the rest stay the model's ``generation_config``."""
    given = {"do_sample": args.do_sample, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.do_sample is False and any(given[k] is not None for k in ("temperature", "top_p", "top_k")):
        raise ValueError("--greedy ignores --temperature/--top-p/--top-k; drop one of them")
    return {k: v for k, v in given.items() if v is not None}


def parse_option_value(text: str) -> bool | int | float | str | None:
    """``true``/``false``/``none``, an int, a float, else the string itself."""
    lowered = text.strip().lower()
    if lowered in {"true", "false"}:
        return lowered == "true"
    if lowered in {"none", "null"}:
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(items: list[str] | None, flag: str = "--method-option") -> dict[str, Any]:
    """``["sink_size=4", "selection=random"]`` -> ``{"sink_size": 4, "selection": "random"}``."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r} must be key=value, e.g. {flag} sink_size=4")
        options[key.strip()] = parse_option_value(value)
    return options


def set_threads(threads: int | None) -> None:
    """Apply a ``--threads`` flag: ``torch.set_num_threads(threads)``; ``None`` keeps torch's choice.

    Raises ValueError (``--threads=N must be >= 1``) for ``threads < 1``.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads={threads} must be >= 1")
    import torch

    torch.set_num_threads(threads)
