"""Testbed report for the predictor pipeline:

1. how often the attention importance (answer rows, summed over layers/heads) ranks the testbed's
   ground-truth critical tokens (the value written after the asked key ``rK=``, found by
   ``data_pipeline.testbed.task.find_critical_positions``) in the top 20% of thinking tokens, over
   all traces and over the held-out questions' traces;
2. the trained predictor's held-out Kendall tau and top-30% overlap against that importance
   (recomputed here on the held-out questions of the training split), and how often the
   predictor itself puts the critical tokens in its top 20% (with a recency baseline: the last
   20% of thinking tokens, what a sliding window keeps);
3. optionally (``--generate N``) ``dynts.generate(..., method="dynts", predictor=...)`` on N fresh
   testbed problems vs the full cache.

Usage::

    flock /tmp/dynts-cpu.lock python scripts/report_testbed_predictor.py \\
        --config configs/predictor/testbed.yaml --predictor checkpoints/testbed-predictor [--generate 50]
    (chain: --config configs/predictor/testbed-chain.yaml --predictor checkpoints/testbed-chain-predictor --family chain)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import yaml

from data_pipeline.loading import load_tokenizer
from data_pipeline.testbed import task
from dynts import ImportancePredictor
from dynts.io import write_atomic
from trainers.predictor_data import PredictorDataModule
from trainers.predictor_metrics import MeanKendallTau, TopPercentOverlap


def critical_in_top(scores: torch.Tensor, critical: list[int], percent: float) -> tuple[int, int]:
    """``(hits, total)``: critical thinking indices among the top ``percent`` % of ``scores``."""
    k = max(1, math.ceil(percent / 100 * scores.numel()))
    top = set(scores.topk(k).indices.tolist())
    return sum(c in top for c in critical), len(critical)


def _add(counter: list[int], hits_total: tuple[int, int]) -> None:
    counter[0] += hits_total[0]
    counter[1] += hits_total[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/predictor/testbed.yaml", help="the train-predictor config")
    parser.add_argument("--predictor", default="checkpoints/testbed-predictor")
    parser.add_argument("--family", default="copy", help="task family of the traces: copy, or chain "
                        "(with --config configs/predictor/testbed-chain.yaml --predictor checkpoints/testbed-chain-predictor)")
    parser.add_argument("--top", type=float, default=20.0, help="percent for the critical-token check")
    parser.add_argument("--generate", type=int, default=0, help="also run dynts.generate on N fresh problems")
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--local-window", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(2)

    cfg = yaml.safe_load(Path(args.config).read_text())
    data_cfg = dict(cfg["data"])
    dm = PredictorDataModule(**data_cfg)
    dm.setup("fit")
    tokenizer = load_tokenizer(data_cfg.get("backbone", "testbed"))
    predictor = ImportancePredictor.from_pretrained(args.predictor).eval()

    # 1. attention importance vs ground-truth critical tokens, over every trace and the held-out ones
    data = dm.train_set.data
    heldout = set(dm.val_set.indices)
    counts = {k: [0, 0] for k in ("attention_all", "attention_heldout", "predictor_heldout", "recency_heldout")}
    first = traces = 0
    kendall, overlap = MeanKendallTau(), TopPercentOverlap(30.0)
    for i, row in enumerate(data):
        tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
        q, a = row["question_len"], row["answer_start"]
        critical = [c - q for c in task.find_critical_positions(tokens, family=args.family) if q <= c < a]
        if not critical:
            continue
        scores = torch.tensor(row["importance"][q:a])
        _add(counts["attention_all"], critical_in_top(scores, critical, args.top))
        traces += 1
        first += int(scores.argmax().item() in critical)
        if i in heldout:
            _add(counts["attention_heldout"], critical_in_top(scores, critical, args.top))
            _add(counts["recency_heldout"], critical_in_top(torch.arange(a - q, dtype=torch.float), critical, args.top))
            item = dm.val_set[dm.val_set.indices.index(i)]
            with torch.no_grad():
                _add(counts["predictor_heldout"], critical_in_top(predictor(item["hidden"]), critical, args.top))

    # 2. predictor vs attention importance on held-out questions (every held-out trace)
    with torch.no_grad():
        for batch in dm.val_dataloader():
            preds = predictor(batch["hidden"])
            kendall.update(preds, batch["target"], batch["mask"])
            overlap.update(preds, batch["target"], batch["mask"])

    top = f"top{args.top:g}pct"
    rate = {k: h / max(n, 1) for k, (h, n) in counts.items()}
    report = {
        "traces": len(data),
        "traces_with_critical_token": traces,
        f"attention_critical_in_{top}": rate["attention_all"],
        "attention_critical_ranked_first": first / max(traces, 1),
        "heldout_questions": len(dm.val_questions),
        "heldout_traces": len(dm.val_set),
        "heldout_critical_tokens": counts["attention_heldout"][1],
        "predictor_heldout_kendall": float(kendall.compute()),
        "predictor_heldout_top30_overlap": float(overlap.compute()),
        f"attention_critical_in_{top}_heldout": rate["attention_heldout"],
        f"predictor_critical_in_{top}_heldout": rate["predictor_heldout"],
        f"recency_critical_in_{top}_heldout": rate["recency_heldout"],
        "predictor_params": sum(p.numel() for p in predictor.parameters()),
        "predictor_metrics_at_export": json.loads((Path(args.predictor) / "metrics.json").read_text())
        if (Path(args.predictor) / "metrics.json").is_file() else None,
    }

    # 3. optional: generation with the exported predictor
    if args.generate:
        import dynts
        from data_pipeline.questions import Question, encode_prompt
        from data_pipeline.testbed.task import check_answer, problem_set

        model, _ = dynts.load(data_cfg.get("backbone", "testbed"))
        problems = problem_set("predictor-report", args.generate, family=args.family)
        prompts = [encode_prompt(tokenizer, Question(p.name, p.question, str(p.answer))) for p in problems]
        ids = torch.tensor(prompts)  # every testbed prompt has 14 tokens
        sampling = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, pad_token_id=0)
        for method, kwargs in {
            "full": {"method": "full"},
            "dynts": {"method": "dynts", "predictor": args.predictor, "budget": args.budget, "local_window": args.local_window},
            "window": {"method": "window", "budget": args.budget, "local_window": args.local_window},
        }.items():
            torch.manual_seed(0)
            out = dynts.generate(model, input_ids=ids, max_new_tokens=1100, **kwargs, **sampling)
            texts = tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
            acc = sum(check_answer(p, t) for p, t in zip(problems, texts)) / len(problems)
            report[f"generate_{method}_accuracy"] = acc
            report[f"generate_{method}_peak_cache_tokens"] = out.stats["peak_cache_tokens"]
    print(json.dumps(report, indent=2))
    if args.out:  # atomic: a killed run leaves no half-written report
        write_atomic(Path(args.out), json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
