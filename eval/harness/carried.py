"""A run's finished cells, carried to the next machine through a commit, and a table's report published from
its run dir or reopened into one.

``runs/`` is not committed, and a dev or final table can outlast a working session. :func:`save` copies what
:func:`eval.harness.runner.run` needs to read a finished cell back (``run.json``, ``cells/<key>.json``,
``records/<key>.json``; not the samples' texts, not an unfinished cell's ``*.partial.jsonl``) to a folder to
commit; :func:`restore` refills an absent run dir from it, and the same ``dynts eval`` command then runs only the
cells that are left. :func:`publish` copies a finished run's tables and the records of its cells (only theirs)
to its report folder; :func:`reopen` refills an absent run dir from such a report, so that a table given more
methods runs only the new cells (a cell whose key changed, e.g. with its predictor's digest, runs again), and
:func:`prune` then drops the reopened cells the run no longer plans (``eval.harness.compare --write`` renders every
cell a run dir holds). :func:`missing` names the methods of a ``--method`` list that a published report lacks.

    python -m eval.harness.carried save runs/chain-dev-fair-s1 reports/chain-dev-fair-s1/carried
    python -m eval.harness.carried restore reports/chain-dev-fair-s1/carried runs/chain-dev-fair-s1
    python -m eval.harness.carried publish runs/chain-dev-fair-s1 reports/chain-dev-fair-s1
    python -m eval.harness.carried reopen reports/chain-dev-fair-s1 runs/chain-dev-fair-s1
    python -m eval.harness.carried prune runs/chain-dev-fair-s1
    python -m eval.harness.carried missing reports/chain-dev-fair-s1 --methods full,dynts,sepllm
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

__all__ = ["main", "missing", "prune", "publish", "reopen", "restore", "save"]


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


def publish(run_dir: str | Path, report: str | Path) -> int:
    """Copy a finished run's ``results.json`` and ``results.md`` and the records of its cells (no other record the
    run dir holds) to ``report``, whose ``records/`` it replaces; ``results.json`` last (its presence marks the table
    done). Returns how many records it copied."""
    run_dir, report = Path(run_dir), Path(report)
    results = run_dir / "results.json"
    if not results.is_file():
        raise FileNotFoundError(f"{results} does not exist: the run has not finished")
    keys = [cell["key"] for cell in json.loads(results.read_text())]
    missing = [k for k in keys if not (run_dir / "records" / f"{k}.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir}/records lacks the records of {missing}")
    shutil.rmtree(report / "records", ignore_errors=True)
    (report / "records").mkdir(parents=True)
    for key in keys:
        shutil.copyfile(run_dir / "records" / f"{key}.json", report / "records" / f"{key}.json")
    shutil.copyfile(run_dir / "results.md", report / "results.md")
    shutil.copyfile(results, report / "results.json")
    return len(keys)


def reopen(report: str | Path, run_dir: str | Path) -> int:
    """Fill an absent ``run_dir`` (no ``run.json``) from a published ``report``: each cell of its ``results.json``
    as ``cells/<key>.json`` with its record; ``dynts eval`` writes ``run.json`` anew and refuses nothing it would
    not refuse for a new run dir. Returns how many cells it wrote (0: ``run_dir`` had started)."""
    report, run_dir = Path(report), Path(run_dir)
    if (run_dir / "run.json").is_file():
        return 0
    cells = json.loads((report / "results.json").read_text())
    for sub in ("cells", "records"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    for cell in cells:
        shutil.copyfile(report / "records" / f"{cell['key']}.json", run_dir / "records" / f"{cell['key']}.json")
        (run_dir / "cells" / f"{cell['key']}.json").write_text(json.dumps(cell, indent=2))
    return len(cells)


def prune(run_dir: str | Path) -> list[str]:
    """Delete the cells (``cells/``, ``records/``, ``samples/``) of ``run_dir`` that its last ``dynts eval`` did not
    plan: every key not in the ``results.json`` it wrote (call it right after that run). Returns the keys deleted."""
    run_dir = Path(run_dir)
    planned = {cell["key"] for cell in json.loads((run_dir / "results.json").read_text())}
    stale = sorted(p.stem for p in (run_dir / "cells").glob("*.json") if p.stem not in planned)
    for key in stale:
        for path in (run_dir / "cells" / f"{key}.json", run_dir / "records" / f"{key}.json",
                     run_dir / "samples" / f"{key}.jsonl"):
            path.unlink(missing_ok=True)
    return stale


def missing(report: str | Path, methods: str) -> list[str]:
    """The labels of ``methods`` (a ``dynts eval --method`` list) that no cell of ``report``'s ``results.json`` ran,
    in the list's order; every label when the report has no ``results.json``."""
    from .methods import parse_methods

    results = Path(report) / "results.json"
    have = {cell["method"]["label"] for cell in json.loads(results.read_text())} if results.is_file() else set()
    return [label for label in dict.fromkeys(m.label for m in parse_methods([methods])) if label not in have]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.harness.carried", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("save", "restore", "publish", "reopen", "prune", "missing"))
    p.add_argument("source", help="save, publish, prune: the run dir; restore: the carried folder; reopen, missing: "
                                  "the report")
    p.add_argument("target", nargs="?", help="save: the carried folder (replaced); restore, reopen: the run dir; "
                                             "publish: the report")
    p.add_argument("--methods", help="missing: the --method list (prints the labels the report lacks, comma-separated)")
    args = p.parse_args(argv)
    if args.action == "missing":
        if not args.methods:
            p.error("missing needs --methods (the dynts eval --method list)")
        print(",".join(missing(args.source, args.methods)))
        return 0
    if args.action == "prune":
        stale = prune(args.source)
        print(f"{len(stale)} cells no longer planned deleted from {args.source}" + "".join(f"\n  {k}" for k in stale))
        return 0
    if args.target is None:
        p.error(f"{args.action} needs a target")
    if args.action == "save":
        print(f"{save(args.source, args.target)} finished cells -> {args.target}")
    elif args.action == "publish":
        print(f"{publish(args.source, args.target)} records -> {args.target}")
    elif args.action == "reopen":
        print(f"{reopen(args.source, args.target)} cells from {args.source} -> {args.target}")
    elif restore(args.source, args.target):
        print(f"finished cells from {args.source} -> {args.target}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
