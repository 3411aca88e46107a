"""The demo: every eviction method at one tight budget on 100 testbed problems of each task family, with
the final tables' models: the seed-1 fair toy reasoning models (trained from scratch on the eviction mechanisms'
own kept sets) and their trained importance predictors, ``copy`` (``testbed-fair``:
``checkpoints/testbed-fair-scratch-s1-lrm``, ``testbed-fair-scratch-s1-predictor``: a step reads only the
question) and ``chain`` (``testbed-chain-fair``: ``checkpoints/testbed-chain-fair-s1-lrm``,
``testbed-chain-fair-s1-predictor``: steps read earlier results, the regime attention-based scorers were designed
for). DynTS, H2O, SnapKV, R-KV and SepLLM run at the settings their dev tuning chose (each attention baseline's
best of its token-level and per-head forms, with and without the question protected); every other registered method
at its defaults. Prints, per family, the LRM's full-cache score and a table that fits 120 columns (each method by its
short name: pass@1 ± SE, tokens vs full, loops, evictions, tokens/s, peak KV), the tuned settings under it, and
where the plot and ``results.md`` (every column, the full method labels) are.

Run: ``python -m eval.harness.demo`` (about 5 min of CPU on one core, chain two thirds of it). It
is one ``dynts eval`` run per family underneath (``runs/demo/<family>``, resumable); ``dynts eval --model
testbed-fair --benchmark testbed ...`` gives every knob.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path

from typing import NamedTuple

from dynts.cli_options import add_load_arguments, load_kwargs
from eval.harness.ledger import add_final_arguments

__all__ = ["main"]

WIDTH = 120  # the demo's printed lines fit a terminal this wide


class Family(NamedTuple):
    """One testbed task family as the demo runs it."""

    model: str  # a bundled name (dynts.models.TESTBED gives its checkpoint directory)
    predictor: str  # its predictor's directory under checkpoints/
    options: str  # added to the testbed benchmark spec
    oracles: str  # the eval.harness.methods list of its oracle presets (imported with dynts, on use)
    config: str  # the config that trains the model, named when it is missing
    tuned: tuple[str, ...]  # the tuned methods' specs (W_l as a share of B): see TUNED_FROM


# Each tuned method's dev choice ("best" of its subsets), as `python -m eval.harness.tuning specs CHOICES CHOICES
# --subsets best --local-window 32 --retention 0.4 --window-shares` prints it for the two files of TUNED_FROM;
# tests/test_eval_demo.py checks they agree. Written here so that an installed wheel (no reports/) runs the same demo.
TUNED_FROM = ("reports/tuning/{family}-fair/choices.json", "reports/tuning/{family}-fair-sepllm/choices.json")
FAMILIES: dict[str, Family] = {
    "copy": Family("testbed-fair", "testbed-fair-scratch-s1-predictor", "", "ORACLES", "lrm-fair-scratch-s1.yaml", (
        "dynts:local_window_share=0.1778,retention=0.6",
        "h2o:local_window_share=0.3556,retention=0.6",
        "rkv-head:normalize=non_window,local_window_share=0.3556,retention=0.6",
        "snapkv-head+q:kernel_size=1,observation_window=32,local_window_share=0.3556,retention=0.6",
        "sepllm:local_window_share=0.7111,retention=0.2")),
    "chain": Family("testbed-chain-fair", "testbed-chain-fair-s1-predictor", ",family=chain", "CHAIN_ORACLES",
                    "chain-lrm-fair-s1.yaml", (
        "dynts:local_window_share=0.5289,retention=0.6",
        "h2o-head+q:local_window_share=0.5289,retention=0.6",
        "rkv+q:mix_lambda=0.2,normalize=non_window,local_window_share=0.2645,retention=0.6",
        "snapkv+q:kernel_size=5,observation_window=16,local_window_share=0.1322,retention=0.6",
        "sepllm:local_window_share=0.1322")),
}


def demo_methods(have_predictor: bool, family: str = "copy") -> tuple[list[str], list[str]]:
    """The full cache; DynTS, H2O, SnapKV, R-KV and SepLLM at their tuned settings (``Family.tuned``); every other
    registered method that runs with default settings; the family's ground-truth oracles by kept-set shape.
    Score-based ones only with a predictor. Returns (specs, skipped notes)."""
    import dynts
    from dynts.evictors.base import EVICTORS

    from . import methods

    predictor = FAMILIES[family].predictor
    tuned = {methods.parse_method(spec).name: spec for spec in FAMILIES[family].tuned}
    specs, notes = [], []
    for name in sorted(dynts.available_methods(), key=lambda n: n != "full"):
        if name == "testbed-oracle":
            continue  # the family's oracle presets below run it with the family's settings
        if "scores" in EVICTORS[name].requires and not have_predictor:
            notes.append(f"skipping {name} on {family}: no trained predictor at checkpoints/{predictor} yet")
            continue
        if name in tuned:
            specs.append(tuned[name])
            continue
        try:
            dynts.make_evictor(name)
        except ValueError:
            continue  # needs explicit settings (e.g. "fixed")
        specs.append(name)
    return specs + getattr(methods, FAMILIES[family].oracles), notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="copy,chain", help="testbed task families, comma-separated: copy, chain")
    parser.add_argument("--n", type=int, default=100, help="testbed problems per family")
    parser.add_argument("--set", default="test", help="testbed problem set (final and confirm need --final)")
    add_final_arguments(parser, "a final table (--set final or confirm)")
    parser.add_argument("--budget", type=int, default=96, help="cache budget B (0.28 of the copy LRM's 345-token mean full-cache sequence on dev, 0.20 of the chain LRM's 477); "
                             "a tuned method's W_l is its tuned share of B")
    parser.add_argument("--local-window", type=int, default=32, help="W_l of the untuned methods")
    parser.add_argument("--retention", type=float, default=0.4, help="retention of the untuned methods")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the testbed's 1100")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the toy model's matrices are too small to gain from more, and "
                             "OpenMP spin-waits cost 10x+ when the cores are shared)")
    parser.add_argument("--run-dir", default="runs/demo", help="one resumable eval run per family under it (<run-dir>/<family>)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier demo results")
    add_load_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the final-set ledger
    load_options = load_kwargs(args, given_only=True)
    families = [f.strip() for f in args.family.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        print(f"demo: error: --family {args.family!r}: choose from {', '.join(FAMILIES)} (comma-separated)", file=sys.stderr)
        return 2

    import torch

    from dynts.models import TESTBED, checkpoints_dir

    paths = {f: checkpoints_dir() / TESTBED[FAMILIES[f].model] for f in families}
    missing = [f for f in families if not (paths[f] / "config.json").is_file()]
    for family in missing:
        print(f"demo: the {family} testbed model is missing at {paths[family]}; train it with "
              f"`dynts testbed train --config configs/testbed/{FAMILIES[family].config}`", file=sys.stderr)
    if missing:
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh:
        shutil.rmtree(Path(args.run_dir), ignore_errors=True)
    for family in families:
        code = run_family(family, args, load_options)
        if code:
            return code
    return 0


def run_family(family: str, args: argparse.Namespace, load_options: dict) -> int:
    """One family's cells (one ``dynts eval`` run in ``<run-dir>/<family>``) and its table."""
    from dynts.models import checkpoints_dir

    from .config import EvalConfig
    from .runner import run

    model, predictor_name, options = FAMILIES[family].model, FAMILIES[family].predictor, FAMILIES[family].options
    predictor = checkpoints_dir() / predictor_name
    have_predictor = (predictor / "predictor_config.json").is_file()
    methods, notes = demo_methods(have_predictor, family)
    for note in notes:
        print(f"demo: {note}", file=sys.stderr)
    run_dir = Path(args.run_dir) / family
    benchmark = f"testbed:n={args.n}{options}" + ("" if args.set == "test" else f",set={args.set}")

    def make() -> EvalConfig:
        return EvalConfig(
            model=model, benchmarks=[benchmark], methods=methods, budgets=[args.budget],
            local_windows=[args.local_window], retentions=[args.retention], k=1, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            predictor=str(predictor) if have_predictor else None, run_dir=run_dir,
        )

    try:
        config = make()
        from eval.harness.ledger import final_run

        from .methods import method_id

        with final_run("dynts demo", args.argv, args.final, run_dir, reread=args.reread,
                       methods=[method_id(m) for m in config.method_specs]) as ledger:
            def finished(cell: dict) -> None:
                ledger.finished_cell(cell["key"], method_id(cell["method"]))

            try:
                results = run(config, after_cell=finished, load_options=load_options)
            except ValueError as err:
                if "other settings" not in str(err):
                    raise
                print(f"demo: checkpoints changed since the last demo; starting over in {run_dir}", file=sys.stderr)
                shutil.rmtree(run_dir)
                results = run(make(), after_cell=finished, load_options=load_options)
            for result in results:  # the cells read back from an earlier demo too
                finished(result)
    except ValueError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    print(family_summary(family, results, args, have_predictor, run_dir))
    return 0


def family_summary(family: str, results: list[dict], args: argparse.Namespace, have_predictor: bool,
                   run_dir: Path) -> str:
    """What the demo prints for one family, every line at most :data:`WIDTH` characters: the setting, the
    full cache's score, the compact table (short method names), the tuned settings behind the names, and where
    the plot and the table with every column are."""
    from .report import compact_table, settings_note

    wrap = lambda text: textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)  # noqa: E731
    lines = ["", wrap(f"{family} family: testbed toy LRM `{FAMILIES[family].model}`, {args.n} problems, budget "
                      f"B={args.budget}, sampling T=0.6 top-p 0.95 top-k 20, k=1")]
    if have_predictor:
        from dynts.models import checkpoints_dir
        from dynts.predictor import predictor_label

        predictor = FAMILIES[family].predictor
        label = predictor_label(checkpoints_dir() / predictor) or "not recorded"
        lines.append(wrap(f"dynts: predictor checkpoints/{predictor}, importance label `{label}`"))
    full = next((r for r in results if r["method"]["name"] == "full"), None)
    if full is not None:
        lines.append(f"full cache (no eviction): pass@1 {100 * full['pass@1']:.1f} %, the ceiling the other rows are read against")
    lines += [compact_table(results),
              wrap(f"tuned on dev (W_l: local window): {settings_note(results)}; the others at W_l={args.local_window} "
                   f"retention={args.retention}")]
    if not have_predictor:
        lines.append(f"(dynts not shown: its trained predictor checkpoints/{FAMILIES[family].predictor} is not there yet)")
    lines += ["", f"plot: {run_dir / 'accuracy_vs_budget.png'}",
              f"every column, full method labels: {run_dir / 'results.md'}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
