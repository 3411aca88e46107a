"""The final-set ledger: every run that reads a final-only namespace (``confirm``, ``final``:
:data:`data_pipeline.testbed.task.FINAL_ONLY`) has one JSON line in ``reports/final-ledger.jsonl`` of this
checkout (committed), so "read once" is checked rather than claimed.

One line per run::

    {"run": "20261203T080102Z-4021-9f3c1a", "utc": "2026-12-03T08:01:02Z", "command": "dynts eval --final ...",
     "program": "dynts eval", "git": "4ee0831...", "dirty": false, "status": "finished",
     "sets": [{"set": "final", "n": 500, "family": "chain", "min_think": 150, "max_think": 900}],
     "methods": ["full", "h2o:keep_question=true", ...], "out": "runs/...", "cells": ["<cell key>", ...]}

The commands that produce final tables (``dynts eval``, ``dynts demo``, ``dynts rescue bench``,
``dynts analyze traces``) run their ``--final`` work inside :func:`final_run`, the only way into
:func:`data_pipeline.testbed.task.final_tables`: that block takes the run handle only this module
creates (:class:`data_pipeline.testbed.task.LedgerHandle`), and the handle sees every final read
before a problem is drawn; :func:`data_pipeline.testbed.task.make_problem` refuses a final-only seed
outright, so ``problem_set`` inside that block is the only way to a final problem. What the ledger
enforces:

**Its place.** The file is :data:`LEDGER`, fixed to the checkout this code runs from: no environment
variable or option moves it. (The tests point :func:`ledger_path` at a file of their own by patching
it in-process: ``tests/conftest.py``.)

**A committed tree.** A final read is refused while tracked files have uncommitted changes (the ledger
file itself excepted: its own new lines are not a change), naming them; commit first. The line records
the commit (``git``) the run started from; a commit made while it runs does not move it. Untracked
files are not looked at (scratch outputs, other work in progress); what a final run imports must be
committed to count. Outside a git checkout a final read is refused (no commit to record).

**The line as it goes.** The first read writes the run's line (``"status": "running"``); each cell the
run finishes is added to it at once (:meth:`_FinalRun.finished_cell`), so a run killed by SIGKILL
leaves its line with every cell it finished; on exit the line becomes ``finished`` or ``failed`` (an
exception, SIGINT or SIGTERM: the block turns SIGTERM into ``SystemExit`` so the line is updated). A
run that reads no final set writes nothing.

**Read once** (:data:`data_pipeline.testbed.task.READ_ONCE`: ``final``): a read of a cell (set name,
family and length range; any ``n``, since problem ``i`` is the same whatever ``n`` is) that an earlier
line already read is refused, under the ledger's lock so two concurrent runs cannot both pass, unless
the run says why with ``--reread WHY`` (``final_run(..., reread=WHY)``); the line then carries
``"reread"`` (the reason) and ``"reread_of"`` (the earlier lines' ``run`` ids). ``confirm`` is final-only
but not read-once: six runs read it before the ledger existed.

**Frozen methods.** A final run declares the methods it evaluates (``final_run(..., methods=...)``: for
``dynts eval`` / ``dynts demo`` each method's spec without its label, :func:`eval.harness.methods.method_id`;
for ``dynts rescue bench`` its cells' setting-method names; for ``dynts analyze traces`` ``traces``).
The first line that reads a namespace (the set name's part before any ``:``: ``final``, ``confirm``) in
a family, for one program (``dynts eval``, ``dynts demo``, ...: each evaluates its own kind of method),
freezes that list: a later run of that program reading that namespace and family (``--reread``, another
length range, another ``n``) with a method outside it is refused, ``--reread`` or not. Each family has its
own list since each family's settings are tuned on its own dev set. Lines written before the ledger
recorded methods freeze nothing: there the next run's list is the frozen one. A cell can only be
recorded under a method the run declared.

**Retired namespaces** (:data:`data_pipeline.testbed.task.RETIRED`: ``sealed``) have one line each,
``"status": "retired"`` with the reason and the namespace that replaces it, written by :func:`retire`
(``python -m eval.harness.ledger retire sealed --why ... --replaced-by final``).

Every write rewrites the file atomically (:func:`dynts.io.write_atomic`) under an exclusive lock, so
concurrent runs lose no line.
"""

from __future__ import annotations

import argparse
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
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from data_pipeline.testbed import task
from dynts.io import write_atomic

__all__ = ["LEDGER", "add_final_arguments", "append", "final_run", "frozen_methods", "ledger_path", "read_ledger",
           "retire", "revision"]

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "reports" / "final-ledger.jsonl"


def ledger_path() -> Path:
    """The ledger file: :data:`LEDGER`, this checkout's ``reports/final-ledger.jsonl`` (nothing in the
    environment moves it)."""
    return LEDGER


def revision(root: Path = ROOT) -> tuple[str, list[str] | None]:
    """``(commit, changed)`` of the checkout at ``root``: ``changed`` lists the tracked files with uncommitted
    changes (staged or not), other than the ledger file itself; ``("unknown", None)`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=no", "--", ".",
                                 f":(exclude){LEDGER.relative_to(ROOT).as_posix()}"],  # the ledger's own new lines
                                cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None
    entries = status.split("\0")
    changed, i = [], 0
    while i < len(entries):
        entry = entries[i]
        if entry:
            changed.append(entry[3:])
            i += entry[0] in "RC"  # a rename's source path follows as its own entry
        i += 1
    return head, changed


def _utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _rewrite(path: Path, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> Path:
    """Under the ledger's exclusive lock: read every line, ``change`` them (it may raise: nothing is
    written), write the result atomically. Lines ``change`` leaves as they were are written back byte
    for byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = path.read_text(encoding="utf-8") if path.is_file() else ""
        raw = [line for line in old.splitlines() if line.strip()]
        lines = [json.loads(line) for line in raw]
        new = change([dict(line) for line in lines])
        out = [raw[i] if i < len(lines) and line == lines[i] else json.dumps(line, sort_keys=True)
               for i, line in enumerate(new)]
        write_atomic(path, "".join(line + "\n" for line in out))
    return path


def append(entry: dict[str, Any], path: str | Path | None = None) -> Path:
    """Append ``entry`` as one JSON line to the ledger (atomic rewrite under an exclusive lock)."""
    return _rewrite(Path(path) if path is not None else ledger_path(), lambda lines: lines + [entry])


def read_ledger(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Every line of the ledger, oldest first."""
    path = Path(path) if path is not None else ledger_path()
    if not path.is_file():
        return []
    return _parse(path.read_text(encoding="utf-8"))


def _same_cell(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two reads draw the same problems (up to the smaller ``n``): same set name, family and length range."""
    return all(a.get(k) == b.get(k) for k in ("set", "family", "min_think", "max_think"))


def earlier_reads(read: dict[str, Any], lines: Sequence[dict[str, Any]], run: str | None = None) -> list[dict[str, Any]]:
    """The ledger lines (other than run ``run``) that read ``read``'s cell."""
    return [line for line in lines if (run is None or line.get("run") != run)
            and any(_same_cell(read, s) for s in line.get("sets") or ())]


def frozen_methods(program: str, read: dict[str, Any], lines: Sequence[dict[str, Any]],
                   run: str | None = None) -> dict[str, Any] | None:
    """The line (other than run ``run``) whose method list ``read`` is held to: the first line of ``program``
    that recorded its methods and read ``read``'s namespace in ``read``'s family; ``None`` if there is none."""
    space = task.namespace(read["set"])
    for line in lines:
        if (line.get("program") == program and "methods" in line and (run is None or line.get("run") != run)
                and any(task.namespace(s.get("set", "")) == space and s.get("family") == read.get("family")
                        for s in line.get("sets") or ())):
            return line
    return None


def retire(namespace: str, why: str, replaced_by: str, path: str | Path | None = None,
           command: str | None = None) -> dict[str, Any]:
    """Write the retirement line of final-only ``namespace`` (``"status": "retired"``, ``why``, the
    namespace that replaces it); :data:`data_pipeline.testbed.task.RETIRED` is what refuses its reads.
    Refused if the namespace is not retired there, the reason is empty, or it already has its line."""
    if namespace not in task.RETIRED:
        raise ValueError(f"{namespace!r} is not retired in data_pipeline.testbed.task.RETIRED ({sorted(task.RETIRED)})")
    if not why.strip():
        raise ValueError("say why the namespace is retired")
    if replaced_by not in task.FINAL_ONLY:
        raise ValueError(f"{replaced_by!r} is not a final-only namespace ({', '.join(task.FINAL_ONLY)})")
    head, changed = revision()
    entry = {"run": _run_id(), "utc": _utc(), "command": command or f"retire {namespace}", "git": head,
             "dirty": None if changed is None else bool(changed), "status": "retired", "namespace": namespace,
             "why": why.strip(), "replaced_by": replaced_by, "sets": [], "out": None, "cells": []}

    def add(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if any(line.get("status") == "retired" and line.get("namespace") == namespace for line in lines):
            raise ValueError(f"{namespace!r} already has its retirement line in the ledger")
        return lines + [entry]

    _rewrite(Path(path) if path is not None else ledger_path(), add)
    return entry


def _run_id() -> str:
    return f"{_utc().replace('-', '').replace(':', '')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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


def _read_text(read: dict[str, Any]) -> str:
    return f"{read['set']} ({read['family']}, {read['min_think']}-{read['max_think']} thinking tokens)"


class _FinalRun(task.LedgerHandle):
    """One final run's ledger line; the handle :func:`final_run` gives
    :func:`~data_pipeline.testbed.task.final_tables` and yields to its block."""

    def __init__(self, command: str, argv: Sequence[str] | None, out: str | Path | None, reread: str | None,
                 methods: Sequence[str]) -> None:
        head, changed = revision()  # the checkout the run started from (a commit made while it runs does not move it)
        args = list(sys.argv[1:] if argv is None else argv)
        self.path = ledger_path()
        self.reread = reread
        self.changed = changed
        self.methods = list(dict.fromkeys(str(m) for m in methods))
        self.entry: dict[str, Any] = {
            "run": _run_id(), "utc": _utc(), "command": " ".join([command, *map(shlex.quote, args)]), "program": command,
            "git": head, "dirty": None if changed is None else bool(changed), "status": "running", "sets": [],
            "methods": self.methods, "out": None if out is None else str(out), "cells": []}
        if reread is not None:
            self.entry.update(reread=reread, reread_of=[])

    def _put(self, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        line = {**self.entry, "cells": list(self.entry["cells"]), "methods": list(self.methods)}
        at = [i for i, old in enumerate(lines) if old.get("run") == self.entry["run"]]
        if at:
            lines[at[0]] = line
            return lines
        return lines + [line]

    def _check_start(self, read: dict[str, Any]) -> None:
        """Refuse a final read from an uncommitted tree, outside git, or by a run that declared no method."""
        what = f"reading {_read_text(read)}"
        if self.changed is None:
            raise task.FinalSetError(f"{what}: a final read records the commit it ran from, and {ROOT} is not a git "
                                     "checkout (or git failed); run the final tables from a git checkout")
        if self.changed:
            shown = ", ".join(self.changed[:12]) + (f" and {len(self.changed) - 12} more" if len(self.changed) > 12 else "")
            raise task.FinalSetError(
                f"{what}: a final read runs from a committed tree, and {len(self.changed)} tracked file(s) have "
                f"uncommitted changes: {shown}. Commit them first (git commit), then run again: the ledger line "
                "records the commit its numbers came from")
        if not self.methods:
            raise task.FinalSetError(f"{what}: this final run declared no method; pass final_run(..., methods=[...]), "
                                     "the methods it evaluates (the ledger freezes them at the namespace's first read)")

    def _check_methods(self, read: dict[str, Any], lines: list[dict[str, Any]]) -> None:
        frozen = frozen_methods(self.entry["program"], read, lines, self.entry["run"])
        extra = [] if frozen is None else [m for m in self.methods if m not in frozen["methods"]]
        if extra:
            raise task.FinalSetError(
                f"{_read_text(read)}: the methods {self.entry['program']} evaluates on {task.namespace(read['set'])!r} "
                f"({read['family']}) were frozen at its first read ({frozen.get('utc')}, run {frozen.get('run')}: "
                f"{len(frozen['methods'])} methods), and this run adds {len(extra)}: {', '.join(extra)}. Run only the "
                "frozen methods on it; a new method is compared on dev/test (or on a fresh final-only namespace)")

    def admit(self, read: dict[str, Any]) -> None:
        """Record ``read`` in this run's line before its problems are drawn. Refused: an uncommitted tree, a
        method outside the namespace's frozen list, a :data:`~data_pipeline.testbed.task.READ_ONCE` cell an
        earlier line read (unless this run passed ``reread``)."""
        if read in self.entry["sets"]:
            return
        self._check_start(read)

        def add(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
            self._check_methods(read, lines)
            reread_of = []
            if task.namespace(read["set"]) in task.READ_ONCE:
                earlier = earlier_reads(read, lines, self.entry["run"])
                if earlier and self.reread is None:
                    seen = "; ".join(f"{line.get('utc')} {line.get('status')} `{line.get('command')}`" for line in earlier)
                    raise task.FinalSetError(
                        f"{_read_text(read)} is read once and the final-set ledger {self.path} already has a run "
                        f"that read it: {seen}. Its numbers are those runs' records; to read it again anyway, say "
                        "why with --reread WHY (written to the ledger)")
                reread_of = [line.get("run") or line.get("utc") for line in earlier]  # reconstructed lines: their utc
            for run in reread_of:
                if run not in self.entry["reread_of"]:
                    self.entry["reread_of"].append(run)
            self.entry["sets"].append(read)
            return self._put(lines)

        _rewrite(self.path, add)

    def finished_cell(self, key: str, method: str) -> None:
        """Put the finished cell ``key`` (of declared method ``method``) on the run's line now, so a run killed
        later still has it on record (before the first final read it waits for that read's write)."""
        if str(method) not in self.methods:
            raise ValueError(f"cell {key}: method {method!r} is not among this final run's declared methods "
                             f"({', '.join(self.methods) or 'none'}); declare it in final_run(..., methods=...)")
        if key in self.entry["cells"]:
            return
        self.entry["cells"].append(key)
        if self.entry["sets"]:
            _rewrite(self.path, self._put)

    def close(self, status: str) -> None:
        self.entry["status"] = status
        if self.entry["sets"]:
            _rewrite(self.path, self._put)


class _NoFinalRun:
    """What :func:`final_run` yields without ``--final``: no ledger line, cells go nowhere."""

    def __init__(self) -> None:
        self.entry: dict[str, Any] = {"cells": []}

    def finished_cell(self, key: str, method: str) -> None:
        """Nothing to record (no final set can be read)."""


def add_final_arguments(parser: "argparse.ArgumentParser", produces: str) -> None:
    """The ``--final`` / ``--reread WHY`` options of every command that may produce a final table
    (``produces``: what such a run makes, e.g. "a final table"); :func:`final_run` takes their values."""
    parser.add_argument("--final", action="store_true",
                        help=f"this run produces {produces}: only then may it read a final-only set (final, confirm), "
                             "from a committed tree, with the methods frozen at the set's first read; choose and tune "
                             "on dev/test, never on a final set")
    parser.add_argument("--reread", metavar="WHY", default=None,
                        help="with --final: read a read-once final set (final) that the final-set ledger says was "
                             "read before; WHY is written to reports/final-ledger.jsonl")


@contextlib.contextmanager
def final_run(command: str, argv: Sequence[str] | None, enabled: bool, out: str | Path | None = None,
              reread: str | None = None, methods: Sequence[str] = ()) -> Iterator[_FinalRun | _NoFinalRun]:
    """Run a block as a final-table run when ``enabled`` (the command's ``--final``): inside
    :func:`~data_pipeline.testbed.task.final_tables` with this run's ledger handle, which the block gets.
    Its first final read writes the run's ledger line (UTC time, ``command`` + ``argv``, the commit, the
    sets read, ``methods``, ``out``; ``"status": "running"``); each ``handle.finished_cell(key, method)``
    adds a cell to the line at once; on exit the line becomes ``finished`` or ``failed``. A read is refused
    from an uncommitted tree, with a method outside the namespace's frozen list, or, for a read-once cell
    read before, unless ``reread`` says why (the command's ``--reread WHY``). Not enabled: a plain block
    whose handle records nothing (final sets stay refused, and ``reread`` is refused)."""
    if reread is not None and not reread.strip():
        raise ValueError("--reread needs the reason the final set is read again (it goes to the ledger)")
    if not enabled:
        if reread is not None:
            raise ValueError("--reread applies to a --final run only")
        yield _NoFinalRun()
        return
    handle = _FinalRun(command, argv, out, None if reread is None else reread.strip(), methods)
    status = "failed"
    with task.final_tables(handle), _sigterm_exits():
        try:
            yield handle
            status = "finished"
        finally:
            handle.close(status)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eval.harness.ledger retire NAMESPACE --why WHY --replaced-by NEW``: the retirement line."""
    parser = argparse.ArgumentParser(prog="python -m eval.harness.ledger", description=main.__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("retire", help="write a retired namespace's ledger line")
    r.add_argument("namespace")
    r.add_argument("--why", required=True)
    r.add_argument("--replaced-by", default=task.FINAL)
    args = parser.parse_args(argv)
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        entry = retire(args.namespace, args.why, args.replaced_by,
                       command=" ".join(["python -m eval.harness.ledger", *map(shlex.quote, words)]))
    except ValueError as err:
        print(f"ledger: error: {err}", file=sys.stderr)
        return 2
    print(f"{ledger_path()}: {json.dumps(entry, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
