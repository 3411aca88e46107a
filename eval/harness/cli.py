"""``dynts eval``: accuracy, throughput and peak KV memory of eviction methods on benchmarks.

Examples::

    dynts eval --model smollm2-135m --benchmark gsm8k,math500 --limit 20 --k 1 \\
        --method full,window,streamingllm --budget 512,1024 --local-window 128 --max-new-tokens 512
    # Table 2 ablations (DynTS needs its trained predictor):
    dynts eval --model testbed --benchmark testbed --predictor checkpoints/testbed-predictor \\
        --method dynts --ablations --budget 64 --local-window 16
    # local-window / retention sweeps (Fig. 6), any registered method with its own settings:
    dynts eval ... --method dynts,streamingllm:sink_size=8 --local-window 16,32,48 --retention 0.2,0.4,0.6
    # your own JSONL (AIME25, GPQA-Diamond):
    dynts eval ... --benchmark gpqa_diamond.jsonl --question-field Question --answer-field "Correct Answer" \\
        --choices-field "Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3" --shuffle-choices

Re-running the same command resumes: finished cells are skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from dynts.cli_options import add_load_arguments, load_kwargs, set_threads

from .ledger import add_final_arguments
from .methods import ABLATIONS, CONTROLS, PER_HEAD, QUESTION_PROTECTED

__all__ = ["main", "parse_float_list", "parse_int_list"]


def parse_int_list(text: str, flag: str) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]``; anything but integers raises ``ValueError`` naming ``flag``."""
    values = []
    for item in (i.strip() for i in str(text).split(",")):
        if not item:
            continue
        try:
            values.append(int(item))
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not an integer; give a comma-separated list like 512,1024") from None
    if not values:
        raise ValueError(f"{flag} is empty; give a comma-separated list like 512,1024")
    return values


def parse_float_list(text: str, flag: str) -> list[float]:
    values = []
    for item in (i.strip() for i in str(text).split(",")):
        if not item:
            continue
        try:
            values.append(float(item))
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a number; give a comma-separated list like 0.2,0.4") from None
    if not values:
        raise ValueError(f"{flag} is empty; give a comma-separated list like 0.2,0.4")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynts eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="dynts.load name (smollm2-135m, testbed) or a local HF directory")
    p.add_argument("--benchmark", action="append", default=None,
                   help="comma list of gsm8k, math500, aime24, amc23, gaokao2023en, olympiadbench, "
                        "testbed[:n=100,set=test] or path.jsonl (repeatable)")
    p.add_argument("--method", action="append", default=None,
                   help="comma list of method specs, e.g. full,window,dynts:selection=random (repeatable); a spec may "
                        "set its own cache settings, e.g. rkv+q:mix_lambda=0.05,retention=0.6 (same budget); "
                        "'all' = every registered method, the +q variants and the per-head ones (-head) (default)")
    p.add_argument("--ablations", action="store_true",
                   help="add DynTS's Table 2 ablations: " + ", ".join(ABLATIONS))
    p.add_argument("--budget", default=None, help="comma list of cache budgets B, e.g. 1024,2048")
    p.add_argument("--budget-fraction", default=None,
                   help="comma list of budgets as shares of the full cache's mean sequence on each benchmark, e.g. "
                        "0.15,0.25 (needs --method full; resolved after the full cache ran)")
    p.add_argument("--allow-vacuous", action="store_true",
                   help="with --final, run budgets whose n_keep leaves no selection slot (flagged vacuous in the tables) "
                        "instead of refusing them")
    p.add_argument("--local-window", default=None, help="comma list of local windows W_l (default: half of each budget)")
    p.add_argument("--retention", default="0.4", help="comma list of retention ratios (default 0.4)")
    p.add_argument("--k", type=str, default="5", help="samples per question; pass@1 is their mean (paper: 5)")
    p.add_argument("--limit", type=int, default=None, help="first N questions of each benchmark")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generation cap (default: 16384, testbed: max_think+200)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per generate call")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (k must be 1)")
    p.add_argument("--predictor", default=None, help="ImportancePredictor directory or auto (needed by dynts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="results directory (default: runs/eval/<model>-<settings hash>)")
    p.add_argument("--question-field", default="question", help="JSONL benchmarks: question field")
    p.add_argument("--answer-field", default="answer", help="JSONL benchmarks: gold answer field")
    p.add_argument("--id-field", default=None, help="JSONL benchmarks: id field (default: line number)")
    p.add_argument("--choices-field", default=None, help="JSONL multiple choice: a list field, or comma list of fields")
    p.add_argument("--shuffle-choices", action="store_true", help="JSONL multiple choice: shuffle options per question")
    p.add_argument("--no-chat-template", action="store_true", help="send raw text instead of the chat template")
    p.add_argument("--think-end", default="</think>", help="token closing the thinking segment")
    p.add_argument("--grade-on", default="auto", choices=["auto", "answer", "full"],
                   help="grade the text after --think-end (answer; unclosed thinking = unanswered) or the whole "
                        "text (full); auto = answer when the tokenizer knows the delimiter (reasoning models)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; 1 is much faster for tiny models on a busy machine)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes running cells side by side, each loading the model once (one copy per worker; "
                        "--device cuda spreads them over the GPUs); --threads is split among them; the samples are "
                        "the same as with 1 (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list", action="store_true", help="list benchmarks, methods and ablation presets, then exit")
    add_final_arguments(p, "a final table")
    add_load_arguments(p)
    return p



def _methods(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Method spec strings; 'all' expands to every registered method (score-based ones only with
    a predictor). Returns (specs, notes)."""
    import dynts
    from dynts.evictors.base import EVICTORS

    from .methods import split_specs

    specs, notes = [], []
    for value in args.method or ["all"]:
        for spec in split_specs(value):
            if spec != "all":
                specs.append(spec)
                continue
            for name in sorted(dynts.available_methods(), key=lambda n: n != "full"):  # the reference first
                if "scores" in EVICTORS[name].requires and args.predictor is None:
                    notes.append(f"'all' skips {name}: it needs --predictor")
                    continue
                try:
                    dynts.make_evictor(name)
                except ValueError:
                    notes.append(f"'all' skips {name}: it has required settings (give them as {name}:key=value)")
                    continue
                specs.append(name)
            specs += QUESTION_PROTECTED  # each attention baseline also with DynTS's question protection
            specs += PER_HEAD  # and at its paper's granularity: a kept set per layer and KV head
    if args.ablations:
        specs += ["dynts", *ABLATIONS]
    return specs, notes


def config_from_args(args: argparse.Namespace):
    from .benchmarks import JsonlFields, split_benchmark_specs
    from .config import EvalConfig

    benchmarks = [b for v in (args.benchmark or ["gsm8k"]) for b in split_benchmark_specs(v)]
    methods, notes = _methods(args)
    for note in notes:
        print(f"dynts eval: {note}", file=sys.stderr)
    k = parse_int_list(args.k, "--k")
    if len(k) != 1:
        raise ValueError(f"--k takes one integer, got {args.k!r}")
    fields = JsonlFields(
        question=args.question_field, answer=args.answer_field, id=args.id_field,
        choices=tuple(c.strip() for c in args.choices_field.split(",")) if args.choices_field else (),
        shuffle_choices=args.shuffle_choices,
    )
    config = EvalConfig(
        model=args.model, benchmarks=benchmarks, methods=methods,
        budgets=parse_int_list(args.budget, "--budget") if args.budget else [],
        budget_fractions=parse_float_list(args.budget_fraction, "--budget-fraction") if args.budget_fraction else [],
        vacuous="refuse" if args.final and not args.allow_vacuous else "flag",
        local_windows=parse_int_list(args.local_window, "--local-window") if args.local_window else None,
        retentions=parse_float_list(args.retention, "--retention"), k=k[0], limit=args.limit,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, greedy=args.greedy, predictor=args.predictor, seed=args.seed,
        run_dir=args.run_dir or "runs/eval", fields=fields, chat_template=not args.no_chat_template,
        think_end=args.think_end, grade_on=args.grade_on, progress=not args.no_progress,
        workers=args.workers,
    )
    if args.run_dir is None:
        load = load_kwargs(args, given_only=True)
        settings = {**config.shared_settings(), **({"load": load} if load else {})}
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
        config.run_dir = Path("runs/eval") / f"{Path(args.model).name}-{digest}"
    return config


def _list() -> None:
    import dynts

    from .benchmarks import available_benchmarks
    from .methods import PLUGINS

    print("benchmarks:", ", ".join(available_benchmarks()), "+ any .jsonl file")
    print("methods:   ", ", ".join(dynts.available_methods()), "| plugins:", ", ".join(PLUGINS))
    print("ablations: ", ", ".join(f"{k} = {v}" for k, v in ABLATIONS.items()))
    print("controls:  ", ", ".join(f"{k} = {v}" for k, v in CONTROLS.items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        _list()
        return 0
    from .runner import run
    from .report import markdown_table

    try:
        set_threads(args.threads)
        config = config_from_args(args)
        print(f"dynts eval: run dir {config.run_dir}", file=sys.stderr)
        from eval.harness.ledger import final_run

        from .methods import method_id

        with final_run("dynts eval", argv, args.final, config.run_dir, reread=args.reread,
                       methods=[method_id(m) for m in config.method_specs]) as ledger:
            results = run(config, after_cell=lambda cell: ledger.finished_cell(cell["key"], method_id(cell["method"])),
                          load_options=load_kwargs(args, given_only=True))
            for r in results:  # the cells read back from an earlier run of this run dir too
                ledger.finished_cell(r["key"], method_id(r["method"]))
    except ValueError as err:
        print(f"dynts eval: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(results))
    print(f"\nresults: {config.run_dir}/results.md, results.csv, results.json")
    plot = config.run_dir / "accuracy_vs_budget.png"
    if plot.is_file():
        print(f"plot: {plot}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
