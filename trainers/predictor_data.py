"""Training data of the importance predictor: thinking tokens' final hidden states and importance.

Input: the importance dataset of :mod:`data_pipeline.importance_data`. Traces are split into train
and validation by *question* (no question in both). The backbone is frozen; its final hidden
states come either

- from disk (``hidden_states: cache``): the dataset's ``hidden`` column when it has one, otherwise
  a cache computed once by the frozen backbone into ``cache_dir`` (atomic shards, resumable): only
  the thinking span of each trace (``[answer_start - question_len, d]`` float16), from left-padded
  batches of at most ``max_batch_tokens`` padded tokens, or
- from the backbone on the fly (``hidden_states: recompute``): memory- and disk-light; the
  LightningModule runs the frozen backbone in each step.

Batches (micro-batches of ``micro_batch_size`` traces), over the thinking tokens only:

- ``labels [b, L]`` normalised importance (:func:`trainers.predictor_metrics.normalize_labels`),
  ``target [b, L]`` raw importance, ``mask [b, L]`` True on real thinking tokens;
- cache: ``hidden [b, L, d]`` float32 (``L`` = longest thinking span in the batch, right-padded);
- recompute: ``input_ids``/``attention_mask [b, S]`` (full sequences, left-padded) and
  ``positions [b, L]`` (column of each thinking token in that layout).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets import Array2D, Dataset, Features, Value, load_from_disk
from torch.utils.data import DataLoader

from dynts.importance import final_hidden_states
from dynts.predictor import BaseModelFingerprint
from dynts.prompts import pad_rows
from data_pipeline.importance_data import load_trace_dataset
from data_pipeline.loading import check_device_map, default_dtype
from data_pipeline.shards import ShardStore
from trainers.predictor_card import traces_settings
from trainers.predictor_metrics import LABEL_TRANSFORMS, normalize_labels

__all__ = ["PredictorDataModule", "final_hidden_states"]  # final_hidden_states re-exported from dynts.importance

IMPORTANCE_COLUMNS = ("question_id", "sample_id", "input_ids", "question_len", "answer_start", "importance")
HIDDEN_MODES = ("cache", "recompute")
CACHE_SPAN = "thinking"  # what the built hidden-state cache holds per trace (stats.json "span")


class _Traces(torch.utils.data.Dataset):
    """Lazy view of the rows ``indices`` of ``data`` (Arrow, memory-mapped)."""

    def __init__(
        self, data: Dataset, indices: list[int], hidden: Dataset | None, max_length: int | None, span_only: bool = False
    ) -> None:
        self.data, self.indices, self.hidden, self.max_length = data, indices, hidden, max_length
        self.span_only = span_only  # hidden rows hold the thinking span only (the built cache), not the whole trace

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        idx = self.indices[i]
        row = self.data[idx]
        start, end = int(row["question_len"]), int(row["answer_start"])
        if self.max_length is not None:
            end = min(end, self.max_length)
        item = {
            "input_ids": row["input_ids"][: max(end, start + 1)],
            "start": start,
            "end": end,
            "target": torch.tensor(row["importance"][start:end], dtype=torch.float32),
        }
        if self.hidden is not None:
            rows = slice(0, max(end - start, 0)) if self.span_only else slice(start, end)
            item["hidden"] = torch.as_tensor(self.hidden[idx]["hidden"][rows], dtype=torch.float32)
        return item


class PredictorDataModule(L.LightningDataModule):
    """Importance dataset -> micro-batches of thinking-token hidden states and labels.

    Args:
        dataset: the importance dataset directory (``<importance output_dir>/dataset``).
        backbone: ``dynts.load`` name/path of the frozen backbone (to build the cache or recompute).
        hidden_states: ``cache`` (from disk) or ``recompute`` (frozen backbone in every step).
        cache_dir: where the hidden-state cache is built when the dataset has no ``hidden`` column
            (default: ``<dataset>/../hidden_cache``).
        label_transform: see :mod:`trainers.predictor_metrics`.
        val_fraction: fraction of questions held out for validation (at least one question).
        micro_batch_size: traces per micro-batch (the paper: 4).
        max_length: truncate traces to this many tokens (the paper: 18000).
        num_workers: DataLoader workers.
        seed: split and shuffling seed.
        dtype: backbone dtype when it is loaded (``float32``/``bfloat16``/``float16``/``auto``);
            default ``float32`` for a bundled toy, ``bfloat16`` otherwise.
        device / device_map / attn_implementation: backbone placement and attention kernel
            (:func:`dynts.load`), e.g. ``device_map: auto`` for a sharded 7B-32B backbone (one
            process: with DDP each rank holds its own copy on its own GPU, and a ``device_map``
            is refused).
        max_batch_tokens: padded tokens per backbone forward while building the cache.
    """

    def __init__(
        self,
        dataset: str = "runs/pipeline-testbed/importance/dataset",
        backbone: str = "testbed",
        hidden_states: str = "cache",
        cache_dir: str | None = None,
        label_transform: str = "log1p-zscore",
        val_fraction: float = 0.1,
        micro_batch_size: int = 4,
        max_length: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        dtype: str | None = None,
        max_batch_tokens: int = 16384,
        device: str | None = None,
        device_map: str | None = None,
        attn_implementation: str | None = None,
    ) -> None:
        super().__init__()
        if hidden_states not in HIDDEN_MODES:
            raise ValueError(f"hidden_states={hidden_states!r} must be one of {HIDDEN_MODES}")
        if label_transform not in LABEL_TRANSFORMS:
            raise ValueError(f"label_transform={label_transform!r} must be one of {LABEL_TRANSFORMS}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1): held-out questions select the best checkpoint")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.dataset, self.backbone_name, self.hidden_mode = dataset, backbone, hidden_states
        self.cache_dir = Path(cache_dir) if cache_dir else Path(dataset).parent / "hidden_cache"
        self.label_transform, self.val_fraction = label_transform, val_fraction
        self.micro_batch_size, self.max_length, self.num_workers = micro_batch_size, max_length, num_workers
        self.seed, self.dtype, self.max_batch_tokens = seed, default_dtype(backbone, dtype), max_batch_tokens
        self.load_options = {"device": device, "device_map": device_map, "attn_implementation": attn_implementation}
        self.backbone: torch.nn.Module | None = None
        self.hidden_size: int | None = None
        self.pad_token_id = 0

    # ------------------------------------------------------------------ data preparation
    def _data(self) -> Dataset:
        data = load_trace_dataset(self.dataset, IMPORTANCE_COLUMNS)
        if len(data) == 0:
            raise ValueError(
                f"dataset {self.dataset} is empty: no trace was kept (see traces/dataset/stats.json); "
                "generate more samples, relax the filters, or check the grader"
            )
        return data

    def load_backbone(self, device: str | torch.device | None = None) -> torch.nn.Module:
        """The frozen backbone, loaded once per process through :func:`dynts.load`, straight onto
        ``device`` (a DDP rank's own ``cuda:{local_rank}``, never every rank onto one GPU) unless the
        config names a ``device`` or ``device_map`` of its own."""
        if self.backbone is None:
            import dynts

            options = dict(self.load_options)
            if device is not None and options["device"] is None and options["device_map"] is None:
                options["device"] = device
            self.backbone, _ = dynts.load(self.backbone_name, dtype=self.dtype, **options)
            self.backbone.requires_grad_(False)
            self.pad_token_id = self.backbone.config.get_text_config().pad_token_id or 0
        return self.backbone

    def base_model(self) -> BaseModelFingerprint:
        """The backbone's fingerprint: the one the importance stage recorded in the dataset's
        ``stats.json``, else computed from the backbone (loaded once; in cache mode freed after)."""
        stats = Path(self.dataset) / "stats.json"
        saved = json.loads(stats.read_text()).get("base_model") if stats.is_file() else None
        if saved:
            fingerprint = BaseModelFingerprint(**saved)
        else:
            loaded = self.backbone is not None
            fingerprint = BaseModelFingerprint.from_model(self.load_backbone())
            if not loaded and self.hidden_mode == "cache":
                self.backbone = None
        fingerprint.name_or_path = self.backbone_name
        return fingerprint

    def traces_settings(self) -> dict[str, Any]:
        """Trace settings and counts behind the dataset, for the model card."""
        return traces_settings(self.dataset)

    @property
    def importance_label(self) -> str:
        """The importance label the dataset holds (its ``stats.json``; ``""`` when it does not say)."""
        return self.traces_settings().get("importance label", "")

    def split_sizes(self) -> dict[str, int]:
        """Traces and questions on each side of the split (after :meth:`setup`), for the model card."""
        if not hasattr(self, "train_set"):
            return {}
        return {"train_traces": len(self.train_set), "heldout_traces": len(self.val_set),
                "heldout_questions": len(self.val_questions)}

    def _check_processes(self) -> None:
        trainer = getattr(self, "trainer", None)
        check_device_map(self.load_options["device_map"], trainer.world_size if trainer is not None else 1, "train-predictor")

    def prepare_data(self) -> None:
        """Build the hidden-state cache once (rank 0) when the dataset has no ``hidden`` column: the
        thinking span of every trace, from batches of at most ``max_batch_tokens`` padded tokens."""
        self._check_processes()
        data = self._data()
        if self.hidden_mode != "cache" or "hidden" in data.column_names:
            return
        keys = {"question_id": Value("string"), "sample_id": Value("int64")}
        if ShardStore(self.cache_dir, Features(keys), tuple(keys)).is_complete():
            return  # built before: never load the backbone for nothing
        model = self.load_backbone("cuda" if torch.cuda.is_available() else "cpu")
        d = model.config.get_text_config().hidden_size
        store = ShardStore(self.cache_dir, Features({**keys, "hidden": Array2D((None, d), "float16")}), tuple(keys))
        store.clean_partial()
        done = store.done()
        todo = [i for i, k in enumerate(zip(data["question_id"], data["sample_id"])) if tuple(k) not in done]
        for s in range(0, len(todo), 256):
            rows = data.select(todo[s : s + 256])
            records = [{"question_id": r["question_id"], "sample_id": r["sample_id"], "hidden": h}
                       for r, h in zip(rows, self._thinking_states(model, rows))]
            store.write(records, [((r["question_id"], r["sample_id"]), "kept") for r in records])
        order = {k: i for i, k in enumerate(zip(data["question_id"], data["sample_id"]))}
        store.merge(sort_key=lambda k: order[(k["question_id"], k["sample_id"])], extra_stats={"span": CACHE_SPAN})
        self.backbone = None  # training reads the cache: free the backbone's memory

    def _thinking_states(self, model: torch.nn.Module, rows: Dataset) -> list:
        """float16 ``[answer_start - question_len, d]`` final hidden states of each row's thinking span
        (numpy), from left-padded batches of at most ``max_batch_tokens`` padded tokens. The answer
        is never fed: causal attention makes the thinking states independent of it."""
        prefixes = [row["input_ids"][: max(int(row["answer_start"]), int(row["question_len"]) + 1)] for row in rows]
        spans = [(int(row["question_len"]), int(row["answer_start"])) for row in rows]
        out: list = [None] * len(prefixes)
        order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
        batch: list[int] = []

        def flush() -> None:
            ids, mask = pad_rows([prefixes[i] for i in batch], self.pad_token_id)
            hidden = final_hidden_states(model, ids, mask)
            width = ids.shape[1]
            for row, i in enumerate(batch):
                start, end = spans[i]
                offset = width - len(prefixes[i])
                out[i] = hidden[row, offset + start : offset + max(end, start)].to(torch.float16).cpu().numpy()
            batch.clear()

        for i in order:
            if batch and len(prefixes[i]) * (len(batch) + 1) > self.max_batch_tokens:
                flush()
            batch.append(i)
        if batch:
            flush()
        return out

    def setup(self, stage: str | None = None) -> None:
        self._check_processes()
        data = self._data()
        hidden, span_only = None, False
        if self.hidden_mode == "cache":
            if "hidden" in data.column_names:
                hidden = data
            else:
                stats = self.cache_dir / "dataset" / "stats.json"
                if not stats.is_file():
                    raise ValueError(f"hidden-state cache {self.cache_dir} is missing; prepare_data() builds it")
                if json.loads(stats.read_text()).get("span") != CACHE_SPAN:
                    raise ValueError(f"hidden-state cache {self.cache_dir} holds whole sequences (an older format); "
                                     "delete it and prepare_data() rebuilds it with the thinking spans only")
                hidden, span_only = load_from_disk(str(self.cache_dir / "dataset")), True
                keys = list(zip(data["question_id"], data["sample_id"]))
                if list(zip(hidden["question_id"], hidden["sample_id"])) != keys:
                    raise ValueError(f"hidden-state cache {self.cache_dir} does not match {self.dataset}; delete the cache")
            self.hidden_size = int(hidden.features["hidden"].shape[1])
            hidden = hidden.with_format("numpy", columns=["hidden"])
        else:
            trainer = getattr(self, "trainer", None)
            model = self.load_backbone(trainer.strategy.root_device if trainer is not None else None)
            self.hidden_size = model.config.get_text_config().hidden_size
        qids = sorted(set(data["question_id"]))
        random.Random(self.seed).shuffle(qids)
        n_val = min(math.ceil(self.val_fraction * len(qids)), len(qids) - 1)
        val_q = set(qids[:n_val])
        if not val_q:
            raise ValueError(f"dataset {self.dataset} has {len(qids)} question(s); need >= 2 to hold one out for validation")
        split = [q in val_q for q in data["question_id"]]
        columns = [c for c in IMPORTANCE_COLUMNS if c in data.column_names]
        data = data.with_format(None, columns=columns)
        self.train_set = _Traces(data, [i for i, v in enumerate(split) if not v], hidden, self.max_length, span_only)
        self.val_set = _Traces(data, [i for i, v in enumerate(split) if v], hidden, self.max_length, span_only)
        self.val_questions = sorted(val_q)

    # ------------------------------------------------------------------ batching
    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        n = max(it["end"] - it["start"] for it in items)
        n = max(n, 1)
        b = len(items)
        target = torch.zeros(b, n)
        labels = torch.zeros(b, n)
        mask = torch.zeros(b, n, dtype=torch.bool)
        for row, it in enumerate(items):
            k = it["end"] - it["start"]
            target[row, :k] = it["target"]
            labels[row, :k] = normalize_labels(it["target"], self.label_transform)
            mask[row, :k] = True
        batch = {"target": target, "labels": labels, "mask": mask}
        if "hidden" in items[0]:
            hidden = torch.zeros(b, n, items[0]["hidden"].shape[-1])
            for row, it in enumerate(items):
                hidden[row, : it["end"] - it["start"]] = it["hidden"]
            batch["hidden"] = hidden
        else:
            ids, attn = pad_rows([it["input_ids"] for it in items], self.pad_token_id)
            width = ids.shape[1]
            positions = torch.zeros(b, n, dtype=torch.long)
            for row, it in enumerate(items):
                offset = width - len(it["input_ids"])
                k = it["end"] - it["start"]
                positions[row, :k] = offset + torch.arange(it["start"], it["end"])
            batch.update(input_ids=ids, attention_mask=attn, positions=positions)
        return batch

    def _loader(self, dataset: _Traces, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset, batch_size=self.micro_batch_size, shuffle=shuffle, collate_fn=self.collate,
            num_workers=self.num_workers, generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
