"""`dynts rescue bench` on the bundled testbed: every setting runs, the comparison columns are
computed from the cells, a rerun resumes from the cell files, and a retrained PRM is not mixed in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eval.rescue.verifiers import DEFAULT_VERIFIER, FAMILY_VERIFIERS, default_verifier
from eval.rescue.cli import main
from eval.rescue.verifiers import testbed_step_verifier as step_verifier

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
    assert row["A_kvr"] == a_kvr and row["verifier"] == DEFAULT_VERIFIER  # the docs' headline verifier
    docs = (Path(__file__).parents[1] / "docs" / "rescue.md").read_text()
    for verifier in FAMILY_VERIFIERS.values():  # each family's headline verifier is the one docs/rescue.md names
        assert f"`--prm '{verifier}'`" in docs
    degen = {(d["setting"], d["method"]): d for d in summary["degeneration"]}
    assert row["loops_kvr"] == degen[("kvr", "window")]["loops"] / 3
    assert table_main([str(out), "--write", str(tmp_path / "table.md")]) == 0
    assert f"| {100 * a_kvr:.1f}" in (tmp_path / "table.md").read_text() and "**" not in (tmp_path / "table.md").read_text()
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


def test_controls_helper_search_and_full_search(tmp_path, monkeypatch):
    """helper-search never runs the base, full-search never evicts, both fit in the tables (cells and
    records alike), and neither changes the cells of the other settings."""
    from dynts.rescue.rows import RaggedCache
    from eval.rescue.table import rows, markdown

    events = []
    evict_rows = RaggedCache.evict_rows
    monkeypatch.setattr(RaggedCache, "evict_rows", lambda self, due: (events.append(sum(due)), evict_rows(self, due))[1])
    out = tmp_path / "run"
    assert main([*ARGS, "--settings", "helper-search,full-search", "--out", str(out)]) == 0
    assert events == []  # neither control has an evicted cache
    cells = {p.name.rsplit("-", 1)[0]: json.loads(p.read_text()) for p in (out / "cells").iterdir()}
    assert set(cells) == {"helper-search", "full-search"}
    helper, full = cells["helper-search"], cells["full-search"]
    assert helper["method"] is None and full["method"] is None  # method-independent, like full / helper
    for rec in helper["records"]:  # the base never proposes, so never commits
        assert rec["base_tokens"] == rec["base_candidates"] == 0 and set(rec["sources"]) == {"h"}
        assert rec["helper_candidates"] == 4 * rec["committed_steps"]  # 2N per step: KV-Rescue's N + N
    assert helper["metrics"]["helper_share"] == 1.0
    assert all(r["base_candidates"] == 2 * r["committed_steps"] for r in full["records"])  # N base + N helper per step
    assert helper["settings"]["search"] == {"n_base": 0, "n_helper": 4} and full["settings"]["search"] == {"n_base": 2, "n_helper": 2}
    for key in ("budget", "local_window", "retention", "predictor"):
        assert key not in helper["settings"] and key not in full["settings"]
    assert "base" not in helper["settings"]["weights"] and "detector" not in helper["settings"]
    assert "base" in full["settings"]["weights"]

    # the same budget's KV-Rescue does evict (the counter works), and a third run reuses the controls
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}
    assert main([*ARGS, "--settings", "full,bon,kvr,helper-search,full-search", "--out", str(out)]) == 0
    assert events and sum(events) > 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir() if p.name in stamps} == stamps
    summary = json.loads((out / "results.json").read_text())
    by = {(c["setting"], c["method"]): c["metrics"] for c in summary["cells"]}
    cmp = summary["comparison"]["window"]
    assert cmp["A_helper_search"] == by[("helper-search", None)]["accuracy"]
    assert cmp["A_full_search"] == by[("full-search", None)]["accuracy"]
    assert cmp["base_step_share"]["bon"] == 1.0 and cmp["base_step_share"]["helper-search"] == 0.0
    assert cmp["base_step_share"]["kvr"] == 1 - by[("kvr", "window")]["helper_share"]
    assert "| helper-search | – |" in (out / "results.md").read_text()
    kvr = json.loads(next((out / "cells").glob("kvr-window-*.json")).read_text())["settings"]
    for key in ("prm", "n", "max_steps", "max_step_tokens", "max_tokens", "delimiter", "temperature", "seed"):
        assert helper["settings"][key] == full["settings"][key] == kvr[key], key  # the same verifier, N, limits, sampling
    assert full["settings"]["detector"] == kvr["detector"]  # full-search screens its base candidates as KV-Rescue does
    assert helper["settings"]["weights"]["prm"] == full["settings"]["weights"]["prm"] == kvr["weights"]["prm"]

    # eval.rescue.table: the control row, KV-Rescue minus helper-search paired; records alone give the same table
    (row,) = rows([out])
    assert row["A_helper_search"] == cmp["A_helper_search"] and "kvr_minus_helper_search" in row["stats"]
    text = markdown([row])
    assert "A_helper-search %" in text and "KVR − helper-search" in text
    control = next(line for line in text.splitlines() if line.startswith("| B = 40") and line.count("|") == 14)
    assert f"{100 * cmp['A_helper_search']:.1f} [" in control and control.endswith(" / 0.0 |")  # helper-search: no base step
    records_only = tmp_path / "records-only"
    shutil.copytree(out / "records", records_only / "records")
    (again,) = rows([records_only], from_records=True)
    assert markdown([again]) == text


def test_controls_keep_the_fingerprints_of_committed_cells():
    """Adding settings changes no existing cell's key: a committed run's cells are still reused."""
    import hashlib
    from dataclasses import replace
    from pathlib import Path

    from eval.rescue.config import RescueEvalConfig

    run = Path(__file__).resolve().parents[1] / "reports/rescue/B64-N4"
    record = json.loads((run / "results.json").read_text())["config"]
    config = RescueEvalConfig.from_record({**record, "settings": ()})
    # the flat record round-trips through the held RescueConfig, names and order included
    assert json.dumps(config.record(), indent=2) == json.dumps({**record, "settings": []}, indent=2)
    digest = lambda key: hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]  # noqa: E731
    paths = sorted((run / "cells").glob("*.json"))
    assert len(paths) == 11
    for path in paths:
        cell = json.loads(path.read_text())
        key = config.cell_settings(cell["setting"], cell["method"])
        key["weights"] = cell["settings"]["weights"]  # digests recorded when they still read file mtimes
        assert key == cell["settings"] and path.stem.endswith(digest(key)), path.name
    # the controls: their own keys, independent of the base's budget, dependent on N
    keys = {s: digest(config.cell_settings(s, None)) for s in ("full", "helper", "helper-search", "full-search")}
    assert len(set(keys.values())) == 4
    other_budget = replace(config, budget=32)
    other_n = replace(config, search=replace(config.search, n_base=8, n_helper=8))
    for s in ("helper-search", "full-search"):
        assert digest(other_budget.cell_settings(s, None)) == keys[s]
        assert digest(other_n.cell_settings(s, None)) != keys[s]


def test_a_committed_cell_key_is_rebuilt_from_the_held_search():
    """The key of ``kvr-window-cba229319f`` comes back byte for byte from a config holding a ``RescueConfig``
    built as ``dynts rescue bench`` builds it (each step-search field under its record name)."""
    import hashlib
    from pathlib import Path

    from dynts.rescue import RescueConfig
    from eval.rescue.config import RescueEvalConfig

    loop = {"repeat_ngram": 8, "min_pattern_size": 1, "max_pattern_size": 4, "min_count": 2}
    detector = {"entropy_threshold": 3.3, "compress_threshold": 0.5, "compress_window": 100, "guard": 12,
                "entropy_window": 6, "include_context": False, "loop": loop}
    search = RescueConfig(n_base=4, n_helper=4, step_delimiter=";", max_steps=96, max_step_tokens=64, detector=detector,
                          temperature=0.6, top_p=0.95, top_k=20, seed=0, max_rows=64)
    config = RescueEvalConfig(benchmark="testbed:n=100,set=test", out="reports/rescue/B64-N4", prm="testbed-prm-order",
                              methods=("window", "rkv", "dynts"), predictor="checkpoints/testbed-predictor", budget=64,
                              local_window=16, retention=0.4, search=search, settings=())
    cell = Path(__file__).resolve().parents[1] / "reports/rescue/B64-N4/cells/kvr-window-cba229319f.json"
    key = config.cell_settings("kvr", "window")
    key["weights"] = json.loads(cell.read_text())["settings"]["weights"]  # a fresh checkout has other file mtimes
    text = json.dumps(key, sort_keys=True, default=str)
    assert hashlib.sha256(text.encode()).hexdigest()[:10] == "cba229319f"
    assert (key["n"], key["delimiter"], key["max_steps"], key["max_step_tokens"], key["detector"]) == (4, ";", 96, 64, detector)
    assert config.step_search("kvr", 100).detector == search.detector and config.step_search("bon", 100).detector is None
    assert (config.step_search("helper-search", 100).n_base, config.step_search("helper-search", 100).n_helper) == (0, 8)


def test_the_held_search_is_checked_by_the_core_and_names_the_field():
    from dynts.rescue import RescueConfig
    from eval.rescue.config import RescueEvalConfig

    with pytest.raises(ValueError, match=r"max_step_tokens=0 must be an int >= 1"):
        RescueEvalConfig(benchmark="testbed", out="", methods=("window",), search=RescueConfig(max_step_tokens=0))
    with pytest.raises(ValueError, match=r"n_base=0, n_helper=4: both must be N >= 1"):
        RescueEvalConfig(benchmark="testbed", out="", methods=("window",), search=RescueConfig(n_base=0))
    with pytest.raises(ValueError, match=r"top_p"):
        main([*ARGS, "--top-p", "0", "--out", "/nonexistent"])


def test_bad_settings_name_the_option_and_the_choices(tmp_path):
    with pytest.raises(SystemExit, match=r"--settings .*bogus.*choose from full,helper,.*helper-search,full-search"):
        main([*ARGS, "--settings", "full,bogus", "--out", str(tmp_path / "run")])


def test_the_default_verifier_is_the_families_prm_alone(monkeypatch, tmp_path):
    """``dynts rescue`` without ``--prm``: the PRM of the helper's testbed family, alone (the paper's verifier);
    the product with the helper's likelihood is the option beside it."""
    from eval.rescue import cli
    from eval.rescue.config import RescueEvalConfig
    from eval.rescue.verifiers import product_verifier

    seen = []
    monkeypatch.setattr(cli, "evaluate", lambda config, **kw: seen.append(config.prm) or {})
    monkeypatch.setattr(cli, "summary_table", lambda summary: "")
    helpers = ("testbed-helper", "testbed-chain-helper", "checkpoints/testbed-chain-fair-helper")
    for helper in helpers:
        assert cli.main(["bench", "--benchmark", "testbed:n=2,set=dev", "--helper", helper, "--method", "window", "--out", str(tmp_path)]) == 0
    assert seen == ["testbed-prm-order", "testbed-chain-prm", "checkpoints/testbed-chain-fair-step-prm"]
    assert not any("*" in v or "likelihood" in v for v in seen)  # no helper likelihood unless asked for
    assert RescueEvalConfig(benchmark="testbed:n=2", out=str(tmp_path), methods=("window",)).prm == DEFAULT_VERIFIER == "testbed-prm-order"
    assert default_verifier("my-own-helper") == DEFAULT_VERIFIER
    assert product_verifier("checkpoints/testbed-chain-fair-helper") == (
        "checkpoints/testbed-chain-fair-step-prm*likelihood:checkpoints/testbed-chain-fair-helper")
    assert all("*" not in v and not v.startswith("likelihood:") for v in FAMILY_VERIFIERS.values())
