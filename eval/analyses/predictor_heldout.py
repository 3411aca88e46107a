"""The predictor measured where nothing was chosen, and what each method keeps when it is needed.

1. **Held-out predictor metrics** (:func:`predictor_metrics`): full-cache traces of the LRM on a fresh
   namespace (``ptest``, :data:`data_pipeline.testbed.task.PREDICTOR_TEST`: no epoch, recipe or
   setting was chosen on it), the attention importance of every thinking token (answer rows, summed
   over layers and heads: the training label, :func:`dynts.importance.sequence_importance`) against
   the predictor's scores of the same tokens: Kendall tau-b and the top-``percent`` % overlap per
   trace (the training metrics :class:`~trainers.predictor_metrics.MeanKendallTau` and
   :class:`~trainers.predictor_metrics.TopPercentOverlap`, one trace at a time), averaged over
   problems, with percentile bootstrap 95 % CIs over problems (:func:`eval.harness.stats.bootstrap_ci`).
2. **On-policy retention** (:func:`retention`): each method generates under its budget; at every
   decode step the cache's kept positions are recorded (:meth:`dynts.cache.BoundedCache.kept_positions`,
   read by a logits processor after the step's forward, i.e. what the next token could attend to).
   A *read* is a token that copies an earlier value: a step operand naming a result (chain, ``r3``),
   a step operand naming a question variable (``a``), the answer's value after ``</think> rK=``. Its
   *sources* are the earlier value tokens written for that name (after ``rX=`` in the thinking; the
   question's value for a variable). The read is *retained* when a source is in the cache at the
   step that writes it. Per method and kind: the share of reads retained, the mean over problems of
   each problem's share, with a bootstrap 95 % CI. The full cache retains everything (a check).

``python -m eval.analyses.predictor_heldout --family chain --n 100 --budget 96 --out reports/predictor-heldout-chain.json``
(methods: ``--methods full,dynts,random,h2o+q,snapkv+q,rkv+q``; ``--skip-metrics`` / ``--skip-retention``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from data_pipeline.testbed import task
from eval.harness.stats import bootstrap_ci

__all__ = ["DEFAULT_METHODS", "READ_KINDS", "main", "predictor_metrics", "reads", "retention"]

DEFAULT_METHODS = ("full", "dynts", "random", "h2o+q", "snapkv+q", "rkv+q")
READ_KINDS = ("step reads a result", "step reads a question variable", "answer reads the asked result")
MODELS = {"copy": ("testbed", "checkpoints/testbed-predictor"), "chain": ("testbed-chain", "checkpoints/testbed-chain-predictor")}


def _ci(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "ci": None, "n": 0}
    return {"mean": statistics.fmean(values), "ci": list(bootstrap_ci(values)), "n": len(values)}


# ------------------------------------------------------------------ 1. held-out predictor metrics


def _trace_ids(tokenizer: Any, problem: task.Problem, text: str) -> list[int]:
    return tokenizer(problem.prompt + " " + text, add_special_tokens=False)["input_ids"]


def predictor_metrics(model: Any, eager: Any, tokenizer: Any, predictor: Any, problems: Sequence[task.Problem],
                      percent: float = 30.0, seed: int = 0, max_new_tokens: int = 1100) -> dict[str, Any]:
    """Kendall tau-b and top-``percent`` % overlap of ``predictor`` against the attention importance
    of ``eager`` (the same LRM with eager attention) on one full-cache trace per problem of ``model``;
    traces that never close their thinking are left out (as in training)."""
    from dynts.importance import sequence_importance
    from trainers.predictor_metrics import MeanKendallTau, TopPercentOverlap
    from trainers.testbed_eval import generate_texts

    texts = generate_texts(model, tokenizer, problems, max_new_tokens=max_new_tokens, seed=seed)
    end = tokenizer.convert_tokens_to_ids(task.END_THINK)
    kept = []
    for p, text in zip(problems, texts):
        ids = _trace_ids(tokenizer, p, text)
        if end in ids[task.QUESTION_TOKENS:]:
            kept.append((p, ids, ids.index(end, task.QUESTION_TOKENS)))
    if not kept:
        raise ValueError("no trace closed its thinking; raise max_new_tokens")
    out = sequence_importance(eager, [ids for _, ids, _ in kept], [a for _, _, a in kept], return_hidden_states=True)
    taus, overlaps = [], []
    with torch.no_grad():
        for (_p, _ids, a), imp in zip(kept, out):
            q = task.QUESTION_TOKENS
            target = imp.scores[q:a].float()[None]
            preds = predictor(imp.hidden_states[q:a])[None]
            mask = torch.ones_like(target, dtype=torch.bool)
            tau, top = MeanKendallTau(), TopPercentOverlap(percent)
            tau.update(preds, target, mask)
            top.update(preds, target, mask)
            if int(tau.count):
                taus.append(float(tau.compute()))
            if int(top.count):
                overlaps.append(float(top.compute()))
    return {"problems": len(problems), "traces": len(kept), "percent": percent,
            "kendall": _ci(taus), f"top{percent:g}_overlap": _ci(overlaps)}


# ------------------------------------------------------------------ 2. on-policy retention


def reads(words: Sequence[str], family: str) -> list[tuple[str, int, list[int]]]:
    """``(kind, position, sources)`` of every read in a trace's words (prompt included, one word per
    token): step operands (a result: the earlier value tokens written after ``rX=``; a question
    variable: its value in the question) and the answer's value (the asked key's earlier values)."""
    w = list(words)
    think = w.index(task.THINK) if task.THINK in w else 0
    stop = w.index(task.END_THINK, think) if task.END_THINK in w[think:] else len(w)

    def written(key: str, before: int) -> list[int]:
        return [i + 1 for i in range(think, min(before, stop) - 1) if w[i] == f"{key}="]

    out = []
    for start, (x, _xv, _op, y, _yv, _k, _v) in task.step_spans(w, family):
        for name, pos in ((x, start + 1), (y, start + 4)):
            if name in task.VARIABLES:
                out.append((READ_KINDS[1], pos, [w.index(name) + 1]))
            else:
                out.append((READ_KINDS[0], pos, written(name, start)))
    if stop + 2 < len(w) and w[stop + 1] in task.RESULT_KEYS:
        out.append((READ_KINDS[2], stop + 2, written(w[stop + 1][:-1], stop)))
    return [r for r in out if r[2]]  # a read of a name never written has nothing to keep


class _KeptRecorder:
    """A logits processor: after each forward, the kept positions of every row of the cache."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.kept: list[dict[int, set[int]]] = []  # per row: sequence length -> kept positions

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cache is not None and hasattr(self.cache, "kept_positions"):
            if not self.kept:
                self.kept = [{} for _ in range(input_ids.shape[0])]
            for row in range(input_ids.shape[0]):
                self.kept[row][input_ids.shape[1]] = set(self.cache.kept_positions(row).tolist())
        return scores


@contextlib.contextmanager
def _recording(recorder: _KeptRecorder) -> Iterator[None]:
    """Hand the cache ``dynts.generate`` builds to ``recorder`` (wraps its ``build_cache``)."""
    module = importlib.import_module("dynts.generate")
    real = module.build_cache

    def build(*args: Any, **kwargs: Any) -> Any:
        recorder.cache = real(*args, **kwargs)
        return recorder.cache

    module.build_cache = build
    try:
        yield
    finally:
        module.build_cache = real


def retention(model: Any, tokenizer: Any, problems: Sequence[task.Problem], methods: Sequence[str], budget: int,
              local_window: int, retention_ratio: float = 0.4, predictor: str | None = None, seed: int = 0,
              max_new_tokens: int = 1100, batch_size: int = 50) -> dict[str, Any]:
    """Per method (``dynts eval`` specs: ``h2o+q``, ``dynts``, ...): the share of reads retained by
    kind (module docstring), mean over problems with bootstrap CIs, and the pooled counts."""
    from transformers import LogitsProcessorList

    import data_pipeline.testbed.oracle  # noqa: F401  (registers "testbed-oracle" for the oracle presets)
    from dynts import generate
    from eval.harness.methods import parse_methods
    from trainers.testbed_eval import SAMPLING

    out: dict[str, Any] = {"budget": budget, "local_window": local_window, "retention": retention_ratio,
                           "problems": len(problems), "methods": {}}
    for spec in parse_methods(methods):
        per_problem: dict[str, list[float]] = {k: [] for k in READ_KINDS}
        pooled = {k: [0, 0] for k in READ_KINDS}
        correct = []
        for i in range(0, len(problems), batch_size):
            batch = problems[i:i + batch_size]
            torch.manual_seed(seed + i)
            recorder = _KeptRecorder()
            kw: dict[str, Any] = {} if not spec.bounded else {"budget": budget, "local_window": local_window, "retention": retention_ratio}
            if "scores" in spec.requires:
                kw["predictor"] = predictor
            with _recording(recorder):
                res = generate(model, tokenizer, [[{"role": "user", "content": p.question}] for p in batch], method=spec.name,
                               method_options=dict(spec.options), max_new_tokens=max_new_tokens,
                               logits_processor=LogitsProcessorList([recorder]), **kw, **SAMPLING)
            for row, (p, seq, length) in enumerate(zip(batch, res.sequences.tolist(), res.stats["lengths"])):
                words = task.words(p.prompt) + tokenizer.convert_ids_to_tokens(seq[:length])
                correct.append(task.check_answer(p, tokenizer.decode(seq[:length], skip_special_tokens=True)))
                hits = {k: [0, 0] for k in READ_KINDS}
                for kind, pos, sources in reads(words, p.family):
                    kept = recorder.kept[row].get(pos) if recorder.kept else None
                    held = True if kept is None and not spec.bounded else bool(kept is not None and kept & set(sources))
                    hits[kind][0] += held
                    hits[kind][1] += 1
                for kind, (h, n) in hits.items():
                    if n:
                        per_problem[kind].append(h / n)
                        pooled[kind][0] += h
                        pooled[kind][1] += n
        out["methods"][spec.label] = {"pass@1": statistics.fmean(correct),
                                      "retained": {k: {**_ci(v), "pooled": pooled[k]} for k, v in per_problem.items()}}
    return out


def markdown(result: dict[str, Any]) -> str:
    """The predictor's held-out metrics [95 % CI], then the retention table: per method, pass@1 and each
    kind's retained share % [95 % CI]."""
    lines: list[str] = []
    if "metrics" in result:
        m = result["metrics"]
        overlap = m[f"top{m['percent']:g}_overlap"]
        lines += [f"Predictor `{result['predictor']}` on {m['traces']} full-cache traces ({result['set']}, {result['family']}): "
                  f"Kendall tau-b {m['kendall']['mean']:.3f} [{m['kendall']['ci'][0]:.3f}, {m['kendall']['ci'][1]:.3f}], "
                  f"top-{m['percent']:g} % overlap {overlap['mean']:.3f} [{overlap['ci'][0]:.3f}, {overlap['ci'][1]:.3f}]", ""]
    if "retention" in result:
        r = result["retention"]
        lines += [f"B = {r['budget']}, W_l = {r['local_window']}, {r['problems']} problems ({result['set']}, {result['family']})", "",
                  "| method | pass@1 % | " + " | ".join(f"{k} % [CI] (reads)" for k in READ_KINDS) + " |",
                  "|---|---|" + "---|" * len(READ_KINDS)]
        for label, m in r["methods"].items():
            cells = []
            for k in READ_KINDS:
                v = m["retained"][k]
                cells.append("–" if v["mean"] is None else f"{100 * v['mean']:.1f} [{100 * v['ci'][0]:.1f}, {100 * v['ci'][1]:.1f}] ({v['pooled'][1]})")
            lines.append(f"| {label} | {100 * m['pass@1']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="chain", choices=sorted(MODELS))
    p.add_argument("--model", default=None, help="bundled testbed LRM (default: the family's)")
    p.add_argument("--predictor", default=None, help="predictor directory (default: the family's shipped one)")
    p.add_argument("--set", default=task.PREDICTOR_TEST, help="problem set (a fresh namespace; default ptest)")
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--percent", type=float, default=30.0, help="top-k overlap percent")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--budget", type=int, default=96)
    p.add_argument("--local-window", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=1100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-metrics", action="store_true")
    p.add_argument("--skip-retention", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON here (atomically), and the table next to it (.md)")
    args = p.parse_args(argv)
    from dynts import ImportancePredictor
    from dynts.io import write_atomic
    from trainers.testbed_eval import load_testbed

    torch.set_num_threads(1)
    model_name, predictor_dir = MODELS[args.family]
    model_name, predictor_dir = args.model or model_name, args.predictor or predictor_dir
    try:
        problems = task.problem_set(args.set, args.n, family=args.family)
    except ValueError as err:
        print(f"predictor_heldout: {err}", file=sys.stderr)
        return 2
    model, tokenizer = load_testbed(model_name)
    result: dict[str, Any] = {"family": args.family, "set": args.set, "n": args.n, "model": model_name, "predictor": predictor_dir}
    if not args.skip_metrics:
        eager, _ = load_testbed(model_name, attn_implementation="eager")
        predictor = ImportancePredictor.from_pretrained(predictor_dir).eval()
        result["metrics"] = predictor_metrics(model, eager, tokenizer, predictor, problems, args.percent, args.seed, args.max_new_tokens)
    if not args.skip_retention:
        result["retention"] = retention(model, tokenizer, problems, [args.methods], args.budget, args.local_window,
                                        predictor=predictor_dir, seed=args.seed, max_new_tokens=args.max_new_tokens)
    print(markdown(result))
    if args.out:
        write_atomic(Path(args.out), json.dumps(result, indent=2) + "\n")
        write_atomic(Path(args.out).with_suffix(".md"), markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
