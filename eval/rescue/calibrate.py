"""Detector calibration for a new model (KV-Rescue paper, Fig. 3): ``dynts rescue calibrate``."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Sequence

from eval.rescue.bench import load_model
from eval.rescue.config import RescueEvalConfig
from eval.rescue.verifiers import load_eval_prm, testbed_step_verifier

__all__ = ["calibrate"]


def calibrate(config: RescueEvalConfig, method: str, log=print, verify: bool = False) -> dict[str, Any]:
    """Paper Fig. 3 for a new model: run eviction-only best-of-N with a detector that never fires and
    record, per base candidate, the peak moving-average entropy and the lowest gzip ratio. Candidates
    that ran to ``max_step_tokens`` without a delimiter are the runaways (label-free proxy); the
    result lists each signal's quantiles for both groups and the firing rates of candidate
    thresholds, to pick ``tau_ent`` / ``tau_cmp`` on a dev set. With ``verify`` (testbed only) it
    also reports the PRM's AUROC at telling the candidates the exact step checker accepts from the
    ones it rejects."""
    from eval.harness.benchmarks import load_benchmark
    from eval.harness.prompts import user_message

    from dynts.rescue import rescue_generate

    bench = load_benchmark(config.benchmark).head(config.limit)
    (base, tokenizer) = load_model(config.base, **config.load_options)
    prm = load_eval_prm(config.prm, config.search.step_delimiter, config.trust_remote_code, config.load_options)
    silent = replace(config.search.detector, entropy_threshold=1e9, compress_threshold=1e-9)  # records, never fires
    rows: list[tuple[bool, float, float]] = []
    judged: list[tuple[float, int]] = []  # (PRM score, exact verifier label) of complete candidates (testbed)

    def record(c) -> None:
        if c.source == "base" and c.screen is not None:
            rows.append((c.status == "cap", c.screen.max_mean_entropy, c.screen.min_ratio))
        if verify and c.complete and c.score is not None:
            steps = [s.text for s in c.owner.steps] + [tokenizer.decode(c.tokens, skip_special_tokens=True)]
            judged.append((c.score, int(testbed_step_verifier(c.owner.question, steps))))

    chats = [[{"role": "user", "content": user_message(e, bench)}] for e in bench.examples]
    search = replace(config.step_search("bon", config.max_tokens or bench.max_new_tokens), detector=silent)
    rescue_generate(base, None, prm, tokenizer, chats, config=search, eviction=config.eviction(method), on_candidate=record)
    result: dict[str, Any] = {"candidates": len(rows), "capped": sum(r[0] for r in rows)}
    if verify:
        from trainers.testbed_prm import auroc

        result["prm_vs_verifier"] = {"candidates": len(judged), "accepted": sum(y for _, y in judged),
                                     "auroc": auroc([x for x, _ in judged], [y for _, y in judged])}
    for name, col, higher in (("entropy", 1, True), ("gzip", 2, False)):
        groups = {g: sorted(r[col] for r in rows if r[0] == (g == "capped") and math.isfinite(r[col])) for g in ("capped", "other")}
        result[name] = {g: [v[int(q * (len(v) - 1))] for q in (0.05, 0.25, 0.5, 0.75, 0.95)] if v else [] for g, v in groups.items()}
        cuts = sorted({round(v, 2) for vs in groups.values() for v in vs})
        rates = []
        for cut in cuts:
            rates.append((cut, *(sum((v > cut) if higher else (v < cut) for v in groups[g]) / max(1, len(groups[g]))
                                 for g in ("capped", "other"))))
        result[name]["firing(cut, capped, other)"] = rates[:: max(1, len(rates) // 25)]
    log(json.dumps({k: v for k, v in result.items() if k not in ("entropy", "gzip")}))
    for name in ("entropy", "gzip"):
        log(f"{name}: quantiles 5/25/50/75/95% capped {_rounded(result[name]['capped'])} other {_rounded(result[name]['other'])}")
        log("  firing rate at cut (capped, other): " + " ".join(f"{c:g}:({a:.2f},{b:.2f})" for c, a, b in result[name]["firing(cut, capped, other)"]))
    return result


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, 3) for v in values]
