"""Reasoning-trace generation (DynTS paper B.1 / C.2) as a Lightning predict loop.

``k`` samples per question with the paper's sampling (temperature 0.6, top-p 0.95, top-k 20);
complete traces (thinking delimiter + a non-empty answer, finished with EOS) whose answer is correct
are kept. Records go to atomic shards (:mod:`data_pipeline.shards`), so a job killed at any moment
and restarted finishes without losing or duplicating a ``(question_id, sample_id)``; every decided
item is recorded with its status (``kept``, ``no_delimiter``, ``no_answer``, ``no_thinking``,
``truncated``, ``incorrect``) and counted in ``dataset/stats.json``.

Lightning places the model, draws progress bars and runs several devices (each rank writes its own
shards). The optional vLLM backend (``backend: vllm``, :mod:`data_pipeline.vllm_backend`; GPUs or
vLLM's CPU build) samples the same work items with the same record logic.

Run: ``python -m data_pipeline.traces --config configs/predictor/testbed.yaml`` (its ``traces:``
section) or the whole chain with ``dynts pipeline --config ...``. Schema: ``docs/pipeline.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import lightning as L
import torch
from datasets import Features, Sequence as ListOf, Value
from lightning.pytorch.callbacks import BasePredictionWriter

from dynts.prompts import pad_id
from data_pipeline.loading import check_device_map, default_dtype, load_model, load_tokenizer
from data_pipeline.grading import ANSWER_RULES, GRADE_ON, find_answer_start, make_grader
from data_pipeline.questions import Question, QuestionDataModule, load_questions
from data_pipeline.shards import ShardStore, settings_from_dict, stage_main

__all__ = ["TRACE_FEATURES", "TraceConfig", "TraceSampler", "generate_traces", "make_record"]

TRACE_FEATURES = Features(
    {
        "question_id": Value("string"),
        "sample_id": Value("int64"),
        "input_ids": ListOf(Value("int32")),
        "question_len": Value("int64"),
        "answer_start": Value("int64"),
        "text": Value("string"),
        "gold": Value("string"),
        "correct": Value("bool"),
    }
)
KEY = ("question_id", "sample_id")
# vllm.LLM arguments that TraceConfig fields set (data_pipeline.vllm_backend.llm_settings)
VLLM_OWN_FIELDS = ("model", "dtype", "seed", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization")


@dataclass
class TraceConfig:
    """Trace generation settings (the ``traces:`` section of a pipeline YAML).

    Args:
        model: ``dynts.load`` name or local HF directory.
        questions: question source (see :mod:`data_pipeline.questions`).
        output_dir: where ``shards/`` and the merged ``dataset/`` go.
        limit: use the first ``limit`` questions.
        samples_per_question: ``k`` (paper: 5).
        temperature / top_p / top_k: sampling (paper: 0.6 / 0.95 / 20).
        max_new_tokens: generation cap (paper: 16384).
        batch_size: prompts per generation batch.
        shard_size: work items per shard (smaller = less redone after a kill).
        answer_rule: how the answer start is found (:data:`data_pipeline.grading.ANSWER_RULES`).
        think_end: the thinking delimiter for ``answer_rule: delimiter``.
        grader: ``math`` / ``testbed`` / ``exact`` / ``any`` / ``module:function``.
        grade_on: ``answer`` (the grader reads the text after the answer start, default) or ``full``
            (the whole generated text); see :mod:`data_pipeline.grading`.
        require_correct: keep only correct traces (the paper); False keeps every complete trace.
        require_eos: reject traces cut by ``max_new_tokens`` (no EOS).
        system / suffix: instruction added to every question.
        seed: sampling seed (per batch: ``seed + batch index``).
        backend: ``hf`` (Lightning) or ``vllm``.
        tensor_parallel_size / max_model_len / gpu_memory_utilization: ``vllm.LLM`` settings
            (``backend: vllm`` only): GPUs per model, the longest sequence vLLM plans KV memory for
            (default: the longest prompt + ``max_new_tokens``, not the model's full context), and the
            fraction of GPU memory vLLM may take (on vLLM's CPU build: of the machine's memory, and the
            engine refuses to start when that much is not free; set the KV cache size instead with
            ``VLLM_CPU_KVCACHE_SPACE=<GiB>`` or ``vllm_args: {kv_cache_memory_bytes: ...}``).
        vllm_args: further ``vllm.LLM`` keyword arguments (``backend: vllm`` only), e.g.
            ``{enforce_eager: true, kv_cache_memory_bytes: 1073741824, block_size: 32}``; the settings
            above have their own fields and are rejected here.
        accelerator / devices / precision: passed to the Lightning ``Trainer``.
        dtype: model weights dtype (``float32``, ``bfloat16``, ``float16``); default ``float32`` for a
            bundled toy, ``bfloat16`` otherwise.
        device_map: shard the model over GPUs (``dynts.load``; ``hf`` backend, ``devices: 1``).
        progress: show a progress bar.
        threads: ``torch.set_num_threads`` for this job (CPU; tiny models decode fastest with 1).
    """

    model: str = "testbed"
    questions: str = "testbed:pipeline:64"
    output_dir: str = "runs/pipeline-testbed/traces"
    limit: int | None = None
    samples_per_question: int = 5
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 16384
    batch_size: int = 8
    shard_size: int = 64
    answer_rule: str = "delimiter"
    think_end: str = "</think>"
    grader: str = "math"
    grade_on: str = "answer"
    require_correct: bool = True
    require_eos: bool = True
    system: str | None = None
    suffix: str = ""
    seed: int = 0
    backend: str = "hf"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    vllm_args: dict[str, Any] | None = None
    accelerator: str = "auto"
    devices: int | str = 1
    dtype: str | None = None
    device_map: str | dict | None = None
    progress: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.answer_rule not in ANSWER_RULES:
            raise ValueError(f"answer_rule={self.answer_rule!r} must be one of {ANSWER_RULES}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend={self.backend!r} must be 'hf' or 'vllm'")
        for name in ("samples_per_question", "max_new_tokens", "batch_size", "shard_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not 0 < self.top_p <= 1 or self.temperature <= 0 or self.top_k < 0:
            raise ValueError(
                f"sampling temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k} must satisfy "
                "temperature > 0, 0 < top_p <= 1, top_k >= 0"
            )
        self.dtype = default_dtype(self.model, self.dtype)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.backend == "hf":
            check_device_map(self.device_map, self.devices, "traces")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an int >= 1 (GPUs per model)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= self.max_new_tokens):
            raise ValueError(
                f"max_model_len={self.max_model_len!r} must be an int > max_new_tokens={self.max_new_tokens} "
                "(prompt + generation), or null for the longest prompt + max_new_tokens"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must lie in (0, 1] (vLLM default 0.9)")
        if self.vllm_args is not None:
            if not isinstance(self.vllm_args, dict) or not all(isinstance(k, str) for k in self.vllm_args):
                raise ValueError(f"vllm_args={self.vllm_args!r} must be a mapping of vllm.LLM keyword arguments, or null")
            own = sorted(set(self.vllm_args) & set(VLLM_OWN_FIELDS))
            if own:
                raise ValueError(f"vllm_args sets {own}: use the trace config's own fields {own} instead")
        make_grader(self.grader)  # fail early on a bad name
        if self.grade_on not in GRADE_ON:
            raise ValueError(f"grade_on={self.grade_on!r} must be one of {GRADE_ON}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TraceConfig":
        return settings_from_dict(cls, values, "traces")


def make_record(
    question: Question,
    sample_id: int,
    prompt: Sequence[int],
    generated: Sequence[int],
    tokenizer,
    config: TraceConfig,
    grader,
) -> tuple[dict[str, Any] | None, str]:
    """``(record, "kept")`` or ``(None, reason)`` for one sample.

    ``generated`` is the raw continuation (may hold EOS and padding after it); it is cut after the
    first EOS.
    """
    eos = tokenizer.eos_token_id
    generated = list(generated)
    finished = eos is not None and eos in generated
    if finished:
        generated = generated[: generated.index(eos) + 1]
    start, reason = find_answer_start(generated, tokenizer, config.answer_rule, config.think_end)
    if start is None:
        return None, reason
    if config.require_eos and not finished:
        return None, "truncated"
    text = tokenizer.decode(generated, skip_special_tokens=True)
    answer_text = tokenizer.decode(generated[start:], skip_special_tokens=True)
    if config.answer_rule == "delimiter":
        answer_text = answer_text.split(config.think_end, 1)[-1]
    correct = bool(grader(question, text, text if config.grade_on == "full" else answer_text))
    if config.require_correct and not correct:
        return None, "incorrect"
    record = {
        "question_id": question.question_id,
        "sample_id": int(sample_id),
        "input_ids": [int(t) for t in prompt] + generated,
        "question_len": len(prompt),
        "answer_start": len(prompt) + start,
        "text": text,
        "gold": question.gold,
        "correct": correct,
    }
    return record, "kept"


class TraceSampler(L.LightningModule):
    """Samples one continuation per prompt row with Hugging Face ``generate``; ``predict_step``
    returns ``[(key, record or None, status)]`` per row."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: TraceConfig, data: QuestionDataModule) -> None:
        super().__init__()
        # a dispatched (device_map) model stays where accelerate put it: held outside the submodules,
        # Lightning never moves it
        self._held = [model] if getattr(model, "hf_device_map", None) else []
        if not self._held:
            self.model = model
        self.tokenizer, self.config, self.data = tokenizer, config, data
        self.grader = make_grader(config.grader)

    @property
    def backbone(self) -> torch.nn.Module:
        return self._held[0] if self._held else self.model

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> list[tuple[tuple, dict | None, str]]:
        cfg = self.config
        torch.manual_seed(cfg.seed + 1_000_003 * self.global_rank + batch_idx)
        pad = pad_id(self.tokenizer)
        out = self.backbone.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=pad,
        )
        new = out[:, batch["input_ids"].shape[1] :].tolist()
        results = []
        for row, generated in enumerate(new):
            qi, sid = int(batch["question_index"][row]), int(batch["sample_id"][row])
            question = self.data.questions[qi]
            record, status = make_record(question, sid, self.data.prompts[qi], generated, self.tokenizer, cfg, self.grader)
            results.append(((question.question_id, sid), record, status))
        return results


class ShardWriter(BasePredictionWriter):
    """Buffers decided items per rank and writes a shard every ``shard_size`` items and at the end."""

    def __init__(self, store: ShardStore, shard_size: int) -> None:
        super().__init__(write_interval="batch")
        self.store, self.shard_size = store, shard_size
        self.records: list[dict] = []
        self.decided: list[tuple[tuple, str]] = []

    def add(self, results: list[tuple[tuple, dict | None, str]], rank: int = 0) -> None:
        for key, record, status in results:
            self.decided.append((key, status))
            if record is not None:
                self.records.append(record)
        if len(self.decided) >= self.shard_size:
            self.flush(rank)

    def flush(self, rank: int = 0) -> None:
        if self.decided:
            self.store.write(self.records, self.decided, rank)
        self.records, self.decided = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        self.add(prediction, trainer.global_rank)

    def on_predict_end(self, trainer, pl_module) -> None:
        self.flush(trainer.global_rank)


def _question_order(questions: Sequence[Question]):
    order = {q.question_id: i for i, q in enumerate(questions)}
    return lambda key: (order.get(key["question_id"], len(order)), key["sample_id"])


def generate_traces(config: TraceConfig | dict[str, Any], model=None, tokenizer=None) -> dict[str, Any]:
    """Generate, filter and store traces; skip everything already done. Returns ``stats.json``.

    ``model``/``tokenizer`` override ``config.model`` (tests, notebooks).
    """
    cfg = config if isinstance(config, TraceConfig) else TraceConfig.from_dict(config)
    store = ShardStore(cfg.output_dir, TRACE_FEATURES, KEY)
    if store.is_complete():
        return store.stats()
    store.clean_partial()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    questions = load_questions(cfg.questions, cfg.limit, system=cfg.system, suffix=cfg.suffix)
    if model is None or tokenizer is None:
        if cfg.backend == "vllm":
            tokenizer = load_tokenizer(cfg.model)
        else:
            model, tokenizer = load_model(cfg.model, cfg.dtype, device_map=cfg.device_map)
    done = store.done()
    data = QuestionDataModule(questions, tokenizer, cfg.samples_per_question, cfg.batch_size, done=set(done))
    writer = ShardWriter(store, cfg.shard_size)
    if data.items and cfg.backend == "vllm":
        from data_pipeline.vllm_backend import run_vllm

        run_vllm(cfg, data, writer, tokenizer, make_record)
    elif data.items:
        module = TraceSampler(model.eval(), tokenizer, cfg, data)
        trainer = L.Trainer(
            accelerator=cfg.accelerator,
            devices=cfg.devices,
            callbacks=[writer],
            logger=False,
            enable_progress_bar=cfg.progress,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.predict(module, datamodule=data, return_predictions=False)
        if trainer.world_size > 1:
            trainer.strategy.barrier()
            if trainer.global_rank != 0:
                return {}
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("progress", "threads")}
    store.merge(sort_key=_question_order(questions), extra_stats={"questions": len(questions), "config": settings})
    return store.stats()


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "Generate reasoning traces (resumable).", "traces", generate_traces)


if __name__ == "__main__":
    raise SystemExit(main())
