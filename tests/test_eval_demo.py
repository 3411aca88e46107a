"""The demo (``python -m eval.harness.demo``) runs every method on the bundled testbed checkpoints; here on
a tiny random stand-in placed where the bundled checkpoints live (``$DYNTS_CHECKPOINTS``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynts.models import TESTBED
from eval.harness import demo
from pipeline_utils import tiny_eval_testbed

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoints(root, predictor: bool, families=("copy", "chain")):
    for family in families:
        spec = demo.FAMILIES[family]
        tiny_eval_testbed(root / TESTBED[spec.model], root / spec.predictor if predictor else None)


def test_demo_without_checkpoints_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DYNTS_CHECKPOINTS", str(tmp_path))
    assert demo.main(["--run-dir", str(tmp_path / "run")]) == 1
    assert "dynts testbed train" in capsys.readouterr().err
    make_checkpoints(tmp_path, False, families=("copy",))  # the chain model is still missing: named, nothing runs
    assert demo.main(["--run-dir", str(tmp_path / "run")]) == 1
    assert "chain-lrm-fair-s1.yaml" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_demo_runs_the_final_tables_models_and_the_tuned_settings():
    """The demo's tables are the final tables' LRMs (seed 1 of the fair ones), each with its own predictor,
    and DynTS, H2O, SnapKV, R-KV and SepLLM at the settings their committed dev tuning chose."""
    from pathlib import Path

    from dynts.models import checkpoints_dir, resolve_path
    from eval.harness.tuning import table_specs

    assert {f: (spec.model, spec.predictor) for f, spec in demo.FAMILIES.items()} == {
        "copy": ("testbed-fair", "testbed-fair-scratch-s1-predictor"),
        "chain": ("testbed-chain-fair", "testbed-chain-fair-s1-predictor")}
    assert TESTBED["testbed-fair"] == "testbed-fair-scratch-s1-lrm" and TESTBED["testbed-chain-fair"] == "testbed-chain-fair-s1-lrm"
    final_tables = (Path(__file__).resolve().parents[1] / "scripts/run_final_tables.sh").read_text()
    root = Path(__file__).resolve().parents[1]
    for family, spec in demo.FAMILIES.items():
        assert resolve_path(spec.model) == checkpoints_dir() / TESTBED[spec.model]
        assert f"model=checkpoints/{TESTBED[spec.model]}" in final_tables
        assert f"pred=checkpoints/{spec.predictor}" in final_tables
        assert (checkpoints_dir() / spec.predictor / "predictor_config.json").is_file()
        docs = [json.loads((root / source.format(family=family)).read_text()) for source in demo.TUNED_FROM]
        assert list(spec.tuned) == table_specs(docs, ["best"], local_window=32, retention=0.4, window_shares=True)
        methods, _ = demo.demo_methods(True, family)
        assert set(spec.tuned) <= set(methods) and not {"h2o", "snapkv", "rkv", "sepllm", "h2o+q", "snapkv+q", "rkv+q"} & {
            m for m in methods if m not in spec.tuned}  # no baseline at its defaults beside its tuned form


def test_demo_refuses_an_unknown_family(tmp_path, capsys):
    assert demo.main(["--family", "copy,chian", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--family" in capsys.readouterr().err


@pytest.mark.parametrize("predictor", [False, True], ids=["no-predictor", "predictor"])
def test_demo_runs_every_method(tmp_path, monkeypatch, capsys, one_thread, predictor):
    make_checkpoints(tmp_path, predictor)
    monkeypatch.setenv("DYNTS_CHECKPOINTS", str(tmp_path))
    code = demo.main(["--n", "2", "--budget", "64", "--local-window", "6", "--max-new-tokens", "64",
                      "--run-dir", str(tmp_path / "run")])
    assert code == 0
    captured = capsys.readouterr()
    oracles = {"copy": {"oracle-step", "oracle-value", "oracle-token"}, "chain": {"chain-oracle-step", "chain-oracle-value"}}
    for family, family_oracles in oracles.items():
        results = json.loads((tmp_path / "run" / family / "results.json").read_text())
        methods = [r["method"]["name"] for r in results]
        assert methods[0] == "full" and "testbed-oracle" in methods and "window" in methods
        labels = [r["method"]["label"] for r in results]
        assert {"random", "window", "streamingllm"} | family_oracles <= set(labels)
        tuned = [spec for spec in demo.FAMILIES[family].tuned if predictor or not spec.startswith("dynts")]
        assert set(tuned) <= set(labels) and all(r["evictions_per_sample"] > 0 for r in results if r["method"]["name"] != "full")
        assert not ({"oracle-step", "oracle-value", "oracle-token", "chain-oracle-step", "testbed-oracle"} - family_oracles) & set(labels)
        assert all(r.get("loop_rate") is not None and r.get("evictions_per_sample") is not None for r in results)
        assert ("dynts" in methods) == predictor
        assert f"{family} family: testbed toy LRM `{demo.FAMILIES[family].model}`" in captured.out
        full = next(r for r in results if r["method"]["name"] == "full")
        assert f"full cache (no eviction): pass@1 {100 * full['pass@1']:.1f} %" in captured.out
    if not predictor:
        assert "skipping dynts on copy" in captured.err and "skipping dynts on chain" in captured.err
    assert "| full " in captured.out and "accuracy_vs_budget.png" in captured.out
    assert "| tokens vs full |" in captured.out and "| loops % |" in captured.out and "tuned on dev" in captured.out
    assert max(map(len, captured.out.splitlines())) <= demo.WIDTH + len(str(tmp_path))  # only a path may run longer


@pytest.mark.parametrize("family", ["copy", "chain"])
def test_demo_prints_the_committed_demo_within_120_columns(family):
    """The demo's printout of its committed records (``reports/demo/<family>``): every line fits 120 columns, each
    method goes by its short name, and the tuned settings behind those names are printed under the table."""
    import argparse

    from eval.harness.report import short_label

    results = json.loads((ROOT / "reports" / "demo" / family / "results.json").read_text())
    args = argparse.Namespace(n=100, budget=96, local_window=32, retention=0.4)
    text = demo.family_summary(family, results, args, True, Path("runs/demo") / family)
    assert max(len(line) for line in text.splitlines()) <= 120, max(text.splitlines(), key=len)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(results)  # the header, the rule and one row per method
    names = [line.split("|")[1].strip() for line in table[2:]]
    assert names == [short_label(r["method"]["label"]) for r in results]
    assert {"dynts", "snapkv (head+q)" if family == "copy" else "snapkv (token+q)"} <= set(names)
    # the header names the predictor and the importance label it learned
    assert f"dynts: predictor checkpoints/{demo.FAMILIES[family].predictor}, importance label `answer`" in text
    for spec in demo.FAMILIES[family].tuned:  # each tuned option is printed under the table
        for item in spec.partition(":")[2].split(","):
            key, _, value = item.partition("=")
            if key not in ("local_window_share", "retention"):
                assert f"{key}={value}" in text
    full = results[0]
    assert f" {100 * full['pass@1']:.1f} ± {100 * full['pass@1_se']:.1f} |" in table[2]  # the rows follow the rule
