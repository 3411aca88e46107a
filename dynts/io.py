"""Output that is never half-written: :func:`write_atomic` (one file) and :func:`replace_directory`
(a directory built next to its target)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["replace_directory", "write_atomic"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically.

    The data goes to a temporary file in ``path``'s directory (created if missing), is fsync'ed and
    then ``os.replace``'d over ``path``: readers see the old file or the whole new one, never a
    partial write. The file gets the permissions a plain ``open(path, "w")`` would give. On any
    error the temporary file is removed and ``path`` is left as it was.
    """
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"data must be str or bytes, got {type(data).__name__}; serialise it first")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_directory(tmp: str | Path, target: str | Path) -> Path:
    """Move the finished directory ``tmp`` to ``target`` (same filesystem), replacing any existing
    ``target``; ``tmp`` is built next to ``target`` so the final rename is atomic."""
    tmp, target = Path(tmp), Path(target)
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    return target
