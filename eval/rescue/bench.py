"""``dynts rescue``: KV-Rescue on a benchmark, with its baselines and the decode-cost columns of the
KV-Rescue paper (Fig. 5, Tables 1-2).

Settings (each a resumable cell, one JSON file):

* ``full``   -- the base with its full KV cache, plain sampling (the A_full reference);
* ``helper`` -- the helper alone, full cache, plain sampling;
* ``evict``  -- the evicted base, plain sampling (no steps, no PRM);
* ``bon``    -- eviction-only stepwise best-of-N (``n_base = N``, ``n_helper = 0``, no detector;
  the A_evict of the recovered fraction, as in the paper);
* ``kvr``    -- KV-Rescue, best-of-(N+N) with the online degeneration detector;
* ``kvr-noexit`` -- KV-Rescue without the detector (Table 2's "+ interleaving" row);

and the two controls of the step search, method-independent (one cell each, like ``full``):

* ``helper-search`` -- the helper alone through the same stepwise search: no base model at all
  (``n_base = 0``), ``n_helper = 2 N``, so that every step scores as many candidates as
  KV-Rescue's ``N + N``; the same verifier and step limits. What the helper plus the search buys
  without the base: KV-Rescue minus this is what the base contributes;
* ``full-search`` -- KV-Rescue (``N + N``, detector on) with an unevicted, full-cache base: what the
  search buys without eviction.

Examples::

    dynts rescue bench --benchmark testbed:n=40,set=test --base testbed --helper testbed-helper \\
        --prm testbed-prm-order --method dynts,window --predictor checkpoints/testbed-predictor \\
        --budget 64 --local-window 16 --n 4 --delimiter ';' --out reports/rescue-testbed
    dynts rescue generate --base testbed --helper testbed-helper --prm testbed-prm-order --method window \\
        --budget 64 --local-window 16 --delimiter ';' --chat "a 6 b 6 c 0 d 4 e 8 find r2"

Re-running the same ``bench`` command resumes: finished cells are read back. The step scorers that
``prm`` names are in :mod:`eval.rescue.verifiers`; ``results.md`` is :func:`eval.rescue.table.summary_table`.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dynts.io import write_atomic
from dynts.rescue.results import EXIT_SIGNALS
from eval.rescue.config import SETTINGS, RescueEvalConfig, check_settings
from eval.rescue.oracle_choice import oracle_choice, plot_oracle_choice
from eval.rescue.table import CONTROLS, SEARCHES, STEPWISE, control_columns, summary_table, write_records
from eval.rescue.verifiers import load_eval_prm

__all__ = ["CONTROLS", "RescueEvalConfig", "cell_names", "check_settings", "SETTINGS", "STEPWISE", "evaluate"]


def helper_options(load_options: dict[str, Any]) -> dict[str, Any]:
    """The helper's load options: the base's placement, without the base's adapter."""
    return {k: v for k, v in load_options.items() if k not in ("adapter", "merge_adapter")}


def load_model(name: str, **load_options: Any):
    """``(model, tokenizer)`` through :func:`dynts.load` (``dtype``, ``device``, ``device_map``, ...)."""
    import dynts

    return dynts.load(name, **load_options)


def _plain(model, tokenizer, prompts, config: RescueEvalConfig, method: str, max_tokens: int) -> tuple[list[str], list[int], float]:
    """Plain sampling (``dynts.generate``) of every prompt under ``method`` (``"full"``: the full cache);
    texts, generated lengths and seconds."""
    import dynts

    from dynts.prompts import pad_rows, pad_id

    texts, lengths, seconds = [], [], 0.0
    pad = pad_id(tokenizer)
    eviction, search = config.eviction(method), config.search
    for start in range(0, len(prompts), 32):
        torch.manual_seed(search.seed * 1_000_003 + start)
        ids, mask = pad_rows(prompts[start : start + 32], pad)
        out = dynts.generate(model, tokenizer, input_ids=ids, attention_mask=mask, eviction=eviction, max_new_tokens=max_tokens,
                             do_sample=True, temperature=search.temperature, top_p=search.top_p, top_k=search.top_k)
        texts += out.texts
        lengths += out.stats["lengths"]
        seconds += out.stats["seconds"]
    return texts, lengths, seconds


def _cell(config: RescueEvalConfig, setting: str, method: str | None, models: dict, bench, prompts) -> dict[str, Any]:
    from dynts.rescue import rescue_generate

    max_tokens = config.max_tokens or bench.max_new_tokens
    base, tokenizer = models["base"]
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    if setting in ("full", "helper", "evict"):
        delimiter = config.search.step_delimiter
        model, tok = models["helper"] if setting == "helper" else models["base"]
        name = method if setting == "evict" else "full"
        texts, lengths, _ = _plain(model, tok, prompts, config, name, max_tokens)
        for ex, text, length in zip(bench.examples, texts, lengths):
            steps = text.count(delimiter) + (not text.rstrip().endswith(delimiter.strip() or delimiter))
            records.append({"id": ex.id, "text": text, "output_tokens": length, "committed_steps": steps,
                            "base_tokens": length if setting != "helper" else 0, "helper_tokens": length if setting == "helper" else 0,
                            "ended": "eos" if length < max_tokens else "max_tokens"})
    else:  # one stepwise engine for every search: the settings differ in candidates, detector and base cache
        search = config.step_search(setting, max_tokens)
        helper = models["helper"][0] if search.n_helper else None
        chats = [[{"role": "user", "content": p}] for p in models["messages"]]
        eviction = config.eviction("full" if setting in CONTROLS else method)
        result = rescue_generate(base, helper, models["prm"], tokenizer, chats, config=search, eviction=eviction)
        for ex, problem in zip(bench.examples, result.problems):
            records.append({"id": ex.id, "text": problem.text, "ended": problem.end, "sources": "".join(s[0] for s in problem.sources),
                            **{k: v for k, v in problem.stats.items() if k != "end"}})
    seconds = time.perf_counter() - start
    for ex, rec in zip(bench.examples, records):
        grade = bench.grader.grade(ex.answer, rec["text"])
        rec["correct"], rec["extracted"] = bool(grade.correct), grade.extracted
    return {"setting": setting, "method": method, "seconds": seconds, "settings": config.cell_settings(setting, method),
            "metrics": metrics(records, config.degen_steps), "records": records}


def metrics(records: Sequence[dict[str, Any]], degen_steps: int) -> dict[str, Any]:
    """pass@1 and the paper's decode-cost columns, means over problems."""
    mean = lambda key: statistics.mean(r.get(key, 0) for r in records)  # noqa: E731
    candidates = sum(r.get("base_candidates", 0) for r in records)
    steps = sum(r["committed_steps"] for r in records)
    return {
        "problems": len(records),
        "accuracy": mean("correct"),
        "degeneration": sum((not r["correct"]) and r["committed_steps"] >= degen_steps for r in records) / len(records),
        "length_capped": sum(r["ended"] != "eos" for r in records) / len(records),
        "committed_steps": mean("committed_steps"),
        "output_tokens": mean("output_tokens"),
        "base_tokens": mean("base_tokens"),
        "helper_tokens": mean("helper_tokens"),
        "early_exit": sum(r.get("early_exits", 0) for r in records) / candidates if candidates else None,
        "exit_by_signal": {k: sum(r.get(f"exit_{k}", 0) for r in records) / candidates if candidates else None
                           for k in EXIT_SIGNALS},
        "helper_share": sum(r.get("helper_steps", 0) for r in records) / steps if steps else 0.0,
    }


def _cells(config: RescueEvalConfig) -> list[tuple[str, str | None]]:
    """The run's cells as ``(setting, method)``, in run order (``method`` None: method-independent)."""
    cells: list[tuple[str, str | None]] = [(s, None) for s in ("full", "helper", *CONTROLS) if s in config.settings]
    return cells + [(s, m) for m in config.methods for s in ("evict", *STEPWISE) if s in config.settings]


def _name(setting: str, method: str | None) -> str:
    return setting if method is None else f"{setting}-{method}"


def cell_names(config: RescueEvalConfig) -> list[str]:
    """Each cell's name (``full``, ``kvr-window``, ...: its setting and base method), what a final run's ledger
    line declares as its methods."""
    return [_name(s, m) for s, m in _cells(config)]


def evaluate(config: RescueEvalConfig, log=print, after_cell: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Run (or resume) every cell; write ``cells/*.json``, ``results.json`` and ``results.md`` under
    ``config.out``; return the results. ``after_cell(file stem, cell name)`` is called as each cell is
    finished (computed or read back)."""
    from eval.harness.benchmarks import load_benchmark
    from eval.harness.prompts import encode_prompts, user_message

    out = Path(config.out)
    bench = load_benchmark(config.benchmark).head(config.limit)
    models: dict[str, Any] = {"base": load_model(config.base, **config.load_options)}
    if {"helper", "kvr", "kvr-noexit", *CONTROLS} & set(config.settings):
        models["helper"] = load_model(config.helper, **helper_options(config.load_options))
    if set(SEARCHES) & set(config.settings):
        models["prm"] = load_eval_prm(config.prm, config.search.step_delimiter, config.trust_remote_code, config.load_options)
    tokenizer = models["base"][1]
    models["messages"] = [user_message(e, bench) for e in bench.examples]
    prompts = encode_prompts(tokenizer, models["messages"])
    results = []
    for setting, method in _cells(config):
        key = _name(setting, method)
        digest = hashlib.sha256(json.dumps(config.cell_settings(setting, method), sort_keys=True, default=str).encode()).hexdigest()[:10]
        path = out / "cells" / f"{key}-{digest}.json"
        if path.is_file():
            cell = json.loads(path.read_text())
        else:
            cell = _cell(config, setting, method, models, bench, prompts)
            write_atomic(path, json.dumps(cell, indent=1))
        if after_cell:
            after_cell(path.stem, key)
        m = cell["metrics"]
        log(f"{key:22s} acc {m['accuracy']:.3f}  base tok {m['base_tokens']:8.1f}  helper share {m['helper_share']:.3f}  ({cell['seconds']:.0f} s)")
        results.append(cell)
    summary = {"config": config.record(), "cells": [{k: c[k] for k in ("setting", "method", "seconds", "metrics")} for c in results]}
    summary["comparison"] = compare(summary["cells"], config.methods)
    by = {(c["setting"], c["method"]): c["records"] for c in results}
    if ("full", None) in by and ("helper", None) in by:
        summary["oracle_choice"] = {m: oracle_choice(by[("full", None)], by[("evict", m)], by[("helper", None)])
                                    for m in config.methods if ("evict", m) in by}
        if summary["oracle_choice"]:
            kvr = {m: r["A_kvr"] for m, r in summary["comparison"].items()}
            plot_oracle_choice(summary["oracle_choice"], out / "oracle_choice.png", kvr=kvr)
    if config.benchmark.startswith("testbed"):
        summary["degeneration"] = degeneration(results, bench)
    write_atomic(out / "results.json", json.dumps(summary, indent=2, default=str))
    write_atomic(out / "results.md", summary_table(summary))
    write_records(out)  # records/<key>.json: the compact per-problem results (eval.rescue.table)
    return summary


def degeneration(cells: Sequence[dict[str, Any]], bench: Any) -> list[dict[str, Any]]:
    """Testbed only: what each cell's wrong answers did (stops early / wrong value / loops /
    incoherent, :func:`eval.harness.testbed_errors.count_errors`)."""
    from eval.harness.testbed_errors import count_errors

    problems = {ex.id: ex.answer for ex in bench.examples}
    return [{"setting": c["setting"], "method": c["method"], "problems": len(c["records"]),
             **count_errors(problems, c["records"], degeneration=True)} for c in cells]


def compare(cells: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per base method with a KV-Rescue cell: the recovered fraction ``(A_KVR - A_evict) / (A_full -
    A_evict)`` (A_evict = eviction-only best-of-N, as in the paper; ``None`` without a best-of-N cell),
    base tokens of KV-Rescue vs best-of-N, helper share, the detector's firing rate, and the controls
    (:func:`eval.rescue.table.control_columns`: helper-search and full-search accuracy, the base's
    share of committed steps in every stepwise cell)."""
    by = {(c["setting"], c["method"]): c["metrics"] for c in cells}
    full = by.get(("full", None))
    out = {}
    for m in methods:
        bon, kvr = by.get(("bon", m)), by.get(("kvr", m))
        if not kvr:
            continue
        row = {"A_evict(bon)": bon["accuracy"] if bon else None, "A_kvr": kvr["accuracy"],
               "base_tokens_bon": bon["base_tokens"] if bon else None, "base_tokens_kvr": kvr["base_tokens"],
               "base_token_reduction": 1 - kvr["base_tokens"] / bon["base_tokens"] if bon and bon["base_tokens"] else None,
               "helper_share": kvr["helper_share"], "detector_firing_rate": kvr["early_exit"],
               "firing_by_signal": kvr.get("exit_by_signal", {})}
        if full:
            row["A_full"] = full["accuracy"]
            gap = full["accuracy"] - bon["accuracy"] if bon else 0
            row["recovered_fraction"] = (kvr["accuracy"] - bon["accuracy"]) / gap if gap > 0 else None
        out[m] = {**row, **control_columns(by, m)}
    return out
