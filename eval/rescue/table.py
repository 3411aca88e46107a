"""One table over several ``dynts rescue bench`` runs: per run and base method, the KV-Rescue comparison
(pass@1 of full cache, eviction-only best-of-N and KV-Rescue; the recovered fraction; base tokens vs
best-of-N; the detector's firing by signal; the loop rate of best-of-N and KV-Rescue), then its
controls: the helper alone through the same step search (``helper-search``: 2N helper candidates per
step, no base) and KV-Rescue with a full-cache base (``full-search``), next to A_full / A_BoN / A_KVR,
and the base's share of the committed steps in every stepwise cell (the helper's is the rest).

``python -m eval.rescue.table reports/rescue/B32-N4 reports/rescue/B64-N4 ... [--method dynts] [--write FILE] [--from-records]``

Every accuracy and the recovered fraction carry a bootstrap 95 % CI (problems resampled, 10,000
times, seed 0) and KV-Rescue is compared with best-of-N, the full cache, helper-search and full-search
**paired** on the same problems (difference in points, McNemar's exact p, Holm-adjusted over the table's
comparisons, TOST within ±3 points, and a verdict: :func:`eval.harness.stats.table_verdicts`), from the per-problem records
(``<run>/records/*.json``, :mod:`eval.harness.records`; built from ``cells/*.json`` when absent).
``--from-records`` recomputes the whole table from ``records/*.json`` alone; ``--write-records``
writes them for runs that have only cells.

:func:`summary_table` is the ``results.md`` of one run (``dynts rescue bench`` writes it): a row per
cell (pass@1 and decode cost), then the recovery comparison, the oracle choice and, on the testbed,
what the wrong answers did.

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
from eval.harness.stats import bootstrap_ci, paired_test, ratio_ci, table_verdicts
from eval.rescue.oracle_choice import oracle_choice_table

__all__ = ["CONTROLS", "DIFFERENCES", "judged", "RESCUE_BITS", "RESCUE_INTS", "SEARCHES", "STEPWISE", "budget_label", "control_columns", "controls_markdown", "markdown", "paired_stats", "rows_from_records", "rescue_record",
           "rows", "run_records", "summary_table", "verifier_label", "write_records"]

# The stepwise settings of eval.rescue.bench (defined here, which the bench imports).
STEPWISE = ("bon", "kvr", "kvr-noexit")  # stepwise cells, one per base method
CONTROLS = ("helper-search", "full-search")  # stepwise cells, method-independent
SEARCHES = (*STEPWISE, *CONTROLS)  # every stepwise cell: each committed step is the base's or the helper's
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


def _cell_of(setting: str, method: str | None) -> tuple[str, str | None]:
    return (setting, None if setting in CONTROLS else method)


def control_columns(metrics: dict[tuple[str, str | None], dict[str, Any]], method: str) -> dict[str, Any]:
    """The controls of base ``method``'s KV-Rescue row from cell metrics by ``(setting, method)``
    (``accuracy``, ``committed_steps`` and ``helper_share``, as :func:`eval.rescue.bench.metrics` writes
    them): helper-search and full-search accuracy, and per stepwise cell the base's share of the
    committed steps (``None`` when the cell is absent or committed nothing)."""
    acc = lambda s: metrics[(s, None)]["accuracy"] if (s, None) in metrics else None  # noqa: E731
    share = {}
    for s in SEARCHES:
        m = metrics.get(_cell_of(s, method))
        share[s] = 1 - m["helper_share"] if m and m["committed_steps"] else None
    return {"A_helper_search": acc("helper-search"), "A_full_search": acc("full-search"), "base_step_share": share}


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
    """Bootstrap 95 % CIs of A_full, A_BoN, A_KVR, the two controls and the recovered fraction, and
    KV-Rescue minus best-of-N / the full cache / helper-search / full-search paired on the problems
    (points, CI, McNemar exact)."""
    full, bon, kvr = recs.get(("full", None)), recs.get(("bon", method)), recs.get(("kvr", method))
    helper_search, full_search = recs.get(("helper-search", None)), recs.get(("full-search", None))
    out: dict[str, Any] = {}
    for name, rec in (("A_full", full), ("A_evict(bon)", bon), ("A_kvr", kvr), ("A_helper_search", helper_search),
                      ("A_full_search", full_search)):
        if rec is not None:
            out[f"{name}_ci"] = bootstrap_ci(per_question(rec))
    for name, other in (("kvr_minus_bon", bon), ("kvr_minus_full", full), ("kvr_minus_helper_search", helper_search),
                        ("kvr_minus_full_search", full_search)):
        if kvr is not None and other is not None and kvr["ids"] == other["ids"]:
            out[name] = paired_test(per_question(kvr), per_question(other), 1, (kvr["bits"]["correct"], other["bits"]["correct"]))
    if full is not None and bon is not None and kvr is not None and full["ids"] == bon["ids"] == kvr["ids"]:
        out["recovered_ci"] = ratio_ci([per_question(full), per_question(bon), per_question(kvr)],
                                       lambda f, b, k: (k - b) / (f - b))
    return out


def _acc(r: dict[str, Any] | None) -> float | None:
    return None if r is None else sum(r["bits"]["correct"]) / len(r["ids"])


def _mean(r: dict[str, Any] | None, f: str) -> float | None:
    return None if r is None else sum(r["ints"][f]) / len(r["ids"])


def _loops(r: dict[str, Any] | None) -> float | None:
    if r is None or not r["cell"]["testbed"]:
        return None
    return sum(l and not c for l, c in zip(r["bits"]["looped"], r["bits"]["correct"])) / len(r["ids"])


def _helper_share(r: dict[str, Any]) -> float:
    """The helper's share of the committed steps, pooled over problems (as the bench's metrics)."""
    steps = sum(r["ints"]["committed_steps"])
    return sum(r["ints"]["helper_steps"]) / steps if steps else 0.0


def rows_from_records(run: str | Path, recs: dict[tuple[str, str | None], dict[str, Any]],
                         methods: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The rows of :func:`rows` recomputed from a run's records alone (in the order of ``methods``
    when given, else by method name)."""
    out = []
    full = recs.get(("full", None))
    rank = {m: i for i, m in enumerate(methods or ())}
    metrics = {k: {"accuracy": _acc(r), "committed_steps": sum(r["ints"]["committed_steps"]), "helper_share": _helper_share(r)}
               for k, r in recs.items()}  # what control_columns reads, as the bench's cell metrics
    for (setting, method), kvr in sorted(recs.items(), key=lambda kv: (rank.get(kv[0][1], len(rank)), str(kv[0][1]))):
        bon = recs.get(("bon", method))
        if setting != "kvr" or (methods and method not in methods):
            continue
        n = len(kvr["ids"])
        candidates = sum(kvr["ints"]["base_candidates"])
        settings = kvr["cell"]["settings"]
        row = {"run": str(run), "budget": budget_label(settings), "n": settings["n"], "problems": n,
               "verifier": verifier_label(settings), "method": method, "A_evict(bon)": _acc(bon), "A_kvr": _acc(kvr),
               "base_tokens_bon": _mean(bon, "base_tokens"), "base_tokens_kvr": _mean(kvr, "base_tokens"),
               "firing_by_signal": {k: sum(kvr["ints"][f"exit_{k}"]) / candidates if candidates else None for k in EXIT_SIGNALS},
               "loops_bon": _loops(bon), "loops_kvr": _loops(kvr)}
        row["base_token_reduction"] = 1 - row["base_tokens_kvr"] / row["base_tokens_bon"] if row["base_tokens_bon"] else None
        if full is not None:
            gap = _acc(full) - _acc(bon) if bon is not None else 0
            row["A_full"] = _acc(full)
            row["recovered_fraction"] = (_acc(kvr) - _acc(bon)) / gap if gap > 0 else None
        out.append({**row, **control_columns(metrics, method), "stats": paired_stats(recs, method)})
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
        metrics = {(c["setting"], c["method"]): c["metrics"] for c in summary["cells"]}
        for method, r in summary.get("comparison", {}).items():
            if methods and method not in methods:
                continue
            out.append({"run": str(run), "budget": budget_label(config), "n": config["n"],
                        "problems": next(c["metrics"]["problems"] for c in summary["cells"] if c["method"] == method),
                        "verifier": verifier_label(config), "method": method, **r,
                        **control_columns(metrics, method),  # from the cells: results.json of earlier runs lack them
                        "loops_bon": loops.get(("bon", method)), "loops_kvr": loops.get(("kvr", method)),
                        "stats": paired_stats(recs, method)})
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _ci(ci: Sequence[float] | None, scale: float = 100, digits: int = 1) -> str:
    return "" if ci is None else f" [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]"


DIFFERENCES = ("kvr_minus_bon", "kvr_minus_full", "kvr_minus_helper_search", "kvr_minus_full_search")


def judged(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows with every KV-Rescue difference (:data:`DIFFERENCES`) Holm-adjusted over the
    whole table and given its verdict (:func:`eval.harness.stats.table_verdicts`)."""
    where = [(i, name) for i, r in enumerate(table) for name in DIFFERENCES if (r.get("stats") or {}).get(name)]
    out = [{**r, "stats": dict(r.get("stats") or {})} for r in table]
    for (i, name), t in zip(where, table_verdicts([table[i]["stats"][name] for i, name in where])):
        out[i]["stats"][name] = t
    return out


def _diff(t: dict[str, Any] | None) -> str:
    if t is None:
        return "–"
    p = t["mcnemar"]["p"]
    text = f"{100 * t['diff']:+.1f} [{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}], p {p:.2g}"
    return text + (f", Holm {t['p_holm']:.2g}, {t['verdict']}" if "verdict" in t else "")


def _tokens(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def markdown(table: Sequence[dict[str, Any]]) -> str:
    """The table; accuracies and the recovered fraction with their bootstrap 95 % CIs, the helper alone
    through the same search (``helper-search``) beside KV-Rescue, and KV-Rescue minus best-of-N /
    helper-search / the full cache paired (points [CI], McNemar exact p, Holm p over the table, verdict),
    where records exist; then the controls table (:func:`controls_markdown`). Nothing is bold: the
    recovered fraction measures the search with a full-context verifier as much as the base."""
    table = judged(table)
    signals = "/".join(EXIT_SIGNALS)
    lines = [f"| budget | N | problems | verifier | base | A_full % | A_BoN % | A_KVR % | A_helper-search % | recovered | KVR − BoN | "
             f"KVR − helper-search | KVR − full | base tok BoN | base tok KVR | base tokens vs BoN | firing {signals} % | loops BoN / KVR % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        st = r.get("stats") or {}
        rec = r.get("recovered_fraction")
        red = r.get("base_token_reduction")
        firing = " / ".join(_pct((r.get("firing_by_signal") or {}).get(k)) for k in EXIT_SIGNALS)
        lines.append(f"| {r['budget']} | {r['n']} + {r['n']} | {r['problems']} | {r['verifier']} | {r['method']} | "
                     f"{_pct(r.get('A_full'))}{_ci(st.get('A_full_ci'))} | {_pct(r['A_evict(bon)'])}{_ci(st.get('A_evict(bon)_ci'))} | "
                     f"{_pct(r['A_kvr'])}{_ci(st.get('A_kvr_ci'))} | "
                     f"{_pct(r.get('A_helper_search'))}{_ci(st.get('A_helper_search_ci'))} | "
                     f"{'–' if rec is None else f'{rec:.2f}' + _ci(st.get('recovered_ci'), 1, 2)} | "
                     f"{_diff(st.get('kvr_minus_bon'))} | {_diff(st.get('kvr_minus_helper_search'))} | {_diff(st.get('kvr_minus_full'))} | "
                     f"{_tokens(r['base_tokens_bon'])} | {_tokens(r['base_tokens_kvr'])} | "
                     f"{'–' if red is None else f'{-100 * red:+.0f} %'} | {firing} | "
                     f"{_pct(r['loops_bon'])} / {_pct(r['loops_kvr'])} |")
    return "\n".join(lines) + "\n" + (("\n" + controls_markdown(table)) if table else "")


def controls_markdown(table: Sequence[dict[str, Any]]) -> str:
    """Per row: A_full / A_BoN / A_KVR next to the controls, helper-search (the helper alone, 2N
    candidates per step, same verifier and step limits) and full-search (KV-Rescue with a full-cache
    base), with bootstrap 95 % CIs; KV-Rescue minus each control paired (points [CI], McNemar exact p);
    and the base's share of the committed steps in each stepwise cell (the helper's is the rest)."""
    table = judged(table)
    names = {"bon": "BoN", "kvr": "KVR", "kvr-noexit": "KVR no-exit", "full-search": "full-search", "helper-search": "helper-search"}
    lines = ["Controls: helper-search = the helper alone through the same step search (2N helper candidates per step, "
             "as many as KV-Rescue's N + N; no base); full-search = KV-Rescue with a full-cache base. "
             "Base steps = the base's share of the committed steps (the helper's is the rest).", "",
             "| budget | N | problems | verifier | base | A_full % | A_BoN % | A_KVR % | A_helper-search % | A_full-search % | "
             "KVR − helper-search | KVR − full-search | base steps % " + " / ".join(names.values()) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        st = r.get("stats") or {}
        share = r.get("base_step_share") or {}
        lines.append(f"| {r['budget']} | {r['n']} + {r['n']} | {r['problems']} | {r['verifier']} | {r['method']} | "
                     f"{_pct(r.get('A_full'))}{_ci(st.get('A_full_ci'))} | {_pct(r['A_evict(bon)'])}{_ci(st.get('A_evict(bon)_ci'))} | "
                     f"{_pct(r['A_kvr'])}{_ci(st.get('A_kvr_ci'))} | "
                     f"{_pct(r.get('A_helper_search'))}{_ci(st.get('A_helper_search_ci'))} | "
                     f"{_pct(r.get('A_full_search'))}{_ci(st.get('A_full_search_ci'))} | "
                     f"{_diff(st.get('kvr_minus_helper_search'))} | {_diff(st.get('kvr_minus_full_search'))} | "
                     + " / ".join(_pct(share.get(s)) for s in names) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)):  # means of 0/1 outcomes can come back as ints
        return f"{100 * v:.1f}" if pct else f"{v:.1f}"
    return str(v)


def _by_signal(rates: dict[str, Any] | None) -> str:
    """Firing rates per detector signal as ``a / b / c / d`` (percent of base candidates)."""
    rates = rates or {}
    return " / ".join(_fmt(rates.get(k), True) for k in EXIT_SIGNALS)


def _sides(setting: str, m: dict[str, Any]) -> str:
    """``base / helper`` percent of a stepwise cell's committed steps (``–`` for plain sampling)."""
    if setting not in SEARCHES or not m["committed_steps"]:
        return "–"
    return f"{_fmt(1 - m['helper_share'], True)} / {_fmt(m['helper_share'], True)}"


def summary_table(summary: dict[str, Any]) -> str:
    """Markdown: one row per cell (accuracy and decode cost), then the recovery comparison."""
    signals = "/".join(EXIT_SIGNALS)
    lines = [f"| setting | base method | pass@1 % | degen. % | capped % | steps | out. len | base tok | helper tok | early exit % | exit {signals} % | steps base / helper % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        m = c["metrics"]
        lines.append(f"| {c['setting']} | {c['method'] or '–'} | {_fmt(m['accuracy'], True)} | {_fmt(m['degeneration'], True)} | "
                     f"{_fmt(m['length_capped'], True)} | {_fmt(m['committed_steps'])} | {_fmt(m['output_tokens'])} | "
                     f"{_fmt(m['base_tokens'])} | {_fmt(m['helper_tokens'])} | {_fmt(m['early_exit'], True)} | "
                     f"{_by_signal(m.get('exit_by_signal'))} | {_sides(c['setting'], m)} |")
    comp = summary.get("comparison") or {}
    if comp:
        lines += ["", f"| base method | A_full % | A_evict (BoN) % | A_KVR % | A_helper-search % | A_full-search % | recovered | base tok BoN | base tok KVR | reduction % | helper share % | detector firing % | firing {signals} % |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m, r in comp.items():
            rec = r.get("recovered_fraction")
            lines.append(f"| {m} | {_fmt(r.get('A_full'), True)} | {_fmt(r['A_evict(bon)'], True)} | {_fmt(r['A_kvr'], True)} | "
                         f"{_fmt(r.get('A_helper_search'), True)} | {_fmt(r.get('A_full_search'), True)} | "
                         f"{'–' if rec is None else f'{rec:.2f}'} | {_fmt(r['base_tokens_bon'])} | {_fmt(r['base_tokens_kvr'])} | "
                         f"{_fmt(r['base_token_reduction'], True)} | {_fmt(r['helper_share'], True)} | {_fmt(r['detector_firing_rate'], True)} | "
                         f"{_by_signal(r.get('firing_by_signal'))} |")
    if summary.get("oracle_choice"):
        lines += ["", "Oracle choice between the evicted base (one sample) and the helper (one sample), KV-Rescue Fig. 1a:", "",
                  oracle_choice_table(summary["oracle_choice"]).rstrip("\n")]
    if summary.get("degeneration"):
        from eval.harness.testbed_errors import DEGENERATION_CLASSES

        lines += ["", "What the wrong answers did (testbed):", "",
                  "| setting | base method | problems | wrong | " + " | ".join(DEGENERATION_CLASSES) + " |",
                  "|---|---|---|---|" + "---|" * len(DEGENERATION_CLASSES)]
        for r in summary["degeneration"]:
            lines.append(f"| {r['setting']} | {r['method'] or '–'} | {r['problems']} | {r['wrong']} | "
                         + " | ".join(str(r[k]) for k in DEGENERATION_CLASSES) + " |")
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
