"""Per-method cache settings in a method spec (``local_window=`` or ``local_window_share=`` / ``retention=``): the
harness takes them out of the evictor's options and builds that method's Budget from them (the run's B),
they show in labels, keys and records, a spec without them keeps its cell key, and bad values are refused
naming the option."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import dynts
from dynts.evictors.base import EVICTORS
from eval.harness.config import EvalConfig
from eval.harness.methods import CACHE_OPTIONS, PLUGINS, MethodSpec, parse_method, parse_methods
from eval.harness.plan import plan_cells
from eval.harness.runner import run
from pipeline_utils import tiny_eval_testbed

pytestmark = pytest.mark.usefixtures("one_thread")

BENCH = "testbed:n=2,set=dev"
PREDICTOR = str(Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-predictor")


def cells(methods, **kw):
    config = EvalConfig(**{"model": "testbed", "benchmarks": [BENCH], "methods": methods, "budgets": [121],
                           "local_windows": [32], "retentions": [0.4], "progress": False, "predictor": PREDICTOR, **kw})
    return {c.method.label: c for c in plan_cells(config)}


def test_no_evictor_has_an_option_named_like_a_cache_setting():
    import importlib

    for module in PLUGINS.values():
        importlib.import_module(module)
    for name, cls in EVICTORS.items():
        assert not {f.name for f in dataclasses.fields(cls)} & set(CACHE_OPTIONS), name


def test_overrides_leave_the_evictor_options_and_set_that_methods_budget():
    spec = parse_method("rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6")
    assert spec.options == (("per_head", True), ("keep_question", True), ("mix_lambda", 0.05))
    assert spec.cache == (("retention", 0.6),) and spec.retention == 0.6 and spec.local_window is None
    assert spec.label == "rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6"
    assert spec.evictor().mix_lambda == 0.05  # built without the cache option
    preset = parse_method("h2o-head+q:local_window=16,retention=0.2")
    assert preset.name == "h2o" and dict(preset.options) == {"per_head": True, "keep_question": True}
    assert preset.label == "h2o-head+q:local_window=16,retention=0.2" and preset.local_window == 16

    planned = cells(["rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6", "h2o+q:local_window=16",
                     "h2o+q", "dynts-no-question:local_window=64,retention=0.2", "full"])
    budgets = {label: c.eviction.build().bounds for label, c in planned.items()}
    assert budgets["rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6"] == dynts.Budget(121, 32, 0.6)
    assert budgets["h2o+q:local_window=16"] == dynts.Budget(121, 16, 0.4)
    assert budgets["h2o+q"] == dynts.Budget(121, 32, 0.4)
    assert budgets["dynts-no-question:local_window=64,retention=0.2"] == dynts.Budget(121, 64, 0.2)
    assert budgets["full"] is None
    # n_keep = W_q + floor(retention x (B - W_q - W_l)) + W_l at a 14-token question
    n_keep = {label: b.n_keep(14) for label, b in budgets.items() if b is not None}
    assert n_keep == {"rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6": 14 + 45 + 32,
                      "h2o+q:local_window=16": 14 + 36 + 16, "h2o+q": 14 + 30 + 32,
                      "dynts-no-question:local_window=64,retention=0.2": 14 + 8 + 64}
    rkv = planned["rkv:per_head=true,keep_question=true,mix_lambda=0.05,retention=0.6"]
    assert rkv.eviction.method_options == (("keep_question", True), ("mix_lambda", 0.05), ("per_head", True))
    assert rkv.as_dict()["method"]["cache"] == {"retention": 0.6} and "cache" not in planned["h2o+q"].as_dict()["method"]


def test_keys_are_unambiguous_and_unchanged_without_overrides():
    run32 = cells(["h2o+q", "h2o+q:local_window=16", "h2o+q:local_window=32"])
    run16 = cells(["h2o+q"], local_windows=[16])
    keys = [c.key for c in run32.values()] + [run16["h2o+q"].key]
    assert len(set(keys)) == 4  # same W_l, other labels: other cells
    assert "W16" in run32["h2o+q:local_window=16"].key and run32["h2o+q:local_window=16"].local_window == 16
    # a spec without overrides: the cell is what it was before overrides existed (its as_dict has no "cache")
    assert run32["h2o+q"].as_dict()["method"] == {"name": "h2o", "options": {"keep_question": True}, "label": "h2o+q"}
    # an override replaces the run's list: one cell per budget, whatever the run sweeps
    swept = plan_cells(EvalConfig(model="testbed", benchmarks=[BENCH], methods=["h2o:local_window=8", "window"],
                                  budgets=[64, 96], local_windows=[16, 32], retentions=[0.2, 0.4], progress=False))
    assert [(c.budget, c.local_window, c.retention) for c in swept if c.method.name == "h2o"] == [(64, 8, 0.2), (64, 8, 0.4), (96, 8, 0.2), (96, 8, 0.4)]
    assert sum(c.method.name == "window" for c in swept) == 8
    # and the fraction budgets, once the full cache sized them
    config = EvalConfig(model="testbed", benchmarks=[BENCH], methods=["full", "h2o:retention=0.6"], budget_fractions=[0.25],
                        local_windows=[32], progress=False)
    extra = [c for c in plan_cells(config, {BENCH: [(90, 0.25)]}) if c.budget is not None]
    assert [(c.budget, c.local_window, c.retention, c.budget_fraction) for c in extra] == [(90, 32, 0.6, 0.25)]


def test_a_window_share_sets_w_l_per_budget():
    spec = parse_method("h2o-head+q:local_window_share=0.7111,retention=0.6")
    assert spec.local_window is None and spec.local_window_share == 0.7111 and spec.cache[0] == ("local_window_share", 0.7111)
    planned = plan_cells(EvalConfig(model="testbed", benchmarks=[BENCH], methods=[spec.label, "window"], budgets=[52, 90, 121],
                                    local_windows=[32], progress=False))
    assert [(c.budget, c.local_window) for c in planned if c.method.name == "h2o"] == [(52, 37), (90, 64), (121, 86)]
    assert [c.local_window for c in planned if c.method.name == "window"] == [32, 32, 32]  # the run's W_l elsewhere
    assert [c.eviction.build().bounds for c in planned if c.method.name == "h2o"][0] == dynts.Budget(52, 37, 0.6)
    assert parse_method("dynts:local_window_share=0").local_window_at(90) == 0
    assert parse_method("dynts:local_window_share=0.25").local_window_at(90) == 23  # 22.5: halves round up
    # fraction budgets: resolved once the full cache sized them
    config = EvalConfig(model="testbed", benchmarks=[BENCH], methods=["full", "h2o:local_window_share=0.5"],
                        budget_fractions=[0.15, 0.25], local_windows=[32], progress=False)
    extra = [c for c in plan_cells(config, {BENCH: [(52, 0.15), (90, 0.25)]}) if c.budget is not None]
    assert [(c.budget, c.local_window) for c in extra] == [(52, 26), (90, 45)]


def test_a_window_share_the_budget_cannot_hold_is_refused_naming_it(tmp_path):
    tiny_eval_testbed(tmp_path / "model")
    config = EvalConfig(model=str(tmp_path / "model"), benchmarks=["testbed:n=2"], methods=["window:local_window_share=0.9"],
                        budgets=[24], k=1, batch_size=2, max_new_tokens=12, run_dir=tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"local_window \(22\)"):  # 0.9 x 24 = 21.6 -> 22, past a 14-token question
        run(config)


@pytest.mark.parametrize("spec, message", [
    ("h2o:local_window_share=1", "local_window_share=1.0 must lie in [0, 1)"),
    ("h2o:local_window_share=-0.1", "local_window_share=-0.1 must lie in [0, 1)"),
    ("h2o:local_window_share=half", "local_window_share='half' must lie in [0, 1)"),
    ("h2o:local_window=16,local_window_share=0.2", "not both"),
    ("h2o:local_window=-1", "local_window=-1 must be an integer >= 0"),
    ("h2o:local_window=2.5", "local_window=2.5 must be an integer >= 0"),
    ("h2o:local_window=true", "local_window=True must be an integer >= 0"),
    ("rkv:retention=0", "retention=0.0 must lie in"),
    ("rkv:retention=1.5", "retention=1.5 must lie in"),
    ("rkv:retention=high", "retention='high' must lie in"),
    ("full:retention=0.4", "retention= does not apply"),
    ("h2o+q:local_window=8,local_window=16", "'local_window' is given twice"),
])
def test_bad_overrides_are_refused_naming_the_option(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_methods([spec])


def test_only_cache_options_are_cache_settings():
    with pytest.raises(ValueError, match="not a cache option"):
        MethodSpec("h2o", (), cache=(("budget", 3),))


def test_a_run_records_the_overrides(tmp_path):
    tiny_eval_testbed(tmp_path / "model")
    config = EvalConfig(model=str(tmp_path / "model"), benchmarks=["testbed:n=2"], methods=["window", "window:local_window=2,retention=0.6"],
                        budgets=[24], local_windows=[6], k=1, batch_size=2, max_new_tokens=12, run_dir=tmp_path / "run", progress=False)
    results = {r["method"]["label"]: r for r in run(config)}
    over = results["window:local_window=2,retention=0.6"]
    assert (over["local_window"], over["retention"]) == (2, 0.6) and over["method"]["cache"] == {"local_window": 2, "retention": 0.6}
    assert (results["window"]["local_window"], results["window"]["retention"]) == (6, 0.4)
    assert (over["n_keep"], results["window"]["n_keep"]) == (14 + 4 + 2, 14 + 1 + 6)  # B = 24, a 14-token question
    record = json.loads((tmp_path / "run" / "records" / f"{over['key']}.json").read_text())
    assert record["cell"]["local_window"] == 2 and record["cell"]["method"]["label"] == "window:local_window=2,retention=0.6"
    # an override the budget cannot hold is refused before anything generates, naming that cell
    config = dataclasses.replace(config, methods=["window:local_window=20"], run_dir=tmp_path / "run2")
    with pytest.raises(ValueError, match=r"window-local-window-20.*W20.*local_window \(20\)"):
        run(config)
    assert not (tmp_path / "run2" / "cells").exists()
