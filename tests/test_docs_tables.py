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


def script(name: str):
    """The module ``scripts/<name>.py`` (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_tables_in_performance_md_come_from_the_committed_run():
    """docs/performance.md's tables of the first GPU run are ``scripts/report_gpu_run.py``'s output, row for row."""
    report = script("report_gpu_run").report
    printed = set(report(ROOT / "reports/gpu-runs/2026-12-04").splitlines())
    text = (ROOT / "docs/performance.md").read_text()
    section = text.split("### The first run: one H200, 2026-12-04", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    assert len(rows) >= 9
    assert [r for r in rows if r not in printed] == []


def test_hook_bench_table_in_vllm_md_comes_from_the_committed_results():
    """docs/vllm.md's before/after table of the worker hooks is ``bench_vllm_hooks.py --compare``'s output."""
    import json

    compare_table = script("bench_vllm_hooks").compare_table
    runs = [(name, json.loads((ROOT / "reports/vllm-hooks-cpu" / f"{name}.json").read_text()))
            for name in ("before-v1", "after-v1", "before-v2", "after-v2")]
    printed = compare_table(runs).splitlines()
    text = (ROOT / "docs/vllm.md").read_text()
    assert all(line in text.splitlines() for line in printed)


def test_seed_verifier_table_in_rescue_md_comes_from_the_committed_answers():
    """docs/rescue.md's answer-AUROC table of seed 1's chain LRM is ``python -m eval.rescue.answers table``'s output."""
    import json

    from eval.rescue.answers import answers_table

    answers, gate = (json.loads((ROOT / "reports" / f"prm-chain-fair-s1-answers{tail}.json").read_text()) for tail in ("", "-gate"))
    printed = answers_table(answers, gate).splitlines()
    lines = (ROOT / "docs/rescue.md").read_text().splitlines()
    assert len(printed) == 10 and all(line in lines for line in printed)


def test_tuning_tables_in_evaluation_md_come_from_the_committed_choices():
    """docs/evaluation.md's two tuning tables are ``python -m eval.harness.tuning table``'s output."""
    import json

    from eval.harness.tuning import summary_table

    doc = (ROOT / "docs/evaluation.md").read_text()
    for family in ("chain", "copy"):
        out = ROOT / "reports" / "tuning" / f"{family}-fair"
        table = "\n".join(summary_table(json.loads((out / "choices.json").read_text())))
        assert table.count("\n") > 15 and table in doc, family
