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


MEASURED_ROW = re.compile(r"^\| (chain|copy) \| (\d+) \| ([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\|([^|]+)\| ([^|]+) \|$", re.M)
MEASURED_SOURCE = {"chain": "reports/sealed-chain", "copy": "reports/sealed-copy"}
MEASURED_METHODS = ("full (no eviction)", "dynts", "rkv+q", "snapkv+q", "h2o+q", "random")


def test_readme_measured_table_recomputes_from_the_records(capsys):
    """Every cell of "What is measured" is what ``eval.harness.compare --from-records --wide`` prints
    from the committed per-problem records (the same command the README names)."""
    from eval.harness.compare import main as compare

    rows = MEASURED_ROW.findall((ROOT / "README.md").read_text())
    assert {family for family, *_ in rows} == {"chain", "copy"}, "README.md lost its 'What is measured' table"
    printed: dict[str, str] = {}
    for family, source in MEASURED_SOURCE.items():
        compare([str(ROOT / source), "--from-records", "--wide", "--question-tokens", "14"])
        printed[family] = capsys.readouterr().out
    for family, budget, *cells, verdicts in rows:
        lines = printed[family].splitlines()
        header = next(line for line in lines if line.startswith("| method |"))
        column = [c.strip() for c in header.strip("|").split("|")].index(f"B = {budget}")
        for method, cell in zip(MEASURED_METHODS, cells):
            row = next(line for line in lines if line.startswith(f"| {method} |"))
            values = [c.strip() for c in row.strip("|").split("|")]
            value = values[1] if method.startswith("full") else values[column]
            assert value.split(" [")[0] == cell.strip(), f"{family} B={budget} {method}: README {cell.strip()}, records {value}"
        for method, verdict in zip(("rkv+q", "snapkv+q", "h2o+q"), verdicts.split(" / ")):
            row = [line for line in lines if line.startswith(f"| {method} |")][-1]  # the "dynts minus" table
            cell = [c.strip() for c in row.strip("|").split("|")][column].strip("*")
            assert cell.endswith(verdict.strip()), f"{family} B={budget} dynts - {method}: README {verdict}, records {cell}"
