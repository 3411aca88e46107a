"""`dynts rescue bench` on the bundled testbed: every setting runs, the comparison columns are
computed from the cells, a rerun resumes from the cell files, and a retrained PRM is not mixed in."""

from __future__ import annotations

import json
import shutil

import pytest

from eval.rescue.cli import main
from eval.rescue.bench import testbed_step_verifier as step_verifier

ARGS = ["bench", "--benchmark", "testbed:n=3,set=test,min_think=60,max_think=150", "--method", "window",
        "--budget", "40", "--local-window", "8", "--n", "2", "--delimiter", ";", "--max-steps", "24",
        "--max-step-tokens", "48", "--temperature", "0.6", "--settings", "full,evict,bon,kvr"]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_runs_compares_and_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert main([*ARGS, "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())
    cells = {(c["setting"], c["method"]): c for c in summary["cells"]}
    assert set(cells) == {("full", None), ("evict", "window"), ("bon", "window"), ("kvr", "window")}
    assert cells[("bon", "window")]["metrics"]["helper_share"] == 0.0  # best-of-N never asks the helper
    cmp = summary["comparison"]["window"]
    a_full, a_evict, a_kvr = (cells[(s, m)]["metrics"]["accuracy"] for s, m in (("full", None), ("bon", "window"), ("kvr", "window")))
    assert cmp["A_full"] == a_full and cmp["A_kvr"] == a_kvr
    if a_full != a_evict:
        assert cmp["recovered_fraction"] == pytest.approx((a_kvr - a_evict) / (a_full - a_evict))
    table = (out / "results.md").read_text()
    assert "recovered" in table and f"| full | – | {100 * a_full:.1f} |" in table
    files = sorted(p.name for p in (out / "cells").iterdir())
    assert len(files) == 4

    # one table over runs (eval.rescue.table): the same comparison, the budget, the verifier, the loop rate
    from eval.rescue.table import main as table_main, rows

    (row,) = rows([out])
    assert (row["budget"], row["n"], row["problems"], row["method"]) == ("B = 40", 2, 3, "window")
    assert row["A_kvr"] == a_kvr and row["verifier"] == "testbed-prm-order"
    degen = {(d["setting"], d["method"]): d for d in summary["degeneration"]}
    assert row["loops_kvr"] == degen[("kvr", "window")]["loops"] / 3
    assert table_main([str(out), "--write", str(tmp_path / "table.md")]) == 0
    assert f"**{100 * a_kvr:.1f}**" in (tmp_path / "table.md").read_text()
    assert rows([out], methods=["dynts"]) == []
    with pytest.raises(SystemExit, match="results.json"):
        table_main([str(tmp_path / "nothing")])
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}

    # rerun: every cell is read back, nothing recomputed
    assert main([*ARGS, "--out", str(out)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()} == stamps

    # a PRM with other weights makes new PRM-dependent cells and reuses the others
    from dynts.models import checkpoints_dir

    other = tmp_path / "prm"
    shutil.copytree(checkpoints_dir() / "testbed-prm", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "retrained"}))
    assert main([*ARGS, "--settings", "full,evict,bon", "--prm", str(other), "--out", str(out)]) == 0
    now = sorted(p.name for p in (out / "cells").iterdir())
    assert len(now) == 5 and sum(n.startswith("bon-") for n in now) == 2 and sum(n.startswith(("full-", "evict-")) for n in now) == 2


def test_testbed_step_verifier():
    question = "a 1 b 2 c 3 d 4 e 5 find r2"
    right = ["wait a 1 plus b 2 gives r1= 3 ;", "ok c 3 times d 4 gives r2= 2 ;"]
    assert step_verifier(question, right[:1]) == 1.0
    assert step_verifier(question, right) == 1.0
    assert step_verifier(question, [right[0], "ok c 3 times d 4 gives r2= 3 ;"]) == 0.0  # wrong arithmetic
    assert step_verifier(question, [right[0], "ok c 9 times d 4 gives r2= 6 ;"]) == 0.0  # wrong operand


def test_bench_reports_the_oracle_choice_and_what_wrong_answers_did(tmp_path):
    out = tmp_path / "run"
    assert main([*ARGS, "--settings", "full,helper,evict", "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())
    cells = {(c["setting"], c["method"]): c["metrics"]["accuracy"] for c in summary["cells"]}
    oc = summary["oracle_choice"]["window"]
    # The oracle is at least as good as either of the two it picks from, and at most their sum.
    assert max(cells[("evict", "window")], cells[("helper", None)]) <= oc["A_oracle"]
    assert oc["A_oracle"] <= cells[("evict", "window")] + cells[("helper", None)]
    assert oc["only_helper"] + oc["only_base"] + oc["both"] + oc["neither"] == oc["problems"]
    assert (out / "oracle_choice.png").is_file()
    degen = {(r["setting"], r["method"]): r for r in summary["degeneration"]}
    for (setting, method), acc in cells.items():
        row = degen[(setting, method)]
        assert row["wrong"] == round(row["problems"] * (1 - acc))
        assert row["wrong"] == sum(row[k] for k in ("stops early", "wrong value", "loops", "incoherent"))
    table = (out / "results.md").read_text()
    assert "Oracle choice" in table and "| evict | window |" in table
