"""docs/rescue.md's section on the fair chain models: its rescue tables are what ``eval.rescue.table
--from-records`` prints from the committed records, and its AUROC table is the committed JSON's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## The fair chain models on `dev`"


def section() -> str:
    text = (ROOT / "docs/rescue.md").read_text()
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("heading, run", [
    ("### KV-Rescue at B = 72, with the controls", "dev-chain-fair-B72-N4"),  # the first fair chain LRM
    ("### KV-Rescue on seed 1's fair chain LRM at B = 72", "dev-chain-fair-s1-B72-N4"),  # the final tables' one
    ("### KV-Rescue on seed 1's fair chain LRM with the step PRM alone", "dev-chain-fair-s1-B72-N4-step-prm"),
    ("### The same with N = 1 + 1", "dev-chain-fair-s1-B72-N1-step-prm"),
    ("### The product verifier with N = 1 + 1", "dev-chain-fair-s1-B72-N1-product"),
])
def test_fair_rescue_tables_recompute_from_the_records(capsys, heading, run):
    from eval.rescue.table import main as table

    table([str(ROOT / "reports/rescue" / run), "--from-records"])
    printed = set(capsys.readouterr().out.splitlines())
    sub = section().split(heading, 1)[1].split("\n### ", 1)[0]
    rows = [line for line in sub.splitlines() if line.startswith("| B = 72 |")]
    assert len(rows) == 2
    assert [r for r in rows if r not in printed] == []


def test_fair_answer_auroc_table_is_the_committed_json():
    dev = json.loads((ROOT / "reports/prm-chain-fair-answers.json").read_text())["samples"]["auroc"]
    gate = json.loads((ROOT / "reports/prm-chain-fair-answers-gate.json").read_text())["gate"]["auroc"]
    fmt = lambda r: f"{r['auroc']:.3f}"  # noqa: E731
    first = section().split("### Which verifier reads answers", 1)[1].split("\n### ", 1)[0]  # the first fair LRM's
    rows = {line.split("|")[1].strip().strip("*`"): line for line in first.splitlines() if line.startswith("| `") or line.startswith("| **`")}
    assert set(rows) == set(dev) == set(gate)
    for name, line in rows.items():
        cells = [c.strip() for c in line.split("|")[3:5]]
        ci = lambda r: f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"  # noqa: E731
        assert cells[0].replace("*", "") == f"{fmt(dev[name])} {ci(dev[name])}", name
        assert cells[1] == f"{fmt(gate[name])} {ci(gate[name])}", name


@pytest.mark.parametrize("heading, runs", [
    ("### KV-Rescue on seed 1's fair chain LRM with the step PRM alone",
     ("dev-chain-fair-s1-B72-N4-step-prm", "dev-chain-fair-s1-B72-N4")),
    ("### The same with N = 1 + 1", ("dev-chain-fair-s1-B72-N1-step-prm",)),
    ("### The product verifier with N = 1 + 1", ("dev-chain-fair-s1-B72-N1-product",)),
])
def test_step_errors_tables_are_the_script_output(heading, runs):
    """The committed-step checks under the step PRM's runs are ``python -m eval.rescue.step_errors``'s tables."""
    from eval.rescue.step_errors import step_errors, step_errors_table

    sub = section().split(heading, 1)[1].split("\n### ", 1)[0]
    lines = [line.strip() for line in sub.splitlines()]
    tables, i = [], 0
    while i < len(lines):
        if lines[i].startswith("| cell | base steps wrong |"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            tables.append("\n".join(lines[i:j]))
            i = j
        i += 1
    assert tables == [step_errors_table(step_errors(ROOT / "reports/rescue" / run)) for run in runs]
