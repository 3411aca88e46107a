"""Add importance labels (and optionally fp16 final hidden states) to a trace dataset.

Input: the trace dataset of :mod:`data_pipeline.traces`. Output: the same rows and columns plus
``importance`` (``list[float]``, one per ``input_ids`` entry, 0.0 on answer positions) and, with
``save_hidden``, ``hidden`` (``[len(input_ids), d]`` float16, the post-norm final hidden states the
predictor reads). ``label`` chooses what ``importance`` holds (:data:`dynts.importance.LABELS`; default
``answer``, the DynTS paper's answer-to-thinking attention; each label's equation and cost at 7B x 16k
tokens are in its module of :mod:`dynts.importance`). One forward per batch of traces
(:func:`dynts.importance.sequence_importance`; ``counterfactual`` runs one per scored token: small models
only); shards are atomic and the job resumes (:mod:`data_pipeline.shards`). An output directory holds one
label: ``label.json`` records it, and another label there is refused.

Run: ``python -m data_pipeline.importance_data --config configs/predictor/testbed.yaml [--label future]``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Array2D, Dataset, Features, Sequence as ListOf, Value, load_from_disk

from data_pipeline.loading import default_dtype, is_bundled_toy
from data_pipeline.shards import ShardStore, settings_from_dict, stage_main
from data_pipeline.traces import KEY, TRACE_FEATURES
from dynts.importance import LABELS, label_settings, sequence_importance
from dynts.predictor import BaseModelFingerprint

__all__ = ["ImportanceConfig", "add_importance", "importance_features", "load_trace_dataset"]


@dataclass
class ImportanceConfig:
    """Importance extraction settings (the ``importance:`` section of a pipeline YAML).

    Args:
        model: ``dynts.load`` name or local HF directory (the model that generated the traces).
        traces_dir: the trace dataset directory (``<traces output_dir>/dataset``).
        output_dir: where ``shards/`` and the merged ``dataset/`` go.
        save_hidden: also store fp16 final hidden states (the predictor's training inputs); default
            ``True`` for a bundled toy only (a 7B trace set would need ~250 GB; the trainer
            recomputes them or builds a thinking-span cache instead).
        max_batch_tokens: padded tokens per forward (long traces go one at a time).
        shard_size: traces per shard.
        dtype: model dtype; default ``float32`` for a bundled toy, ``bfloat16`` otherwise.
        device: ``cpu`` / ``cuda`` / ``auto`` (without ``device_map``).
        device_map: shard the model over GPUs (``dynts.load``, e.g. ``auto`` for 32B).
        threads: ``torch.set_num_threads`` for this job.
        label: what ``importance`` holds, one of :data:`dynts.importance.LABELS` (default ``answer``).
        label_settings: the label's settings (e.g. ``{window: 16, reduce: max}`` for ``future``;
            :func:`dynts.importance.label_settings`); empty for ``answer``.
    """

    model: str = "testbed"
    traces_dir: str = "runs/pipeline-testbed/traces/dataset"
    output_dir: str = "runs/pipeline-testbed/importance"
    save_hidden: bool | None = None
    max_batch_tokens: int = 16384
    shard_size: int = 256
    dtype: str | None = None
    device: str = "auto"
    device_map: str | dict | None = None
    threads: int | None = None
    label: str = "answer"
    label_settings: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.label not in LABELS:
            raise ValueError(f"label={self.label!r} must be one of {LABELS}")
        label_settings(self.label, self.label_settings)  # refuses unknown or bad settings now, not after the traces load
        self.dtype = default_dtype(self.model, self.dtype)
        if self.save_hidden is None:
            self.save_hidden = is_bundled_toy(self.model)
        if self.max_batch_tokens < 1 or self.shard_size < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} and shard_size={self.shard_size} must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ImportanceConfig":
        return settings_from_dict(cls, values, "importance")


def importance_features(hidden_size: int | None = None) -> Features:
    """Trace features + ``importance`` (+ ``hidden [T, hidden_size]`` float16)."""
    feats = dict(TRACE_FEATURES)
    feats["importance"] = ListOf(Value("float32"))
    if hidden_size is not None:
        feats["hidden"] = Array2D(shape=(None, hidden_size), dtype="float16")
    return Features(feats)


def load_trace_dataset(path: str | Path, required: tuple[str, ...] = tuple(TRACE_FEATURES)) -> Dataset:
    """Load a trace/importance dataset directory and check its columns."""
    path = Path(path)
    if not (path / "dataset_info.json").is_file():
        raise ValueError(f"{path} is not a datasets directory (save_to_disk); run the traces stage first")
    data = load_from_disk(str(path))
    missing = [c for c in required if c not in data.column_names]
    if missing:
        raise ValueError(f"dataset {path} lacks columns {missing}; it must come from data_pipeline.traces / importance_data")
    return data


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_label(cfg: ImportanceConfig) -> None:
    """Write ``<output_dir>/label.json`` (label and settings) on first use; refuse an output directory
    that holds another label's shards."""
    want = {"label": cfg.label, "label_settings": cfg.label_settings or {}}
    marker = Path(cfg.output_dir) / "label.json"
    if marker.is_file():
        have = json.loads(marker.read_text())
        if have != want:
            raise ValueError(f"{cfg.output_dir} holds importance labelled {have}, not {want}; "
                             "give this label its own output_dir")
        return
    if (Path(cfg.output_dir) / "shards").is_dir() and any((Path(cfg.output_dir) / "shards").iterdir()) and cfg.label != "answer":
        raise ValueError(f"{cfg.output_dir} holds shards from before labels were recorded (answer labels); "
                         f"give label={cfg.label!r} its own output_dir")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(want, indent=1) + "\n")


def add_importance(config: ImportanceConfig | dict[str, Any], model=None) -> dict[str, Any]:
    """Score every trace; skip what is done. Returns the merged dataset's ``stats.json``."""
    cfg = config if isinstance(config, ImportanceConfig) else ImportanceConfig.from_dict(config)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    check_label(cfg)
    if ShardStore(cfg.output_dir, importance_features(), KEY).is_complete():
        # a finished stage never loads the model (DDP children re-run the whole pipeline)
        return ShardStore(cfg.output_dir, importance_features(), KEY).stats()
    traces = load_trace_dataset(cfg.traces_dir)
    if model is None:
        from data_pipeline.loading import load_model

        device = None if cfg.device_map is not None else _device(cfg.device)
        model, _ = load_model(cfg.model, cfg.dtype, device, device_map=cfg.device_map)
    hidden_size = model.config.get_text_config().hidden_size
    store = ShardStore(cfg.output_dir, importance_features(hidden_size if cfg.save_hidden else None), KEY)
    store.clean_partial()
    done = store.done()
    todo = [i for i, key in enumerate(zip(traces["question_id"], traces["sample_id"])) if tuple(key) not in done]
    pad = model.config.get_text_config().pad_token_id or 0
    for start in range(0, len(todo), cfg.shard_size):
        rows = traces.select(todo[start : start + cfg.shard_size])
        scored = sequence_importance(
            model, rows["input_ids"], rows["answer_start"], label=cfg.label, prompt_lengths=rows["question_len"],
            settings=cfg.label_settings, max_batch_tokens=cfg.max_batch_tokens,
            return_hidden_states=cfg.save_hidden, pad_token_id=pad,
        )
        records = []
        for row, imp in zip(rows, scored):
            record = dict(row, importance=imp.scores.float().cpu().tolist())
            if cfg.save_hidden:
                record["hidden"] = imp.hidden_states.to(torch.float16).cpu().numpy()
            records.append(record)
        store.write(records, [((r["question_id"], r["sample_id"]), "kept") for r in records])
    order = {key: i for i, key in enumerate(zip(traces["question_id"], traces["sample_id"]))}
    settings = {k: v for k, v in asdict(cfg).items() if k != "threads"}
    store.merge(sort_key=lambda k: order.get((k["question_id"], k["sample_id"]), len(order)),
                extra_stats={"config": settings, "hidden_size": hidden_size,
                             "base_model": asdict(BaseModelFingerprint.from_model(model, cfg.model))})
    return store.stats()


def main(argv: list[str] | None = None) -> int:
    label = {"choices": LABELS, "help": "what the importance column holds (default: the config's label, else answer)"}
    return stage_main(argv, "Add importance labels to a trace dataset (resumable).", "importance", add_importance,
                      overrides={"label": label})


if __name__ == "__main__":
    raise SystemExit(main())

