"""The before/after table: two runs of the same methods on the same problems, paired by problem and budget rank."""

import pytest

from eval.harness import before_after as ba
from eval.harness.records import eval_record, read_records, write_record


def _run(directory, budgets, right, k=2, ids=None):
    """Records of a full-cache cell and a dynts cell per budget; ``right[label]`` = problems whose k samples are all right."""
    ids = ids or [f"dev:{q}" for q in range(10)]
    for label, ok in right.items():
        for budget in ([None] if label == "full" else budgets):
            rows = [{"question": q, "sample": s, "id": ids[q], "correct": q in ok} for q in range(len(ids)) for s in range(k)]
            key = f"{label}-{budget}"
            write_record(directory, eval_record(key, {"method": {"label": label}, "budget": budget}, ids, k, rows))
    return directory


def test_pairs_by_problem_and_budget_rank(tmp_path, capsys):
    before = _run(tmp_path / "before", [59, 98], {"full": range(8), "dynts": range(4)})
    after = _run(tmp_path / "after", [72, 121], {"full": range(9), "dynts": range(7)})
    assert ba.main([str(before), str(after), "--names", "favouring,fair"]) == 0
    out = capsys.readouterr().out
    assert "| method | B = 59 / 72 favouring | B = 59 / 72 fair | B = 59 / 72 change [95 % CI] | B = 98 / 121 favouring |" in out
    assert "| full | 80.0 | 90.0 | +10.0 [" in out
    # problems 4-6 gained at both budgets, none lost: the paired CI (seeded bootstrap over the 10 problems) never falls below 0
    assert "| dynts | 40.0 | 70.0 | +30.0 [+0.0, +60.0] | 40.0 | 70.0 | +30.0 [+0.0, +60.0] |" in out


def test_equal_budgets_print_once(tmp_path, capsys):
    before = _run(tmp_path / "before", [64], {"dynts": range(4)})
    after = _run(tmp_path / "after", [64], {"dynts": range(5)})
    assert ba.main([str(before), str(after)]) == 0
    assert "| B = 64 before | B = 64 after | B = 64 change [95 % CI] |" in capsys.readouterr().out


def test_refuses_other_problems_budgets_or_no_records(tmp_path):
    before = _run(tmp_path / "before", [64], {"dynts": range(4)})
    other = _run(tmp_path / "other", [64], {"dynts": range(4)}, ids=[f"test:{q}" for q in range(10)])
    with pytest.raises(ValueError, match="other problems"):
        ba.before_after(read_records(before), read_records(other))
    two = _run(tmp_path / "two", [64, 96], {"dynts": range(4)})
    with pytest.raises(ValueError, match="pair by rank"):
        ba.before_after(read_records(before), read_records(two))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        ba.main([str(before), str(tmp_path / "empty")])


def test_docs_chain_before_after_table_recomputes_from_the_committed_records():
    """docs/testbed.md prints the chain before/after table as this module computes it from reports/."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = ba.before_after(read_records(root / "reports/chain-dev-favouring"),
                            read_records(root / "reports/chain-dev-fair"), ("favouring", "fair"))
    assert table in (root / "docs/testbed.md").read_text()
    assert table == (root / "reports/chain-dev-before-after.md").read_text().strip()
