"""Predictor training: labels, losses, metrics, cache/recompute, export, resume, DDP, bad input, pipeline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torchmetrics import KendallRankCorrCoef

import dynts
from data_pipeline.importance_data import add_importance
from data_pipeline.traces import generate_traces
from pipeline_utils import tiny_testbed_lm, write_yaml
from dynts.predictor import BaseModelFingerprint, predictor_label
from trainers.predictor import PredictorModule, export_predictor
from trainers.predictor_cli import PredictorCLI, check_checkpoint
from trainers.predictor_data import PredictorDataModule
from trainers.predictor_metrics import (
    MeanKendallTau,
    TopPercentOverlap,
    importance_loss,
    normalize_labels,
    top_mask,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A tiny model, its traces and two importance datasets (with / without hidden states)."""
    root = tmp_path_factory.mktemp("predictor")
    torch.set_num_threads(1)
    model_dir = tiny_testbed_lm(root / "model")
    traces = dict(
        model=str(model_dir), questions="testbed:ptrain:16", output_dir=str(root / "traces"),
        samples_per_question=2, max_new_tokens=40, batch_size=8, shard_size=16, grader="any", require_eos=False,
        progress=False, accelerator="cpu", dtype="float32",  # a local dir defaults to bfloat16 (7B settings)
    )
    generate_traces(traces)
    add_importance(dict(model=str(model_dir), traces_dir=str(root / "traces/dataset"), output_dir=str(root / "imp"),
                        dtype="float32", save_hidden=True))
    add_importance(dict(model=str(model_dir), traces_dir=str(root / "traces/dataset"), output_dir=str(root / "imp-nohidden"),
                        dtype="float32"))
    return {"root": root, "model": model_dir, "traces": traces, "imp": root / "imp/dataset", "imp_nohidden": root / "imp-nohidden/dataset"}


def train_config(work, run: Path, **model) -> dict:
    return {
        "model": {"global_batch_size": 4, "run_dir": str(run), "export_dir": str(run / "export"), **model},
        "data": {"dataset": str(work["imp"]), "backbone": str(work["model"]), "micro_batch_size": 2, "val_fraction": 0.25,
                 "dtype": "float32"},
        "trainer": {"accelerator": "cpu", "max_epochs": 2, "logger": False, "enable_progress_bar": False},
        "ckpt_path": "last",
    }


# ---------------------------------------------------------------- labels, losses, metrics


def test_label_transforms_are_monotone_scale_free_and_standardised():
    s = torch.tensor([1e-4, 3e-3, 0.02, 0.5, 7.0, 40.0, 0.02])
    for transform in ("mean", "log1p-mean", "log1p-zscore", "rank"):
        y = normalize_labels(s, transform)
        order = torch.argsort(s)
        assert torch.all(y[order][1:] >= y[order][:-1]), transform  # monotone: ranks preserved
        assert torch.allclose(normalize_labels(s * 1000, transform), y, atol=1e-5), transform  # per-trace scale-free
    z = normalize_labels(s, "log1p-zscore")
    assert abs(z.mean().item()) < 1e-6 and abs(z.std(unbiased=False).item() - 1) < 1e-5
    assert torch.allclose(normalize_labels(s, "mean").mean(), torch.tensor(1.0))
    r = normalize_labels(s, "rank")
    assert r.min() == 0 and r.max() == 1 and r[2] == r[6]  # ties share their rank
    assert torch.equal(normalize_labels(s, "none"), s)
    with pytest.raises(ValueError, match="label_transform"):
        normalize_labels(s, "log")
    with pytest.raises(ValueError, match=">= 0"):
        normalize_labels(-s, "mean")


def test_kendall_metric_equals_torchmetrics_per_trace():
    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(3, 50, generator=g), torch.rand(3, 50, generator=g)
    target[:, :10] = 0.0  # ties
    mask = torch.ones(3, 50, dtype=torch.bool)
    mask[1, 30:] = False
    metric = MeanKendallTau()
    metric.update(preds, target, mask)
    expected = torch.stack([KendallRankCorrCoef(variant="b")(preds[i][mask[i]], target[i][mask[i]]) for i in range(3)]).mean()
    assert abs(metric.compute().item() - expected.item()) < 1e-5


def test_top_percent_overlap():
    target = torch.tensor([[10.0, 9, 8, 1, 2, 3, 4, 5, 6, 7]])
    mask = torch.ones_like(target, dtype=torch.bool)
    metric = TopPercentOverlap(30)
    metric.update(target.clone(), target, mask)
    assert metric.compute().item() == 1.0
    metric = TopPercentOverlap(30)
    metric.update(torch.tensor([[10.0, 9, 0, 8, 1, 1, 1, 1, 1, 1]]), target, mask)  # 2 of the top 3
    assert abs(metric.compute().item() - 2 / 3) < 1e-6
    assert top_mask(target, mask, 30).sum() == 3


def test_losses():
    labels = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, True, False]])
    preds = torch.zeros(1, 4, requires_grad=True)
    assert abs(importance_loss(preds, labels, mask, "mse").item() - 5 / 3) < 1e-6
    weighted = importance_loss(preds, labels, mask, "weighted_mse", top_percent=30, top_weight=4.0)
    assert abs(weighted.item() - (0 + 1 + 5 * 4) / 7) < 1e-6  # the top token (label 2) weighs 5
    good = importance_loss(torch.tensor([[0.0, 1, 2, 0]]), labels, mask, "kendall", generator=torch.Generator().manual_seed(0))
    bad = importance_loss(torch.tensor([[2.0, 1, 0, 0]]), labels, mask, "kendall", generator=torch.Generator().manual_seed(0))
    assert good < bad
    importance_loss(preds, labels, mask, "mse", pairwise_weight=0.5).backward()
    assert preds.grad is not None and preds.grad[0, 3] == 0
    with pytest.raises(ValueError, match="loss"):
        importance_loss(preds, labels, mask, "l1")


# ---------------------------------------------------------------- data


def test_recompute_and_built_cache_match_stored_hidden_states(work, tmp_path):
    stored = PredictorDataModule(str(work["imp"]), str(work["model"]), micro_batch_size=3, dtype="float32")
    stored.setup("fit")
    built = PredictorDataModule(str(work["imp_nohidden"]), str(work["model"]), micro_batch_size=3, cache_dir=str(tmp_path / "cache"),
                                dtype="float32")
    built.prepare_data()
    built.setup("fit")
    recompute = PredictorDataModule(str(work["imp_nohidden"]), str(work["model"]), hidden_states="recompute", micro_batch_size=3,
                                    dtype="float32")
    recompute.setup("fit")
    assert stored.hidden_size == built.hidden_size == recompute.hidden_size == 32
    assert stored.val_questions == recompute.val_questions and stored.val_questions
    a, b, c = (next(iter(dm.train_dataloader())) for dm in (stored, built, recompute))
    assert torch.equal(a["mask"], c["mask"]) and torch.equal(a["labels"], c["labels"])
    torch.testing.assert_close(a["hidden"], b["hidden"])
    module = PredictorModule(hidden_size=32)
    module._frozen = [recompute.backbone]
    torch.testing.assert_close(module._hidden(c) * c["mask"][..., None], a["hidden"], atol=2e-3, rtol=2e-3)  # fp16 cache


def test_empty_dataset_and_hidden_size_mismatch(work, tmp_path):
    empty_traces = dict(work["traces"], output_dir=str(tmp_path / "traces"), grader="testbed", require_eos=True, questions="testbed:e:2")
    generate_traces(empty_traces)
    add_importance(dict(model=str(work["model"]), traces_dir=str(tmp_path / "traces/dataset"), output_dir=str(tmp_path / "imp"),
                        dtype="float32"))
    dm = PredictorDataModule(str(tmp_path / "imp/dataset"), str(work["model"]))
    with pytest.raises(ValueError, match="empty"):
        dm.setup("fit")
    with pytest.raises(ValueError, match="not a datasets directory"):
        PredictorDataModule(str(tmp_path / "nowhere"), str(work["model"])).setup("fit")
    module = PredictorModule(hidden_size=64)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        trainer.fit(module, datamodule=PredictorDataModule(str(work["imp"]), str(work["model"])))


# ---------------------------------------------------------------- training, export, resume


def test_fit_exports_a_predictor_that_generate_loads(work, tmp_path):
    run = tmp_path / "run"
    config = write_yaml(tmp_path / "train.yaml", train_config(work, run, loss="weighted_mse", pairwise_weight=0.1))
    PredictorCLI(args=["fit", "--config", str(config)])
    metrics = json.loads((run / "done.json").read_text())
    assert {"val/kendall", "val/overlap", "val/mse"} <= set(metrics)
    assert -1 <= metrics["val/kendall"] <= 1 and 0 <= metrics["val/overlap"] <= 1
    exported = run / "export"
    predictor = dynts.ImportancePredictor.from_pretrained(exported)
    assert predictor.config.hidden_size == 32 and predictor.config.label_transform == "log1p-zscore"
    assert predictor.config.label == "answer" and predictor_label(exported) == "answer"  # the label it learned
    assert predictor.config.extra["metrics"]["val/kendall"] == metrics["val/kendall"]
    assert (run / "ckpt" / "last.ckpt").is_file()
    model, tok = dynts.load(str(work["model"]))
    # bound to its backbone (the importance stage recorded the fingerprint), with a model card
    assert predictor.config.base_model == BaseModelFingerprint.from_model(model, str(work["model"]))
    card = (exported / "README.md").read_text()
    assert f"{metrics['val/kendall']:.3f}" in card and f"{metrics['val/overlap']:.3f}" in card
    assert f"dynts train-predictor fit --config {config}" in card and "testbed:ptrain:16" in card
    assert "log1p-zscore" in card and predictor.config.base_model.final_norm_sha256 in card
    ids = torch.tensor([[2, 9, 21, 10, 14, 11, 19, 12, 20, 13, 17, 7, 28, 4]])
    result = dynts.generate(model, input_ids=ids, method="dynts", predictor=str(exported), budget=24, local_window=4,
                            max_new_tokens=30, pad_token_id=0)
    assert result.stats["evictions"] > 0 and result.stats["peak_cache_tokens"] <= 24

    # resume: a second fit with more epochs continues from last.ckpt instead of restarting
    state = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    steps = state["global_step"]
    (run / "done.json").unlink()
    PredictorCLI(args=["fit", "--config", str(config), "--trainer.max_epochs=3"])
    state = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] == steps + steps // 2  # one more epoch, not three from scratch


def test_corrupted_checkpoint_and_predictor_files(work, tmp_path):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "last.ckpt").write_bytes(b"PK\x03\x04 truncated by a kill")
    config = write_yaml(tmp_path / "train.yaml", train_config(work, run))
    with pytest.raises(ValueError, match="corrupted"):
        PredictorCLI(args=["fit", "--config", str(config)])
    with pytest.raises(ValueError, match="corrupted"):
        check_checkpoint(run / "ckpt" / "last.ckpt")
    good = tmp_path / "good"
    dynts.ImportancePredictor(32).save_pretrained(good)
    data = (good / "predictor.safetensors").read_bytes()
    (good / "predictor.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted"):
        export_predictor(good, tmp_path / "export")
    with pytest.raises(ValueError, match="corrupted"):
        dynts.generate(dynts.load(str(work["model"]))[0], input_ids=torch.tensor([[2, 9, 4]]), method="dynts",
                       predictor=str(good), budget=16, local_window=4, max_new_tokens=2)


def test_ddp_two_cpu_processes(work, tmp_path):
    run = tmp_path / "run"
    cfg = train_config(work, run)
    cfg["trainer"].update(max_epochs=1, max_steps=2)
    config = write_yaml(tmp_path / "train.yaml", cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "dynts.cli", "train-predictor", "fit", "--config", str(config),
         "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out.stderr
    state = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] >= 1
    assert (run / "export" / "predictor.safetensors").is_file()


def test_pipeline_runs_every_stage_then_skips_them(work, tmp_path):
    from trainers.pipeline import run_pipeline

    shutil.copytree(work["root"] / "traces", tmp_path / "traces")  # the traces stage is already done
    run = tmp_path / "run"
    cfg = train_config(work, run)
    cfg["data"]["dataset"] = str(tmp_path / "imp/dataset")
    cfg["trainer"]["max_epochs"] = 1
    train_yaml = write_yaml(tmp_path / "train.yaml", cfg)
    pipeline = {
        "traces": dict(work["traces"], output_dir=str(tmp_path / "traces")),
        "importance": {"output_dir": str(tmp_path / "imp"), "save_hidden": False, "dtype": "float32"},
        "train": {"config": str(train_yaml), "args": ["--data.hidden_states=recompute"]},
        "export_dir": str(tmp_path / "exported"),
    }
    summary = run_pipeline(pipeline)
    assert summary["traces"]["records"] > 0 and summary["importance"]["records"] == summary["traces"]["records"]
    assert "val/kendall" in summary["train"] and (tmp_path / "exported" / "predictor.safetensors").is_file()
    again = run_pipeline(pipeline)
    assert again["train"]["skipped"] and again["export"]["skipped"]
    with pytest.raises(ValueError, match="train.config"):
        run_pipeline({"traces": pipeline["traces"]})


# ---------------------------------------------------------------- 7B-32B defaults


def test_backbones_default_to_bf16_without_stored_hidden_states_unless_bundled_toys(work, tmp_path):
    from data_pipeline.importance_data import ImportanceConfig
    from data_pipeline.traces import TraceConfig

    assert TraceConfig(model="models/DeepSeek-R1-Distill-Qwen-7B").dtype == "bfloat16"
    assert TraceConfig(model="testbed").dtype == "float32" and TraceConfig(model="x", dtype="float16").dtype == "float16"
    seven_b = ImportanceConfig(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
    assert (seven_b.dtype, seven_b.save_hidden) == ("bfloat16", False)
    toy = ImportanceConfig(model="smollm2-135m")
    assert (toy.dtype, toy.save_hidden) == ("float32", True)
    assert PredictorDataModule(backbone="models/R1-7B").dtype == "bfloat16"
    assert PredictorDataModule(backbone="testbed").dtype == "float32"
    # the importance stage on a (tiny) non-bundled backbone: bf16, no hidden column, fingerprint recorded
    stats = add_importance(dict(model=str(work["model"]), traces_dir=str(work["imp"].parents[1] / "traces/dataset"),
                                output_dir=str(tmp_path / "imp")))
    assert stats["config"]["dtype"] == "bfloat16" and stats["config"]["save_hidden"] is False
    assert "hidden" not in dynts_dataset(tmp_path / "imp/dataset").column_names
    model, _ = dynts.load(str(work["model"]), dtype="bfloat16")
    assert stats["base_model"]["final_norm_sha256"] == BaseModelFingerprint.from_model(model).final_norm_sha256


def dynts_dataset(path: Path):
    from datasets import load_from_disk

    return load_from_disk(str(path))


def test_device_map_with_ddp_is_a_clear_error(work):
    from data_pipeline.loading import check_device_map
    from data_pipeline.traces import TraceConfig

    with pytest.raises(ValueError, match="device_map='auto' with 2 processes"):
        TraceConfig(model="models/R1-32B", device_map="auto", devices=2)
    TraceConfig(model="models/R1-32B", device_map="auto", devices=1)  # one process, sharded: fine
    data = PredictorDataModule(str(work["imp_nohidden"]), str(work["model"]), hidden_states="recompute", device_map="auto")
    data.trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="train-predictor: device_map='auto' with 2 processes"):
        data.setup("fit")
    with pytest.raises(ValueError, match="devices: 1"):
        data.prepare_data()
    check_device_map(None, 8, "x")
    check_device_map({"": 0}, 1, "x")


def test_hidden_cache_holds_thinking_spans_built_in_token_batches(work, tmp_path, monkeypatch):
    import trainers.predictor_data as predictor_data

    calls = []
    real = predictor_data.final_hidden_states

    def counting(model, ids, mask):
        calls.append(tuple(ids.shape))
        return real(model, ids, mask)

    monkeypatch.setattr(predictor_data, "final_hidden_states", counting)
    built = PredictorDataModule(str(work["imp_nohidden"]), str(work["model"]), cache_dir=str(tmp_path / "cache"),
                                dtype="float32", max_batch_tokens=256, micro_batch_size=3)
    built.prepare_data()
    data = dynts_dataset(work["imp_nohidden"])
    assert len(calls) < len(data) and all(b * s <= 256 or b == 1 for b, s in calls)  # several traces per forward
    assert max(s for _, s in calls) <= max(data["answer_start"])  # the answer is never fed
    cache = dynts_dataset(tmp_path / "cache/dataset")
    spans = [a - q for a, q in zip(data["answer_start"], data["question_len"])]
    assert [len(h) for h in cache["hidden"]] == spans  # the thinking span only
    stored = dynts_dataset(work["imp"]).with_format("numpy", columns=["hidden"])
    for i in (0, len(data) - 1):
        q, a = data[i]["question_len"], data[i]["answer_start"]
        torch.testing.assert_close(torch.as_tensor(cache[i]["hidden"]), torch.as_tensor(stored[i]["hidden"][q:a]),
                                   atol=2e-3, rtol=2e-3)
    built.setup("fit")
    batch = next(iter(built.train_dataloader()))
    assert batch["hidden"].shape[1] == batch["mask"].shape[1] and batch["hidden"][~batch["mask"]].abs().sum() == 0
    stats = tmp_path / "cache/dataset/stats.json"
    stats.write_text(json.dumps({k: v for k, v in json.loads(stats.read_text()).items() if k != "span"}))
    with pytest.raises(ValueError, match="older format"):
        built.setup("fit")


def test_recompute_leaves_a_sharded_backbone_where_it_is(work):
    from trainers.predictor import place_backbone

    model, _ = dynts.load(str(work["model"]))
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}  # as accelerate dispatches
    model.to = lambda *a, **k: pytest.fail("a dispatched backbone was moved")
    assert place_backbone(model, torch.device("meta")) is model
    plain, _ = dynts.load(str(work["model"]))
    assert next(place_backbone(plain, torch.device("meta")).parameters()).device.type == "meta"


# ---------------------------------------------------------------- labels beyond the answer


def test_importance_stage_takes_a_label_and_an_output_dir_holds_one(work, tmp_path):
    from data_pipeline.importance_data import ImportanceConfig, main as importance_main

    traces_dir = str(work["imp"].parents[1] / "traces/dataset")
    answer = dynts_dataset(work["imp"])
    config = write_yaml(tmp_path / "imp.yaml", {"importance": dict(
        model=str(work["model"]), traces_dir=traces_dir, output_dir=str(tmp_path / "future"), dtype="float32",
        label_settings={"window": 2})})
    assert importance_main(["--config", str(config), "--label", "future"]) == 0
    future = dynts_dataset(tmp_path / "future/dataset")
    assert json.loads((tmp_path / "future/label.json").read_text()) == {"label": "future", "label_settings": {"window": 2}}
    assert json.loads((tmp_path / "future/dataset/stats.json").read_text())["config"]["label"] == "future"
    row_a, row_f = answer[0], future[0]
    assert row_a["input_ids"] == row_f["input_ids"] and len(row_f["importance"]) == len(row_f["input_ids"])
    assert row_f["importance"] != row_a["importance"] and max(row_f["importance"][row_f["answer_start"]:]) == 0.0
    with pytest.raises(ValueError, match="its own output_dir"):  # the same directory, another label
        add_importance(dict(model=str(work["model"]), traces_dir=traces_dir, output_dir=str(tmp_path / "future"),
                            dtype="float32", label="golden"))
    with pytest.raises(ValueError, match="label="):
        ImportanceConfig(label="attention")
    with pytest.raises(ValueError, match="windw"):
        ImportanceConfig(label="future", label_settings={"windw": 2})
    with pytest.raises(SystemExit):  # argparse refuses a label it does not know
        importance_main(["--config", str(config), "--label", "attention"])


def test_pipeline_label_option_replaces_the_configs_label(work, tmp_path, capsys):
    from trainers.pipeline import main as pipeline_main

    shutil.copytree(work["root"] / "traces", tmp_path / "traces")
    pipeline = write_yaml(tmp_path / "pipeline.yaml", {
        "traces": dict(work["traces"], output_dir=str(tmp_path / "traces")),
        "importance": {"output_dir": str(tmp_path / "imp-golden"), "save_hidden": False, "dtype": "float32",
                       "label_settings": {"budget": 24, "local_window": 2}},
        "train": {"config": str(write_yaml(tmp_path / "train.yaml", train_config(work, tmp_path / "run")))},
    })
    assert pipeline_main(["--config", str(pipeline), "--stages", "traces,importance", "--label", "golden"]) == 0
    assert json.loads((tmp_path / "imp-golden/label.json").read_text())["label"] == "golden"
    scores = dynts_dataset(tmp_path / "imp-golden/dataset")[0]["importance"]
    assert max(scores) <= 1.0 + 1.001e-3 and min(scores) >= 0.0  # survival shares (+ the tie-break), the question at 1


def test_predictor_label_reads_the_config_or_an_older_predictors_card(tmp_path):
    """dynts.predictor.predictor_label: the config's label; a predictor saved before the config held one is read
    from its card's ``Labels:`` line, whichever label the card names; neither: ``""``."""
    from trainers.predictor_card import LABEL_SENTENCES

    predictor = dynts.ImportancePredictor(8)
    predictor.save_pretrained(tmp_path / "unlabelled")
    assert predictor_label(tmp_path / "unlabelled") == ""
    for label, sentence in LABEL_SENTENCES.items():
        (tmp_path / "unlabelled" / "README.md").write_text(f"# card\n\n{sentence}\nmore text\n")
        assert predictor_label(tmp_path / "unlabelled") == label
    dynts.ImportancePredictor(8, label="future").save_pretrained(tmp_path / "labelled")
    assert predictor_label(tmp_path / "labelled") == "future"
