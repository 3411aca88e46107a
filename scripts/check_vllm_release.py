"""Check the vLLM internals the plugin uses against another vLLM release's source, with no engine run.

``python scripts/check_vllm_release.py 0.33.0`` downloads that release's wheel (``pip download vllm==X
--no-deps``, ~340 MB) into a temporary directory, unpacks the Python files the plugin reads, runs
:func:`dynts.vllm.missing_internals` on that tree (``ast``; nothing of it is imported) and prints what it
lacks. ``--wheel PATH`` uses a wheel already on disk; ``--expect-missing N`` exits non-zero when the count
differs (``make check-vllm`` records the 0.33.0 result this way). A clean result says the names are there,
not that the plugin runs on that release: the supported ranges (``dynts.vllm.SUPPORTED_RELEASES``) move only
with the engine tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dynts.vllm.compat import COMMON, INTERNALS, RUNNER, WORKER_V1, WORKER_V2, missing_internals


def unpack(wheel: Path, into: Path) -> Path:
    """The ``vllm/`` files :data:`INTERNALS` reads, extracted from ``wheel``; returns the package root."""
    wanted = {f"vllm/{entry[0]}" for entry in INTERNALS}
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into, members=[n for n in z.namelist() if n in wanted])
    return into / "vllm"


def download(release: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={release}", "--no-deps", "--only-binary", ":all:",
                    "-q", "-d", str(into)], check=True)
    return next(into.glob(f"vllm-{release}-*.whl"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("release", help="a vLLM release on PyPI, e.g. 0.33.0")
    p.add_argument("--wheel", type=Path, default=None, help="a wheel already downloaded")
    p.add_argument("--expect-missing", type=int, default=None, help="exit 1 unless this many internals are missing")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(args.release, Path(tmp))
        root = unpack(wheel, Path(tmp) / "src")
        runner = "v1" if (root / RUNNER).is_file() else "v2"  # what missing_internals checks on this tree
        missing = missing_internals(root, runner)
    checked = len(COMMON) + len(WORKER_V1 if runner == "v1" else WORKER_V2)
    print(f"vllm {args.release}: {checked} internals checked ({runner} runner), {len(missing)} missing"
          + "".join(f"\n  missing: {m}" for m in missing))
    if args.expect_missing is not None and len(missing) != args.expect_missing:
        print(f"expected {args.expect_missing} missing: update docs/vllm.md and the Makefile", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
