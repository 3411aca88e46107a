"""The pipeline on GPUs: finished stages never load a model, each DDP rank loads
the backbone once onto its own device, and the vLLM backend gets its settings from the config
(checked with a fake ``vllm`` module that records the arguments)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import data_pipeline.loading as loading
from data_pipeline.importance_data import add_importance, importance_features
from data_pipeline.shards import ShardStore
from data_pipeline.traces import KEY, TRACE_FEATURES, TraceConfig, generate_traces
from pipeline_utils import tiny_testbed_lm, write_yaml
from trainers.pipeline import run_pipeline
from trainers.predictor import PredictorModule
from trainers.predictor_data import PredictorDataModule

pytestmark = pytest.mark.usefixtures("one_thread")


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a finished stage loaded a model: load_model{args}")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr("data_pipeline.traces.load_model", refuse)
    import dynts

    monkeypatch.setattr(dynts, "load", refuse)


RECORD = dict(question_id="q1", sample_id=0, input_ids=[5, 6, 7, 8], question_len=1, answer_start=3, text="t",
              gold="1", correct=True)


def _finished(root: Path, features, records=()) -> Path:
    store = ShardStore(root, features, KEY)
    store.write(list(records), [((r["question_id"], r["sample_id"]), "kept") for r in records])
    store.merge()
    return root / "dataset"


def test_finished_importance_stage_never_loads_the_model(tmp_path, monkeypatch):
    _finished(tmp_path / "imp", importance_features(32), [dict(RECORD, importance=[0.0, 1.0, 2.0, 0.0], hidden=[[0.0] * 32] * 4)])
    _no_model_load(monkeypatch)
    stats = add_importance(dict(model="never-loaded", traces_dir=str(tmp_path / "missing"), output_dir=str(tmp_path / "imp")))
    assert stats["records"] == 1


def test_a_rerun_pipeline_with_every_stage_done_loads_no_model(tmp_path, monkeypatch):
    """What every DDP child does: re-run ``dynts pipeline`` from the top."""
    _finished(tmp_path / "traces", TRACE_FEATURES, [RECORD])
    _finished(tmp_path / "imp", importance_features(), [dict(RECORD, importance=[0.0, 1.0, 2.0, 0.0])])
    run = tmp_path / "run"
    run.mkdir()
    (run / "done.json").write_text('{"val/kendall": 0.5}')
    train = write_yaml(tmp_path / "train.yaml", {"model": {"run_dir": str(run)}})
    config = {
        "traces": {"model": "never-loaded", "output_dir": str(tmp_path / "traces")},
        "importance": {"output_dir": str(tmp_path / "imp")},
        "train": {"config": str(train)},
    }
    _no_model_load(monkeypatch)
    summary = run_pipeline(config, ("traces", "importance", "train"))
    assert summary["train"]["skipped"] and summary["importance"]["records"] == 1


def test_a_built_hidden_cache_never_loads_the_backbone(tmp_path, monkeypatch):
    data = _finished(tmp_path / "imp", importance_features(), [dict(RECORD, importance=[0.0, 1.0, 2.0, 0.0])])
    from datasets import Array2D, Features, Value

    cache = tmp_path / "cache"
    _finished(cache, Features({"question_id": Value("string"), "sample_id": Value("int64"), "hidden": Array2D((None, 8), "float16")}),
              [{"question_id": "q1", "sample_id": 0, "hidden": [[0.0] * 8] * 2}])
    _no_model_load(monkeypatch)
    PredictorDataModule(str(data), "never-loaded", hidden_states="cache", cache_dir=str(cache)).prepare_data()


def test_each_rank_loads_the_backbone_once_onto_its_own_device(tmp_path, monkeypatch):
    data_dir = _finished(tmp_path / "imp", importance_features(), [
        dict(RECORD, question_id=q, importance=[0.0, 1.0, 2.0, 0.0]) for q in ("q1", "q2", "q3")
    ])
    model_dir = tiny_testbed_lm(tmp_path / "model")
    loads = []
    import dynts

    real = dynts.load

    def recording(name, **options):
        loads.append(torch.device(options.get("device") or "cpu"))
        return real(name, **{**options, "device": "cpu"})  # no cuda:3 here; the requested device is what counts

    monkeypatch.setattr(dynts, "load", recording)
    rank_device = torch.device("cuda", 3)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=rank_device), world_size=8)
    data = PredictorDataModule(str(data_dir), str(model_dir), hidden_states="recompute", val_fraction=0.34)
    data.trainer = trainer
    data.setup("validate")
    module = PredictorModule()
    module._trainer = SimpleNamespace(**vars(trainer), datamodule=data)
    module.setup("validate")
    assert loads == [rank_device]  # one load per process, onto the rank's device


# ---------------------------------------------------------------- vLLM backend with a fake vllm
class FakeVLLM(types.ModuleType):
    """Records ``LLM(...)``, ``SamplingParams(...)`` and engine shutdowns; rejects ``top_k=0`` as vLLM
    < 0.9 does."""

    def __init__(self, answer: list[int]):
        super().__init__("vllm")
        self.llm_kwargs, self.sampling, self.shutdowns = [], [], []
        fake = self

        class SamplingParams:
            def __init__(self, **kwargs):
                if kwargs.get("top_k") == 0:
                    raise ValueError("top_k must be -1 (disable), or at least 1, got 0.")
                fake.sampling.append(kwargs)
                self.kwargs = kwargs

        class LLM:
            def __init__(self, **kwargs):
                fake.llm_kwargs.append(kwargs)
                core = SimpleNamespace(shutdown=lambda: fake.shutdowns.append(len(fake.llm_kwargs)))
                self.llm_engine = SimpleNamespace(engine_core=core)

            def generate(self, prompts, params, use_tqdm=True):
                assert len(prompts) == len(params)
                return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(answer))]) for _ in prompts]

        self.LLM, self.SamplingParams = LLM, SamplingParams


@pytest.fixture
def fake_vllm(monkeypatch):
    from data_pipeline.testbed.tokenizer import build_tokenizer

    tok = build_tokenizer()
    answer = tok.encode("a 1 plus b 2 gives r1= 3 ; </think> r1= 3", add_special_tokens=False) + [tok.eos_token_id]
    fake = FakeVLLM(answer)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return fake


def test_vllm_backend_gets_its_settings_from_the_config(tmp_path, fake_vllm):
    model_dir = tiny_testbed_lm(tmp_path / "model")
    settings = dict(
        model=str(model_dir), questions="testbed:tiny:5", output_dir=str(tmp_path / "t"), samples_per_question=2,
        max_new_tokens=40, shard_size=4, grader="any", progress=False, backend="vllm", dtype="bfloat16",
        top_k=0, tensor_parallel_size=4, gpu_memory_utilization=0.55,
    )
    stats = generate_traces(settings)
    assert stats["decided"] == 10 and stats["records"] == 10
    (llm,) = fake_vllm.llm_kwargs
    from data_pipeline.questions import encode_prompt, load_questions
    from data_pipeline.testbed.tokenizer import build_tokenizer

    longest = max(len(encode_prompt(build_tokenizer(), q)) for q in load_questions("testbed:tiny:5"))
    assert llm["tensor_parallel_size"] == 4 and llm["gpu_memory_utilization"] == 0.55 and llm["dtype"] == "bfloat16"
    assert llm["max_model_len"] == longest + 40  # not the model's whole context
    assert [p["top_k"] for p in fake_vllm.sampling] == [-1] * 10  # HF's "off" mapped to vLLM's
    assert len({p["seed"] for p in fake_vllm.sampling}) == 10
    assert fake_vllm.shutdowns == [1]  # the engine is stopped before the next stage

    fake_vllm.llm_kwargs.clear()
    generate_traces(dict(settings, output_dir=str(tmp_path / "u"), top_k=20, max_model_len=4096,
                         vllm_args={"enforce_eager": True, "block_size": 32}))
    assert fake_vllm.llm_kwargs[0]["max_model_len"] == 4096
    assert fake_vllm.llm_kwargs[0]["enforce_eager"] is True and fake_vllm.llm_kwargs[0]["block_size"] == 32
    assert fake_vllm.sampling[-1]["top_k"] == 20


@pytest.mark.parametrize(
    "field, value",
    [("tensor_parallel_size", 0), ("tensor_parallel_size", 1.5), ("max_model_len", 10), ("gpu_memory_utilization", 0.0),
     ("gpu_memory_utilization", 1.5)],
)
def test_bad_vllm_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TraceConfig(**{field: value, "max_new_tokens": 40})


@pytest.mark.parametrize("value, match", [(["enforce_eager"], "vllm_args"), ({"seed": 3}, "seed"),
                                          ({"model": "x", "dtype": "half"}, "dtype")])
def test_bad_vllm_args_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        TraceConfig(vllm_args=value)


def test_vllm_backend_does_not_import_the_traces_module():
    import ast

    source = (Path(__file__).resolve().parents[1] / "data_pipeline" / "vllm_backend.py").read_text()
    imported = {
        node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    } | {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for alias in node.names}
    assert "data_pipeline.traces" not in imported
