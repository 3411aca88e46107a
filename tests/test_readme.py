"""Every ```python block of README.md runs as written (from the repository root, in order, in one
namespace), with ``max_new_tokens`` capped at ``README_MAX_NEW_TOKENS`` (default 200) to stay fast."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def cap_tokens(code: str, cap: int) -> str:
    return re.sub(r"max_new_tokens=(\d+)", lambda m: f"max_new_tokens={min(int(m.group(1)), cap)}", code)


def test_readme_has_python_examples():
    assert readme_blocks(), "README.md lost its python examples"
    assert (ROOT / "README.md").read_text().startswith("# dynts\n\n```bash\nmake demo")


def test_readme_python_blocks_run(monkeypatch, capsys):
    import torch

    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    cap = int(os.environ.get("README_MAX_NEW_TOKENS", "200"))
    namespace: dict = {"__name__": "__readme__"}
    for i, code in enumerate(readme_blocks()):
        try:
            exec(compile(cap_tokens(code, cap), f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - name the block that failed
            pytest.fail(f"README.md python block {i + 1} raised {type(err).__name__}: {err}\n{code}")
    printed = capsys.readouterr().out
    assert printed.strip(), "the README examples print their results"


