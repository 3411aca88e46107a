"""The oracle choice between the evicted base and the helper (KV-Rescue Fig. 1a)."""

from __future__ import annotations

import math

import pytest

from eval.rescue.oracle_choice import oracle_choice, oracle_choice_table, plot_oracle_choice


def _records(flags: str) -> list[dict]:
    return [{"id": f"q{i}", "correct": c == "1"} for i, c in enumerate(flags)]


def test_oracle_picks_whichever_is_right_and_counts_the_recovery():
    full, evict, helper = _records("11111111"), _records("11000000"), _records("10110100")
    r = oracle_choice(full, evict, helper)
    assert r["A_evict"] == 0.25 and r["A_helper"] == 0.5 and r["A_full"] == 1.0
    assert r["A_oracle"] == 5 / 8  # q0 q1 (base), q2 q3 q5 (helper)
    assert r["recovered_fraction"] == pytest.approx((5 / 8 - 0.25) / 0.75)
    assert (r["only_helper"], r["only_base"], r["both"], r["neither"]) == (3, 1, 1, 3)
    assert r["se"]["A_helper"] == pytest.approx(math.sqrt(0.25 / 8))
    # Order of records does not matter: problems are matched by id.
    assert oracle_choice(full, evict, helper[::-1])["A_oracle"] == 5 / 8


def test_no_gap_gives_no_recovered_fraction_and_mismatched_cells_are_refused():
    same = _records("1100")
    assert oracle_choice(same, same, _records("0011"))["recovered_fraction"] is None
    with pytest.raises(ValueError, match="same problems"):
        oracle_choice(same, same, _records("001"))


def test_table_and_plot(tmp_path):
    rows = {"window": oracle_choice(_records("1111"), _records("1000"), _records("0110"))}
    table = oracle_choice_table(rows).splitlines()
    assert table[0].startswith("| base method | A_full % | A_evict % | A_helper %")
    assert table[2].startswith("| window | 100.0 ± 0.0 | 25.0 ± 21.7 | 50.0 ± 25.0 | 75.0 ± 21.7 | 0.67 | 2 | 1 | 0 | 1 |")
    path = plot_oracle_choice(rows, tmp_path / "oracle.png", kvr={"window": 0.7})
    assert path.is_file() and path.stat().st_size > 5000
