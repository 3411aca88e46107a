"""The final-set ledger: every run that reads a final-only namespace (``confirm``, ``sealed``:
:data:`data_pipeline.testbed.task.FINAL_ONLY`) appends one JSON line to ``reports/final-ledger.jsonl``
(committed), so "read once" can be checked rather than claimed.

One line per run::

    {"utc": "2026-12-03T08:01:02Z", "command": "dynts eval --final ...", "git": "4ee0831...", "dirty": false,
     "status": "finished", "sets": [{"set": "sealed", "n": 500, "family": "chain", ...}], "out": "runs/...",
     "cells": ["<cell key>", ...]}

The commands that produce final tables (``dynts eval``, ``dynts demo``, ``dynts rescue bench``,
``dynts analyze traces``) run their ``--final`` work inside :func:`final_run`, the only way into
:func:`data_pipeline.testbed.task.final_tables`; a run that reads no final set writes nothing, a run
that fails after reading one is logged with ``"status": "failed"``, and so is one stopped by SIGINT or
SIGTERM (``kill``; the block turns SIGTERM into ``SystemExit`` so the line is written; only SIGKILL
leaves no line). The append rewrites the file
atomically (:func:`dynts.io.write_atomic`) under an exclusive lock, so concurrent runs lose no line.
``DYNTS_FINAL_LEDGER`` names another file (the tests use it).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from data_pipeline.testbed import task
from dynts.io import write_atomic

__all__ = ["LEDGER", "append", "final_run", "ledger_path", "read_ledger", "revision"]

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "reports" / "final-ledger.jsonl"


def ledger_path() -> Path:
    """``$DYNTS_FINAL_LEDGER`` if set, else :data:`LEDGER`."""
    return Path(os.environ.get("DYNTS_FINAL_LEDGER") or LEDGER)


def revision() -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the checkout this code runs from (``("unknown", None)`` without git); ``dirty``
    counts tracked changes other than those to the ledger file itself."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":(exclude){LEDGER.relative_to(ROOT)}"],  # the ledger's own new lines are not a change
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip() != ""
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def append(entry: dict[str, Any], path: str | Path | None = None) -> Path:
    """Append ``entry`` as one JSON line to the ledger (atomic rewrite under an exclusive lock)."""
    path = Path(path) if path is not None else ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = path.read_text(encoding="utf-8") if path.is_file() else ""
        if old and not old.endswith("\n"):
            old += "\n"
        write_atomic(path, old + json.dumps(entry, sort_keys=True) + "\n")
    return path


def read_ledger(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Every line of the ledger, oldest first."""
    path = Path(path) if path is not None else ledger_path()
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Within the block SIGTERM raises ``SystemExit(143)`` (in the main thread), so ``finally`` clauses run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def final_run(command: str, argv: Sequence[str] | None, enabled: bool, out: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Run a block as a final-table run when ``enabled`` (the command's ``--final``): inside
    :func:`~data_pipeline.testbed.task.final_tables`, and on exit, if it read a final-only set, one
    ledger line (UTC time, ``command`` + ``argv``, git revision, the sets read, ``out``, and the cells
    the block put in the yielded dict's ``"cells"`` list). Not enabled: a plain block (final sets stay
    refused)."""
    entry: dict[str, Any] = {"cells": []}
    if not enabled:
        yield entry
        return
    status = "failed"
    head, dirty = revision()  # the checkout the run started from (a commit made while it runs does not move it)
    with task.final_tables() as reads, _sigterm_exits():
        try:
            yield entry
            status = "finished"
        finally:
            if reads:
                args = list(sys.argv[1:] if argv is None else argv)
                append({"utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "command": " ".join([command, *map(shlex.quote, args)]), "git": head, "dirty": dirty,
                        "status": status, "sets": reads, "out": None if out is None else str(out),
                        "cells": list(entry.get("cells") or [])})
