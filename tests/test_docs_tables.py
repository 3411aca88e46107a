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


BEST_SECTION = "### DynTS against the best baseline"


def best_baseline_section() -> str:
    """docs/evaluation.md's section on DynTS against the best baseline (the final tables' and each seed's)."""
    return (ROOT / "docs/evaluation.md").read_text().split(BEST_SECTION, 1)[1].split("\n### ", 1)[0]


def test_final_rows_against_the_best_baseline_are_the_committed_final_tables():
    """docs/evaluation.md's final-table rows of DynTS against the best baseline are ``python -m eval.harness.seeds
    reports/final-<family> --names <family>``'s, for every family whose table is written; the docs say a family
    without one is still running."""
    from eval.harness.records import read_records
    from eval.harness.seeds import seed_table

    text = best_baseline_section().split("- **The ranking does not hold", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith(("| chain |", "| copy |"))]
    want = []
    for family in ("copy", "chain"):  # the docs' order
        report = ROOT / "reports" / f"final-{family}"
        if (report / "results.json").is_file():
            printed = seed_table([read_records(report)], [family]).splitlines()
            want += [line for line in printed if line.startswith(f"| {family} |")]
        else:
            assert f"**The `{family}` final table is still running**" in text
    assert want and rows == want


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
    """docs/vllm.md's table of the worker hooks is ``bench_vllm_hooks.py --compare``'s output."""
    import json

    compare_table = script("bench_vllm_hooks").compare_table
    runs = [(name, json.loads((ROOT / "reports/vllm-hooks-cpu" / f"{name}.json").read_text()))
            for name in ("before-v1", "v1-dynts", "v1-sepllm", "v1-random", "before-v2", "v2-dynts", "v2-sepllm",
                         "v2-random")]
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


def glance() -> dict[str, str]:
    """README's results at a glance: each bullet by its bold lead (``Copy, toy testbed``)."""
    text = (ROOT / "README.md").read_text().split("\n## Results at a glance\n", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in text.splitlines() if line.startswith("- **")]
    assert len(bullets) <= 8 and all(line.count("](docs/") == 1 for line in bullets), bullets  # one link each
    return {line[4:].split(":**", 1)[0]: line for line in bullets}


def final_cells(family: str) -> list[list[str]]:
    """The cells of ``python -m eval.harness.seeds reports/final-<family>``'s rows: family, B, full %, DynTS %, best
    baseline, its %, DynTS - best [CI], verdict."""
    from eval.harness.records import read_records
    from eval.harness.seeds import seed_table

    printed = seed_table([read_records(ROOT / "reports" / f"final-{family}")], [family]).splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in printed if line.startswith(f"| {family} |")]


def final_tests(family: str) -> tuple[list[dict], dict, int]:
    """``eval.harness.seeds``' best-baseline rows of ``reports/final-<family>``, every paired test of the table (by
    method and budget) and the size of its Holm family (the non-vacuous cells)."""
    from eval.harness.compare import cells_from_records, paired_tests
    from eval.harness.records import read_records
    from eval.harness.seeds import best_baseline_rows

    records = read_records(ROOT / "reports" / f"final-{family}")
    rows = best_baseline_rows(records)
    tests = paired_tests(cells_from_records(records), rows[0]["against"], {r["key"]: r for r in records})
    return rows, tests, sum(1 for t in tests.values() if t["p_holm"] is not None)


def slash(values) -> str:
    """``a / b / c`` in ``eval.harness.compare``'s p-value format."""
    from eval.harness.compare import _p

    return " / ".join(_p(v) for v in values)


ATTENTION = ("h2o", "snapkv", "rkv")


def attention_cells_without_a_lead(tests: dict) -> list[tuple[str, int, str]]:
    """(label, budget, verdict) of every H2O / SnapKV / R-KV cell (any form) that DynTS does not lead."""
    return sorted((m, b, t["verdict"]) for (m, b), t in tests.items()
                  if m.split(":")[0].split("-")[0].removesuffix("+q") in ATTENTION and t["verdict"] != "leads")


def test_readme_results_at_a_glance_are_the_records():
    """Every number of README's results at a glance is recomputed from the committed record its line names."""
    import json

    lines = glance()
    copy = lines["Copy, toy testbed"]
    cells = final_cells("copy")
    assert "`reports/final-copy/`" in copy and all(c[4].startswith("h2o") for c in cells) and "H2O" in copy
    assert f"DynTS scores {' / '.join(c[3] for c in cells)} % at budgets B = {' / '.join(c[1] for c in cells)}" in copy
    assert f"(full cache {cells[0][2]} %)" in copy
    assert f"({' / '.join(c[5] for c in cells)} %)" in copy and {c[7] for c in cells} == {"inconclusive"}
    rows, tests, family = final_tests("copy")
    best = [tests[(r["best"], r["budget"])] for r in rows]
    assert f"its {' / '.join(c[6].split(' [')[0] for c in cells)} points are inconclusive" in copy
    assert f"(sign test p = {slash(t['p'] for t in best)}, Holm over the table's {family} tests {slash(t['p_holm'] for t in best)};" in copy
    assert all(t["tost_p_holm"] >= 0.05 for t in best) and "not equivalent within ±3 either" in copy

    chain = lines["Chain, toy testbed"]
    cells = final_cells("chain")
    assert "`reports/final-chain/`" in chain and all(c[4].startswith("sepllm") for c in cells)
    assert f"({' / '.join(c[6].split(' [')[0] for c in cells)} points" in chain and {c[7] for c in cells} == {"trails"}
    rows, tests, family = final_tests("chain")
    best = [tests[(r["best"], r["budget"])] for r in rows]
    assert f"sign test, Holm over the table's {family} tests p = {slash(t['p_holm'] for t in best)})" in chain
    (label, budget, verdict), = attention_cells_without_a_lead(tests)  # the one attention-score cell DynTS does not lead
    assert label.startswith("snapkv+q:") and verdict == "inconclusive" and budget == max(r["budget"] for r in rows)
    assert f"all but SnapKV+q ({100 * tests[(label, budget)]['diff']:+.1f} points, inconclusive) at B = {budget}" in chain

    seeds = lines["Three training seeds, toy testbed"]
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in seed_rows()]
    copy_rows = [r for r in rows if r[0] == "copy"]
    assert f"in {sum(r[-1] == 'leads' for r in copy_rows)} of {len(copy_rows)} seed x budget cells on copy" in seeds
    chain_seeds = {r[1] for r in rows if r[0] == "chain"}
    leading = [s for s in chain_seeds if all(r[-1] == "leads" for r in rows if r[:2] == ["chain", s])]
    assert f"at every budget on {len(leading)} of {len(chain_seeds)} seeds on chain" in seeds

    demo = lines["`make demo`, toy testbed"]
    pct = lambda family, name: next(f"{100 * r['pass@1']:.1f}" for r in json.loads(  # noqa: E731
        (ROOT / "reports/demo" / family / "results.json").read_text()) if r["method"]["name"] == name)
    assert f"DynTS scores {pct('copy', 'dynts')} % on copy (full cache {pct('copy', 'full')} %)" in demo
    assert f"{pct('chain', 'dynts')} % on chain (full cache {pct('chain', 'full')} %)" in demo
    assert f"SepLLM scores {pct('chain', 'sepllm')} %" in demo and "at B = 96" in demo
    from eval.harness.compare import cells_from_records, paired_tests
    from eval.harness.records import read_records

    records = read_records(ROOT / "reports/demo/chain")
    cells = cells_from_records(records)
    ours = next(c["method"]["label"] for c in cells if c["method"]["name"] == "dynts")
    (test,) = [t for (m, _), t in paired_tests(cells, ours, {r["key"]: r for r in records}).items() if m.split(":")[0] == "sepllm"]
    assert f"SepLLM scores {pct('chain', 'sepllm')} % ({100 * test['diff']:+.1f} points, {test['verdict']})" in demo

    rescue = lines["KV-Rescue, toy testbed"]
    from eval.rescue.table import DIFFERENCES, judged, rows as rescue_rows

    alone, product = rescue.split("With the PRM times the helper's likelihood", 1)
    for text, name in ((alone, "dev-chain-fair-s1-B72-N4-step-prm"), (product, "dev-chain-fair-s1-B72-N4")):
        run = json.loads((ROOT / "reports/rescue" / name / "results.json").read_text())
        accuracy = {cell["setting"]: f"{100 * cell['metrics']['accuracy']:.1f}" for cell in run["cells"]}
        assert f"best-of-N's {accuracy['bon']} % to {accuracy['kvr']} %" in text, name
        assert f"(full cache {accuracy['full']} %" in text and f"alone scores {accuracy['helper-search']} %" in text
        assert f"B = {run['config']['budget']} " in rescue
        (row,) = judged(rescue_rows([ROOT / "reports/rescue" / name], from_records=True))
        if name.endswith("step-prm"):
            assert run["config"]["prm"] == "checkpoints/testbed-chain-fair-step-prm"
            behind = row["stats"]["kvr_minus_helper_search"]
            assert (f"KV-Rescue minus helper-search is {100 * behind['diff']:+.1f} points (McNemar p = {behind['mcnemar']['p']:.2g}, Holm "
                    f"{behind['p_holm']:.2g}: {behind['verdict']})") in text
            one = json.loads((ROOT / "reports/rescue/dev-chain-fair-s1-B72-N1-step-prm/results.json").read_text())
            single = {cell["setting"]: f"{100 * cell['metrics']['accuracy']:.1f}" for cell in one["cells"]}
            (row1,) = judged(rescue_rows([ROOT / "reports/rescue/dev-chain-fair-s1-B72-N1-step-prm"], from_records=True))
            gap = row1["stats"]["kvr_minus_helper_search"]
            assert one["config"]["n"] == 1 and one["config"]["prm"] == run["config"]["prm"]
            assert (f"(N = 1 + 1) it scores {single['kvr']} %, the full cache's, and the helper searching alone "
                    f"{single['helper-search']} % ({100 * gap['diff']:+.1f} points, {gap['verdict']})") in text
            assert single["kvr"] == single["full"]
            continue
        gain, tests = row["stats"]["kvr_minus_bon"], sum(1 for name in DIFFERENCES if row["stats"].get(name))
        assert (f"{100 * gain['diff']:+.1f} points, McNemar p = {gain['mcnemar']['p']:.2g}, Holm over the table's {tests} "
                f"tests {gain['p_holm']:.2g}: {gain['verdict']})") in text

    gpu = lines["Speed, one H200 GPU (7B shapes, bf16)"]
    report = script("report_gpu_run").report(ROOT / "reports/gpu-runs/2026-12-04")
    table = lambda title: [[c.strip() for c in line.strip("|").split("|")] for line in  # noqa: E731
                           report.split(title, 1)[1].split("\n### ", 1)[0].splitlines()[4:] if line.startswith("| ")]
    kernels = table("### Kernels")
    assert all(k[4] == "True" for k in kernels)
    span = lambda values: f"{min(values):.2f}-{max(values):.2f}x"  # noqa: E731
    assert f"bitwise at {span([float(k[3]) for k in kernels])} its speed" in gpu
    compiled = [d for d in table("### Decode") if d[0] == "compiled"]
    assert {d[2] for d in compiled} == {"4096"} and "at B = 4096" in gpu
    assert f"({span([float(d[8]) for d in compiled])})" in gpu  # t / t_full(B)
    assert f"{span([float(d[7]) for d in compiled if d[1] == '16'])} less" in gpu  # the speedup at batch 16

    vllm = lines["vLLM, CPU build (testbed LRM)"]
    bench = json.loads((ROOT / "reports/bench-serve-vllm/tight.json").read_text())
    stock, bounded = bench["runs"]
    args = bench["args"]
    fits = stock["pool_blocks"] // -(-(args["prompt"] + args["generate"]) // args["page"])
    assert f"at B = {args['budgets'][0]} serves {args['requests']} requests of {args['generate']} tokens" in vllm
    assert f"at {bounded['tokens_per_s'] / stock['tokens_per_s']:.2f}x stock vLLM's tokens/s" in vllm
    assert f"fits {fits} full-length requests ({bounded['preemptions']} preemptions against {stock['preemptions']})" in vllm


def test_seed_models_table_in_testbed_md_is_the_committed_records():
    """docs/testbed.md's table of the seeds' LRMs and predictors is ``python -m eval.harness.seed_models``'s output."""
    from eval.harness.seed_models import models_table

    assert models_table(ROOT) in (ROOT / "docs/testbed.md").read_text()


def seed_rows() -> list[str]:
    """``python -m eval.harness.seeds``'s rows over every committed dev table of each family (seed 1 on), each
    prefixed with its family."""
    from eval.harness.records import read_records
    from eval.harness.seeds import seed_table

    want = []
    for family, stem in (("chain", "chain-dev-fair"), ("copy", "copy-dev-fair-scratch")):
        dirs = [ROOT / "reports" / f"{stem}-s{seed}" for seed in (1, 2, 3)]
        dirs = [d for d in dirs if (d / "results.json").is_file()]
        printed = seed_table([read_records(d) for d in dirs], [d.name.rsplit("-", 1)[1] for d in dirs])
        want += [f"| {family} " + line for line in printed.splitlines() if line.startswith("| s") and not line.startswith("| seed")]
    return want


def test_seed_verdicts_are_the_committed_dev_tables():
    """docs/evaluation.md's per-seed verdict rows are ``python -m eval.harness.seeds``'s over every committed dev
    table of each family, all of them: a seed's table committed without its rows fails here."""
    text = best_baseline_section().split("- **The ranking does not hold on chain", 1)[1].split("\n- **", 1)[0]
    rows = [line.strip() for line in text.splitlines() if line.strip().startswith(("| chain | s", "| copy | s"))]
    want = seed_rows()
    assert len(want) >= 12 and rows == want


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


def test_demo_table_in_evaluation_md_is_the_committed_demo():
    """docs/evaluation.md's demo table is ``reports/demo/<family>/results.json`` (what ``dynts demo`` wrote), cell for
    cell, and each tuned baseline's form in brackets is the preset the demo ran."""
    import json

    from eval.harness.demo import FAMILIES

    text = (ROOT / "docs/evaluation.md").read_text().split("\n## The demo\n", 1)[1].split("\n## ", 1)[0]
    table = text.split("pass@1 % [bootstrap 95 % CI in `wide.md`]", 1)[1].split("\n\n", 2)[1]
    header, _, *rows = table.splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    names = ("dynts", "h2o", "snapkv", "rkv", "sepllm", "random", "window", "streamingllm")
    assert {r.split("|")[1].strip() for r in rows} == set(FAMILIES) and set(names) <= set(columns)
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
        results = json.loads((ROOT / "reports/demo" / cells["family"] / "results.json").read_text())
        by_name = {r["method"]["name"]: r for r in results if "oracle" not in r["method"]["name"]}
        by_label = {r["method"]["label"]: r for r in results}
        assert cells["full"] == f"{100 * by_name['full']['pass@1']:.1f}"
        for name in names:
            result = by_name[name]
            value, _, form = cells[name].partition(" (")
            assert value == f"{100 * result['pass@1']:.1f}", (cells["family"], name)
            if form:  # the preset the tuning chose: h2o, snapkv-head+q, rkv+q, ...
                assert form.strip("()`") == result["method"]["label"].split(":")[0], (cells["family"], name)
        oracles = dict(part.split() for part in cells["oracles"].split(", "))
        prefix = "chain-oracle-" if cells["family"] == "chain" else "oracle-"
        assert oracles == {k: f"{100 * by_label[prefix + k]['pass@1']:.1f}" for k in oracles}
        assert len(oracles) == sum(1 for label in by_label if label.startswith(prefix))


def test_label_diagnostic_tables_in_testbed_md_come_from_the_committed_record():
    """docs/testbed.md's label diagnostic (each label's recall of the counterfactual's top tokens and of the answer's
    closure, per seed and family, and the future forms the defaults were chosen on) is ``python -m
    eval.analyses.label_diagnostic --table-only``'s output over ``reports/label-diagnostic/results.json``."""
    import json

    from eval.analyses.label_diagnostic import table, variants_table

    record = json.loads((ROOT / "reports/label-diagnostic/results.json").read_text())
    assert {(r["family"], r["seed"]) for r in record["runs"]} == {(f, s) for f in ("chain", "copy") for s in (1, 2, 3)}
    section = (ROOT / "docs/testbed.md").read_text().split("### Which tokens the labels pick", 1)[1].split("\n## ", 1)[0]
    assert table(record) in section and variants_table(record) in section


def test_step_prm_table_in_rescue_md_recomputes_from_the_committed_record():
    """docs/rescue.md's step-PRM AUROC table (alone and in the product) is ``python -m eval.rescue.step_auroc table``'s
    output, every AUROC and interval recomputed from the scores, labels and problems of the committed record."""
    import json

    from eval.rescue.step_auroc import step_table

    record = json.loads((ROOT / "reports" / "prm-chain-fair-step-dev.json").read_text())
    printed = step_table(record).splitlines()
    lines = (ROOT / "docs/rescue.md").read_text().splitlines()
    assert len(printed) == 2 + len(record["verifiers"]) and all(line in lines for line in printed)


def flat(text: str) -> str:
    """``text`` with every run of whitespace as one space (the docs' prose wraps anywhere)."""
    return " ".join(text.split())


def test_best_baseline_prose_is_the_records():
    """The statistics docs/evaluation.md's section on DynTS against the best baseline gives in prose (the final tables'
    sign-test and TOST p-values before and after Holm, the Holm family sizes, the one attention-score cell DynTS does
    not lead on chain, each method's kept count, SepLLM's range on each seed's dev table) are the records'."""
    import json

    text = flat(best_baseline_section())

    rows, tests, family = final_tests("copy")
    best = [tests[(r["best"], r["budget"])] for r in rows]
    signs = ", ".join(f"{t['sign']['plus']} / {t['sign']['minus']}" for t in best).rsplit(", ", 1)
    assert (f"the sign test over problems gives p = {slash(t['p'] for t in best)} ({' and '.join(signs)} problems with "
            f"DynTS higher / lower), {slash(t['p_holm'] for t in best)} after Holm over the table's {family} cells, and TOST "
            f"within ±3 points fails as well (Holm p {slash(t['tost_p_holm'] for t in best)})") in text
    plus_q = [tests[(r["best"].replace("h2o:", "h2o+q:"), r["budget"])] for r in rows]
    assert {t["verdict"] for t in best + plus_q} == {"inconclusive"}
    diffs = " / ".join(f"{100 * t['diff']:+.1f}" for t in plus_q)
    assert f"H2O+q is inconclusive too ({diffs})" in text
    assert f"(54 on copy, 57 on chain;" in text and family == 54

    rows, tests, family = final_tests("chain")
    best = [tests[(r["best"], r["budget"])] for r in rows]
    assert {t["verdict"] for t in best} == {"trails"} and family == 57
    assert f"gives p = {slash(t['p'] for t in best)}, {slash(t['p_holm'] for t in best)} after Holm over the table's {family} cells" in text
    (label, budget, verdict), = attention_cells_without_a_lead(tests)
    t = tests[(label, budget)]
    assert label.startswith("snapkv+q:") and budget == rows[-1]["budget"]
    assert f"every one but token-level SnapKV+q at {budget}, where {100 * t['diff']:+.1f} [{100 * t['lo']:+.1f}, {100 * t['hi']:+.1f}] is {verdict}" in text

    def counts(cells, pick) -> str:
        return " / ".join(str(next(c["n_keep"] for c in cells if c.get("budget") == b and pick(c))) for b in budgets)

    for family_name, rival, rival_pick in (("copy", "tuned H2O", lambda c: c["method"]["label"].startswith("h2o:")),
                                           ("chain", "untuned SepLLM", lambda c: c["method"]["label"] == "sepllm")):
        cells = json.loads((ROOT / "reports" / f"final-{family_name}" / "results.json").read_text())
        budgets = sorted({c["budget"] for c in cells if c.get("budget") is not None})
        untuned = [c for c in cells if c.get("budget") is not None and not c["method"].get("cache")]
        assert all(len({c["n_keep"] for c in untuned if c["budget"] == b}) == 1 for b in budgets)  # one count per budget
        spans = " / ".join(f"{min(ks)}-{max(ks)}" for ks in ([c["n_keep"] for c in cells if c.get("budget") == b] for b in budgets))
        dynts = f"on {family_name} DynTS keeps {counts(cells, lambda c: c['method']['name'] == 'dynts')} at B = {' / '.join(map(str, budgets))}"
        assert f"{dynts}, {rival} {counts(cells, rival_pick)}," in text, family_name
        assert f"the table's methods {spans}" in text, family_name
        if family_name == "copy":
            assert f"the untuned methods {counts(untuned, lambda c: True)}," in text
        else:
            tuned = counts(cells, lambda c: c["method"]["label"].startswith("sepllm:"))
            assert f"tuned SepLLM {tuned}," in text

    ranges = []
    for seed in (1, 2, 3):
        cells = json.loads((ROOT / "reports" / f"chain-dev-fair-s{seed}" / "results.json").read_text())
        scores = [100 * c["pass@1"] for c in cells if c["method"]["name"] == "sepllm"]
        ranges.append(f"{min(scores):.1f}-{max(scores):.1f} % on seed {seed}")
    assert f"SepLLM (both rows) scores {ranges[0]}, {ranges[1]} and {ranges[2]}" in text


def test_final_reads_in_evaluation_md_are_the_ledger():
    """What docs/evaluation.md says of the final tables' reads is on their ledger lines: the copy table's first run
    (its commit, its 13 cells) did not list tuned SepLLM, which the finished run did; the lines that started from a
    tree with uncommitted changes (``"dirty": true``) are the ones named; and no seed LRM's eviction mixture holds a
    SepLLM shape."""
    import json

    import yaml

    text = flat(best_baseline_section())
    lines = [json.loads(line) for line in (ROOT / "reports/final-ledger.jsonl").read_text().splitlines() if line.strip()]
    final = {family: [line for line in lines if any(s.get("set") == "final" and s.get("family") == family for s in line["sets"])]
             for family in ("copy", "chain")}
    first = final["copy"][0]
    assert "sepllm:" not in first["command"] and any("sepllm:" in line["command"] for line in final["copy"][1:])
    assert len(first["cells"]) == 13 and first["utc"].startswith("2026-12-05T14:09")
    assert f"(2026-12-05 14:09, commit {first['git'][:7]}, 13 cells:" in text
    assert final["chain"][0]["utc"].startswith("2026-12-05T17:57") and "the chain table's first read (17:57)" in text
    dirty = {family: [line["utc"][11:16] for line in final[family] if line["dirty"]] for family in final}
    assert dirty == {"copy": ["17:57"], "chain": ["17:57", "21:47", "02:33", "02:35", "02:37"]}
    (copy_dirty,) = [line for line in final["copy"] if line["dirty"]]
    assert len(copy_dirty["cells"]) == 1 and "1 copy cell (17:57)" in text
    assert "runs of 21:47 and 02:37, 14 each" in text
    configs = sorted((ROOT / "configs/testbed").glob("*-s[123].yaml"))  # the seed LRMs of both families
    assert len(configs) == 6
    for config in configs:
        shapes = yaml.safe_load(config.read_text())["data"]["evict_shapes"]
        assert {"h2o", "snapkv", "rkv"} <= set(shapes) and not any("sep" in shape for shape in shapes), config.name
    assert "SepLLM's kept set (sinks, separators, local window) is not in it" in text


def test_label_predictor_table_in_testbed_md_comes_from_the_committed_records():
    """docs/testbed.md's "What a predictor learns from each label" table is ``python -m eval.analyses.label_predictors``'s
    output over the committed dev reports it names."""
    from eval.analyses.label_predictors import label_predictor_table

    text = (ROOT / "docs/testbed.md").read_text().split("### What a predictor learns from each label", 1)[1]
    command = text.split("`python -m eval.analyses.label_predictors ", 1)[1].split("`", 1)[0].split()
    want = label_predictor_table(ROOT / command[0], [ROOT / c for c in command[1:]])
    assert want in text
