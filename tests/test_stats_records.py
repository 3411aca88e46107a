"""Paired statistics (hand-checkable numbers), per-problem records (round trip) and the tables
recomputed from records alone."""
from __future__ import annotations

import json
import random

import pytest

from eval.harness import compare as cmp
from eval.harness.records import cell_record, eval_record, pack_bits, per_question, read_records, unpack_bits, write_record
from eval.harness.stats import (bootstrap_ci, holm, mcnemar_exact, paired_difference, paired_test, ratio_ci, sign_test,
                                table_verdicts, tost)


def test_mcnemar_exact_by_hand():
    # 8 pairs right only under a, 2 only under b, 5 both, 3 neither: p = 2 P(X <= 2 | 10, 1/2) = 2 * 56 / 1024
    a = [True] * 8 + [False] * 2 + [True] * 5 + [False] * 3
    b = [False] * 8 + [True] * 2 + [True] * 5 + [False] * 3
    t = mcnemar_exact(a, b)
    assert (t["only_a"], t["only_b"]) == (8, 2) and t["p"] == pytest.approx(112 / 1024)
    assert sign_test(a, b) == {"plus": 8, "minus": 2, "p": pytest.approx(112 / 1024)}  # k = 1: the same test
    assert mcnemar_exact([True, False], [True, False])["p"] == 1.0  # no discordant pair
    with pytest.raises(ValueError, match="pair them"):
        mcnemar_exact([True], [True, False])


def test_sign_test_drops_ties_on_per_question_scores():
    t = sign_test([1.0, 0.5, 0.5, 0.0], [0.5, 0.5, 0.0, 0.0])  # + , tie, +, tie
    assert (t["plus"], t["minus"]) == (2, 0) and t["p"] == pytest.approx(0.5)


def test_paired_bootstrap_contains_the_true_difference():
    rng = random.Random(1)
    b = [rng.random() < 0.6 for _ in range(2000)]
    a = [x or rng.random() < 0.25 for x in b]  # a fixes a quarter of b's misses: true difference 0.4 * 0.25 = 0.10
    t = paired_difference(a, b)
    assert t["lo"] < 0.10 < t["hi"] and t["lo"] > 0
    assert t["hi"] - t["lo"] < 0.04  # paired: much tighter than the unpaired ~ +- 0.06
    assert paired_difference(a, b) == t  # seeded
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)
    lo, hi = bootstrap_ci([1] * 90 + [0] * 10)
    assert lo < 0.9 < hi and 0.8 < lo and hi < 0.97


def test_ratio_ci_drops_undefined_resamples():
    full, bon, kvr = [1] * 20, [1] * 10 + [0] * 10, [1] * 18 + [0] * 2
    lo, hi = ratio_ci([full, bon, kvr], lambda f, b, k: (k - b) / (f - b))
    assert lo < 0.8 < hi <= 1.0
    assert ratio_ci([[1, 1], [1, 1], [1, 1]], lambda f, b, k: (k - b) / (f - b)) is None  # never a gap


def test_records_round_trip(tmp_path):
    assert pack_bits([True, False, True]) == "a0" and unpack_bits("a0", 3) == [True, False, True]
    with pytest.raises(ValueError, match="hex digits"):
        unpack_bits("a0ff", 3)
    bits = [random.Random(i).random() < 0.5 for i in range(203)]
    assert unpack_bits(pack_bits(bits), 203) == bits
    rows = [{"question": q, "sample": s, "correct": (q + s) % 2 == 0, "tokens": 10 * q + s, "looped": s == 1}
            for q in range(3) for s in range(2)]
    rec = eval_record("c1", {"method": {"label": "dynts"}, "budget": 64}, ["p0", "p1", "p2"], 2, rows[::-1])
    path = write_record(tmp_path, rec)
    assert path == tmp_path / "records" / "c1.json" and len(path.read_text()) < 400
    (back,) = read_records(tmp_path)
    assert back["bits"]["correct"] == [True, False, False, True, True, False] and back["ints"]["tokens"] == [0, 1, 10, 11, 20, 21]
    assert per_question(back) == [0.5, 0.5, 0.5] and per_question(back, "looped") == [0.5] * 3
    with pytest.raises(ValueError, match="one row per question and sample"):
        cell_record("c2", {}, ["p0"], 2, rows[:1], ("correct",))


def _run_dir(tmp_path):
    """Two bounded cells and the full cache on 10 questions, k = 1, as dynts eval writes them."""
    right = {"full": range(10), "dynts": range(9), "h2o": [0, 1, 2, 9]}
    for label, ok in right.items():
        budget = None if label == "full" else 64
        cell = {"key": label, "benchmark": "testbed:n=10", "method": {"label": label}, "budget": budget, "k": 1,
                "pass@1": len(ok) / 10, "pass@1_se": 0.1, "mean_prompt_tokens": 14, "mean_generated_tokens": 114}
        (tmp_path / "cells").mkdir(exist_ok=True)
        (tmp_path / "cells" / f"{label}.json").write_text(json.dumps(cell))
        samples = [{"question": q, "sample": 0, "id": f"test:{q}", "correct": q in ok, "tokens": 100 + q,
                    "looped": False, "truncated": False, "evictions": 0 if budget is None else 3} for q in range(10)]
        (tmp_path / "samples").mkdir(exist_ok=True)
        (tmp_path / "samples" / f"{label}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return tmp_path


def test_compare_is_paired_and_recomputes_from_records(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert cmp.main([str(run)]) == 0
    from_run = capsys.readouterr().out
    # dynts right on 6 questions h2o misses, h2o on 1 dynts misses: McNemar p = 2 * 8 / 128
    assert "| h2o | 64 | +50.0 |" in from_run and "| 6 / 1 | 0.12 | 6 / 1 (0.12) |" in from_run
    assert "| dynts | 90.0 [" in from_run or "| dynts | 90.0 [" in from_run.replace(" (no eviction)", "")
    assert cmp.main([str(run), "--wide"]) == 0
    wide = capsys.readouterr().out
    # 6 vs 1 discordant problems: the bootstrap CI excludes 0, the exact test does not (p = 0.125)
    assert "| dynts minus | B = 64 |" in wide and "| h2o | +50.0 [" in wide and "] inconclusive |" in wide and "McNemar" in wide
    assert "| *B / full seq* | *0.50* |" in wide  # 64 / (14 + 114)
    # write the compact records (as a dynts eval run does), drop everything else, recompute
    for cell in cmp.finished_cells(run):
        samples = [json.loads(x) for x in (run / "samples" / f"{cell['key']}.jsonl").read_text().splitlines()]
        write_record(run, cmp.record_of_samples(cell, samples))
    for sub in ("cells", "samples"):
        for f in (run / sub).iterdir():
            f.unlink()
    assert cmp.main([str(run), "--from-records"]) == 0
    assert capsys.readouterr().out == from_run
    with pytest.raises(SystemExit):
        cmp.main([str(run), "--from-records", "--write"])


def test_compare_joins_several_runs(tmp_path, capsys):
    """Cells of two runs on the same problems form one table, paired as if one run wrote them."""
    (tmp_path / "one").mkdir()
    one = _run_dir(tmp_path / "one")
    assert cmp.main([str(one)]) == 0
    together = capsys.readouterr().out
    two = tmp_path / "two"
    for sub in ("cells", "samples"):
        (two / sub).mkdir(parents=True)
        suffix = ".json" if sub == "cells" else ".jsonl"
        (one / sub / f"h2o{suffix}").rename(two / sub / f"h2o{suffix}")
    assert cmp.main([str(one), str(two)]) == 0
    assert capsys.readouterr().out == together
    for sub, suffix in (("cells", ".json"), ("samples", ".jsonl")):  # the full cache in both runs: counted once
        (two / sub / f"full{suffix}").write_text((one / sub / f"full{suffix}").read_text())
    assert cmp.main([str(one), str(two)]) == 0
    assert capsys.readouterr().out == together
    assert cmp.main([str(one)]) == 0
    assert "| h2o |" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cmp.main([str(one), str(tmp_path / "missing")])


def test_pairing_refuses_other_questions(tmp_path):
    a = read_records(_write(tmp_path, "a", ["q0", "q1"]))[0]
    b = read_records(_write(tmp_path / "b", "b", ["q0", "q2"]))[0]
    cells = [{"key": "a", "method": {"label": "dynts"}, "budget": 64, "pass@1": 1, "pass@1_se": 0},
             {"key": "b", "method": {"label": "h2o"}, "budget": 64, "pass@1": 1, "pass@1_se": 0}]
    with pytest.raises(ValueError, match="other questions"):
        cmp.compare(cells, records={"a": a, "b": b})


def _write(directory, key, ids):
    rows = [{"question": i, "sample": 0, "correct": True} for i in range(len(ids))]
    write_record(directory, eval_record(key, {}, ids, 1, rows))
    return directory


def test_rescue_table_recomputes_from_records(tmp_path):
    """A committed rescue run: the table from records alone equals the table from results.json + cells."""
    import shutil
    from pathlib import Path

    from eval.rescue.table import main as table_main

    run = tmp_path / "B64-N4"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/rescue/B64-N4", run)
    assert table_main([str(run), "--write-records", "--method", "window,rkv,dynts", "--write", str(tmp_path / "a.md")]) == 0
    assert sum(f.stat().st_size for f in (run / "records").iterdir()) < 150_000
    shutil.rmtree(run / "cells")
    (run / "results.json").unlink()
    assert table_main([str(run), "--from-records", "--method", "window,rkv,dynts", "--write", str(tmp_path / "b.md")]) == 0
    a, b = (tmp_path / "a.md").read_text(), (tmp_path / "b.md").read_text()
    assert a == b and "| 0.13 [-1.00, 0.80] |" in a and "+73.0 [+64.0, +81.0], p 2.1e-22, Holm " in a
    # the controls table: this run has no helper-search / full-search cells, but every stepwise cell's
    # committed steps by side (the DynTS base wrote 43.0 % of KV-Rescue's steps, every step of best-of-N)
    assert "KVR − helper-search" in a and "| dynts | " in a and "| 100.0 / 43.0 / – / – / – |" in a


# ---------------------------------------------------------------- Holm, TOST and verdicts


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1, monotone
    assert holm([0.04]) == [0.04] and holm([]) == []
    # the case: 13 raw p-values just under 0.05 among 130 fail Holm
    raw = [1e-4] * 5 + [0.04] * 13 + [0.5] * 112  # 1e-4 x 130 = 0.013 passes, 0.04 x 125 does not
    adjusted = holm(raw)
    assert sum(p < 0.05 for p in raw) == 18 and sum(p < 0.05 for p in adjusted) == 5


def _diffs(plus: int, minus: int, n: int) -> tuple[list[float], list[float]]:
    """Per-problem 0/1 scores of two arms: ``plus`` problems right only under a, ``minus`` only under b."""
    a = [1.0] * plus + [0.0] * minus + [0.0] * (n - plus - minus)
    b = [0.0] * plus + [1.0] * minus + [0.0] * (n - plus - minus)
    return a, b


def test_tost_against_the_t_distribution():
    from scipy.stats import t as student

    # 10 problems +1, 10 problems -1, 180 ties (n = 200): mean 0, sd sqrt(20 / 199), se = sd / sqrt(200)
    a, b = _diffs(10, 10, 200)
    se = (20 / 199) ** 0.5 / 200 ** 0.5
    for margin, equivalent in ((0.03, False), (0.05, True)):
        expected = student.sf(margin / se, 199)  # both one-sided tests give the same p (mean 0)
        t = tost(a, b, margin)
        assert t["p"] == pytest.approx(expected, rel=1e-9) and (t["p"] < 0.05) == equivalent
    assert tost(a, b, 0.03)["p"] == pytest.approx(0.0911, abs=5e-4)  # by hand: t = 0.03 / 0.022417 = 1.338, df 199
    # identical arms have no spread: p = (1 - m)^n, not equivalent on 3 problems, equivalent on 200
    assert tost([1, 0, 1], [1, 0, 1])["p"] == pytest.approx(0.97 ** 3)
    assert tost([1] * 200, [1] * 200)["p"] == pytest.approx(0.97 ** 200) and tost([1] * 200, [1] * 200)["p"] < 0.0025
    assert tost([1, 1, 1], [0, 0, 0])["p"] == 1.0  # every problem +100 points
    with pytest.raises(ValueError, match="margin"):
        tost(a, b, 0)


def test_four_to_zero_is_not_a_lead():
    """The issue's anti-conservative case: 4 problems right only under a, none only under b, n = 200.
    The percentile bootstrap CI excludes 0; exact McNemar gives p = 2 / 16 = 0.125; +2 points is not
    within +-3 either by TOST (p_upper = P(T_199 <= (0.02 - 0.03) / se) = 0.157): inconclusive."""
    from scipy.stats import t as student

    a, b = _diffs(4, 0, 200)
    test = paired_test(a, b, 1)
    assert test["lo"] > 0  # what the old verdict read
    assert test["mcnemar"]["p"] == pytest.approx(2 / 16) and test["p"] == test["mcnemar"]["p"]
    sd = ((4 * 0.98 ** 2 + 196 * 0.02 ** 2) / 199) ** 0.5
    assert test["tost"]["p"] == pytest.approx(student.cdf((0.02 - 0.03) / (sd / 200 ** 0.5), 199), rel=1e-9)
    (judged,) = table_verdicts([test])
    assert judged["verdict"] == "inconclusive"


def test_k_samples_use_the_sign_test_over_problem_means():
    # 3 problems x 5 samples: per-problem means; McNemar is not used with k > 1
    a, b = [1.0, 0.8, 0.6, 0.4], [0.6, 0.8, 0.2, 0.0]  # +, tie, +, +
    t = paired_test(a, b, 5)
    assert t["mcnemar"] is None and t["sign"] == {"plus": 3, "minus": 0, "p": pytest.approx(0.25)} and t["p"] == t["sign"]["p"]
    assert t["diff"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="k=0"):
        paired_test(a, b, 0)


def test_table_verdicts_holm_order_and_words():
    # TOST p-values are Holm-adjusted too: at n = 200, 10 vs 10 is equivalent within +-5 alone (p 0.013)
    # but not in a family of 4 (0.054); at n = 400 it is (p ~ 5e-6)
    big_lead, trail, small = _diffs(30, 2, 400), _diffs(1, 25, 400), _diffs(10, 10, 400)
    tests = [paired_test(*big_lead, 1), paired_test(*trail, 1), paired_test(*small, 1, margin=0.05), paired_test(*_diffs(6, 2, 100), 1)]  # +4 points, p 0.29
    out = table_verdicts(tests)
    raw = [t["p"] for t in tests]
    assert [t["p_holm"] for t in out] == pytest.approx(holm(raw))
    assert [t["verdict"] for t in out] == ["leads", "trails", "equivalent within ±5", "inconclusive"]
    assert out[0]["p_holm"] == pytest.approx(min(1.0, 4 * raw[0]))  # the smallest p is multiplied by the family size
    # Holm can turn a raw p < 0.05 into no verdict: alone it leads, in a family of 20 it does not
    single = paired_test(*_diffs(9, 1, 200), 1)
    assert single["p"] < 0.05 and table_verdicts([single])[0]["verdict"] == "leads"
    assert table_verdicts([single] * 20)[0]["verdict"] == "inconclusive"


def test_compare_marks_vacuous_cells_and_reports_k(tmp_path, capsys):
    """k = 5 per problem: no McNemar column values, the sign test decides; a cell whose n_keep leaves no
    selection slot is marked vacuous and left out of the Holm family."""
    n, k = 12, 5
    rows = lambda right: [{"question": q, "sample": s, "correct": right(q, s), "tokens": 10} for q in range(n) for s in range(k)]  # noqa: E731
    arms = {"dynts": lambda q, s: True, "h2o": lambda q, s: s < 2, "rkv": lambda q, s: True}
    ids = [f"p{q}" for q in range(n)]
    cells = []
    for label, right in arms.items():
        for budget, slots in ((48, 0), (96, 20)):
            key = f"{label}-{budget}"
            write_record(tmp_path, eval_record(key, {"method": {"label": label}, "budget": budget, "local_window": 32,
                                                     "selection_slots": slots}, ids, k, rows(right)))
    recs = {r["key"]: r for r in read_records(tmp_path)}
    results = cmp.cells_from_records(list(recs.values()))
    tests = cmp.paired_tests(results, "dynts", recs)
    assert tests[("h2o", 48)]["verdict"].startswith("vacuous") and tests[("h2o", 48)]["p_holm"] is None
    assert tests[("h2o", 96)]["mcnemar"] is None and tests[("h2o", 96)]["sign"]["plus"] == n
    assert tests[("h2o", 96)]["verdict"] == "leads"  # 12 of 12 problems: p = 2 / 4096, Holm x2
    assert tests[("rkv", 96)]["verdict"] == "inconclusive"  # bit-identical on 12 problems: TOST p = 0.97^12 = 0.69
    assert cmp.main([str(tmp_path), "--from-records"]) == 0
    out = capsys.readouterr().out
    assert "| h2o | 96 | +60.0 |" in out and "| – | – | 12 / 0 (" in out and "vacuous (no selection slot)" in out
    # records that predate selection_slots: from budget, W_l and retention with the prompt length given
    # (the chain confirm table's B = 48: W_s = 48 - 14 - 32 = 2, floor(0.4 * 2) = 0 selected)
    old = {"budget": 48, "local_window": 32, "retention": 0.4}
    assert cmp.selection_slots(old) is None and cmp.selection_slots(old, 14) == 0
    assert cmp.selection_slots({**old, "budget": 64}, 14) == 7
