"""DynTS against the best baseline per training seed (eval/harness/seeds.py): the best baseline is the strongest
deployable method of each budget (not DynTS, the random control or an oracle), its paired test is the table's."""

from pathlib import Path

import pytest

from eval.harness import seeds
from eval.harness.compare import cells_from_records, paired_tests
from eval.harness.records import eval_record, read_records, write_record

ROOT = Path(__file__).resolve().parents[1]


def _table(directory, right, budgets=(64, 96), k=2, n=20):
    """Records of one seed's dev table; ``right[(name, label)]`` = problems whose k samples are all right."""
    ids = [f"dev:{q}" for q in range(n)]
    for (name, label), ok in right.items():
        for budget in ([None] if name == "full" else budgets):
            rows = [{"question": q, "sample": s, "id": ids[q], "correct": q in ok} for q in range(n) for s in range(k)]
            cell = {"method": {"name": name, "label": label}, "budget": budget}
            write_record(directory, eval_record(f"{label}-{budget}", cell, ids, k, rows))
    return read_records(directory)


def test_the_best_baseline_excludes_dynts_the_control_and_the_oracles(tmp_path):
    records = _table(tmp_path, {("full", "full"): range(19), ("dynts", "dynts"): range(15), ("rkv", "rkv+q"): range(9),
                                ("snapkv", "snapkv-head+q"): range(11), ("random", "random"): range(17),
                                ("testbed-oracle", "oracle-step"): range(18)})
    rows = seeds.best_baseline_rows(records)
    assert [r["budget"] for r in rows] == [64, 96]
    assert all(r["best"] == "snapkv-head+q" and r["best_pass"] == pytest.approx(0.55) for r in rows)
    assert rows[0]["full"] == pytest.approx(0.95) and rows[0]["dynts"] == pytest.approx(0.75)
    tests = paired_tests(cells_from_records(records), "dynts", {r["key"]: r for r in records})
    assert {k: rows[0][k] for k in ("diff", "lo", "hi", "verdict")} == {k: tests[("snapkv-head+q", 64)][k] for k in ("diff", "lo", "hi", "verdict")}
    assert rows[0]["diff"] == pytest.approx(0.2)


def test_the_verdict_line_says_whether_every_seed_leads(tmp_path):
    lead = _table(tmp_path / "s1", {("dynts", "dynts"): range(18), ("rkv", "rkv+q"): range(2)})
    tie = _table(tmp_path / "s2", {("dynts", "dynts"): range(10), ("rkv", "rkv+q"): range(10)})
    out = seeds.seed_table([lead, lead], ["s1", "s1b"])
    assert "| s1 | 64 | – | 90.0 | rkv+q | 10.0 | +80.0 [" in out and out.endswith("every seed: yes.")
    out = seeds.seed_table([lead, tie], ["s1", "s2"])
    assert "| s2 | 96 | – | 50.0 | rkv+q | 50.0 | +0.0 [+0.0, +0.0] |" in out
    assert out.endswith("every seed: no (2 of 4 seed x budget cells without a lead).")


def test_refuses_tables_without_one_dynts_or_a_baseline(tmp_path, capsys):
    with pytest.raises(ValueError, match="exactly one DynTS method, found none"):
        seeds.best_baseline_rows(_table(tmp_path / "a", {("rkv", "rkv+q"): range(3)}))
    two = _table(tmp_path / "b", {("dynts", "dynts"): range(3), ("dynts", "dynts:local_window=16"): range(3), ("rkv", "rkv"): range(2)})
    with pytest.raises(ValueError, match=r"found \['dynts', 'dynts:local_window=16'\]"):
        seeds.best_baseline_rows(two)
    with pytest.raises(ValueError, match="at least one baseline"):
        seeds.best_baseline_rows(_table(tmp_path / "c", {("dynts", "dynts"): range(3), ("random", "random"): range(2)}))
    with pytest.raises(ValueError, match="one name per table"):
        seeds.seed_table([read_records(tmp_path / "c")], ["s1", "s2"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        seeds.main([str(tmp_path / "empty")])
    assert "no records/*.json" in capsys.readouterr().err


def test_the_committed_fair_dev_tables_lead_at_every_budget(capsys):
    # The committed fair LRMs (one seed each): the command on their dev tables' committed records.
    assert seeds.main([str(ROOT / "reports/chain-dev-fair"), str(ROOT / "reports/copy-dev-fair"), "--names", "chain,copy"]) == 0
    out = capsys.readouterr().out
    assert "| chain | 72 | 86.4 | 56.9 | rkv+q | 47.3 | +9.6 [+5.1, +14.1] | leads |" in out
    assert "| chain | 121 | 86.4 | 78.3 | rkv+q | 70.7 | +7.6 [+4.3, +10.9] | leads |" in out  # docs/testbed.md "Seeds"
    assert "| chain | 169 | 86.4 | 81.7 | rkv+q | 78.2 | +3.5 [+0.8, +6.2] | leads |" in out
    assert "| copy | 90 | 98.0 | 91.9 | rkv+q | 41.2 | +50.7 [+45.7, +55.5] | leads |" in out
    assert out.rstrip().endswith("every seed: yes.")
