"""``scripts/gpu_check.py --dry-run`` lists both GPU commands' time plans (each inside one call's 540 s, and the pair
inside one 15-minute lending), then runs every section on CPU (tiny shapes) and writes its JSON; an unsupported
release stops it before any test or timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--methods", "window", "dynts"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {k: result[k].get("error", result[k]) for k in ("kernels", "logits", "serve", "serve_graphs", "vllm", "model")
              if result[k] is None or not result[k].get("ok", "error" not in result[k])}
    assert rc == 0, (failed, result["tests"])
    assert result["budget_s"] is None  # a dry run checks code paths, not time: no section is time-boxed
    assert result["dry_run"] and not result["skipped"] and set(result["plans"]["alone"]) == {"gpu_check", "vllm_gpu_bundle"}
    assert result["kernels"]["warm_up"]["backend"] == "torch" and result["kernels"]["keep_top_by_budget"]["ok"]
    assert result["model"]["shape"] and "vllm_v2" not in result  # the carried vLLM is the second command
    assert not result["versions"]["refused"] and result["versions"]["found"]["transformers"]
    assert result["kernels"]["ok"] and result["kernels"]["layout"] == [2, 2, 64, 16]
    assert result["attention_stats"]["bf16_ms"] > 0 and result["attention_stats"]["max_prob_diff"] < 1e-2
    assert result["logits"]["ok"] and result["logits"]["fp32_tokens_identical"]
    serve = result["serve"]
    assert [r["name"] for r in serve["runs"]] == ["full", "streamingllm@16", "dynts@16"] and "error" not in serve
    assert not serve["skipped"] and set(serve["tokens_per_s_ratio_by_method"]) == {"streamingllm@16", "dynts@16"}
    for run in serve["runs"][1:]:
        assert run["peak_slots_max"] <= 16 and run["evictions"] > 0
    graphs = result["serve_graphs"]  # on CPU the engine has no graphs: both runs eager, still compared
    assert graphs["ok"] and graphs["tokens_identical"] and graphs["kept_identical"] and graphs["events"] > 0
    assert result["vllm"]["ok"] and result["vllm"]["moved_slots"] > 0  # the plugin's slot copy, exact
    hooks = result["vllm"]["hooks_by_runner"]  # V1 and V2 worker hooks on their stand-in runners, checked and timed
    from eval.perf.syncs import V1_HOOKS, V2_HOOKS  # every hook each runner binds

    assert hooks["v1"]["hooks"] == list(V1_HOOKS) and hooks["v2"]["hooks"] == list(V2_HOOKS)
    for record in hooks.values():
        assert record["verified"]["event_rounds"] >= 2 and record["syncs_per_plain_step"] == 0
        assert record["us_per_plain_step"] > 0 and record["us_per_event_round"] > 0 and record["rows"] == 4
    replay = result["vllm"]["graph_replay"]  # on CPU the graph driver runs eager, against its reference
    assert replay["ok"] and not replay["graphs"] and replay["rounds"]["event"] == 2
    assert result["tests"]["returncode"] == 0 and "test_cuda.py" in result["tests"]["output_tail"]
    assert [(c["compile"], c["batch"], c.get("methods")) for c in result["bench"]] == [
        (False, 1, None), (False, 2, None), (True, 1, ["h2o", "snapkv", "rkv"]), (True, 1, None)]
    for combo in result["bench"]:
        assert [row["position"] for row in combo["rows"]] == [256, 512]
        for row in combo["rows"]:
            assert set(row["methods"]) == set(combo.get("methods", ["window", "dynts"]))
            # a compiled full cache is one static cache of the largest L (+ 3 steps of 4 + 1) at every L
            assert row["full_capacity"] == (512 + 13 if combo["compile"] else None)
            for r in row["methods"].values():
                assert r["t_ms"] > 0 and r["speedup"] > 0 and r["peak_kv_bytes"] < row["full_peak_kv_bytes"]


def test_dry_run_lists_both_commands_each_inside_one_call_and_both_inside_one_lending(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    assert gpu_check.main(["--dry-run", "--plan", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    plans = json.loads((tmp_path / "gpu_check.json").read_text())["plans"]
    assert set(plans["commands"]) == {"gpu_check", "vllm_gpu_bundle"}
    assert "scripts/gpu_check.py --out $OUT --budget-s 540" in plans["commands"]["gpu_check"]
    assert "-m eval.perf.vllm_gpu_bundle --out $OUT --budget-s 540" in plans["commands"]["vllm_gpu_bundle"]
    for name, plan in plans["alone"].items():
        assert plan["budget_s"] == 540 and 0 < plan["planned_s"] <= 540, (name, plan["planned_s"])
        assert f"$ {plans['commands'][name]}" in printed
        assert plan["skipped"] == [r["name"] for r in plan["steps"] if not r["runs"]]
        assert all(r["basis"] and r["estimate_s"] > 0 for r in plan["steps"])
    gpu = [r["name"] for r in plans["alone"]["gpu_check"]["steps"]]
    assert gpu[:3] == ["setup", "kernels", "vllm"]  # the new code first: kernels, the worker hooks, the graph check
    assert {"logits", "tests", "serve_graphs", "serve", "decode eager batch 1 B=4096"} <= set(gpu)
    bundle = [r["name"] for r in plans["alone"]["vllm_gpu_bundle"]["steps"]]
    assert bundle[:6] == ["install", "models", "smoke", "check-float32-testbed-dynts", "cost-ample-stock",
                          "cost-ample-plugin"]
    assert not {"smoke", "check-float32-testbed-dynts", "cost-ample-stock", "cost-ample-plugin"} \
        & set(plans["alone"]["vllm_gpu_bundle"]["skipped"])
    lending = plans["lending"]  # both in one lending: the machine's start, each call's overhead, both budgets
    budgets = [p["budget_s"] for p in lending["plans"].values()]
    assert lending["start_s"] + 2 * lending["per_call_s"] + sum(budgets) <= lending["lending_s"] == 900
    assert all(p["planned_s"] <= p["budget_s"] for p in lending["plans"].values())
    assert lending["plans"]["vllm_gpu_bundle"]["steps"][2]["runs"]  # the smoke runs in a lending too
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--budget-s", "900"])  # more than one call may run


def test_gpu_check_refuses_an_unsupported_release_before_anything_runs(tmp_path, monkeypatch):
    import importlib.metadata

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.16.0" if name == "transformers" else real(name))
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 2
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert any("transformers 5.16.0 is outside" in r for r in result["versions"]["refused"])
    assert result["kernels"] is None and result["tests"] is None and result["bench"] == []
    assert result["plan"]["planned_s"] <= result["plan"]["budget_s"] == 540


def test_gpu_check_runs_the_core_on_any_supported_release(monkeypatch):
    """transformers 5.17 (the GPU image's) is inside the core range: nothing is refused, only the serving
    sections (``dynts.serving`` pins 5.24) are gated."""
    import importlib.metadata

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))
    versions = gpu_check.check_versions()
    assert versions["refused"] == []
    assert any("transformers 5.17.0 is outside the supported transformers<5.26,>=5.24" in r
               for r in versions["serving_refused"]), versions["serving_refused"]


def test_vllm_engine_section_skips_without_vllm_or_lists_its_runs():
    """The vllm_v2 section: FLASH_ATTN with FA2 and FA3 under FULL_AND_PIECEWISE graphs through dynts vllm-check;
    without vLLM a skip that says how to install it (a dry run lists the commands only)."""
    import importlib.util

    from eval.perf.vllm_v2_check import vllm_v2_check

    result = vllm_v2_check(dry_run=True)
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM is not installed" in result["skipped"] and "dynts-lrm[vllm]" in result["skipped"]
        return
    commands = [" ".join(r["command"]) for r in result["runs"]]
    assert all("vllm-check" in c and "--cudagraph-mode FULL_AND_PIECEWISE" in c and "FLASH_ATTN" in c for c in commands)
    assert {c.split("--flash-attn-version ")[1][0] for c in commands} == {"2", "3"} and result["ok"]


def test_the_plans_in_performance_md_are_the_printed_ones():
    """docs/performance.md's plan table and lending steps quote ``gpu_check.py --dry-run --plan``'s numbers."""
    from eval.perf.gpu_plans import lending_plans

    plans = lending_plans()
    text = (ROOT / "docs/performance.md").read_text()
    section = text.split("## GPU: `scripts/gpu_check.py` and the carried vLLM", 1)[1].split("### The first run", 1)[0]
    for name, label in (("gpu_check", "`gpu_check.py --budget-s 540`"), ("vllm_gpu_bundle", "`vllm_gpu_bundle --budget-s 540`")):
        assert f"| {label} | {plans['alone'][name]['planned_s']:.0f} s |" in section, name
        lending = plans["lending"]["plans"][name]
        assert f"--budget-s {lending['budget_s']:.0f}" in section.replace("\n   ", " ")
        assert f"{lending['planned_s']:.0f} s planned" in section, name


def test_a_deadline_too_short_for_any_section_skips_each_with_its_numbers(tmp_path, monkeypatch):
    """The running deadline of the GPU order (a dry run given a budget): at 1 s nothing but the version check fits;
    every section is listed under ``skipped`` with its estimate and what was left, the model's users with why."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    assert gpu_check.main(["--dry-run", "--budget-s", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["budget_s"] == 1 and result["versions"]["found"]["torch"]
    skipped = {s["section"]: s for s in result["skipped"]}
    for name in ("kernels", "vllm", "logits", "tests", "serve_graphs", "model", "attention_stats"):
        assert skipped[name]["estimate_s"] > skipped[name]["left_s"] and "would not fit" in skipped[name]["reason"]
        assert result[name] is None
    assert skipped["serve"]["reason"] == "no model: its section was skipped or failed" and result["bench"] == []
