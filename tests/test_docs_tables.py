"""The docs' and README's measured tables are what the repo's printers print from the committed records, row for
row: the final tables on ``final`` and the retired ones on ``sealed`` (``eval.harness.compare --from-records
--wide``), the seeds' verdicts, the tunings, the demo, the GPU run and the rescue tables."""

from __future__ import annotations

from pathlib import Path

import pytest

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


FINAL_SECTION = "### The final tables on `final`: k = 5"
NOT_DATA = ("| method |", "|---", "| *B / full seq*")


def final_part(family: str) -> str:
    """The ``#### <Family>`` part of docs/evaluation.md's section on the final tables."""
    text = (ROOT / "docs/evaluation.md").read_text()
    section = text.split(FINAL_SECTION, 1)[1].split("\n### ", 1)[0]
    return section.split(f"\n#### {family.capitalize()}\n", 1)[1].split("\n#### ", 1)[0]


@pytest.mark.parametrize("family", ["chain", "copy"])
def test_final_table_recomputes_from_the_records_or_is_still_running(family, capsys):
    """A family's final table on ``final`` is ``compare --from-records --wide``'s output over its committed records,
    row for row and in order; a table not written yet (no ``reports/final-<family>/results.json``) is said to be
    running and shows no number."""
    from eval.harness.compare import main as compare

    report = ROOT / "reports" / f"final-{family}"
    part = final_part(family)
    rows = [line for line in part.splitlines() if line.startswith("| ") and not line.startswith(NOT_DATA)]
    if not (report / "results.json").is_file():
        assert part.lstrip().startswith("Still running") and rows == []
        return
    compare([str(report), "--from-records", "--wide"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and not line.startswith(NOT_DATA)]
    assert len(printed) > 30 and rows == printed
    assert f"`reports/final-{family}/`" in part


def test_readme_final_rows_are_the_committed_final_tables():
    """README's final-table rows are ``python -m eval.harness.seeds reports/final-<family> --names <family>``'s, for
    every family whose table is written; the README says a family without one is still running."""
    from eval.harness.records import read_records
    from eval.harness.seeds import seed_table

    text = (ROOT / "README.md").read_text().split("**The final tables**", 1)[1].split("- **The ranking does not hold", 1)[0]
    readme = [line for line in text.splitlines() if line.startswith(("| chain |", "| copy |"))]
    want = []
    for family in ("copy", "chain"):  # the README's order
        report = ROOT / "reports" / f"final-{family}"
        if (report / "results.json").is_file():
            printed = seed_table([read_records(report)], [family]).splitlines()
            want += [line for line in printed if line.startswith(f"| {family} |")]
        else:
            assert f"**The `{family}` final table is still running**" in text
    assert want and readme == want


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


def test_readme_rescue_row_is_the_committed_run():
    """README's KV-Rescue row (seed 1's fair chain models) is ``reports/rescue/dev-chain-fair-s1-B72-N4/results.json``."""
    import json

    results = json.loads((ROOT / "reports/rescue/dev-chain-fair-s1-B72-N4/results.json").read_text())
    accuracy = {cell["setting"]: cell["metrics"]["accuracy"] for cell in results["cells"]}
    order = ("full", "evict", "bon", "helper", "helper-search", "kvr", "full-search")
    want = "| " + " | ".join(f"**{100 * accuracy[s]:.1f} %**" if s == "kvr" else f"{100 * accuracy[s]:.1f} %" for s in order) + " |"
    assert want in [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]


def test_seed_models_table_in_testbed_md_is_the_committed_records():
    """docs/testbed.md's table of the seeds' LRMs and predictors is ``python -m eval.harness.seed_models``'s output."""
    from eval.harness.seed_models import models_table

    assert models_table(ROOT) in (ROOT / "docs/testbed.md").read_text()


def test_readme_seed_verdicts_are_the_committed_dev_tables():
    """README's per-seed verdict rows are ``python -m eval.harness.seeds``'s over every committed dev table of each
    family (seed 1 on), all of them: a seed's table committed without its README rows fails here."""
    from eval.harness.records import read_records
    from eval.harness.seeds import seed_table

    text = (ROOT / "README.md").read_text().split("- **The ranking does not hold on chain", 1)[1].split("\n- **", 1)[0]
    readme = [line.strip() for line in text.splitlines() if line.strip().startswith(("| chain | s", "| copy | s"))]
    want = []
    for family, stem in (("chain", "chain-dev-fair"), ("copy", "copy-dev-fair-scratch")):
        dirs = [ROOT / "reports" / f"{stem}-s{seed}" for seed in (1, 2, 3)]
        dirs = [d for d in dirs if (d / "results.json").is_file()]
        printed = seed_table([read_records(d) for d in dirs], [d.name.rsplit("-", 1)[1] for d in dirs])
        want += [f"| {family} " + line for line in printed.splitlines() if line.startswith("| s") and not line.startswith("| seed")]
    assert len(want) >= 12 and readme == want


def test_tuning_tables_in_evaluation_md_come_from_the_committed_choices():
    """docs/evaluation.md's tuning tables (each family's grid and SepLLM's) are ``python -m eval.harness.tuning table``'s output."""
    import json

    from eval.harness.tuning import summary_table

    doc = (ROOT / "docs/evaluation.md").read_text()
    for family in ("chain", "copy"):
        out = ROOT / "reports" / "tuning" / f"{family}-fair"
        table = "\n".join(summary_table(json.loads((out / "choices.json").read_text())))
        assert table.count("\n") > 15 and table in doc, family
        sepllm = "\n".join(summary_table(json.loads((out.with_name(f"{family}-fair-sepllm") / "choices.json").read_text())))
        assert "| sepllm | best |" in sepllm and sepllm in doc, family


def test_readme_demo_table_is_the_committed_demo():
    """README's demo table is ``reports/demo/<family>/results.json`` (what ``dynts demo`` wrote), cell for cell, and
    each tuned baseline's form in brackets is the one the demo ran."""
    import json

    from eval.harness.demo import FAMILIES

    text = (ROOT / "README.md").read_text().split("## The demo", 1)[1].split("\n## ", 1)[0]
    header, *rows = [line for line in text.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    names = {"DynTS": "dynts", "H2O": "h2o", "SnapKV": "snapkv", "R-KV": "rkv", "SepLLM": "sepllm", "random": "random",
             "window": "window", "StreamingLLM": "streamingllm"}
    assert {r.split("|")[1].strip() for r in rows} == set(FAMILIES)
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
        results = json.loads((ROOT / "reports/demo" / cells["family"] / "results.json").read_text())
        by_name = {r["method"]["name"]: r for r in results if "oracle" not in r["method"]["name"]}
        by_label = {r["method"]["label"]: r for r in results}
        assert cells["full"] == f"{100 * by_name['full']['pass@1']:.1f}"
        for column, name in names.items():
            result = by_name[name]
            value, _, form = cells[column].partition(" (")
            assert value == f"{100 * result['pass@1']:.1f}", (cells["family"], column)
            label = result["method"]["label"].split(":")[0]
            if form:  # token / token+q / head / head+q: the preset the tuning chose
                assert label == {"token": name, "token+q": f"{name}+q", "head": f"{name}-head",
                                 "head+q": f"{name}-head+q"}[form.rstrip(")")], (cells["family"], column)
        oracles = dict(part.split() for part in cells["oracles"].split(", "))
        prefix = "chain-oracle-" if cells["family"] == "chain" else "oracle-"
        assert oracles == {k: f"{100 * by_label[prefix + k]['pass@1']:.1f}" for k in oracles}
        assert len(oracles) == sum(1 for label in by_label if label.startswith(prefix))
