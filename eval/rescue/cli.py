"""``dynts rescue {bench,generate,calibrate}``: the command line of :mod:`eval.rescue.bench` and
:mod:`eval.rescue.calibrate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dynts.core.budget import Budget
from dynts.cli_options import add_load_arguments, load_kwargs
from dynts.io import write_atomic
from dynts.rescue import RescueConfig
from eval.harness.ledger import add_final_arguments
from eval.rescue.bench import cell_names, evaluate, helper_options, load_model
from eval.rescue.calibrate import calibrate
from eval.rescue.config import SETTINGS, RescueEvalConfig, check_settings
from eval.rescue.table import summary_table
from eval.rescue.verifiers import DEFAULT_VERIFIER, FAMILY_VERIFIERS, default_verifier, load_eval_prm

__all__ = ["main"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="testbed", help="base model: a dynts.load name or a local HF directory")
    p.add_argument("--helper", default="testbed-helper", help="full-context helper (same tokenizer as the base)")
    p.add_argument("--prm", default=None,
                   help=f"verifier (default: the PRM of the helper's family alone, as in the KV-Rescue paper: {DEFAULT_VERIFIER} "
                        f"for testbed-helper, {FAMILY_VERIFIERS['testbed-chain-helper']} for testbed-chain-helper, "
                        f"{FAMILY_VERIFIERS['checkpoints/testbed-chain-fair-helper']} for checkpoints/testbed-chain-fair-helper); "
                        "testbed-prm-order (the testbed PRM that sees repeated steps), testbed-prm, a local directory (Qwen2.5-Math-PRM recipe), likelihood:<causal LM> "
                        "(e.g. likelihood:testbed: a full-context LM's token likelihoods), testbed-verifier (exact step checker; testbed-verifier:chain for the chain family), "
                        "or A*B: the product of such verifiers (the option beside the default: the PRM times the helper's likelihood, "
                        "e.g. testbed-prm-order*likelihood:testbed-helper)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the PRM directory's own model code")
    p.add_argument("--predictor", default=None, help="importance predictor directory or auto (needed by --method dynts)")
    p.add_argument("--budget", type=int, default=64,
                   help="the base's KV budget B: the physical bound, or with --paper-budget the score-selected entries")
    p.add_argument("--paper-budget", action="store_true",
                   help="B as in the KV-Rescue paper (Appendix C): B score-selected entries + --headroom, B + headroom held")
    p.add_argument("--headroom", type=int, default=128, help="with --paper-budget: the buffer w on top of B (paper: 128)")
    p.add_argument("--local-window", type=int, default=16)
    p.add_argument("--retention", type=float, default=0.4)
    p.add_argument("--n", type=int, default=4,
                   help="candidates per step from each model (paper: N=8); helper-search: 2N from the helper")
    p.add_argument("--delimiter", default="\n\n", help="step delimiter (paper: a blank line; the testbed: ';')")
    p.add_argument("--max-tokens", type=int, default=None, help="output token cap (default: the benchmark's)")
    p.add_argument("--max-steps", type=int, default=1024)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--entropy-threshold", type=float, default=7.0, help="detector tau_ent in nats (<= 0: off)")
    p.add_argument("--compress-threshold", type=float, default=0.18, help="detector tau_cmp (<= 0: off)")
    p.add_argument("--compress-window", type=int, default=800, help="detector gzip window in characters")
    p.add_argument("--guard", type=int, default=24)
    p.add_argument("--entropy-window", type=int, default=12)
    p.add_argument("--include-context", action="store_true", help="let the gzip window reach into committed text")
    p.add_argument("--loop-ngram", type=int, default=0,
                   help="cross-step loop screen: abort a base candidate sharing this many consecutive tokens with a committed step (0: off)")
    p.add_argument("--loop-pattern", default="0",
                   help="cross-step loop screen, vLLM repetition_detection over steps: MIN,MAX,COUNT "
                        "(min_pattern_size, max_pattern_size, min_count; e.g. 1,4,2) or 0 (off)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for tiny models on shared cores)")
    add_load_arguments(p, trust_remote_code=False)


def _loop(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``StepLoopDetector`` fields of ``--loop-ngram`` / ``--loop-pattern`` (``None``: both off)."""
    ngram = args.loop_ngram if args.loop_ngram > 0 else None
    if args.loop_pattern.strip() in ("", "0"):
        pattern = (1, 0, 2)
    else:
        try:
            pattern = tuple(int(v) for v in args.loop_pattern.split(","))
        except ValueError:
            pattern = ()
        if len(pattern) != 3:
            raise SystemExit(f"--loop-pattern {args.loop_pattern!r}: give MIN,MAX,COUNT (e.g. 1,4,2) or 0")
    if ngram is None and not pattern[1]:
        return None
    return {"repeat_ngram": ngram, "min_pattern_size": pattern[0], "max_pattern_size": pattern[1], "min_count": pattern[2]}


def _detector(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "entropy_threshold": args.entropy_threshold if args.entropy_threshold > 0 else None,
        "compress_threshold": args.compress_threshold if args.compress_threshold > 0 else None,
        "compress_window": args.compress_window, "guard": args.guard, "entropy_window": args.entropy_window,
        "include_context": args.include_context,
    }
    loop = _loop(args)
    if loop is not None:  # only when on: cells of runs without the loop screen stay reusable
        options["loop"] = loop
    return options


def _search(args: argparse.Namespace, n_base: int, n_helper: int, detector: dict[str, Any] | None,
            max_tokens: int = 4096, max_rows: int = 64) -> RescueConfig:
    """The step search the flags name (``--delimiter`` is ``step_delimiter``); the core checks it."""
    return RescueConfig(n_base=n_base, n_helper=n_helper, step_delimiter=args.delimiter, max_steps=args.max_steps,
                        max_step_tokens=args.max_step_tokens, max_tokens=max_tokens, detector=detector,
                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_rows=max_rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynts rescue", description="KV-Rescue: an evicted base + a full-context helper, PRM-selected steps")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="full / helper / evicted / best-of-N / KV-Rescue on a benchmark (resumable)")
    bench.add_argument("--benchmark", required=True, help="e.g. testbed:n=40,set=test or gsm8k")
    bench.add_argument("--method", default="dynts,window", help="base eviction methods, comma-separated")
    bench.add_argument("--settings", default=",".join(SETTINGS),
                       help=f"subset of {','.join(SETTINGS)} (helper-search: the helper alone, 2N candidates per step; "
                            "full-search: KV-Rescue with a full-cache base)")
    bench.add_argument("--limit", type=int, default=None, help="first N questions")
    bench.add_argument("--degen-steps", type=int, default=None, help="steps that make an incorrect trajectory degenerate")
    bench.add_argument("--max-rows", type=int, default=64, help="candidate rows per batched forward")
    bench.add_argument("--out", required=True, help="run directory (re-run to resume)")
    add_final_arguments(bench, "a final table")
    _common(bench)
    cal = sub.add_parser("calibrate", help="detector statistics of best-of-N base candidates (paper Fig. 3), to pick thresholds")
    cal.add_argument("--benchmark", required=True)
    cal.add_argument("--method", default="window", help="the base's eviction method")
    cal.add_argument("--limit", type=int, default=None)
    cal.add_argument("--out", default=None, help="write the statistics as JSON here")
    cal.add_argument("--verify", action="store_true", help="testbed: AUROC of the PRM against the exact step checker")
    _common(cal)
    gen = sub.add_parser("generate", help="KV-Rescue for a few prompts; prints the solution, step sources and costs")
    gen.add_argument("prompts", nargs="+", help="prompts (raw text unless --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--method", default="window", help="the base's eviction method")
    gen.add_argument("--n-base", type=int, default=4)
    gen.add_argument("--n-helper", type=int, default=4)
    gen.add_argument("--no-detector", action="store_true")
    gen.add_argument("--json", action="store_true", help="print the results as JSON")
    _common(gen)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from dynts.rescue import rescue_generate

    options = load_kwargs(args, given_only=True)
    base, tokenizer = load_model(args.base, **options)
    helper = load_model(args.helper, **helper_options(options))[0] if args.n_helper else None
    prm = load_eval_prm(args.prm, args.delimiter, args.trust_remote_code, options)
    prompts = [[{"role": "user", "content": p}] for p in args.prompts] if args.chat else list(args.prompts)
    search = _search(args, args.n_base, args.n_helper, None if args.no_detector else _detector(args), args.max_tokens or 4096)
    out = rescue_generate(
        base, helper, prm, tokenizer, prompts, config=search, method=args.method,
        budget=Budget.from_paper(args.budget, args.headroom, args.local_window) if args.paper_budget else args.budget,
        local_window=args.local_window, retention=args.retention, predictor=args.predictor,
    )
    if args.json:
        print(json.dumps({"stats": out.stats, "problems": [
            {"text": p.text, "end": p.end, "sources": p.sources, "stats": p.stats} for p in out.problems]}, indent=2, default=str))
        return 0
    for prompt, p in zip(args.prompts, out.problems):
        print(f"prompt: {prompt}\nsolution ({p.end}): {p.text}")
        print("steps: " + " | ".join(f"[{s.source[0]}{'' if s.score is None else f' {s.score:.2f}'}] {s.text}" for s in p.steps))
        print("cost: " + ", ".join(f"{k}={v}" for k, v in p.stats.items()) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.prm is None:  # the PRM of the helper's family, alone
        args.prm = default_verifier(args.helper)
    torch.set_num_threads(args.threads)
    if args.command == "generate":
        return _generate(args)
    if args.command == "calibrate":
        config = RescueEvalConfig(
            benchmark=args.benchmark, out=args.out or "", base=args.base, prm=args.prm, methods=(args.method,),
            predictor=args.predictor,
            budget=args.budget, paper_budget=args.paper_budget, headroom=args.headroom,
            local_window=args.local_window, retention=args.retention, search=_search(args, args.n, args.n, _detector(args)),
            max_tokens=args.max_tokens, limit=args.limit, trust_remote_code=args.trust_remote_code,
            load_options=load_kwargs(args, given_only=True),
        )
        result = calibrate(config, args.method, verify=args.verify)
        if args.out:
            write_atomic(Path(args.out), json.dumps(result, indent=1))
        return 0
    settings = tuple(s.strip() for s in args.settings.split(",") if s.strip())
    try:
        check_settings(settings, empty_ok=False)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    config = RescueEvalConfig(
        benchmark=args.benchmark, out=args.out, base=args.base, helper=args.helper, prm=args.prm,
        methods=tuple(m.strip() for m in args.method.split(",") if m.strip()), predictor=args.predictor,
        budget=args.budget, paper_budget=args.paper_budget, headroom=args.headroom, local_window=args.local_window,
        retention=args.retention, search=_search(args, args.n, args.n, _detector(args), max_rows=args.max_rows),
        max_tokens=args.max_tokens, degen_steps=args.degen_steps, limit=args.limit, settings=settings,
        trust_remote_code=args.trust_remote_code, load_options=load_kwargs(args, given_only=True),
    )
    from eval.harness.ledger import final_run

    with final_run("dynts rescue", sys.argv[1:] if argv is None else argv, args.final, config.out,
                   reread=args.reread, methods=cell_names(config)) as ledger:
        summary = evaluate(config, after_cell=ledger.finished_cell)
    print(summary_table(summary))
    print(f"wrote {Path(config.out) / 'results.md'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
