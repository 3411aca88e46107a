#!/usr/bin/env python
"""Tune the baselines' settings, and DynTS's own, on dev problems: two stages, each
method's own options at the shared cache settings, then every winner over W_l x retention.

    python scripts/tune_baselines.py --grid configs/tuning/chain-fair.yaml --out reports/tuning/chain-fair \\
        [--resume] [--dry-run] [--run-dir runs/tuning/chain-fair]

The grid files, the stages, the rule and what is written: :mod:`eval.harness.tuning` and docs/evaluation.md
("Tuning on dev"). ``python -m eval.harness.tuning specs reports/tuning/chain-fair/choices.json --subsets
token+q,head+q --local-window 32 --retention 0.4`` prints the chosen specs as a ``dynts eval --method`` list.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the repository's packages first
    sys.path.insert(0, str(ROOT))

from eval.harness.tuning import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
