"""docs/evaluation.md's final tables on ``sealed`` are what ``eval.harness.compare --from-records --wide``
prints from the committed per-problem records, row for row."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### The final tables on `sealed`"
SOURCES = ("reports/sealed-chain", "reports/sealed-copy")


def sealed_section_rows() -> list[str]:
    """The data rows of every table in the section (not headers, separators or the ``B / full seq`` row,
    which needs the run dirs' full-cache sequence lengths)."""
    text = (ROOT / "docs/evaluation.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [r for r in rows if not r.startswith(("| method |", "| dynts minus |", "|---", "| *B / full seq*"))]


def test_sealed_tables_recompute_from_the_records(capsys):
    from eval.harness.compare import main as compare

    printed = ""
    for source in SOURCES:
        compare([str(ROOT / source), "--from-records", "--wide", "--question-tokens", "14"])
        printed += capsys.readouterr().out
    recomputed = set(printed.splitlines())
    rows = sealed_section_rows()
    assert len(rows) >= 2 * 13 + 2 * 11, "docs/evaluation.md lost a final table on sealed"
    assert [r for r in rows if r not in recomputed] == []
