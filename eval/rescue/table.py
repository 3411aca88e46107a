"""One table over several ``dynts rescue bench`` runs: per run and base method, the KV-Rescue comparison
(pass@1 of full cache, eviction-only best-of-N and KV-Rescue; the recovered fraction; base tokens vs
best-of-N; the detector's firing by signal; the loop rate of best-of-N and KV-Rescue).

``python -m eval.rescue.table reports/rescue/B32-N4 reports/rescue/B64-N4 ... [--method dynts] [--write FILE] [--from-records]``

Every accuracy and the recovered fraction carry a bootstrap 95 % CI (problems resampled, 10,000
times, seed 0) and KV-Rescue is compared with best-of-N and with the full cache **paired** on the same
problems (difference in points, McNemar's exact p), from the per-problem records
(``<run>/records/*.json``, :mod:`eval.harness.records`; built from ``cells/*.json`` when absent).
``--from-records`` recomputes the whole table from ``records/*.json`` alone; ``--write-records``
writes them for runs that have only cells.

The loop rate is the share of problems whose answer is wrong because the trajectory wrote a step key
a second time (the testbed's ``loops`` class, :func:`eval.harness.testbed_errors.count_errors`);
``–`` off the testbed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from dynts.io import write_atomic
from dynts.rescue.results import EXIT_SIGNALS
from eval.harness.loops import testbed_loops
from eval.harness.records import cell_record, per_question, read_records, unpack_bits, write_record
from eval.harness.stats import bootstrap_ci, mcnemar_exact, paired_difference, ratio_ci

__all__ = ["RESCUE_BITS", "RESCUE_INTS", "budget_label", "markdown", "paired_stats", "rows_from_records", "rescue_record",
           "rows", "run_records", "verifier_label", "write_records"]

RESCUE_BITS = ("correct", "looped")
RESCUE_INTS = ("output_tokens", "base_tokens", "helper_tokens", "committed_steps", "helper_steps", "base_candidates",
               "early_exits", *(f"exit_{k}" for k in EXIT_SIGNALS))


def budget_label(config: dict[str, Any]) -> str:
    """``B = 64`` (the physical bound) or ``paper B = 64 (+128)`` (score-selected + headroom)."""
    if config.get("paper_budget"):
        return f"paper B = {config['budget']} (+{config['headroom']})"
    return f"B = {config['budget']}"


def verifier_label(config: dict[str, Any]) -> str:
    """The PRM and whether the cross-step loop screen was on."""
    loop = (config.get("detector") or {}).get("loop")
    return f"{config['prm']}{' + loop screen' if loop else ''}"


def rescue_record(key: str, cell: dict[str, Any]) -> dict[str, Any]:
    """The compact per-problem record of one ``dynts rescue bench`` cell (``cells/<key>.json``):
    correct and, on the testbed, looped (a step key written twice) bits, and the cost counters."""
    testbed = str(cell["settings"].get("benchmark", "")).startswith("testbed")
    rows_ = [{**r, "looped": testbed and testbed_loops(r["text"])} for r in cell["records"]]
    meta = {"setting": cell["setting"], "method": cell["method"], "settings": cell["settings"], "testbed": testbed}
    return cell_record(key, meta, [r["id"] for r in rows_], 1, rows_, RESCUE_BITS, RESCUE_INTS)


def write_records(run_dir: str | Path) -> list[Path]:
    """``records/<key>.json`` for every cell of a rescue run (atomic writes)."""
    return [write_record(run_dir, rescue_record(p.stem, json.loads(p.read_text())))
            for p in sorted((Path(run_dir) / "cells").glob("*.json"))]


def run_records(run_dir: str | Path) -> dict[tuple[str, str | None], dict[str, Any]]:
    """Decoded records of a run by ``(setting, method)``: ``records/*.json``, else built from the
    cells; a pair with several cells (e.g. after a retrained PRM) is left out."""
    recs = read_records(run_dir)
    if not recs:
        for p in sorted((Path(run_dir) / "cells").glob("*.json")):
            rec = rescue_record(p.stem, json.loads(p.read_text()))
            rec["bits"] = {f: unpack_bits(v, len(rec["ids"])) for f, v in rec["bits"].items()}
            recs.append(rec)
    by: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for r in recs:
        by.setdefault((r["cell"]["setting"], r["cell"]["method"]), []).append(r)
    return {k: v[0] for k, v in by.items() if len(v) == 1}


def paired_stats(recs: dict[tuple[str, str | None], dict[str, Any]], method: str) -> dict[str, Any]:
    """Bootstrap 95 % CIs of A_full, A_BoN, A_KVR and the recovered fraction, and KV-Rescue minus
    best-of-N / minus the full cache paired on the problems (points, CI, McNemar exact)."""
    full, bon, kvr = recs.get(("full", None)), recs.get(("bon", method)), recs.get(("kvr", method))
    out: dict[str, Any] = {}
    for name, rec in (("A_full", full), ("A_evict(bon)", bon), ("A_kvr", kvr)):
        if rec is not None:
            out[f"{name}_ci"] = bootstrap_ci(per_question(rec))
    for name, other in (("kvr_minus_bon", bon), ("kvr_minus_full", full)):
        if kvr is not None and other is not None and kvr["ids"] == other["ids"]:
            out[name] = {**paired_difference(per_question(kvr), per_question(other)),
                         "mcnemar": mcnemar_exact(kvr["bits"]["correct"], other["bits"]["correct"])}
    if full is not None and bon is not None and kvr is not None and full["ids"] == bon["ids"] == kvr["ids"]:
        out["recovered_ci"] = ratio_ci([per_question(full), per_question(bon), per_question(kvr)],
                                       lambda f, b, k: (k - b) / (f - b))
    return out


def rows_from_records(run: str | Path, recs: dict[tuple[str, str | None], dict[str, Any]],
                         methods: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The rows of :func:`rows` recomputed from a run's records alone (in the order of ``methods``
    when given, else by method name)."""
    out = []
    full = recs.get(("full", None))
    rank = {m: i for i, m in enumerate(methods or ())}
    for (setting, method), kvr in sorted(recs.items(), key=lambda kv: (rank.get(kv[0][1], len(rank)), str(kv[0][1]))):
        bon = recs.get(("bon", method))
        if setting != "kvr" or bon is None or (methods and method not in methods):
            continue
        n = len(kvr["ids"])
        acc = lambda r: sum(r["bits"]["correct"]) / len(r["ids"])  # noqa: E731
        mean = lambda r, f: sum(r["ints"][f]) / len(r["ids"])  # noqa: E731
        loops = lambda r: (sum(l and not c for l, c in zip(r["bits"]["looped"], r["bits"]["correct"])) / len(r["ids"])  # noqa: E731
                           if r["cell"]["testbed"] else None)
        candidates = sum(kvr["ints"]["base_candidates"])
        settings = kvr["cell"]["settings"]
        row = {"run": str(run), "budget": budget_label(settings), "n": settings["n"], "problems": n,
               "verifier": verifier_label(settings), "method": method, "A_evict(bon)": acc(bon), "A_kvr": acc(kvr),
               "base_tokens_bon": mean(bon, "base_tokens"), "base_tokens_kvr": mean(kvr, "base_tokens"),
               "firing_by_signal": {k: sum(kvr["ints"][f"exit_{k}"]) / candidates if candidates else None for k in EXIT_SIGNALS},
               "loops_bon": loops(bon), "loops_kvr": loops(kvr)}
        row["base_token_reduction"] = 1 - row["base_tokens_kvr"] / row["base_tokens_bon"] if row["base_tokens_bon"] else None
        if full is not None:
            gap = acc(full) - acc(bon)
            row["A_full"] = acc(full)
            row["recovered_fraction"] = (acc(kvr) - acc(bon)) / gap if gap > 0 else None
        out.append({**row, "stats": paired_stats(recs, method)})
    return out


def rows(run_dirs: Sequence[str | Path], methods: Sequence[str] | None = None, from_records: bool = False) -> list[dict[str, Any]]:
    """One row per (run, base method) with a best-of-N and a KV-Rescue cell (only ``methods``, if
    given), with :func:`paired_stats`; ``from_records``: from ``records/*.json`` alone."""
    out = []
    for run in run_dirs:
        if from_records:
            recs = run_records(run)
            if not any(k[0] == "kvr" for k in recs):
                raise ValueError(f"{run} has no records/*.json with a KV-Rescue cell; write them with --write-records")
            out += rows_from_records(run, recs, methods)
            continue
        recs = run_records(run)
        summary = json.loads((Path(run) / "results.json").read_text())
        config = summary["config"]
        loops = {(d["setting"], d["method"]): d["loops"] / d["problems"] for d in summary.get("degeneration", [])}
        for method, r in summary.get("comparison", {}).items():
            if methods and method not in methods:
                continue
            out.append({"run": str(run), "budget": budget_label(config), "n": config["n"],
                        "problems": next(c["metrics"]["problems"] for c in summary["cells"] if c["method"] == method),
                        "verifier": verifier_label(config), "method": method, **r,
                        "loops_bon": loops.get(("bon", method)), "loops_kvr": loops.get(("kvr", method)),
                        "stats": paired_stats(recs, method)})
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _ci(ci: Sequence[float] | None, scale: float = 100, digits: int = 1) -> str:
    return "" if ci is None else f" [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]"


def _diff(t: dict[str, Any] | None) -> str:
    if t is None:
        return "–"
    p = t["mcnemar"]["p"]
    return f"{100 * t['diff']:+.1f} [{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}], p {p:.2g}"


def markdown(table: Sequence[dict[str, Any]]) -> str:
    """The table; accuracies and the recovered fraction with their bootstrap 95 % CIs, and KV-Rescue
    minus best-of-N / the full cache paired (points [CI], McNemar exact p), where records exist."""
    signals = "/".join(EXIT_SIGNALS)
    lines = [f"| budget | N | problems | verifier | base | A_full % | A_BoN % | A_KVR % | recovered | KVR − BoN | KVR − full | "
             f"base tok BoN | base tok KVR | base tokens vs BoN | firing {signals} % | loops BoN / KVR % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        st = r.get("stats") or {}
        rec = r.get("recovered_fraction")
        red = r.get("base_token_reduction")
        firing = " / ".join(_pct((r.get("firing_by_signal") or {}).get(k)) for k in EXIT_SIGNALS)
        lines.append(f"| {r['budget']} | {r['n']} + {r['n']} | {r['problems']} | {r['verifier']} | {r['method']} | "
                     f"{_pct(r.get('A_full'))}{_ci(st.get('A_full_ci'))} | {_pct(r['A_evict(bon)'])}{_ci(st.get('A_evict(bon)_ci'))} | "
                     f"**{_pct(r['A_kvr'])}**{_ci(st.get('A_kvr_ci'))} | "
                     f"{'–' if rec is None else f'**{rec:.2f}**' + _ci(st.get('recovered_ci'), 1, 2)} | "
                     f"{_diff(st.get('kvr_minus_bon'))} | {_diff(st.get('kvr_minus_full'))} | "
                     f"{r['base_tokens_bon']:.1f} | {r['base_tokens_kvr']:.1f} | "
                     f"{'–' if red is None else f'{-100 * red:+.0f} %'} | {firing} | "
                     f"{_pct(r['loops_bon'])} / {_pct(r['loops_kvr'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one KV-Rescue comparison table over several rescue bench runs")
    p.add_argument("runs", nargs="+", help="run directories of dynts rescue bench (each with results.json)")
    p.add_argument("--method", default=None, help="only these base methods (comma-separated)")
    p.add_argument("--write", default=None, help="also write the table to this file")
    p.add_argument("--from-records", action="store_true", help="recompute the table from each run's records/*.json alone")
    p.add_argument("--write-records", action="store_true", help="write records/*.json from each run's cells/*.json first")
    args = p.parse_args(argv)
    if args.write_records:
        for run in args.runs:
            write_records(run)
    if not args.from_records:
        missing = [r for r in args.runs if not (Path(r) / "results.json").is_file()]
        if missing:
            raise SystemExit(f"no results.json in {missing}: run dynts rescue bench --out DIR first (or --from-records)")
    try:
        text = markdown(rows(args.runs, args.method.split(",") if args.method else None, args.from_records))
    except ValueError as err:
        raise SystemExit(f"eval.rescue.table: {err}") from None
    print(text, end="")
    if args.write:
        write_atomic(Path(args.write), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
