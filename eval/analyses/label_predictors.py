"""What a predictor learns from each importance label, on dev: the same DynTS spec with predictors trained on
different labels, side by side from committed records.

``python -m eval.analyses.label_predictors BASE VARIANT_DIR [VARIANT_DIR ...]`` -- ``BASE``: a dev report whose
DynTS cells ran the ``answer`` label's predictor (e.g. ``reports/chain-dev-fair-s1``); each ``VARIANT_DIR``: a report
``reports/<base>-<label>`` whose records ran the same DynTS spec with another label's predictor
(``scripts/run_label_chain_s1.sh``). Prints pass@1 % with its bootstrap 95 % CI per label (rows) and budget (columns),
then each label minus ``answer``, paired over the same problems (:func:`eval.harness.compare.paired_tests`, Holm over
this table's cells).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from eval.harness.compare import cells_from_records, paired_tests, pivot
from eval.harness.records import read_records

__all__ = ["label_predictor_table", "labelled_records"]


def labelled_records(base: str | Path, variants: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The DynTS records of ``base`` labelled ``answer`` and every record of each variant directory labelled by the
    directory's last name part after ``base``'s name (``chain-dev-fair-s1-golden-b72`` -> ``golden-b72``)."""
    base = Path(base)
    out = []
    for directory, label in [(base, "answer")] + [(Path(v), Path(v).name[len(base.name) + 1:]) for v in variants]:
        for record in read_records(directory):
            if record["cell"]["method"].get("name") != "dynts":
                continue
            method = {**record["cell"]["method"], "label": label}
            out.append({**record, "key": f"{label}:{record['key']}", "cell": {**record["cell"], "method": method}})
    return out


def label_predictor_table(base: str | Path, variants: Sequence[str | Path]) -> str:
    """pass@1 % [95 % CI] per label and budget, then each label minus ``answer`` (paired, Holm over the table)."""
    records = labelled_records(base, variants)
    by_key = {r["key"]: r for r in records}
    results = cells_from_records(records)
    lines = [pivot(results, by_key), "", "| label minus answer | B | points [95 % CI] | verdict |", "|---|---|---|---|"]
    for (label, budget), t in sorted(paired_tests(results, "answer", by_key).items()):  # answer minus label: turned
        verdict = {"leads": "trails", "trails": "leads"}.get(t["verdict"], t["verdict"])
        lines.append(f"| {label} | {budget} | {-100 * t['diff']:+.1f} [{-100 * t['hi']:+.1f}, {-100 * t['lo']:+.1f}] "
                     f"| {verdict} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.analyses.label_predictors", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the answer label's dev report (records/*.json)")
    parser.add_argument("variants", nargs="+", help="reports of the same DynTS spec with other labels' predictors")
    args = parser.parse_args(argv)
    print(label_predictor_table(args.base, args.variants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
