"""Which tokens each importance label picks, against the tokens whose eviction hurts the continuation.

On reference traces of the testbed (``problem_set("dev", n, family=..., max_think=...)``, teacher-forced
through a seed's fair LRM: ``checkpoints/testbed-chain-fair-sN-lrm``, ``checkpoints/testbed-fair-scratch-sN-lrm``)
every label of :data:`dynts.importance.LABELS` scores each thinking token, and per trace:

- **cf recall@k**: the share of the counterfactual's top ``k`` thinking tokens (the tokens whose eviction
  raises the later tokens' loss most, :mod:`dynts.importance.counterfactual`, the ground truth) that the
  label's top ``k`` holds;
- **closure recall@k**: the share of the answer's closure values (``Problem.critical_positions``) in the
  label's top ``k``.

Both are averaged over traces, per label, seed and family. ``--variants`` adds the ``future`` and ``golden``
labels under every :class:`dynts.importance.FutureSettings` form (``normalize`` x ``reduce`` x ``sinks``), the
measurements the defaults were chosen on; the main table shows ``future`` and ``golden`` at the defaults.

``flock /tmp/dynts-cpu.lock python -m eval.analyses.label_diagnostic --out reports/label-diagnostic/results.json``
writes the record (atomically, after each seed and family; a rerun skips what is there) and prints the tables
(``--table-only`` prints them from the record).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["FUTURE_VARIANTS", "MODELS", "diagnose", "main", "table", "trace_metrics", "variants_table"]

MODELS = {"chain": "checkpoints/testbed-chain-fair-s{seed}-lrm", "copy": "checkpoints/testbed-fair-scratch-s{seed}-lrm"}
FUTURE_VARIANTS = [dict(normalize=n, reduce=r, sinks=s) for n in ("none", "row") for r in ("sum", "max") for s in (0, 1)]
LABEL_ORDER = ("answer", "future", "golden", "counterfactual")


def variant_name(variant: dict[str, Any]) -> str:
    return f"normalize={variant['normalize']} reduce={variant['reduce']} sinks={variant['sinks']}"


def top(scores: torch.Tensor, first: int, stop: int, k: int) -> set[int]:
    """Positions of the ``k`` highest ``scores`` among ``first .. stop - 1``."""
    span = scores[first:stop].float()
    return {first + int(i) for i in torch.topk(span, min(k, span.numel())).indices}


def trace_metrics(scores: torch.Tensor, truth: torch.Tensor, critical: Sequence[int], first: int, stop: int, k: int) -> dict[str, float]:
    """cf recall@k and closure recall@k of one label's ``scores [T]`` on one trace (thinking = ``first .. stop-1``)."""
    picked = top(scores, first, stop, k)
    wanted = top(truth, first, stop, k)
    return {"cf": len(picked & wanted) / len(wanted), "closure": len(picked & set(critical)) / max(1, len(critical))}


def diagnose(family: str, seed: int, n: int, max_think: int, k: int, variants: bool) -> dict[str, Any]:
    """Per-trace metrics of every label (and, with ``variants``, every future form) for one seed and family."""
    import dynts
    from data_pipeline.testbed import task
    from dynts.importance import FutureSettings, GoldenSettings, token_importance

    model, tokenizer = dynts.load(MODELS[family].format(seed=seed), dtype="float32", device="cpu")
    problems = task.problem_set("dev", n, max_think=max_think, family=family)
    labels: dict[str, list[dict[str, float]]] = {name: [] for name in LABEL_ORDER}
    forms: dict[str, list[dict[str, float]]] = {}
    lengths = []
    for problem in problems:
        words = task.words(problem.text)
        ids = tokenizer(problem.text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        if ids.shape[1] != len(words):
            raise ValueError(f"the tokenizer split {problem.text[:60]!r}... into {ids.shape[1]} ids, not {len(words)} words")
        start = words.index(task.END_THINK)
        first = task.QUESTION_TOKENS
        lengths.append(ids.shape[1])

        def score(label: str, settings: Any = None) -> torch.Tensor:
            return token_importance(model, ids, [start], label=label, prompt_length=[first], settings=settings).scores[0]

        truth = score("counterfactual")
        for name in LABEL_ORDER:
            scores = truth if name == "counterfactual" else score(name)
            labels[name].append(trace_metrics(scores, truth, problem.critical_positions, first, start, k))
        if variants:
            for variant in FUTURE_VARIANTS:
                future = FutureSettings(**variant)
                for name, settings in (("future", future), ("golden", GoldenSettings(future=future))):
                    key = f"{name} {variant_name(variant)}"
                    forms.setdefault(key, []).append(
                        trace_metrics(score(name, settings), truth, problem.critical_positions, first, start, k))
    return {"family": family, "seed": seed, "model": MODELS[family].format(seed=seed), "n": n, "max_think": max_think,
            "k": k, "mean_length": statistics.fmean(lengths), "labels": labels, "variants": forms}


def _mean(rows: Sequence[dict[str, float]], metric: str) -> float:
    return 100 * statistics.fmean(r[metric] for r in rows)


def label_rows(run: dict[str, Any], name: str) -> list[dict[str, float]]:
    """A run's per-trace metrics of label ``name`` at today's defaults: ``future`` and ``golden`` from the
    variant of :class:`dynts.importance.FutureSettings`' defaults when the run measured the variants."""
    from dynts.importance import FutureSettings

    defaults = FutureSettings()
    key = f"{name} {variant_name(dict(normalize=defaults.normalize, reduce=defaults.reduce, sinks=defaults.sinks))}"
    return run["variants"][key] if key in (run.get("variants") or {}) else run["labels"][name]


def table(record: dict[str, Any]) -> str:
    """One markdown table: per label (rows), seed and family (columns), cf recall@k / closure recall@k in %."""
    runs = sorted(record["runs"], key=lambda r: (r["family"], r["seed"]))
    k = runs[0]["k"]
    head = "| label | " + " | ".join(f"{r['family']} s{r['seed']}" for r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for name in LABEL_ORDER:
        cells = [f"{_mean(label_rows(r, name), 'cf'):.0f} / {_mean(label_rows(r, name), 'closure'):.0f}" for r in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| *traces, mean tokens* | " + " | ".join(f"{r['n']}, {r['mean_length']:.0f}" for r in runs) + " |")
    return "\n".join(lines).replace("| label |", f"| label (recall@{k} %: cf / closure) |", 1)


def variants_table(record: dict[str, Any]) -> str:
    """The future and golden labels under every future form: cf / closure recall@k in %, mean over seeds per family."""
    runs = [r for r in record["runs"] if r["variants"]]
    families = sorted({r["family"] for r in runs})
    lines = ["| label and future form | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]
    for key in runs[0]["variants"]:
        cells = []
        for family in families:
            mine = [r["variants"][key] for r in runs if r["family"] == family]
            cells.append(f"{statistics.fmean(_mean(m, 'cf') for m in mine):.0f} / "
                         f"{statistics.fmean(_mean(m, 'closure') for m in mine):.0f}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", default="chain,copy")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--n", type=int, default=24, help="dev problems per seed and family")
    parser.add_argument("--max-think", type=int, default=400, help="longest thinking (the counterfactual is O(T^2))")
    parser.add_argument("--k", type=int, default=24, help="top tokens compared")
    parser.add_argument("--variants", action="store_true", help="also every future form (normalize x reduce x sinks)")
    parser.add_argument("--out", default="reports/label-diagnostic/results.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table-only", action="store_true", help="print the tables of the record, compute nothing")
    args = parser.parse_args(argv)
    from dynts.io import write_atomic

    out = Path(args.out)
    record = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    if not args.table_only:
        torch.set_num_threads(args.threads)
        for family in [f.strip() for f in args.families.split(",") if f.strip()]:
            if family not in MODELS:
                raise SystemExit(f"--families: {family!r} is not one of {sorted(MODELS)}")
            for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
                if any(r["family"] == family and r["seed"] == seed for r in record["runs"]):
                    continue
                began = time.time()
                run = diagnose(family, seed, args.n, args.max_think, args.k, args.variants)
                run["seconds"] = round(time.time() - began, 1)
                record["runs"].append(run)
                out.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(out, json.dumps(record, indent=1) + "\n")
                print(f"{family} s{seed}: {run['seconds']} s", flush=True)
    if not record["runs"]:
        raise SystemExit(f"{out} holds no runs; run without --table-only first")
    print(table(record))
    if any(r["variants"] for r in record["runs"]):
        print()
        print(variants_table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
