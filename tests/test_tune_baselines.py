"""``scripts/tune_baselines.py``: the grid file is validated (an unknown method, option or field is a
ValueError naming it), only dev problems are read, ``--resume`` skips finished cells, and the choice is
the highest dev pass@1 with ties to the method's default. One end-to-end run on a tiny random model
with the testbed tokenizer; the rest with a stand-in harness."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_utils import tiny_eval_testbed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def _script():
    spec = importlib.util.spec_from_file_location("tune_baselines", ROOT / "scripts" / "tune_baselines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tune = _script()
PREDICTOR = str(ROOT / "checkpoints" / "testbed-predictor")


def grid_dict(**kw) -> dict:
    base = {
        "name": "tiny", "model": "testbed", "predictor": PREDICTOR, "problems": {"family": "copy", "set": "dev", "n": 2},
        "k": 1, "budget": 48, "local_window": 16, "retention": 0.4, "batch_size": 2,
        "select": {"restrict": {"+q": {"keep_question": True}}},
        "methods": {
            "h2o": {"grid": {"local_window": [8, 16], "keep_question": [False, True]}},
            "dynts": {"grid": {"retention": [0.2, 0.4]}},
        },
    }
    return {**base, **kw}


def write(tmp_path, values: dict, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ------------------------------------------------------------------ validation


def test_the_committed_grids_load_and_enumerate():
    for name in ("chain-fair", "copy-fair"):
        grid = tune.load_grid(ROOT / "configs" / "tuning" / f"{name}.yaml", strict=False)
        counts = {m: sum(c.method == m for c in grid.cells) for m in grid.methods}
        assert counts == {"h2o": 12, "snapkv": 60, "rkv": 96, "dynts": 18}, name
        assert grid.problems["set"] == "dev" and grid.benchmark.endswith(",set=dev") and grid.k == 2
        assert grid.problems["n"] == 100 and grid.budget == {"chain-fair": 121, "copy-fair": 90}[name]
        assert not any(c.method == "snapkv" and dict(c.options)["kernel_size"] == 1 and dict(c.options)["pooling"] == "avg"
                       for c in grid.cells)  # excluded: a kernel of 1 pools nothing


@pytest.mark.parametrize("change, field", [
    ({"methods": {"nope": {"grid": {"keep_question": [True]}}}}, "methods.nope"),
    ({"methods": {"h2o": {"grid": {"keep_questoin": [True]}}}}, "methods.h2o.grid.keep_questoin"),
    ({"methods": {"rkv": {"grid": {"mix_lambda": [0.1, 2.0]}}}}, "mix_lambda"),
    ({"methods": {"snapkv": {"grid": {"kernel_size": [4]}}}}, "kernel_size"),
    ({"methods": {"h2o": {"grid": {"keep_question": []}}}}, "methods.h2o.grid.keep_question"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True, True]}}}}, "methods.h2o.grid.keep_question"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True]}, "exclude": [{"pooling": "avg"}]}}}, "methods.h2o.exclude.pooling"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True]}, "defaults": {}}}}, "methods.h2o.defaults"),
    ({"methods": {"h2o": {"grid": {"local_window": [-1]}}}}, "methods.h2o.grid.local_window"),
    ({"budgets": [48]}, "budgets"),
    ({"select": {"restrict": {"x": {"no_such": 1}}}}, "select.restrict.x.no_such"),
    ({"select": {"metric": "tokens"}}, "select.metric"),
    ({"predictor": None}, "predictor"),
    ({"budget": 0}, "budget"),
    ({"budget_from": {"fraction": 0.25, "full_mean_sequence": 400}}, "budget"),
    ({"problems": {"family": "copy", "set": "dev", "n": 2, "size": 3}}, "problems.size"),
])
def test_bad_grids_name_the_field(tmp_path, change, field):
    with pytest.raises(ValueError, match=f"grid.yaml: {field}|{field}"):
        tune.load_grid(write(tmp_path, grid_dict(**change)))


def test_an_option_no_evictor_has_yet_is_reported_by_a_dry_run_and_refused_by_a_run(tmp_path):
    path = write(tmp_path, grid_dict(methods={"h2o": {"grid": {"keep_question": [False, True], "future_knob": [False, True]}}}))
    with pytest.raises(ValueError, match=r"methods\.h2o\.grid\.future_knob: h2o has no option 'future_knob'"):
        tune.load_grid(path)
    grid = tune.load_grid(path, strict=False)
    assert len(grid.cells) == 4 and "h2o:keep_question=false,future_knob=true" in [c.spec for c in grid.cells]
    text = tune.dry_run(grid)
    assert "NOT YET AN OPTION" in text and "future_knob" in text and "total 4" in text
    with pytest.raises(ValueError, match="future_knob"):
        tune.run_grid(grid, tmp_path / "out", runner=_never, loader=_never)


@pytest.mark.parametrize("problem_set", ["test", "val", "gate", "ptest", "confirm", "sealed", "final", "train", None])
def test_only_dev_is_read(tmp_path, problem_set):
    problems = {"family": "chain", "n": 2, **({} if problem_set is None else {"set": problem_set})}
    with pytest.raises(ValueError, match=r"problems\.set.*set=dev"):
        tune.load_grid(write(tmp_path, grid_dict(problems=problems)))
    grid = tune.load_grid(write(tmp_path, grid_dict()))
    grid.problems["set"] = problem_set  # changed after validation: the run refuses it too
    with pytest.raises(ValueError, match="set=dev only"):
        tune.run_grid(grid, tmp_path / "out", runner=_never, loader=_never)


def test_dry_run_projects_the_cost(tmp_path, capsys):
    path = write(tmp_path, grid_dict(cost={"seconds_per_sample": 0.5}, reference=["full"]))
    assert tune.main(["--grid", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 6 cells + the full cache, 2 problems x k = 1 each, 0.5 s per sample
    assert "total 6 + 1 reference" in out and "7 cells x 2 samples x 0.5 s/sample" in out
    assert "h2o:local_window" not in out and "h2o:keep_question=true  W_l=8 r=0.4" in out
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ choosing


def row(order, score, **setting):
    return {"order": order, "pass@1": score, "setting": {"local_window": 32, "retention": 0.4, **setting}}


def test_choose_takes_the_highest_then_the_default_then_grid_order():
    default = {"mix_lambda": 0.1, "normalize": "all", "local_window": 32, "retention": 0.4}
    rows = [row(0, 0.50, mix_lambda=0.05, normalize="all"), row(1, 0.60, mix_lambda=0.07, normalize="all"),
            row(2, 0.55, mix_lambda=0.1, normalize="all"), row(3, 0.40, mix_lambda=0.2, normalize="all")]
    picked = tune.choose(rows, default)
    assert picked["chosen"]["order"] == 1 and picked["runner_up"]["order"] == 2 and picked["default"]["order"] == 2
    assert picked["chosen_minus_default_points"] == pytest.approx(5.0) and picked["tied_at_top"] == 1
    # a tie with the default: the default wins, whatever the grid order
    rows[2]["pass@1"] = 0.60
    picked = tune.choose(rows, default)
    assert picked["chosen"]["order"] == 2 and picked["runner_up"]["order"] == 1 and picked["tied_at_top"] == 2
    assert picked["chosen_minus_default_points"] == 0.0
    # tied cells, none the default: the one differing from it in fewest settings, then grid order
    rows = [row(0, 0.7, mix_lambda=0.05, normalize="non_window"), row(1, 0.7, mix_lambda=0.2, normalize="all"),
            row(2, 0.7, mix_lambda=0.07, normalize="all"), row(3, 0.2, mix_lambda=0.1, normalize="all")]
    picked = tune.choose(rows, default)
    assert picked["chosen"]["order"] == 1 and picked["runner_up"]["order"] == 2 and picked["default"]["order"] == 3
    # floating sums that are equal in counts are ties
    rows = [row(0, 0.1 + 0.2, mix_lambda=0.05, normalize="all"), row(1, 0.3, mix_lambda=0.1, normalize="all")]
    assert tune.choose(rows, default)["chosen"]["order"] == 1


def test_defaults_are_the_evictors_own_and_the_grids_cache_settings(tmp_path):
    grid = tune.load_grid(ROOT / "configs" / "tuning" / "chain-fair.yaml", strict=False)
    rkv = grid.defaults("rkv")
    assert rkv.pop("per_head", False) is False  # an option the evictors are gaining: its default once it exists
    assert rkv == {"mix_lambda": 0.1, "retention": 0.4, "normalize": "all", "keep_question": False, "local_window": 32}
    assert grid.defaults("dynts") == {"retention": 0.4, "local_window": 32, "keep_question": True}
    assert grid.defaults("snapkv")["observation_window"] == 8 and grid.defaults("snapkv")["kernel_size"] == 7


# ------------------------------------------------------------------ running (a stand-in harness)


def _never(*args, **kwargs):
    raise AssertionError("nothing may be loaded or run")


class FakeHarness:
    """Stands in for eval.harness.runner.run: writes each planned cell's record and returns its result,
    pass@1 from ``scores`` (by method label and W_l), recording what it was asked to run."""

    def __init__(self, scores, stop_after=None):
        self.scores, self.stop_after, self.ran, self.loaded = scores, stop_after, [], []

    def __call__(self, config, after_cell=None, loaded=None):
        from dynts.io import write_atomic
        from eval.harness.runner import plan_cells

        self.loaded.append(loaded)
        results = []
        for cell in plan_cells(config):
            if self.stop_after is not None and len(self.ran) == self.stop_after:
                raise KeyboardInterrupt
            self.ran.append((cell.method.label, cell.local_window, cell.retention))
            write_atomic(config.run_dir / "records" / f"{cell.key}.json", json.dumps({"key": cell.key, "ids": ["dev:0", "dev:1"]}))
            score = self.scores.get((cell.method.label, cell.local_window, cell.retention), 0.5)
            result = {"key": cell.key, **cell.as_dict(), "pass@1": score, "pass@1_se": 0.1, "n_keep": 30,
                      "mean_generated_tokens": 100.0, "loop_rate": 0.0, "seconds": 1.0, "mean_prompt_tokens": 14.0}
            results.append(result)
            if after_cell:
                after_cell(result)
        return results


def test_resume_skips_finished_cells_and_a_grid_is_fixed_once_started(tmp_path):
    path = write(tmp_path, grid_dict(reference=["full"]))
    grid = tune.load_grid(path)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    scores = {("h2o:keep_question=true", 8, 0.4): 0.9}  # every other cell scores 0.5
    first = FakeHarness(scores, stop_after=3)  # the full cache + 2 cells, then a stop
    with pytest.raises(KeyboardInterrupt):
        tune.run_grid(grid, out, run_dir, runner=first, loader=lambda name: ("model", "tok"))
    assert len(list((out / "cells").glob("*.json"))) == 3 and len(list((out / "records").glob("*.json"))) == 3
    assert all(item == ("model", "tok") for item in first.loaded)  # loaded once, handed to every harness call
    assert not (out / "choices.json").exists()

    with pytest.raises(ValueError, match="--resume"):
        tune.run_grid(grid, out, run_dir, runner=_never, loader=_never)
    second = FakeHarness(scores)
    loads = []
    doc = tune.run_grid(grid, out, run_dir, resume=True, runner=second, loader=lambda name: loads.append(name) or ("m", "t"))
    assert loads == ["testbed"]
    done = {("full", None, None), ("h2o:keep_question=false", 8, 0.4), ("h2o:keep_question=true", 8, 0.4)}
    assert set(first.ran) == done and not done & set(second.ran) and len(second.ran) == 4
    assert len(list((out / "cells").glob("*.json"))) == 7

    assert doc["incomplete"] == [] and doc["reference"]["full"]["pass@1"] == 0.5
    h2o = doc["methods"]["h2o"]
    assert h2o["chosen"]["spec"] == "h2o:keep_question=true" and h2o["chosen"]["setting"]["local_window"] == 8
    assert h2o["default"]["setting"] == {"keep_question": False, "local_window": 16, "retention": 0.4}
    assert h2o["restricted"]["+q"]["chosen"]["pass@1"] == 0.9 and h2o["cells"] == 4
    assert doc["methods"]["dynts"]["chosen"]["setting"]["retention"] == 0.4  # all tied at 0.5: the default
    assert json.loads((out / "choices.json").read_text()) == json.loads(json.dumps(doc, sort_keys=True))
    table = (out / "grid.md").read_text()
    assert "6 of 6 cells finished" in table and "| h2o | `keep_question=true,local_window=8,retention=0.4` | 90.0 |" in table

    third = FakeHarness(scores)  # everything finished: nothing runs, nothing loads
    tune.run_grid(grid, out, run_dir, resume=True, runner=third, loader=_never)
    assert third.ran == []

    changed = write(tmp_path, grid_dict(reference=["full"], k=2), "grid.yaml")
    with pytest.raises(ValueError, match="another grid"):
        tune.run_grid(tune.load_grid(changed), out, run_dir, resume=True, runner=_never, loader=_never)


# ------------------------------------------------------------------ end to end (the real harness)


def test_end_to_end_on_a_tiny_model(tmp_path):
    tiny_eval_testbed(tmp_path / "model", tmp_path / "predictor")
    values = grid_dict(model=str(tmp_path / "model"), predictor=str(tmp_path / "predictor"), max_new_tokens=16,
                       budget=24, local_window=6, reference=["full"],
                       methods={"h2o": {"grid": {"keep_question": [False, True]}}, "dynts": {"grid": {"local_window": [4, 6]}}})
    grid = tune.load_grid(write(tmp_path, values))
    out = tmp_path / "out"
    assert tune.main(["--grid", str(grid.path), "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    doc = json.loads((out / "choices.json").read_text())
    assert set(doc["methods"]) == {"h2o", "dynts"} and doc["benchmark"] == "testbed:n=2,set=dev"
    records = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    assert len(records) == 5 and all(r["ids"] == ["dev:0", "dev:1"] for r in records)
    assert {r["cell"]["local_window"] for r in records} == {None, 4, 6}
    # a second run with --resume runs nothing
    assert tune.main(["--grid", str(grid.path), "--out", str(out), "--run-dir", str(tmp_path / "run"), "--resume"]) == 0
