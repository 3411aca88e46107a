"""Train a testbed checkpoint from a YAML config: fit (resumable), export, gate.

``kind: lm`` trains the reasoning model or its helper (:mod:`trainers.testbed_lm`), ``kind: prm``
the process reward model (:mod:`trainers.testbed_prm`). Lightning checkpoints live in
``run_dir/ckpt`` (``last.ckpt`` every ``ckpt_every`` steps); the final weights are exported as a
standard HF directory to ``export_dir``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger


class FitClock(Callback):
    """Seconds of fitting over every segment of a resumed run: kept in each checkpoint (and so in a committed
    resume point), so a run carried across machines reports its whole cost, not its last segment's. Work a kill
    threw away (the steps after the last checkpoint) is not counted."""

    def __init__(self) -> None:
        self.before = 0.0  # the checkpoint's seconds
        self.start: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return self.before + (time.monotonic() - self.start if self.start is not None else 0.0)

    def state_dict(self) -> dict[str, float]:
        return {"fit_seconds": self.seconds}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self.before = float(state_dict["fit_seconds"])


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def _modules(cfg: dict[str, Any]) -> tuple[L.LightningModule, L.LightningDataModule]:
    if cfg.get("kind", "lm") == "prm":
        from trainers.testbed_prm import PRMModule, PRMData

        module = PRMModule(cfg)
        return module, PRMData(module.cfg)
    from trainers.testbed_lm import LMData, LMModule

    module = LMModule(cfg)
    return module, LMData(module.cfg)


def train(config_path: str | Path, resume: bool = False, progress: bool = False) -> dict[str, Any]:
    """Fit (from ``last.ckpt`` when ``resume``), export, and run the kind's gate check."""
    cfg = load_config(config_path)
    # One thread: on a shared 2-core machine two threads spin on each other (measured 4x slower).
    torch.set_num_threads(int(os.environ.get("DYNTS_TRAIN_THREADS", cfg.get("threads", 1))))
    L.seed_everything(cfg.get("seed", 0), workers=True)
    module, data = _modules(cfg)
    run_dir = Path(module.cfg.run_dir)
    ckpt = ModelCheckpoint(dirpath=run_dir / "ckpt", save_last=True, every_n_train_steps=module.cfg.ckpt_every, save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=module.cfg.max_steps,
        gradient_clip_val=1.0,
        precision=module.cfg.precision,
        val_check_interval=module.cfg.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=25,
        callbacks=[ckpt, clock := FitClock()],
        logger=CSVLogger(run_dir, name="logs"),
        enable_progress_bar=progress,
        enable_model_summary=False,
    )
    last = run_dir / "ckpt" / "last.ckpt"
    t0 = time.monotonic()
    trainer.fit(module, datamodule=data, ckpt_path=str(last) if resume and last.exists() else None)
    fit_s, total_s = time.monotonic() - t0, clock.seconds
    out = module.export()
    gate = module.gate()
    # fit_seconds: this segment's; total_fit_seconds: every segment's (FitClock, carried in the checkpoints)
    result = {"config": str(config_path), "export_dir": str(out), "fit_seconds": fit_s, "global_step": trainer.global_step,
              **gate, "total_fit_seconds": total_s}
    (run_dir / "train_result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), flush=True)
    return result


if __name__ == "__main__":  # pragma: no cover - convenience for nohup runs
    import sys

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(sys.argv[1], resume="--resume" in sys.argv)
