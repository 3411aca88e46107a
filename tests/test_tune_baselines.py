"""Tuning on dev (``scripts/tune_baselines.py`` = :mod:`eval.harness.tuning`): the grid file is validated (an
unknown method, option or field is a ValueError naming it), only dev problems are read, stage "own" sweeps
each method's options at the shared cache settings and stage "cache" every subset winner over W_l x
retention, ``--resume`` skips finished cells, the choice is the highest dev pass@1 with ties to the default,
and choices.json's specs are ``dynts eval`` specs. One end-to-end run on a tiny random model with the
testbed tokenizer; the rest with a stand-in harness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eval.harness import tuning as tune
from eval.harness.methods import parse_methods
from pipeline_utils import tiny_eval_testbed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
PREDICTOR = str(ROOT / "checkpoints" / "testbed-predictor")


def grid_dict(**kw) -> dict:
    base = {
        "name": "tiny", "model": "testbed", "predictor": PREDICTOR, "problems": {"family": "copy", "set": "dev", "n": 2},
        "k": 1, "budget": 48, "local_window": 16, "retention": 0.4, "batch_size": 2,
        "cache": {"local_window": [8, 16], "retention": [0.4, 0.6]},
        "select": {"subsets": {"token+q": {"per_head": False, "keep_question": True},
                               "head+q": {"per_head": True, "keep_question": True}, "best": {}}},
        "methods": {
            "h2o": {"grid": {"keep_question": [False, True], "per_head": [False, True]}},
            "dynts": {"grid": {"keep_question": [True, False]}},
        },
    }
    return {**base, **kw}


def write(tmp_path, values: dict, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ------------------------------------------------------------------ the grid


SEED1 = {"chain-fair": ("testbed-chain-fair-s1-lrm", "testbed-chain-fair-s1-predictor", "testbed-chain-fair-lrm", "testbed-chain-fair-predictor"),
         "copy-fair": ("testbed-fair-scratch-s1-lrm", "testbed-fair-scratch-s1-predictor", "testbed-fair-lrm", "testbed-fair-predictor")}


def _committed_grid(name: str, tmp_path: Path) -> Path:
    """The committed grid; it tunes on the seed-1 LRM and predictor, and until the seeds' queue has exported
    them, a copy that loads the committed fair pair in their place (the grid's structure is the same)."""
    path = ROOT / "configs" / "tuning" / f"{name}.yaml"
    model, predictor, stand_model, stand_predictor = SEED1[name]
    raw = yaml.safe_load(path.read_text())
    assert (raw["model"], raw["predictor"]) == (f"checkpoints/{model}", f"checkpoints/{predictor}")
    if (ROOT / "checkpoints" / predictor / "predictor_config.json").is_file():
        return path
    copy = tmp_path / path.name
    copy.write_text(path.read_text().replace(f"checkpoints/{model}", f"{ROOT}/checkpoints/{stand_model}")
                    .replace(f"checkpoints/{predictor}", f"{ROOT}/checkpoints/{stand_predictor}"))
    return copy


def test_the_committed_grids_load_and_treat_every_method_alike(tmp_path):
    for name in ("chain-fair", "copy-fair"):
        grid = tune.load_grid(_committed_grid(name, tmp_path))
        counts = {m: sum(c.method == m for c in grid.cells) for m in grid.methods}
        assert counts == {"h2o": 4, "snapkv": 60, "rkv": 32, "dynts": 2}, name
        assert {(c.local_window, c.retention) for c in grid.cells} == {(32, 0.4)}  # stage own: the shared cache only
        assert grid.cache_pairs() == [(w, r) for w in (16, 32, 64) for r in (0.2, 0.4, 0.6)]
        assert {m: grid.max_winners(m) for m in grid.methods} == {"h2o": 4, "snapkv": 4, "rkv": 4, "dynts": 1}
        assert set(grid.subsets_of("rkv")) == {"token", "token+q", "head", "head+q", "best"} and set(grid.subsets_of("dynts")) == {"best"}
        assert grid.problems["set"] == "dev" and grid.benchmark.endswith(",set=dev") and grid.k == 2 and grid.problems["n"] == 100
        assert grid.budget == {"chain-fair": 121, "copy-fair": 90}[name]
        assert not any(c.method == "snapkv" and dict(c.options)["kernel_size"] == 1 and dict(c.options)["pooling"] == "avg"
                       for c in grid.cells)  # excluded: a kernel of 1 pools nothing
        assert "at most 203" in tune.dry_run(grid)  # 98 + 13 winners x 8 + the full cache


@pytest.mark.parametrize("change, field", [
    ({"methods": {"nope": {"grid": {"keep_question": [True]}}}}, "methods.nope"),
    ({"methods": {"h2o": {"grid": {"keep_questoin": [True]}}}}, "methods.h2o.grid.keep_questoin"),
    ({"methods": {"h2o": {"grid": {"local_window": [8, 16]}}}}, "methods.h2o.grid.local_window"),
    ({"methods": {"rkv": {"grid": {"mix_lambda": [0.1, 2.0]}}}}, "mix_lambda"),
    ({"methods": {"snapkv": {"grid": {"kernel_size": [4]}}}}, "kernel_size"),
    ({"methods": {"h2o": {"grid": {"keep_question": []}}}}, "methods.h2o.grid.keep_question"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True, True]}}}}, "methods.h2o.grid.keep_question"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True]}, "exclude": [{"pooling": "avg"}]}}}, "methods.h2o.exclude.pooling"),
    ({"methods": {"h2o": {"grid": {"keep_question": [True]}, "defaults": {}}}}, "methods.h2o"),
    ({"methods": {"h2o": {"grid": {"keep_question": [False]}}}}, "select.subsets.token+q"),  # no h2o cell in it
    ({"select": {"subsets": {"head": {"per_head": True}}}}, "methods.dynts"),  # no subset applies to dynts
    ({"select": {"subsets": {"x": {"no_such": 1}, "best": {}}}}, "select.subsets.x.no_such"),
    ({"select": {"metric": "tokens", "subsets": {"best": {}}}}, "select.metric"),
    ({"cache": {"local_window": [8, -1], "retention": [0.4]}}, "cache.local_window"),
    ({"cache": {"local_window": [8], "retention": [0.4, 1.5]}}, "cache.retention"),
    ({"cache": {"local_window": [8]}}, "cache"),
    ({"budgets": [48]}, "budgets"),
    ({"predictor": None}, "predictor"),
    ({"budget": 0}, "budget"),
    ({"budget_from": {"fraction": 0.25, "full_mean_sequence": 400}}, "budget"),
    ({"problems": {"family": "copy", "set": "dev", "n": 2, "size": 3}}, "problems.size"),
])
def test_bad_grids_name_the_field(tmp_path, change, field):
    with pytest.raises(ValueError, match=f"grid.yaml: {field}|: {field}=".replace("+", r"\+")):
        tune.load_grid(write(tmp_path, grid_dict(**change)))


@pytest.mark.parametrize("problem_set", ["test", "val", "gate", "ptest", "confirm", "sealed", "final", "train", None])
def test_only_dev_is_read(tmp_path, problem_set):
    problems = {"family": "chain", "n": 2, **({} if problem_set is None else {"set": problem_set})}
    with pytest.raises(ValueError, match=r"problems\.set.*set=dev"):
        tune.load_grid(write(tmp_path, grid_dict(problems=problems)))
    grid = tune.load_grid(write(tmp_path, grid_dict()))
    grid.problems["set"] = problem_set  # changed after validation: the run refuses it too
    with pytest.raises(ValueError, match="set=dev only"):
        tune.run_grid(grid, tmp_path / "out", runner=_never, loader=_never)


def test_dry_run_projects_both_stages(tmp_path, capsys):
    path = write(tmp_path, grid_dict(cost={"seconds_per_sample": 0.5}, reference=["full"]))
    assert tune.main(["--grid", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # stage own 6; stage cache: h2o at most 3 winners (token+q, head+q, best), dynts 1, 3 new cells each; + full
    assert "h2o 3 (token+q, head+q, best), dynts 1 (best)" in out and "= 6; stage cache at most 12; + 1 reference = at most 19" in out
    assert "19 cells x 2 samples x 0.5 s/sample" in out and "h2o:keep_question=true,per_head=false,local_window=16,retention=0.4" in out
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
    rows[2]["pass@1"] = 0.60  # a tie with the default: the default wins, whatever the grid order
    picked = tune.choose(rows, default)
    assert picked["chosen"]["order"] == 2 and picked["runner_up"]["order"] == 1 and picked["tied_at_top"] == 2
    rows = [row(0, 0.7, mix_lambda=0.05, normalize="non_window"), row(1, 0.7, mix_lambda=0.2, normalize="all"),
            row(2, 0.7, mix_lambda=0.07, normalize="all"), row(3, 0.2, mix_lambda=0.1, normalize="all")]
    picked = tune.choose(rows, default)  # tied, none the default: fewest differing settings, then grid order
    assert picked["chosen"]["order"] == 1 and picked["runner_up"]["order"] == 2 and picked["default"]["order"] == 3
    rows = [row(0, 0.1 + 0.2, mix_lambda=0.05, normalize="all"), row(1, 0.3, mix_lambda=0.1, normalize="all")]
    assert tune.choose(rows, default)["chosen"]["order"] == 1  # equal in counts: a tie


def test_defaults_are_the_evictors_own_and_the_shared_cache(tmp_path):
    grid = tune.load_grid(_committed_grid("chain-fair", tmp_path))
    assert grid.defaults("rkv") == {"mix_lambda": 0.1, "normalize": "all", "keep_question": False, "per_head": False,
                                    "local_window": 32, "retention": 0.4}
    assert grid.defaults("dynts") == {"keep_question": True, "local_window": 32, "retention": 0.4}
    assert grid.defaults("snapkv")["observation_window"] == 8 and grid.defaults("snapkv")["kernel_size"] == 7


def test_short_specs_name_the_preset_and_what_differs():
    s = tune.short_spec
    assert s("h2o", {"keep_question": True, "per_head": True, "local_window": 32, "retention": 0.4}, 32, 0.4) == "h2o-head+q"
    assert s("h2o", {"keep_question": False, "per_head": False, "local_window": 16, "retention": 0.4}, 32, 0.4) == "h2o:local_window=16"
    assert (s("rkv", {"mix_lambda": 0.05, "normalize": "all", "keep_question": True, "per_head": False, "local_window": 32,
                      "retention": 0.6}, 32, 0.4) == "rkv+q:mix_lambda=0.05,retention=0.6")
    assert s("dynts", {"keep_question": False, "local_window": 32, "retention": 0.4}) == "dynts-no-question:local_window=32,retention=0.4"
    assert s("dynts", {"keep_question": True, "local_window": 32, "retention": 0.4}, 32, 0.4) == "dynts"
    assert (s("h2o", {"keep_question": True, "per_head": True, "local_window": 64, "retention": 0.6}, 32, 0.4, share_of=90)
            == "h2o-head+q:local_window_share=0.7111,retention=0.6")
    assert tune.window_share(64, 90) == 0.7111 and tune.window_share(7, 9999) == 0.0007  # 4 decimals where they suffice
    assert tune.window_share(12345, 30011) == 0.41135  # more where they do not


# ------------------------------------------------------------------ running (a stand-in harness)


def _never(*args, **kwargs):
    raise AssertionError("nothing may be loaded or run")


class FakeHarness:
    """Stands in for eval.harness.runner.run: writes each planned cell's record and returns its result,
    pass@1 from ``scores`` (by method label), recording what it was asked to run."""

    def __init__(self, scores, stop_after=None):
        self.scores, self.stop_after, self.ran, self.loaded = scores, stop_after, [], []

    def __call__(self, config, after_cell=None, loaded=None):
        from dynts.io import write_atomic
        from eval.harness.plan import plan_cells

        self.loaded.append(loaded)
        results = []
        for cell in plan_cells(config):
            if self.stop_after is not None and len(self.ran) == self.stop_after:
                raise KeyboardInterrupt
            self.ran.append(cell.method.label)
            write_atomic(config.run_dir / "records" / f"{cell.key}.json", json.dumps({"key": cell.key, "ids": ["dev:0", "dev:1"]}))
            result = {"key": cell.key, **cell.as_dict(), "pass@1": self.scores.get(cell.method.label, 0.5), "pass@1_se": 0.1,
                      "n_keep": 30, "mean_generated_tokens": 100.0, "loop_rate": 0.0, "seconds": 1.0, "mean_prompt_tokens": 14.0}
            results.append(result)
            if after_cell:
                after_cell(result)
        return results


H2O = "h2o:keep_question={},per_head={},local_window={},retention={}"
SCORES = {H2O.format("true", "false", 16, 0.4): 0.7,  # stage own: the token+q winner, and the best
          H2O.format("true", "true", 16, 0.4): 0.6,  # the head+q winner
          H2O.format("true", "false", 8, 0.6): 0.8}  # stage cache: token+q's winner does better at W_l 8, retention 0.6


def test_two_stages_resume_and_choose(tmp_path):
    grid = tune.load_grid(write(tmp_path, grid_dict(reference=["full"])))
    out, run_dir = tmp_path / "out", tmp_path / "run"
    loader = lambda name: ("model", "tok")  # noqa: E731
    first = FakeHarness(SCORES, stop_after=3)  # the full cache + 2 cells, then a stop
    with pytest.raises(KeyboardInterrupt):
        tune.run_grid(grid, out, run_dir, runner=first, loader=loader)
    assert len(list((out / "cells").glob("*.json"))) == 3 and len(list((out / "records").glob("*.json"))) == 3
    assert not (out / "choices.json").exists() and first.loaded == [("model", "tok")]
    with pytest.raises(ValueError, match="--resume"):
        tune.run_grid(grid, out, run_dir, runner=_never, loader=_never)

    second = FakeHarness(SCORES, stop_after=8)  # the 4 stage-own cells left, then 4 of stage cache
    with pytest.raises(KeyboardInterrupt):
        tune.run_grid(grid, out, run_dir, resume=True, runner=second, loader=loader)
    assert not set(first.ran) & set(second.ran)
    third = FakeHarness(SCORES)
    doc = tune.run_grid(grid, out, run_dir, resume=True, runner=third, loader=loader)
    ran = first.ran + second.ran + third.ran
    assert len(ran) == len(set(ran)) == 1 + 6 + 9  # full, stage own, stage cache: 2 h2o winners x 3 + dynts x 3
    assert [label for label in third.ran] == [label for label in third.ran if "local_window=16,retention=0.4" not in label]
    stage2 = [label for label in ran[7:]]
    assert {label.rsplit(",local_window", 1)[0] for label in stage2} == {
        "h2o:keep_question=true,per_head=false", "h2o:keep_question=true,per_head=true", "dynts:keep_question=true"}

    assert doc["complete"] and doc["incomplete"] == [] and doc["reference"]["full"]["pass@1"] == 0.5
    h2o = doc["methods"]["h2o"]["subsets"]
    assert h2o["token+q"]["spec"] == H2O.format("true", "false", 8, 0.6) and h2o["token+q"]["pass@1"] == 0.8
    assert h2o["token+q"]["short_spec"] == "h2o+q:local_window=8,retention=0.6"
    assert h2o["token+q"]["own"]["chosen"]["pass@1"] == 0.7 and h2o["token+q"]["cache"]["chosen_minus_default_points"] == 10.0
    assert h2o["head+q"]["short_spec"] == "h2o-head+q" and h2o["best"]["spec"] == h2o["token+q"]["spec"]
    dynts = doc["methods"]["dynts"]["subsets"]
    assert set(dynts) == {"best"} and dynts["best"]["short_spec"] == "dynts"  # all tied: the default, kept question, shared cache
    assert doc["methods"]["h2o"]["cells"] == {"own": 4, "cache": 8}
    assert json.loads((out / "choices.json").read_text()) == json.loads(json.dumps(doc, sort_keys=True))
    table = (out / "grid.md").read_text()
    assert "15 cells finished (6 of 6 of stage own)" in table and "| h2o | token+q | `keep_question=true,per_head=false` | 70.0 |" in table
    assert "| 8 | 50.0 (30) | 80.0 (30) |" in table  # token+q's winner: W_l 8 at retention 0.4, 0.6

    assert tune.table_specs(doc, ["token+q", "head+q"], (), 16, 0.4) == ["h2o+q:local_window=8,retention=0.6", "h2o-head+q", "dynts"]
    assert tune.table_specs(doc, [], ["dynts"], 16, 0.4) == ["dynts"]
    # for a table at other budgets: every chosen W_l as its share of the tuning's B = 48, the run's W_l included
    shares = tune.table_specs(doc, ["token+q", "head+q"], (), 16, 0.4, window_shares=True)
    assert shares == ["h2o+q:local_window_share=0.1667,retention=0.6", "h2o-head+q:local_window_share=0.3333",
                      "dynts:local_window_share=0.3333"]
    assert [m.local_window_at(48) for m in parse_methods([",".join(shares)])] == [8, 16, 16]  # the tuned W_l back at B
    assert len(parse_methods([",".join(tune.table_specs(doc, ["token+q", "head+q"]))])) == 3  # dynts eval takes them
    with pytest.raises(ValueError, match="neither a subset"):
        tune.table_specs(doc, ["token"])
    with pytest.raises(ValueError, match="not complete"):
        tune.table_specs({**doc, "complete": False, "incomplete": ["h2o"]}, ["token+q"])
    # a second tuning (e.g. SepLLM's own grid, subsets: best only): its specs follow, each subset named by either applies
    other = {"complete": True, "budget": 48, "subsets": {"best": {}}, "methods": {"sepllm": {"subsets": {"best": {
        "setting": {"local_window": 32}}}}}}
    assert tune.table_specs([doc, other], ["token+q", "head+q"], (), 16, 0.4) == [
        "h2o+q:local_window=8,retention=0.6", "h2o-head+q", "dynts", "sepllm:local_window=32"]
    assert tune.table_specs([doc, other], [], ["sepllm"], 16, 0.4, window_shares=True) == ["sepllm:local_window_share=0.6667"]
    with pytest.raises(ValueError, match="not complete"):
        tune.table_specs([doc, {**other, "complete": False}], ["token+q"])
    with pytest.raises(ValueError, match="neither a subset"):
        tune.table_specs([doc, other], [], ["streamingllm"])

    fourth = FakeHarness(SCORES)  # everything finished: nothing runs, nothing loads
    tune.run_grid(grid, out, run_dir, resume=True, runner=fourth, loader=_never)
    assert fourth.ran == []
    changed = write(tmp_path, grid_dict(reference=["full"], k=2))
    with pytest.raises(ValueError, match="another grid"):
        tune.run_grid(tune.load_grid(changed), out, run_dir, resume=True, runner=_never, loader=_never)


def test_specs_command_refuses_a_missing_or_unfinished_tuning(tmp_path, capsys):
    assert tune.specs_main([str(tmp_path / "choices.json"), "--subsets", "token+q"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "choices.json").write_text(json.dumps({"complete": False, "incomplete": ["rkv"], "subsets": {}, "methods": {}}))
    assert tune.specs_main([str(tmp_path / "choices.json"), "--subsets", "token+q"]) == 2
    assert "not complete (incomplete: rkv)" in capsys.readouterr().err


# ------------------------------------------------------------------ end to end (the real harness)


def test_end_to_end_on_a_tiny_model(tmp_path):
    tiny_eval_testbed(tmp_path / "model", tmp_path / "predictor")
    values = grid_dict(model=str(tmp_path / "model"), predictor=str(tmp_path / "predictor"), max_new_tokens=16,
                       budget=24, local_window=6, reference=["full"], cache={"local_window": [4, 6], "retention": [0.4]},
                       select={"subsets": {"best": {}}},
                       methods={"h2o": {"grid": {"keep_question": [False, True]}}, "dynts": {"grid": {"keep_question": [True]}}})
    grid = tune.load_grid(write(tmp_path, values))
    out = tmp_path / "out"
    script = [sys.executable, str(ROOT / "scripts" / "tune_baselines.py"), "--grid", str(grid.path), "--out", str(out),
              "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(script, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((out / "choices.json").read_text())
    assert doc["complete"] and set(doc["methods"]) == {"h2o", "dynts"} and doc["benchmark"] == "testbed:n=2,set=dev"
    records = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    assert len(records) == 6 and all(r["ids"] == ["dev:0", "dev:1"] for r in records)  # full + 3 own + 2 cache
    assert {r["cell"]["local_window"] for r in records} == {None, 4, 6}
    assert all(r["cell"]["method"].get("cache") for r in records if r["cell"]["budget"])  # each cell's own W_l / retention
    assert tune.main(["--grid", str(grid.path), "--out", str(out), "--run-dir", str(tmp_path / "run"), "--resume"]) == 0
    assert len(list((out / "cells").glob("*.json"))) == 6
    specs = subprocess.run([sys.executable, "-m", "eval.harness.tuning", "specs", str(out / "choices.json"), "--local-window", "6",
                            "--retention", "0.4"], capture_output=True, text=True, cwd=ROOT)
    assert specs.returncode == 0 and len(parse_methods([specs.stdout.strip()])) == 2
