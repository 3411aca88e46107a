"""The ``dynts eval`` harness on a tiny random model with the testbed tokenizer: every registered
method runs, cells are written atomically, an interrupted run resumes (between and inside cells)
and reproduces an uninterrupted one, and results render as CSV/markdown/PNG."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import dynts
import eval.harness.cell_run as cell_run
from eval.harness.config import EvalConfig
from eval.harness.plan import plan_cells
from eval.harness.runner import run
from pipeline_utils import tiny_eval_testbed

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_testbed(tmp_path_factory):
    """A random 2-layer Qwen2 over the testbed vocabulary + an untrained predictor, as directories."""
    root = tmp_path_factory.mktemp("tiny-testbed")
    tiny_eval_testbed(root / "model", root / "predictor")
    return root


def config(root, run_dir, **kw):
    base = dict(
        model=str(root / "model"), benchmarks=["testbed:n=3"], methods=["full", "window"], budgets=[24],
        local_windows=[6], k=2, batch_size=2, max_new_tokens=20, run_dir=run_dir, progress=False,
    )
    return EvalConfig(**{**base, **kw})


def counting(monkeypatch, fail_at: int | None = None) -> list:
    """Count generate batches; raise on call number ``fail_at`` (simulating a kill)."""
    calls, real = [], cell_run._run_batch

    def wrapped(*args, **kwargs):
        calls.append(args[-1])
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cell_run, "_run_batch", wrapped)
    return calls


def samples(run_dir) -> dict:
    return {p.name: p.read_text() for p in sorted((run_dir / "samples").glob("*.jsonl"))}


def test_every_registered_method_runs(tiny_testbed, tmp_path):
    names = [m for m in dynts.available_methods() if m != "fixed"]  # "fixed" needs an explicit kept set
    cfg = config(tiny_testbed, tmp_path, methods=names, predictor=str(tiny_testbed / "predictor"), k=1,
                 benchmarks=["testbed:n=2"], max_new_tokens=24)
    results = run(cfg)
    assert [r["method"]["name"] for r in results] == names
    for r in results:
        assert r["samples"] == 2 and 0.0 <= r["pass@1"] <= 1.0 and r["tokens_per_second"] > 0
        if r["budget"] is not None:
            assert r["peak_cache_tokens"] <= 24
    bounded = [r for r in results if r["budget"] is not None]
    assert any(r["evictions"] > 0 for r in bounded)


def test_resume_between_and_inside_cells(tiny_testbed, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    run(config(tiny_testbed, reference))  # uninterrupted
    cells = plan_cells(config(tiny_testbed, reference))
    assert len(cells) == 2 and len(list((reference / "cells").glob("*.json"))) == 2

    resumed = tmp_path / "resumed"
    # 1) interrupted right after the first cell finished
    def stop(result):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(config(tiny_testbed, resumed), after_cell=stop)
    first = resumed / "cells" / f"{cells[0].key}.json"
    assert first.is_file() and not (resumed / "cells" / f"{cells[1].key}.json").exists()
    assert "| full |" in (resumed / "results.md").read_text()  # tables rendered after each cell
    before = first.read_text()

    # 2) rerun, killed during the second batch of the second cell
    calls = counting(monkeypatch, fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        run(config(tiny_testbed, resumed))
    assert calls == [0, 1]  # the finished cell was skipped; the second cell started at batch 0
    partial = resumed / "cells" / f"{cells[1].key}.partial.jsonl"
    assert [json.loads(l)["batch"] for l in partial.read_text().splitlines()] == [0]

    # 3) rerun: only the missing batches run, and everything equals the uninterrupted run
    calls = counting(monkeypatch)
    results = run(config(tiny_testbed, resumed))
    assert calls == [1, 2]
    assert first.read_text() == before and not partial.exists()
    assert samples(resumed) == samples(reference)
    ref = json.loads((reference / "results.json").read_text())
    for a, b in zip(results, ref):
        assert {k: v for k, v in a.items() if k not in {"seconds", "tokens_per_second"}} == {
            k: v for k, v in b.items() if k not in {"seconds", "tokens_per_second"}
        }

    # 4) a finished run reruns nothing
    calls = counting(monkeypatch)
    run(config(tiny_testbed, resumed))
    assert calls == []


def test_workers_run_the_same_samples_and_resume_a_single_process_run(tiny_testbed, tmp_path, monkeypatch):
    """Two worker processes produce the one-process run's samples and tables, this process loading no model; each
    kind of run resumes the other's run dir. A plugin method (the oracle) is registered in the workers too."""
    kw = dict(methods=["full", "window", "oracle-step"], budgets=[24, 30], k=1)
    reference = tmp_path / "reference"
    ref = run(config(tiny_testbed, reference, **kw))

    def no_load(*args, **kwargs):
        raise AssertionError("the parent of the workers loaded the model")

    monkeypatch.setattr(cell_run, "load_model", no_load)
    parallel = tmp_path / "parallel"
    run(config(tiny_testbed, parallel, methods=["full"], k=1, workers=2))  # one cell: one worker; read back below
    seen = []
    results = run(config(tiny_testbed, parallel, workers=2, **kw), after_cell=lambda r: seen.append(r["key"]))
    assert [r["key"] for r in results] == [r["key"] for r in ref]  # plan order
    assert sorted(seen) == sorted(r["key"] for r in ref[1:])  # every cell run here, once
    assert samples(parallel) == samples(reference)
    timing = {"seconds", "tokens_per_second"}
    assert [{k: v for k, v in a.items() if k not in timing} for a in results] == [
        {k: v for k, v in b.items() if k not in timing} for b in ref]
    assert json.loads((parallel / "results.json").read_text())[-1]["key"] == ref[-1]["key"]
    monkeypatch.undo()
    calls = counting(monkeypatch)
    run(config(tiny_testbed, parallel, **kw))  # one process resumes it: nothing left
    assert calls == []


def test_workers_refuse_a_bad_cell_before_generating(tiny_testbed, tmp_path):
    with pytest.raises(ValueError, match=r"the longest testbed:n=3 prompt: budget=16 is smaller than question"):
        run(config(tiny_testbed, tmp_path, budgets=[16, 24], k=1, workers=2))
    assert not list(tmp_path.glob("cells/*"))  # no cell started, not even the full cache's
    with pytest.raises(ValueError, match=r"workers=0 must be an integer >= 1"):
        config(tiny_testbed, tmp_path, workers=0)


def test_workers_run_a_final_table_read_once_through_the_ledger(tiny_testbed, tmp_path, final_ledger):
    """The final set is read by this process inside the ledger block and handed to the workers, which never read it
    (a worker reading it would be refused: the ledger's handle is this process's)."""
    from eval.harness.ledger import final_run, read_ledger
    from eval.harness.methods import method_id

    cfg = config(tiny_testbed, tmp_path / "run", benchmarks=["testbed:n=2,set=final"], k=1, workers=2)
    seen = []

    def finished(result: dict) -> None:  # each finished cell is on the ledger line as it finishes
        ledger.finished_cell(result["key"], method_id(result["method"]))
        seen.append(sorted(read_ledger()[0]["cells"]))

    with final_run("pytest", ["--final"], enabled=True, out=str(cfg.run_dir),
                   methods=[method_id(m) for m in cfg.method_specs]) as ledger:
        results = run(cfg, after_cell=finished)
    (line,) = read_ledger()
    assert line["status"] == "finished" and sorted(line["cells"]) == sorted(r["key"] for r in results)
    assert [len(cells) for cells in seen] == [1, 2]
    assert [s["set"] for s in line["sets"]] == ["final"] and len(results) == 2


def test_workers_spread_over_the_gpus_and_split_the_threads():
    from eval.harness.workers import worker_load_options, worker_threads

    assert [worker_load_options({"device": "cuda", "dtype": "bfloat16"}, i, 2) for i in range(3)] == [
        {"device": f"cuda:{g}", "dtype": "bfloat16"} for g in (0, 1, 0)]
    assert worker_load_options({"device": "cuda:1"}, 1, 4) == {"device": "cuda:1"}  # a placement the user chose
    assert worker_load_options({"device": "cuda"}, 1, 1) == {"device": "cuda"}
    assert worker_load_options(None, 0, 8) == {}
    assert (worker_threads(2, 1), worker_threads(2, 8), worker_threads(3, 8)) == (1, 4, 2)


def test_outputs_and_metrics(tiny_testbed, tmp_path):
    results = run(config(tiny_testbed, tmp_path, budgets=[24, 30], retentions=[0.4, 0.8], k=2))
    assert len(results) == 1 + 2 * 2
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(results) and rows[0]["method"] == "full" and rows[0]["budget"] == "-"
    assert (tmp_path / "results.md").read_text().count("\n") == len(results) + 2
    assert (tmp_path / "accuracy_vs_budget.png").stat().st_size > 1000
    assert (tmp_path / "accuracy_vs_retention.png").is_file() and not (tmp_path / "accuracy_vs_local_window.png").exists()
    for r in results:
        records = [json.loads(l) for l in (tmp_path / "samples" / f"{r['key']}.jsonl").read_text().splitlines()]
        assert len(records) == 3 * 2
        per_question = {}
        for rec in records:
            per_question.setdefault(rec["question"], []).append(rec["correct"])
        assert r["pass@1"] == pytest.approx(sum(sum(v) / 2 for v in per_question.values()) / 3)
        scores = [sum(v) / 2 for v in per_question.values()]
        mean = sum(scores) / 3
        assert r["pass@1_se"] == pytest.approx((sum((x - mean) ** 2 for x in scores) / 3) ** 0.5 / 3 ** 0.5)
        assert r["mean_generated_tokens"] == pytest.approx(sum(rec["tokens"] for rec in records) / 6)
        assert r["peak_kv_mib_per_sequence"] > 0
    full, bounded = results[0], results[1:]
    assert all(b["peak_cache_tokens"] <= b["budget"] for b in bounded)


def test_settings_mismatch_and_infeasible_budget(tiny_testbed, tmp_path, monkeypatch):
    run(config(tiny_testbed, tmp_path, methods=["full"], k=1))
    with pytest.raises(ValueError, match=r"other settings \(k\)"):
        run(config(tiny_testbed, tmp_path, methods=["full"], k=2))
    with pytest.raises(ValueError, match=r"other settings \(load\)"):  # another dtype changes the numbers
        run(config(tiny_testbed, tmp_path, methods=["full"], k=1), load_options={"dtype": "bfloat16"})
    run(config(tiny_testbed, tmp_path, methods=["full"], k=1), load_options={"device": "cpu"})  # placement does not
    calls = counting(monkeypatch)
    with pytest.raises(ValueError, match=r"the longest testbed:n=3 prompt: budget=16 is smaller than question \(14 tokens\)"):
        run(config(tiny_testbed, tmp_path / "small", budgets=[16], k=1))
    assert calls == []  # nothing was generated


def test_retrained_predictor_makes_new_score_cells_only(tiny_testbed, tmp_path, monkeypatch):
    import shutil

    predictor = tmp_path / "predictor"
    shutil.copytree(tiny_testbed / "predictor", predictor)
    kw = dict(methods=["full", "window", "dynts"], predictor=str(predictor), k=1, benchmarks=["testbed:n=2"])
    first = run(config(tiny_testbed, tmp_path / "run", **kw))
    assert [r.get("predictor") is not None for r in first] == [False, False, True]
    torch.manual_seed(1)
    dynts.ImportancePredictor(32).save_pretrained(predictor)  # "retrained"
    calls = counting(monkeypatch)
    second = run(config(tiny_testbed, tmp_path / "run", **kw))
    assert len(calls) == 1  # only the dynts cell (one batch) ran again
    assert second[:2] == first[:2] and second[2]["key"] != first[2]["key"]


def test_a_fresh_clone_resumes_the_cells_of_a_carried_run(tiny_testbed, tmp_path, monkeypatch):
    """A run dir carried to another machine resumes there: the model's and predictor's digests read their
    bytes, not their files' mtimes (which a fresh checkout sets anew)."""
    import os
    import shutil

    root = tmp_path / "clone"
    for sub in ("model", "predictor"):
        shutil.copytree(tiny_testbed / sub, root / sub)
    kw = dict(methods=["full", "dynts"], predictor=str(root / "predictor"), k=1, benchmarks=["testbed:n=2"])
    first = run(config(root, tmp_path / "run", **kw))
    for f in [*(root / "model").iterdir(), *(root / "predictor").iterdir()]:
        os.utime(f, (1e9, 1e9))  # what a fresh checkout does to every file
    calls = counting(monkeypatch)
    assert run(config(root, tmp_path / "run", **kw)) == first and calls == []


def test_a_published_table_reopens_and_runs_only_the_methods_added(tiny_testbed, tmp_path, monkeypatch):
    """``carried.publish`` copies a finished run's tables and its cells' records (not a stray one) to the report;
    ``carried.reopen`` refills a new run dir from it, so a table given another method runs only that cell, and
    ``carried.prune`` drops the reopened cells the new run does not plan."""
    from eval.harness import carried

    kw = dict(k=1, benchmarks=["testbed:n=2"])
    first = run(config(tiny_testbed, tmp_path / "run", methods=["full", "window"], **kw))
    (tmp_path / "run" / "records" / "stray.json").write_text("{}")  # e.g. a cell whose key changed
    assert carried.missing(tmp_path / "report", "full,window") == ["full", "window"]  # not published yet
    assert carried.publish(tmp_path / "run", tmp_path / "report") == 2
    assert carried.missing(tmp_path / "report", "window,full,window,streamingllm") == ["streamingllm"]
    assert sorted(p.stem for p in (tmp_path / "report" / "records").glob("*.json")) == sorted(r["key"] for r in first)
    assert carried.reopen(tmp_path / "report", tmp_path / "again") == 2
    assert carried.reopen(tmp_path / "report", tmp_path / "run") == 0  # a started run dir is left as it is
    calls = counting(monkeypatch)
    more = run(config(tiny_testbed, tmp_path / "again", methods=["full", "streamingllm"], **kw))
    assert len(calls) == 1 and more[0] == first[0]  # only the new method's cell (one batch) ran
    assert carried.prune(tmp_path / "again") == [first[1]["key"]]  # window: reopened, no longer planned
    assert sorted(p.stem for p in (tmp_path / "again" / "records").glob("*.json")) == sorted(r["key"] for r in more)
    assert carried.publish(tmp_path / "again", tmp_path / "report") == 2
    assert sorted(p.stem for p in (tmp_path / "report" / "records").glob("*.json")) == sorted(r["key"] for r in more)


def test_single_budget_plot_is_bars_per_method():
    """One budget (the demo): bars per method, best on top, the full cache as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.harness.report import _bars

    def cell(label, acc, budget=96):
        return {"benchmark": "testbed:n=2", "method": {"label": label}, "pass@1": acc, "budget": budget,
                "local_window": None if budget is None else 32, "retention": None if budget is None else 0.4}

    fig, ax = plt.subplots()
    _bars(ax, [cell("full", 0.9, None), cell("window", 0.3), cell("dynts", 0.8), cell("h2o", 0.7)], "budget")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["window", "h2o", "dynts"]
    assert [round(p.get_width()) for p in ax.patches] == [30, 70, 80]
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [pytest.approx(90)]
    plt.close(fig)


def test_tables_compare_with_full_and_report_loops_and_evictions(tiny_testbed, tmp_path):
    from eval.harness.report import markdown_table

    results = run(config(tiny_testbed, tmp_path, methods=["full", "window", "h2o+q", "random"], k=1, max_new_tokens=30))
    full = results[0]
    assert full["n_keep"] is None and full["mean_prompt_tokens"] == pytest.approx(14)
    for r in results[1:]:
        assert r["n_keep"] == dynts.Budget(24, 6, 0.4).n_keep(14)
        records = [json.loads(l) for l in (tmp_path / "samples" / f"{r['key']}.jsonl").read_text().splitlines()]
        K = 24 - r["n_keep"]
        for rec in records:  # the cache holds 14 + tokens entries minus K per event, never more than B
            assert 14 + rec["tokens"] - K * rec["evictions"] <= 24 < 14 + rec["tokens"] - K * (rec["evictions"] - 1)
        assert r["evictions_per_sample"] == pytest.approx(sum(rec["evictions"] for rec in records) / len(records))
        assert r["evictions_per_sample"] > 0
        assert 0.0 <= r["loop_rate"] <= 1.0
    table = markdown_table(results)
    header = [h.strip() for h in table.splitlines()[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    col = {h: i for i, h in enumerate(header)}
    for r, row in zip(results, rows):
        assert float(row[col["tokens vs full"]]) == pytest.approx(r["mean_generated_tokens"] / full["mean_generated_tokens"], abs=0.006)
        if r["budget"] is not None:
            want = 24 / (full["mean_prompt_tokens"] + full["mean_generated_tokens"])
            assert float(row[col["B / full seq"]]) == pytest.approx(want, abs=0.006)
    assert rows[2][col["method"]] == "h2o+q"
    assert dict(results[2]["method"]["options"]) == {"keep_question": True}


def test_loop_rules():
    from eval.harness.loops import tail_repeats, testbed_loops

    assert tail_repeats([5] * 64) and not tail_repeats([5] * 63)
    assert tail_repeats(list(range(100)) + [1, 2, 3, 4, 5, 6, 7, 8] * 9)
    assert not tail_repeats(list(range(300)))
    assert tail_repeats(list(range(200)) * 3)  # a 200-token pattern three times
    from data_pipeline.testbed import task

    p = task.make_problem("loop", min_think=100, max_think=100)
    assert not testbed_loops(p.text)
    think = p.text.split(task.END_THINK)[0]
    steps = think.split(";")
    assert testbed_loops(";".join(steps[:-1] + steps[1:3]) + " ;")  # a step written again


def test_compare_states_who_leads_by_two_standard_errors(tmp_path, capsys):
    from eval.harness.compare import compare, main, pivot

    def cell(label, budget, acc, se):
        return {"method": {"label": label}, "budget": budget, "pass@1": acc, "pass@1_se": se}

    results = [cell("full", None, 0.98, 0.01), cell("dynts", 64, 0.85, 0.02), cell("random", 64, 0.25, 0.03),
               cell("h2o+q", 64, 0.82, 0.02), cell("dynts", 96, 0.90, 0.02), cell("h2o+q", 96, 0.97, 0.01)]
    table = compare(results)
    assert "| random | +60.0 ± 3.6 (leads) |" in table
    assert "| h2o+q | +3.0 ± 2.8 (within 2 SE) | -7.0 ± 2.2 (trails) |" in table
    assert "| full (no eviction) | 98.0 ± 1.0 |" in pivot(results) and "| random | 25.0 ± 3.0 |  |" in pivot(results)
    with pytest.raises(ValueError, match="--against: no bounded method 'snapkv'.*labels: dynts, random, h2o\\+q"):
        compare(results, "snapkv")
    tuned = [{**c, "method": {"label": c["method"]["label"].replace("dynts", "dynts:retention=0.6").replace("h2o+q", "h2o+q:lw=8"),
                              "name": c["method"]["label"].split("+")[0]}} for c in results]
    assert compare(tuned, "dynts") == compare(results).replace("dynts", "dynts:retention=0.6").replace("h2o+q", "h2o+q:lw=8")
    with pytest.raises(ValueError, match="2 methods named 'dynts'"):
        compare(tuned + [{**tuned[1], "method": {"label": "dynts:retention=0.5", "name": "dynts"}}], "dynts")
    (tmp_path / "cells").mkdir()
    for i, r in enumerate(results):
        (tmp_path / "cells" / f"{i}.json").write_text(json.dumps(r))
    assert main([str(tmp_path)]) == 0 and "dynts minus" in capsys.readouterr().out


def test_k_samples_distinct_recorded_seeds_fraction_budgets_and_vacuous_cells(tiny_testbed, tmp_path):
    """k samples per problem: the record holds k per problem, pass@1 is the mean of the per-problem
    means, every sample's (seed, row) stream is recorded and distinct; budgets given as shares of the
    full cache's mean sequence resolve after the full cell; a budget whose n_keep leaves no selection
    slot is flagged (selection_slots 0) or, under vacuous='refuse', refused before generating."""
    from eval.harness.records import per_question, read_records

    run_dir = tmp_path / "run"
    results = run(config(tiny_testbed, run_dir, k=3, budgets=[], budget_fractions=[0.9], batch_size=4))
    full, window = results
    seq = full["mean_prompt_tokens"] + full["mean_generated_tokens"]
    assert window["budget_fraction"] == 0.9 and window["budget"] == round(0.9 * seq)
    records = {r["key"]: r for r in read_records(run_dir)}
    for cell in results:
        rec = records[cell["key"]]
        assert rec["k"] == 3 and len(rec["bits"]["correct"]) == 3 * len(rec["ids"])
        scores = per_question(rec)
        assert cell["pass@1"] == pytest.approx(sum(scores) / len(scores))
        streams = list(zip(rec["ints"]["seed"], rec["ints"]["row"]))
        assert len(set(streams)) == len(streams)  # every sample its own (seed, row) stream
    rows = [json.loads(line) for line in (run_dir / "samples" / f"{window['key']}.jsonl").read_text().splitlines()]
    assert {(r["question"], r["sample"]) for r in rows} == {(q, s) for q in range(3) for s in range(3)}
    assert window["selection_slots"] >= 1 and records[window["key"]]["cell"]["selection_slots"] == window["selection_slots"]

    q = round(full["mean_prompt_tokens"])
    vacuous = q + 6 + 2  # W_s = 2 slots, floor(0.4 * 2) = 0 selected
    with pytest.raises(ValueError, match="no selection slot"):
        run(config(tiny_testbed, tmp_path / "refused", budgets=[vacuous], k=1, vacuous="refuse"))
    assert not (tmp_path / "refused" / "cells").exists() or not any((tmp_path / "refused" / "cells").glob("*window*"))
    flagged = run(config(tiny_testbed, tmp_path / "flagged", budgets=[vacuous, vacuous + 1], k=1))
    assert [r.get("selection_slots") for r in flagged] == [None, 0, 1]
    # a method whose own W_l (its spec's local_window= / local_window_share=) leaves it no slot is that method's
    # setting, not a budget too small for the run: flagged even under 'refuse'
    own = run(config(tiny_testbed, tmp_path / "own", methods=["full", "window:local_window=6"], budgets=[vacuous], k=1,
                     local_windows=[2], vacuous="refuse"))
    assert [r.get("selection_slots") for r in own] == [None, 0]
    with pytest.raises(ValueError, match="add the full cache"):
        config(tiny_testbed, tmp_path / "x", methods=["window"], budgets=[], budget_fractions=[0.5])
    with pytest.raises(ValueError, match="budget_fractions"):
        config(tiny_testbed, tmp_path / "x", budgets=[], budget_fractions=[1.5])
