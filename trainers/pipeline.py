"""``dynts pipeline --config ...``: traces -> importance -> predictor training -> export.

Each stage skips what is already done, so rerunning after a kill (or after adding a stage)
finishes the job without redoing finished work:

1. ``traces``: :func:`data_pipeline.traces.generate_traces` (atomic shards; done when
   ``<traces.output_dir>/dataset`` exists);
2. ``importance``: :func:`data_pipeline.importance_data.add_importance` (same);
3. ``train``: ``dynts train-predictor fit`` with ``train.config`` (resumes from ``last.ckpt``; done
   when ``<run_dir>/done.json`` exists);
4. ``export``: the best predictor copied to ``export_dir`` (loadable by ``dynts.generate``).

Config (YAML)::

    traces: {...}                  # TraceConfig fields
    importance: {...}              # ImportanceConfig fields; model / traces_dir default from traces
    train:
      config: configs/predictor/testbed.yaml   # a train-predictor (LightningCLI) config
      args: []                                 # extra CLI arguments, e.g. ["--trainer.devices=2"]
    export_dir: checkpoints/testbed-predictor  # overrides the train config's model.export_dir

``--label`` replaces ``importance.label`` (:data:`dynts.importance.LABELS`; default ``answer``). An importance
``output_dir`` holds one label (``label.json``): a new label needs its own ``importance.output_dir`` and a train
config whose dataset is that directory's ``dataset``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
from pathlib import Path
from typing import Any

import yaml

from dynts.importance.labels import LABELS

__all__ = ["STAGES", "main", "run_pipeline"]

STAGES = ("traces", "importance", "train", "export")


def _sections(cfg: dict[str, Any]) -> tuple[dict, dict, dict, Path, Path | None]:
    unknown = sorted(set(cfg) - {"traces", "importance", "train", "export_dir"})
    if unknown:
        raise ValueError(f"unknown pipeline sections {unknown}; valid: traces, importance, train, export_dir")
    traces = dict(cfg.get("traces") or {})
    importance = dict(cfg.get("importance") or {})
    importance.setdefault("model", traces.get("model", "testbed"))
    if "output_dir" in traces:
        importance.setdefault("traces_dir", str(Path(traces["output_dir"]) / "dataset"))
    train = dict(cfg.get("train") or {})
    if "config" not in train:
        raise ValueError("pipeline config needs train.config: a `dynts train-predictor` YAML (see configs/predictor/)")
    train_yaml = yaml.safe_load(Path(train["config"]).read_text()) or {}
    run_dir = Path((train_yaml.get("model") or {}).get("run_dir", "runs/predictor"))
    export = cfg.get("export_dir") or (train_yaml.get("model") or {}).get("export_dir")
    return traces, importance, train, run_dir, Path(export) if export else None


def _same_files(a: Path, b: Path, names: tuple[str, ...]) -> bool:
    return all((b / n).is_file() and filecmp.cmp(a / n, b / n, shallow=False) for n in names if (a / n).is_file())


def run_pipeline(config: str | Path | dict[str, Any], stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    """Run the chosen stages in order; returns a summary per stage."""
    from dynts.predictor import CONFIG_NAME, WEIGHTS_NAME

    cfg = yaml.safe_load(Path(config).read_text()) if isinstance(config, (str, Path)) else dict(config)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"stages {bad} unknown; choose from {STAGES}")
    traces, importance, train, run_dir, export_dir = _sections(cfg or {})
    summary: dict[str, Any] = {}
    if "traces" in stages:
        from data_pipeline.traces import generate_traces

        stats = generate_traces(traces)
        if not stats:  # a non-zero rank of a multi-device trace job: rank 0 runs the rest
            return {}
        summary["traces"] = {k: v for k, v in stats.items() if k != "config"}
    if "importance" in stages:
        from data_pipeline.importance_data import add_importance

        stats = add_importance(importance)
        summary["importance"] = {k: v for k, v in stats.items() if k != "config"}
    done = run_dir / "done.json"
    if "train" in stages:
        if done.is_file():
            summary["train"] = {"skipped": True, **json.loads(done.read_text())}
        else:
            from trainers.predictor_cli import PredictorCLI

            args = ["fit", "--config", str(train["config"]), *map(str, train.get("args", []))]
            if export_dir is not None:
                args.append(f"--model.export_dir={export_dir}")
            command = f"dynts pipeline --config {config}" if isinstance(config, (str, Path)) else None
            cli = PredictorCLI(args=args, command=command)
            if not cli.trainer.is_global_zero:
                return {}
            summary["train"] = json.loads(done.read_text()) if done.is_file() else {"error": "no best predictor"}
    if "export" in stages:
        best = run_dir / "best"
        if export_dir is None:
            summary["export"] = {"skipped": True, "reason": "no export_dir"}
        elif not best.is_dir():
            raise ValueError(f"no trained predictor in {best}; run the train stage first")
        elif _same_files(best, export_dir, (WEIGHTS_NAME, CONFIG_NAME)):
            summary["export"] = {"skipped": True, "export_dir": str(export_dir)}
        else:
            from trainers.predictor import export_predictor

            summary["export"] = {"export_dir": str(export_dir), **export_predictor(best, export_dir)}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynts pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="pipeline YAML (e.g. configs/predictor/testbed.pipeline.yaml)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--label", choices=LABELS, default=None,
                        help="the importance label the predictor learns (replaces importance.label; default answer)")
    args = parser.parse_args(argv)
    config: str | dict[str, Any] = args.config
    if args.label is not None:
        config = yaml.safe_load(Path(args.config).read_text()) or {}
        config.setdefault("importance", {})
        config["importance"] = {**(config["importance"] or {}), "label": args.label}
    summary = run_pipeline(config, tuple(s.strip() for s in args.stages.split(",") if s.strip()))
    if summary:
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
