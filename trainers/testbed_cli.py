"""``dynts testbed {train,sample,report}``: train, try and measure the embedded testbed models."""

from __future__ import annotations

import argparse
import os


def _parser() -> argparse.ArgumentParser:
    from data_pipeline.testbed.task import FAMILIES  # stdlib only: --help stays fast

    parser = argparse.ArgumentParser(prog="dynts testbed", description="the embedded testbed: a toy LRM, its helper and a PRM")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one checkpoint from a YAML config (resumable)")
    train.add_argument("--config", required=True, help="e.g. configs/testbed/lrm.yaml")
    train.add_argument("--resume", action="store_true", help="continue from the run's last Lightning checkpoint")
    train.add_argument("--progress", action="store_true", help="show a progress bar")
    carry = sub.add_parser("resume-point", help="save a run's last.ckpt as a committable resume point (safetensors + JSON), "
                           "or restore it as the run's last.ckpt")
    carry.add_argument("action", choices=("save", "restore"))
    carry.add_argument("--run-dir", required=True, help="the training's run_dir, e.g. runs/testbed-chain-lrm-fair-s1")
    carry.add_argument("--dir", default=None, help="the resume point's folder (default: checkpoints/resume/<run name>)")
    carry.add_argument("--force", action="store_true", help="restore: replace the run's existing last.ckpt")
    sample = sub.add_parser("sample", help="print a generated problem and the model's trace")
    sample.add_argument("--seed", type=int, default=0, help="problem seed")
    sample.add_argument("--model", default="testbed", help="testbed, testbed-helper or a local HF directory")
    sample.add_argument("--method", default="full", help="eviction method (e.g. full, window, testbed-oracle)")
    sample.add_argument("--budget", type=int, default=None)
    sample.add_argument("--local-window", type=int, default=64)
    sample.add_argument("--min-think", type=int, default=150)
    sample.add_argument("--max-think", type=int, default=900)
    sample.add_argument("--family", default="copy", help="task family: copy or chain (use --model testbed-chain)")
    report = sub.add_parser("report", help="compute the testbed's numbers of one task family; write reports/testbed.json "
                            "(chain: reports/testbed-chain.json)")
    report.add_argument("--family", default="copy", choices=FAMILIES, help="task family: copy (the default) or chain")
    report.add_argument("--n", type=int, default=200, help="fresh problems per policy")
    report.add_argument("--budget", type=int, default=None, help="eviction budget (default: a quarter of the mean trace)")
    report.add_argument("--local-window", type=int, default=64)
    report.add_argument("--out", default=None, help="default: reports/testbed.json (--family chain: reports/testbed-chain.json)")
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--k", type=int, default=1, help="samples per problem (pass@1 = their mean; the paper's protocol: 5)")
    report.add_argument("--prm-only", action="store_true", help="recompute only the PRM numbers of an existing report")
    report.add_argument("--skip-prm", action="store_true",
                        help="leave the PRM out (e.g. before it is trained); add it later with --prm-only")
    report.add_argument("--helper-only", action="store_true", help="recompute only the helper numbers of an existing report")
    report.add_argument("--eviction-only", action="store_true", help="recompute only the eviction numbers of an existing report")
    report.add_argument("--min-think", type=int, default=300, help="second eviction run: ban </think> for this many tokens")
    report.add_argument("--oracles-from", default=None, metavar="RUN_DIR",
                        help="only record the kept-set shape check (oracle-step/value/token per budget) of a dynts eval run")
    report.add_argument("--oracles-label", default="testbed-lrm", help="the LRM those oracle cells ran on (a key of oracle_shapes)")
    return parser


def _sample(args: argparse.Namespace) -> int:
    import torch

    import data_pipeline.testbed.oracle  # noqa: F401  (registers "testbed-oracle")
    from data_pipeline.testbed import task
    from dynts import generate
    from trainers.testbed_eval import SAMPLING, load_testbed

    problem = task.make_problem(args.seed, min_think=args.min_think, max_think=args.max_think, family=args.family)
    model, tokenizer = load_testbed(args.model)
    torch.manual_seed(args.seed)
    kw = {} if args.method == "full" else {"budget": args.budget or 128, "local_window": args.local_window}
    options = {"keep_question": True} if args.method == "window" else None
    out = generate(model, tokenizer, [[{"role": "user", "content": problem.question}]], method=args.method,
                   method_options=options, max_new_tokens=args.max_think + 200, **kw, **SAMPLING)
    text = out.texts[0]
    print(f"question:  {problem.question}")
    print(f"reference: {problem.thinking_length} thinking tokens, answer r{problem.asked}= {problem.answer}")
    print(f"trace ({len(task.thinking_words(text))} thinking tokens, method {args.method}):\n{text}")
    print(f"parsed answer: {task.parse_answer(text)}  correct: {task.check_answer(problem, text)}")
    return 0


def main(argv: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    if args.command == "train":
        from trainers.testbed import train

        train(args.config, resume=args.resume, progress=args.progress)
        return 0
    if args.command == "resume-point":
        from trainers import resume_point

        where = args.dir or resume_point.default_dir(args.run_dir)
        if args.action == "save":
            print(f"saved step {resume_point.saved_step(resume_point.save(args.run_dir, where))} of {args.run_dir} to {where}")
        else:
            print(f"restored {resume_point.restore(where, args.run_dir, force=args.force)} (step {resume_point.saved_step(where)})")
        return 0
    if args.command == "sample":
        return _sample(args)
    from trainers.testbed_report import family_models, report, table, update_eviction, update_helper, update_oracle_shapes, update_prm

    family, out = args.family, args.out or family_models(args.family).out
    if args.oracles_from:
        result = update_oracle_shapes(args.oracles_from, args.oracles_label, out, family=family)
    elif args.prm_only:
        result = update_prm(out, n=args.n, family=family)
    elif args.helper_only:
        result = update_helper(out, seed=args.seed, family=family)
    elif args.eviction_only:
        result = update_eviction(out, min_think=args.min_think, family=family)
    else:
        result = report(n=args.n, budget=args.budget, local_window=args.local_window, out=out, seed=args.seed,
                        min_think=args.min_think, family=family, skip_prm=args.skip_prm, k=args.k)
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    raise SystemExit(main(sys.argv[1:]))
