"""``dynts train-predictor``: a LightningCLI over :class:`PredictorModule` + :class:`PredictorDataModule`.

Usage::

    dynts train-predictor fit --config configs/predictor/testbed.yaml
    dynts train-predictor fit --config configs/predictor/testbed.yaml --trainer.devices=2 --trainer.strategy=ddp
    dynts train-predictor validate --config configs/predictor/testbed.yaml --ckpt_path runs/.../ckpt/last.ckpt

The configs set ``ckpt_path: last``: a killed run continues from ``<run_dir>/ckpt/last.ckpt``
(a fresh run starts when there is none). After ``fit`` the best predictor is copied to
``model.export_dir`` (``ImportancePredictor.save_pretrained`` files) when it is set.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings
import zipfile
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

from trainers.predictor import METRICS_NAME, PredictorModule, export_predictor
from trainers.predictor_data import PredictorDataModule

__all__ = ["PredictorCLI", "check_checkpoint", "main"]

TRAINER_DEFAULTS = {
    "max_epochs": 15,
    "gradient_clip_val": 1.0,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 10,
    "enable_model_summary": False,
}


def check_checkpoint(path: str | Path) -> None:
    """Raise ``ValueError`` when a Lightning checkpoint cannot be read (truncated by a kill, not a
    checkpoint at all). Loaded with ``weights_only=True``: tensors and plain containers only."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        raise ValueError(
            f"checkpoint {path} is corrupted or not a Lightning checkpoint ({type(err).__name__}: {str(err)[:200]}); "
            "delete it to start from scratch, or pass --ckpt_path with another checkpoint"
        ) from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"checkpoint {path} has no state_dict; it is not a Lightning checkpoint of this trainer")


class PredictorCLI(LightningCLI):
    """LightningCLI with the paper's trainer defaults, checkpoint checks and export after fit."""

    def __init__(self, args: list[str] | None = None, command: str | None = None, **kwargs) -> None:
        # `dynts train-predictor` / `dynts pipeline` pass their own argv slice: that is intended
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        # the command for the model card (the CLI runs the subcommand inside LightningCLI.__init__)
        self.command = command or " ".join(["dynts train-predictor", *map(str, args or sys.argv[1:])])
        super().__init__(
            PredictorModule,
            PredictorDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            args=args,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.run_dir", "trainer.default_root_dir")

    def _resolved_ckpt(self) -> Path | None:
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt == "last":
            path = Path(self.model.hparams.run_dir) / "ckpt" / "last.ckpt"
            return path if path.exists() else None
        return Path(ckpt) if ckpt and ckpt not in ("best", "hpc", "registry") else None

    def before_fit(self) -> None:
        # Resolve "last" here: Lightning resolves it before the module's callbacks (which know
        # <run_dir>/ckpt) are attached, and would silently start from scratch.
        self.model.training_command = self.command
        path = self._resolved_ckpt()
        if path is not None:
            check_checkpoint(path)
        if self.config_init[self.subcommand].get("ckpt_path") == "last":
            self.config_init[self.subcommand]["ckpt_path"] = str(path) if path is not None else None

    before_validate = before_fit

    def after_fit(self) -> None:
        run = Path(self.model.hparams.run_dir)
        best = run / "best"
        if not self.trainer.is_global_zero or not (best / METRICS_NAME).is_file():
            return
        metrics = json.loads((best / METRICS_NAME).read_text())
        if self.model.hparams.export_dir:
            export_predictor(best, self.model.hparams.export_dir)
            metrics["export_dir"] = str(self.model.hparams.export_dir)
        (run / "done.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps({"best": metrics}, indent=2), flush=True)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    PredictorCLI(args=argv or ["--help"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
