"""The seeds' fair LRMs and predictors, one row per family and seed (docs/testbed.md "Seeds").

``python -m eval.harness.seed_models [--root .]`` reads what the queue (``scripts/run_fair_seeds.sh``) committed: each
exported LRM's training record (``reports/training/<run name>.json``: steps and its gate on 100 held-out problems,
overall and per skill) and each predictor's held-out metrics (``checkpoints/<predictor>/metrics.json``: Kendall tau
and top-30 % overlap on the validation traces). A seed not trained yet reads ``–``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["FAMILIES", "main", "models_table"]

# family -> (training record name, predictor directory), each with {seed}
FAMILIES = {
    "chain": ("testbed-chain-lrm-fair-s{seed}", "testbed-chain-fair-s{seed}-predictor"),
    "copy": ("testbed-lrm-fair-scratch-s{seed}", "testbed-fair-scratch-s{seed}-predictor"),
}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def models_table(root: str | Path = ".", seeds: tuple[int, ...] = (1, 2, 3)) -> str:
    """The markdown table of every family's seeds (``root``: the repository)."""
    root = Path(root)
    lines = ["| family | seed | LRM steps | gate % | retrieval / operand copy / step arithmetic % | predictor val Kendall | "
             "top-30 % overlap |", "|---|---|---|---|---|---|---|"]
    for family, (record, predictor) in FAMILIES.items():
        for seed in seeds:
            lrm = _read(root / "reports" / "training" / f"{record.format(seed=seed)}.json")
            pred = _read(root / "checkpoints" / predictor.format(seed=seed) / "metrics.json")
            cells = ["–"] * 5
            if lrm is not None:
                skills = " / ".join(f"{100 * lrm[f'gate_{k}']:.0f}" for k in ("retrieval", "operand_copy", "step_arithmetic"))
                cells[:3] = [f"{lrm['global_step']:,}", f"{100 * lrm['gate_accuracy']:.0f}", skills]
            if pred is not None:
                cells[3:] = [f"{pred['val/kendall']:.3f}", f"{pred['val/overlap']:.3f}"]
            lines.append(f"| {family} | s{seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.harness.seed_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".", help="the repository (default: here)")
    args = parser.parse_args(argv)
    print(models_table(args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
