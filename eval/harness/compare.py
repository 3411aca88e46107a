"""One method against the others, budget by budget: the tables ``docs/evaluation.md`` prints.

``python -m eval.harness.compare RUN_DIR [RUN_DIR ...] [--against dynts] [--margin 3] [--write] [--from-records]``
reads every finished cell of one or more runs on the same problems (``cells/*.json``, whichever command wrote them) with its per-problem results
(``records/<key>.json``, :mod:`eval.harness.records`, else ``samples/<key>.jsonl``) and prints, against one
method (``--against``: a label, or a method name exactly one label has, so ``dynts`` finds a tuned run's
``dynts:local_window_share=...``; :func:`resolve_against`)

1. pass@1 % and its bootstrap 95 % CI (questions resampled, 10,000 times, seed 0), one row per method,
   one column per budget (the full cache first);
2. for each other method and budget, ``against - method`` in points, **paired** on the same
   questions' per-problem scores (the mean over their ``k`` samples): the paired bootstrap 95 % CI
   of the difference, McNemar's exact test where ``k = 1`` (right under one method only), the sign
   test over per-problem scores, the TOST equivalence test within ``--margin`` points, both
   Holm-adjusted over the table, and a verdict: ``leads``, ``trails``, ``equivalent within ±m`` or
   ``inconclusive`` (:func:`eval.harness.stats.table_verdicts`); a cell whose budget leaves no
   selection slot (``n_keep`` = question + local window) is marked ``vacuous`` and left out of the
   Holm family;
3. what the runs wrote: mean generated tokens, loop %, truncated %, evictions per sample.

``--wide`` prints 1 and the paired differences as one method x budget table instead (each cell
``points [CI]`` and its verdict, bold where it leads or trails, a first row with ``B / full seq``).

Cells without per-problem results fall back to ``pass@1 ± SE`` and the unpaired
``sqrt(se_a^2 + se_b^2)`` (``leads`` = at least 2 SE). ``--from-records`` recomputes all tables from
``records/*.json`` alone (a report directory with nothing else); ``--write`` also renders the cells
as the run's ``results.{json,csv,md}`` and plots.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Sequence

from .records import eval_record, per_question, read_records, unpack_bits
from .stats import ALPHA, MARGIN, bootstrap_ci, paired_test, table_verdicts

__all__ = ["cells_from_records", "compare", "finished_cells", "main", "paired_tests", "paired_wide", "pivot",
           "record_of_samples", "records_of", "resolve_against", "selection_slots", "written"]

def finished_cells(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every finished cell of a run directory, the full cache first, then by method and budget."""
    cells = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "cells").glob("*.json"))]
    return _ordered(cells)


def _ordered(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {m: i for i, m in enumerate(dict.fromkeys(c["method"]["label"] for c in cells))}
    return sorted(cells, key=lambda c: (c.get("budget") is not None, order[c["method"]["label"]], c.get("budget") or 0))


def record_of_samples(cell: dict[str, Any], samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-problem record of a finished cell from its ``samples/<key>.jsonl`` rows."""
    rows = sorted(samples, key=lambda r: (r["question"], r["sample"]))
    k = cell.get("k") or len({r["sample"] for r in rows})
    settings = {f: cell[f] for f in ("benchmark", "method", "budget", "local_window", "retention", "predictor") if f in cell}
    return eval_record(cell["key"], settings, [r["id"] for r in rows[::k]], k, rows)


def records_of(run_dir: str | Path, cells: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Decoded per-problem records by cell key: ``records/<key>.json``, else built from
    ``samples/<key>.jsonl``; cells with neither are left out."""
    run_dir = Path(run_dir)
    stored = {r["key"]: r for r in read_records(run_dir)}
    out = {}
    for c in cells:
        key = c.get("key")
        if key in stored:
            out[key] = stored[key]
        elif key and (run_dir / "samples" / f"{key}.jsonl").is_file():
            lines = (run_dir / "samples" / f"{key}.jsonl").read_text(encoding="utf-8").splitlines()
            rec = record_of_samples(c, [json.loads(line) for line in lines if line.strip()])
            n = len(rec["ids"]) * rec["k"]
            out[key] = {**rec, "bits": {f: unpack_bits(v, n) for f, v in rec["bits"].items()}}
    return out


def cells_from_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cell results (method, budget, pass@1 and its SE over questions) recomputed from records alone."""
    cells = []
    for rec in records:
        scores = per_question(rec)
        mean = sum(scores) / len(scores)
        se = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores)) / math.sqrt(len(scores))
        cells.append({**rec["cell"], "key": rec["key"], "questions": len(scores), "k": rec["k"],
                      "pass@1": mean, "pass@1_se": se})
    return _ordered(cells)


def _cells(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[int], dict[tuple[str, int | None], dict[str, Any]]]:
    methods = list(dict.fromkeys(r["method"]["label"] for r in results))
    budgets = sorted({r["budget"] for r in results if r.get("budget") is not None})
    return methods, budgets, {(r["method"]["label"], r.get("budget")): r for r in results}


def resolve_against(results: Sequence[dict[str, Any]], against: str) -> str:
    """The label of the method ``against`` names: a label with bounded cells, or a method name that exactly one
    bounded label has (``dynts`` for a tuned run's ``dynts:local_window_share=...``). Raises ``ValueError``
    naming the labels otherwise."""
    bounded = list(dict.fromkeys(r["method"]["label"] for r in results if r.get("budget") is not None))
    if against in bounded:
        return against
    named = list(dict.fromkeys(r["method"]["label"] for r in results
                               if r.get("budget") is not None and r["method"].get("name") == against))
    if len(named) == 1:
        return named[0]
    which = f"{len(named)} methods named {against!r} ({', '.join(named)})" if named else f"no bounded method {against!r}"
    raise ValueError(f"--against: {which} in these results; pass one of their labels: {', '.join(bounded)}")


def _accuracy(cell: dict[str, Any], records: dict[str, dict[str, Any]]) -> str:
    rec = records.get(cell.get("key"))
    if rec is None:
        return f"{100 * cell['pass@1']:.1f} ± {100 * cell['pass@1_se']:.1f}"
    lo, hi = bootstrap_ci(per_question(rec))
    return f"{100 * cell['pass@1']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def pivot(results: Sequence[dict[str, Any]], records: dict[str, dict[str, Any]] | None = None) -> str:
    """pass@1 % per method (rows) and budget (columns), with its bootstrap 95 % CI where the cell
    has per-problem ``records`` (by cell key), else ± 1 SE; the full cache spans the row."""
    records = records or {}
    methods, budgets, cells = _cells(results)
    lines = ["| method | " + " | ".join(f"B = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in methods:
        if (m, None) in cells:
            lines.append(f"| {m} (no eviction) | {_accuracy(cells[(m, None)], records)} |" + " |" * (len(budgets) - 1))
            continue
        row = [_accuracy(cells[(m, b)], records) if (m, b) in cells else "" for b in budgets]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def selection_slots(cell: dict[str, Any], question_tokens: int | None = None) -> int | None:
    """Selection slots a bounded cell kept per event, ``n_keep - W_q - W_l`` (0: the budget holds only
    the question and the local window, a *vacuous* cell where every question-protecting method keeps
    the same set); from the cell's ``selection_slots``, else its ``n_keep`` and mean prompt, else (records
    written before cells recorded it) from its budget, local window and retention with a prompt of
    ``question_tokens`` (``--question-tokens``; the testbed's is 14); None when unknown or for the full cache."""
    if cell.get("budget") is None:
        return None
    if cell.get("selection_slots") is not None:
        return int(cell["selection_slots"])
    if cell.get("n_keep") is not None and cell.get("mean_prompt_tokens") is not None and cell.get("local_window") is not None:
        return max(0, int(cell["n_keep"]) - round(cell["mean_prompt_tokens"]) - int(cell["local_window"]))
    if question_tokens is not None and cell.get("local_window") is not None:
        import dynts

        budget = dynts.Budget(int(cell["budget"]), int(cell["local_window"]), float(cell.get("retention") or 0.4))
        return budget.n_keep(question_tokens) - question_tokens - int(cell["local_window"])
    return None


def _vacuous(*cells: dict[str, Any], question_tokens: int | None = None) -> bool:
    return any(selection_slots(c, question_tokens) == 0 for c in cells)


def _paired(a: dict[str, Any], o: dict[str, Any], margin: float = MARGIN) -> dict[str, Any]:
    if a["ids"] != o["ids"] or a["k"] != o["k"]:
        raise ValueError(f"cells {a['key']} and {o['key']} ran on other questions (or another k); "
                         "pair only cells of one benchmark and k (one run directory)")
    bits = (a["bits"]["correct"], o["bits"]["correct"]) if a["k"] == 1 else None
    return paired_test(per_question(a), per_question(o), a["k"], bits, margin)


def paired_tests(results: Sequence[dict[str, Any]], against: str = "dynts", records: dict[str, dict[str, Any]] | None = None,
                 margin: float = MARGIN, alpha: float = ALPHA, question_tokens: int | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """``against`` minus every other bounded method at every budget where both cells have records:
    :func:`eval.harness.stats.paired_test` with the table's Holm adjustment and verdicts
    (:func:`eval.harness.stats.table_verdicts`), by ``(method, budget)``. Vacuous cells
    (:func:`selection_slots` 0) keep their tests but leave the Holm family; their verdict is ``vacuous``."""
    records = records or {}
    methods, budgets, cells = _cells(results)
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for m in methods:
        if m == against or (m, None) in cells:
            continue
        for b in budgets:
            a, o = cells.get((against, b)), cells.get((m, b))
            ra, ro = records.get((a or {}).get("key")), records.get((o or {}).get("key"))
            if ra is not None and ro is not None:
                found[(m, b)] = {**_paired(ra, ro, margin), "vacuous": _vacuous(a, o, question_tokens=question_tokens)}
    family = [key for key, t in found.items() if not t["vacuous"]]
    judged = dict(zip(family, table_verdicts([found[key] for key in family], alpha)))
    for key, t in found.items():
        if t["vacuous"]:
            judged[key] = {**t, "p_holm": None, "tost_p_holm": None, "verdict": "vacuous (no selection slot)"}
    return {key: judged[key] for key in found}


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.0e}"


def _holm_p(p: float | None) -> str:
    return "–" if p is None else _p(p)


def compare(results: Sequence[dict[str, Any]], against: str = "dynts", records: dict[str, dict[str, Any]] | None = None,
            margin: float = MARGIN, question_tokens: int | None = None) -> str:
    """``against`` minus every other bounded method, in points: paired (CI, McNemar at k = 1, sign
    test, TOST, Holm, verdict: :func:`paired_tests`) where both cells have per-problem ``records``,
    else the unpaired SE of the difference."""
    records = records or {}
    against = resolve_against(results, against)
    methods, budgets, cells = _cells(results)
    tests = paired_tests(results, against, records, margin, question_tokens=question_tokens)
    paired = [f"| {against} minus | B | points | paired 95 % CI | right only under {against} / the other (k = 1) | "
              f"McNemar exact p (k = 1) | sign test + / - (p) | Holm p | TOST ±{100 * margin:g} p (Holm) | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    unpaired = [f"| {against} minus (unpaired) | " + " | ".join(f"B = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for m in methods:
        if m == against or not any((m, b) in cells for b in budgets):
            continue
        row = []
        for b in budgets:
            if (m, b) not in cells or (against, b) not in cells:
                row.append("")
                continue
            a, o = cells[(against, b)], cells[(m, b)]
            if (m, b) in tests:
                t = tests[(m, b)]
                mc, sg = t["mcnemar"], t["sign"]
                mcn = ("–", "–") if mc is None else (f"{mc['only_a']} / {mc['only_b']}", _p(mc["p"]))
                paired.append(f"| {m} | {b} | {100 * t['diff']:+.1f} | [{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}] | "
                              f"{mcn[0]} | {mcn[1]} | {sg['plus']} / {sg['minus']} ({_p(sg['p'])}) | {_holm_p(t['p_holm'])} | "
                              f"{_holm_p(t['tost_p_holm'])} | {t['verdict']} |")
                row.append("")
                continue
            diff = 100 * (a["pass@1"] - o["pass@1"])
            se = 100 * math.hypot(a["pass@1_se"], o["pass@1_se"])
            verdict = "leads" if diff >= 2 * se else "trails" if diff <= -2 * se else "within 2 SE"
            row.append(f"{diff:+.1f} ± {se:.1f} ({verdict})")
        if any(row):
            unpaired.append(f"| {m} | " + " | ".join(row) + " |")
    tables = [t for t, head in ((paired, 2), (unpaired, 2)) if len(t) > head]
    return "\n\n".join("\n".join(t) for t in tables)


def paired_wide(results: Sequence[dict[str, Any]], against: str = "dynts", records: dict[str, dict[str, Any]] | None = None,
                margin: float = MARGIN, question_tokens: int | None = None) -> str:
    """The paired differences of :func:`compare` as one method x budget table (the docs' final tables):
    each cell ``points [95 % CI]`` and its Holm-adjusted verdict (:func:`paired_tests`), **bold**
    where it leads or trails; a first row gives ``B`` over the full cache's mean sequence (prompt
    included), as peers size budgets. Cells without records are left out."""
    from .report import against_full

    records = records or {}
    against = resolve_against(results, against)
    methods, budgets, cells = _cells(results)
    tests = paired_tests(results, against, records, margin, question_tokens=question_tokens)
    short = {"leads": "leads", "trails": "trails", "inconclusive": "inconclusive"}
    lines = [f"| {against} minus | " + " | ".join(f"B = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    fraction = {r["budget"]: r["budget_vs_full"] for r in against_full(results) if "budget_vs_full" in r}
    if fraction:
        lines.append("| *B / full seq* | " + " | ".join(f"*{fraction[b]:.2f}*" if b in fraction else "" for b in budgets) + " |")
    for m in methods:
        if m == against or (m, None) in cells:
            continue
        row = []
        for b in budgets:
            t = tests.get((m, b))
            if t is None:
                row.append("")
                continue
            word = short.get(t["verdict"], "equivalent" if t["verdict"].startswith("equivalent") else "vacuous")
            text = f"{100 * t['diff']:+.1f} [{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}] {word}"
            row.append(f"**{text}**" if t["verdict"] in ("leads", "trails") else text)
        if any(row):
            lines.append(f"| {m} | " + " | ".join(row) + " |")
    if len(lines) <= 2:
        return ""
    note = (f"Verdicts: sign test over problems (exact McNemar at k = 1) and TOST within ±{100 * margin:g} points, each "
            f"Holm-adjusted over this table's {sum(not t['vacuous'] for t in tests.values())} cells, alpha {ALPHA}; "
            "vacuous = no selection slot at this budget (left out of the family).")
    return "\n".join(lines) + "\n\n" + note


def written(results: Sequence[dict[str, Any]], records: dict[str, dict[str, Any]]) -> str:
    """Per cell with records: mean generated tokens, loop %, truncated %, evictions per sample."""
    lines = ["| method | B | pass@1 % | mean tokens | loop % | truncated % | evictions/sample |", "|---|---|---|---|---|---|---|"]
    for c in results:
        rec = records.get(c.get("key"))
        if rec is None:
            continue
        n = len(rec["bits"]["correct"])
        mean = lambda f: sum(rec["ints"][f]) / n  # noqa: E731
        share = lambda f: 100 * sum(rec["bits"][f]) / n  # noqa: E731
        lines.append(f"| {c['method']['label']} | {c.get('budget') or '–'} | {_accuracy(c, records)} | {mean('tokens'):.0f} | "
                     f"{share('looped'):.1f} | {share('truncated'):.1f} | {mean('evictions'):.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="dynts eval run directories (cells of several runs on the same problems form one table), "
                             "or report directories holding records/*.json")
    parser.add_argument("--against", default="dynts",
                        help="the method every other one is compared with: its label, or a method name one label has")
    parser.add_argument("--write", action="store_true",
                        help="render all finished cells as results.{json,csv,md} and plots (in the first RUN_DIR)")
    parser.add_argument("--from-records", action="store_true", help="recompute every table from records/*.json alone")
    parser.add_argument("--margin", type=float, default=100 * MARGIN,
                        help="equivalence margin of the TOST verdicts, in points (default 3)")
    parser.add_argument("--question-tokens", type=int, default=None,
                        help="prompt length for finding vacuous cells in records that predate selection_slots (testbed: 14)")
    parser.add_argument("--wide", action="store_true",
                        help="only pass@1 and the paired differences as method x budget tables (the docs' final tables)")
    args = parser.parse_args(argv)
    if args.from_records:
        if args.write:
            parser.error("--write renders cells/*.json; --from-records reads records only: give one of them")
        records = {r["key"]: r for d in args.run_dirs for r in read_records(d)}  # a cell two runs share counts once
        if not records:
            parser.error(f"{', '.join(args.run_dirs)}: no records/*.json; a dynts eval run writes them next to its cells")
        results = cells_from_records(list(records.values()))
    else:
        results, records = [], {}
        for run_dir in args.run_dirs:
            cells = finished_cells(run_dir)
            if not cells:
                parser.error(f"{run_dir} has no finished cells (cells/*.json); give the --run-dir of a dynts eval run "
                             "(or --from-records for a report directory)")
            results += cells
            records.update(records_of(run_dir, cells))
        results = _ordered(list({c.get("key") or id(c): c for c in results}.values()))  # a cell two runs share counts once
        if args.write:
            from .report import write_reports

            write_reports(args.run_dirs[0], results)
    try:
        args.against = resolve_against(results, args.against)
    except ValueError as e:
        parser.error(str(e))
    if args.wide:
        tables = [pivot(results, records), paired_wide(results, args.against, records, args.margin / 100, args.question_tokens)]
    else:
        tables = [pivot(results, records), compare(results, args.against, records, args.margin / 100, args.question_tokens),
                  written(results, records)]
    print("\n\n".join(t for t in tables if t))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
