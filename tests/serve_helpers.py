"""Run ``dynts serve`` on 127.0.0.1 in a subprocess for loopback tests (always stopped)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str | Path, args: list[str], log_path: Path, timeout: float = 120,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the base url of ``dynts serve MODEL ARGS`` once ``/health`` answers 200; its output goes to ``log_path``.
    ``env``: more environment for the server (``PYTHONPATH`` entries go before the checkout)."""
    port = free_port()
    extra = dict(env or {})
    path = os.pathsep.join(p for p in (extra.pop("PYTHONPATH", ""), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}
    cmd = [sys.executable, "-m", "dynts.cli", "serve", str(model), "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"dynts serve exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dynts serve did not come up within {timeout} s: {log_path.read_text()[-3000:]}")
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
