"""Training the DynTS importance predictor on a frozen backbone (paper 4.1, 6.1, C.2) with Lightning.

:class:`PredictorModule` fits :class:`dynts.ImportancePredictor` (MLP ``d -> 2d -> d/2 -> 1``) to the
normalised answer-to-thinking importance of each thinking token from its final hidden state
(:class:`trainers.predictor_data.PredictorDataModule`). Defaults follow the paper: AdamW
(0.9, 0.95), weight decay 0.01, lr 5e-4 with cosine decay, gradient clipping 1.0 (Trainer), 15
epochs (Trainer), global batch 256 traces from micro-batches by gradient accumulation (set here
from ``global_batch_size``, the micro-batch size and the number of devices).

Validation (held-out questions) logs ``val/mse`` (torchmetrics ``MeanSquaredError`` on normalised
labels), ``val/kendall`` (per-trace Kendall tau-b, averaged) and ``val/overlap`` (top-``top_percent``%
overlap). :class:`ExportBest` writes the best predictor as ``save_pretrained`` safetensors (no pickle)
to ``<run_dir>/best`` with its metrics, its backbone's fingerprint (``config.base_model``) and a
model card (``README.md``, :mod:`trainers.predictor_card`); :func:`export_predictor` copies it to
the export directory that ``dynts.generate(..., predictor=path)`` loads.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanSquaredError

from dynts.io import replace_directory, write_atomic
from dynts.predictor import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, ImportancePredictor, PredictorConfig
from dynts.importance import final_hidden_states
from trainers.predictor_card import model_card, write_model_card
from trainers.predictor_data import PredictorDataModule
from trainers.schedules import warmup_cosine
from trainers.predictor_metrics import LOSSES, MeanKendallTau, TopPercentOverlap, importance_loss

__all__ = ["ExportBest", "PredictorModule", "export_predictor", "place_backbone"]

METRICS_NAME = "metrics.json"


class PredictorModule(L.LightningModule):
    """Importance-predictor training.

    Args:
        hidden_size: backbone hidden size; default: read from the data (cached states or backbone).
            A value that disagrees with the data raises ``ValueError``.
        activation: predictor activation (``softplus`` as the authors' code).
        loss: ``mse`` (paper), ``weighted_mse`` or ``kendall`` (pairwise ranking).
        pairwise_weight: add this times the pairwise ranking loss to an MSE loss.
        pairs_per_trace: random token pairs per trace for the ranking loss.
        top_percent: ``p`` of the top-p% overlap metric and of ``weighted_mse`` (paper: 30).
        top_weight: extra weight of top-p% tokens in ``weighted_mse``.
        lr / betas / weight_decay: AdamW (paper: 5e-4, (0.9, 0.95), 0.01).
        warmup_steps: linear warmup before the cosine decay (paper: none).
        min_lr_ratio: final lr as a fraction of ``lr``.
        global_batch_size: traces per optimizer step (paper: 256); gradient accumulation makes up the
            difference to ``micro_batch_size x devices``.
        run_dir: where ``ckpt/`` (Lightning checkpoints, ``last.ckpt`` for resuming) and ``best/`` go.
        export_dir: where the CLI copies the best predictor after fitting (optional).
        monitor / mode: the validation metric choosing the best predictor.
    """

    def __init__(
        self,
        hidden_size: int | None = None,
        activation: str = "softplus",
        loss: str = "mse",
        pairwise_weight: float = 0.0,
        pairs_per_trace: int = 1024,
        top_percent: float = 30.0,
        top_weight: float = 4.0,
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        global_batch_size: int = 256,
        run_dir: str = "runs/predictor",
        export_dir: str | None = None,
        monitor: str = "val/kendall",
        mode: str = "max",
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss={loss!r} must be one of {LOSSES}")
        if global_batch_size < 1 or lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be >= 1, lr={lr} > 0, 0 <= min_lr_ratio={min_lr_ratio} <= 1, "
                f"warmup_steps={warmup_steps} >= 0"
            )
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        self.save_hyperparameters()
        self.predictor: ImportancePredictor | None = None
        if hidden_size is not None:
            self._build(hidden_size)
        self._frozen: list[torch.nn.Module] = []  # the backbone in recompute mode (not a submodule: never saved)
        self.training_command: str | None = None  # set by the CLI; goes on the model card
        self.val_mse = MeanSquaredError()
        self.val_kendall = MeanKendallTau()
        self.val_overlap = TopPercentOverlap(top_percent)

    # ------------------------------------------------------------------ setup
    def _build(self, hidden_size: int, backbone: str = "", label_transform: str = "log1p-zscore") -> None:
        config = PredictorConfig(
            hidden_size=hidden_size, activation=self.hparams.activation, backbone=backbone, label_transform=label_transform
        )
        self.predictor = ImportancePredictor(config)

    def configure_callbacks(self) -> list[Callback]:
        run = Path(self.hparams.run_dir)
        mode = self.hparams.mode
        return [
            ModelCheckpoint(
                dirpath=run / "ckpt", monitor=self.hparams.monitor, mode=mode, save_last=True, save_top_k=1,
                enable_version_counter=False,  # overwrite last.ckpt on resume instead of writing last-v1.ckpt
            ),
            ExportBest(run / "best", self.hparams.monitor, mode),
        ]

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        if not isinstance(data, PredictorDataModule):
            raise ValueError("PredictorModule trains with a PredictorDataModule (trainer.fit(module, datamodule=...))")
        # Lightning has already run data.setup(stage): the hidden size is known
        if self.hparams.hidden_size is not None and self.hparams.hidden_size != data.hidden_size:
            raise ValueError(
                f"hidden size mismatch: the {data.hidden_mode} hidden states have size {data.hidden_size} but the "
                f"predictor has hidden_size={self.hparams.hidden_size}; set model.hidden_size to {data.hidden_size} "
                "(or null) or use the dataset of this predictor's backbone"
            )
        if self.predictor is None:
            self._build(data.hidden_size, data.backbone_name, data.label_transform)
        else:
            self.predictor.config.backbone = data.backbone_name
            self.predictor.config.label_transform = data.label_transform
        self.predictor.config.label = data.importance_label
        if data.hidden_mode == "recompute":  # each DDP rank loads it once, onto its own device
            self._frozen = [data.load_backbone(self.trainer.strategy.root_device).eval()]
        # binds the predictor to its backbone (dynts.load_predictor refuses any other model)
        self.predictor.config.base_model = data.base_model()
        if stage == "fit":
            micro, world = data.micro_batch_size, max(self.trainer.world_size, 1)
            accumulate = max(1, round(self.hparams.global_batch_size / (micro * world)))
            if accumulate * micro * world != self.hparams.global_batch_size:
                rank_zero_warn(
                    f"global_batch_size={self.hparams.global_batch_size} is not micro_batch_size ({micro}) x devices "
                    f"({world}) x an integer; using {accumulate * micro * world}"
                )
            self.trainer.accumulate_grad_batches = accumulate

    # ------------------------------------------------------------------ steps
    def _hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "hidden" in batch:
            return batch["hidden"]
        backbone = place_backbone(self._frozen[0], self.device)
        hidden = final_hidden_states(backbone, batch["input_ids"], batch["attention_mask"]).to(self.device)
        index = batch["positions"][..., None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, index).float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.predictor(hidden)

    def _loss(self, preds: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.hparams
        return importance_loss(
            preds, batch["labels"], batch["mask"], h.loss, top_percent=h.top_percent, top_weight=h.top_weight,
            pairwise_weight=h.pairwise_weight, pairs_per_trace=h.pairs_per_trace,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        preds = self(self._hidden(batch))
        loss = self._loss(preds, batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["mask"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        preds = self(self._hidden(batch))
        mask = batch["mask"]
        b = mask.shape[0]
        self.log("val/loss", self._loss(preds, batch), batch_size=b, sync_dist=True)
        self.val_mse(preds[mask], batch["labels"][mask])
        self.val_kendall(preds, batch["target"], mask)
        self.val_overlap(preds, batch["target"], mask)
        self.log("val/mse", self.val_mse, batch_size=b)
        self.log("val/kendall", self.val_kendall, prog_bar=True, batch_size=b)
        self.log("val/overlap", self.val_overlap, prog_bar=True, batch_size=b)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict[str, Any]:
        h = self.hparams
        optimizer = torch.optim.AdamW(self.predictor.parameters(), lr=h.lr, betas=tuple(h.betas), weight_decay=h.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)

        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, h.warmup_steps, total, h.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def place_backbone(backbone: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The frozen backbone on the training device, unless accelerate dispatched it (``device_map``):
    a sharded backbone stays where it is (its inputs go to the embedding's device, its outputs come
    back to ``device``)."""
    if getattr(backbone, "hf_device_map", None):
        return backbone
    if next(backbone.parameters()).device != device:
        backbone.to(device)
    return backbone


class ExportBest(Callback):
    """After each validation, when ``monitor`` improved, write the predictor with
    ``save_pretrained`` (safetensors + json) and ``metrics.json`` to ``directory`` (rank 0)."""

    def __init__(self, directory: str | Path, monitor: str = "val/kendall", mode: str = "max") -> None:
        self.directory, self.monitor, self.mode = Path(directory), monitor, mode
        self.best: float | None = None

    def _better(self, value: float) -> bool:
        if self.best is None or not math.isfinite(self.best):
            return math.isfinite(value)
        return value > self.best if self.mode == "max" else value < self.best

    def on_validation_end(self, trainer: L.Trainer, pl_module: PredictorModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        if not self._better(value):
            return
        self.best = value
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        metrics.update(epoch=trainer.current_epoch, global_step=trainer.global_step)
        pl_module.predictor.config.extra = {"metrics": metrics, "hparams": _jsonable(dict(pl_module.hparams))}
        tmp = self.directory.parent / f".tmp-best-{uuid.uuid4().hex[:8]}"
        pl_module.predictor.save_pretrained(tmp)
        (tmp / METRICS_NAME).write_text(json.dumps(metrics, indent=2))
        data = trainer.datamodule
        card = model_card(
            pl_module.predictor.config, metrics, traces=data.traces_settings(), split=data.split_sizes(),
            command=pl_module.training_command, top_percent=pl_module.hparams.top_percent,
            parameters=sum(p.numel() for p in pl_module.predictor.parameters()),
        )
        write_model_card(tmp, card)
        replace_directory(tmp, self.directory)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(values, default=str))


def export_predictor(best_dir: str | Path, export_dir: str | Path) -> dict[str, Any]:
    """Copy the best predictor (``save_pretrained`` files + metrics) to ``export_dir`` after loading
    it once (a corrupted or mismatched file raises ``ValueError`` here, not in ``dynts.generate``).
    Returns its validation metrics."""
    best_dir, export_dir = Path(best_dir), Path(export_dir)
    ImportancePredictor.from_pretrained(best_dir)  # validates config + safetensors
    export_dir.mkdir(parents=True, exist_ok=True)
    for name in (WEIGHTS_NAME, CONFIG_NAME, METRICS_NAME, CARD_NAME):
        if (best_dir / name).is_file():
            write_atomic(export_dir / name, (best_dir / name).read_bytes())
    metrics = best_dir / METRICS_NAME
    return json.loads(metrics.read_text()) if metrics.is_file() else {}
