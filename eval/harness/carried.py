"""An unfinished run's finished cells, carried to the next machine through a commit.

``runs/`` is not committed, and a dev or final table can outlast a working session. :func:`save` copies what
:func:`eval.harness.runner.run` needs to read a finished cell back (``run.json``, ``cells/<key>.json``,
``records/<key>.json``; not the samples' texts, not an unfinished cell's ``*.partial.jsonl``) to a folder to
commit; :func:`restore` refills an absent run dir from it, and the same ``dynts eval`` command then runs only the
cells that are left.

    python -m eval.harness.carried save runs/chain-dev-fair-s1 reports/chain-dev-fair-s1/carried
    python -m eval.harness.carried restore reports/chain-dev-fair-s1/carried runs/chain-dev-fair-s1
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

__all__ = ["main", "restore", "save"]


def save(run_dir: str | Path, dest: str | Path) -> int:
    """Replace ``dest`` with ``run_dir``'s settings and finished cells; returns how many cells it holds."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / "run.json").is_file():
        raise FileNotFoundError(f"{run_dir}/run.json does not exist: not a started dynts eval run dir")
    shutil.rmtree(dest, ignore_errors=True)
    for sub in ("cells", "records"):
        (dest / sub).mkdir(parents=True)
        for path in sorted((run_dir / sub).glob("*.json")):  # finished cells only (not *.partial.jsonl)
            shutil.copyfile(path, dest / sub / path.name)
    shutil.copyfile(run_dir / "run.json", dest / "run.json")
    return len(list((dest / "cells").glob("*.json")))


def restore(src: str | Path, run_dir: str | Path) -> bool:
    """Fill ``run_dir`` from ``src`` when it has not started (no ``run.json``) and ``src`` holds a carried run;
    returns whether it did."""
    src, run_dir = Path(src), Path(run_dir)
    if (run_dir / "run.json").is_file() or not (src / "run.json").is_file():
        return False
    shutil.copytree(src, run_dir, dirs_exist_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.harness.carried", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("save", "restore"))
    p.add_argument("source", help="save: the run dir; restore: the carried folder")
    p.add_argument("target", help="save: the carried folder (replaced); restore: the run dir")
    args = p.parse_args(argv)
    if args.action == "save":
        print(f"{save(args.source, args.target)} finished cells -> {args.target}")
    elif restore(args.source, args.target):
        print(f"finished cells from {args.source} -> {args.target}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
