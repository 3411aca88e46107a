"""The model card (``README.md``) of a trained importance predictor, and re-binding a saved one.

The trainer (:class:`trainers.predictor.ExportBest`) writes the card next to the weights: base model
(its :class:`~dynts.predictor.BaseModelFingerprint`), the traces and questions it learned from, the
label normalisation, the held-out Kendall tau and top-``p``% overlap, and the training command.

``python -m trainers.predictor_card --predictor DIR --backbone MODEL`` binds a predictor saved
without a fingerprint to its backbone and (re)writes its card; the weights file is not touched::

    python -m trainers.predictor_card --predictor checkpoints/testbed-predictor --backbone testbed \\
        --pipeline configs/predictor/testbed.pipeline.yaml --report reports/testbed-predictor.json \\
        --command "dynts pipeline --config configs/predictor/testbed.pipeline.yaml"
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from dynts.io import write_atomic
from dynts.predictor import CARD_NAME, CONFIG_NAME, BaseModelFingerprint, ImportancePredictor, PredictorConfig

__all__ = ["TRACE_FIELDS", "bind_predictor", "model_card", "traces_settings", "write_model_card"]

# the trace settings a card reports (data_pipeline.traces.TraceConfig fields)
TRACE_FIELDS = ("model", "questions", "limit", "samples_per_question", "temperature", "top_p", "top_k",
                "max_new_tokens", "answer_rule", "think_end", "grader", "require_correct", "backend", "dtype")


def traces_settings(importance_dataset: str | Path) -> dict[str, Any]:
    """The trace settings and counts behind an importance dataset, read from the ``stats.json`` files
    the pipeline stages wrote (``{}`` where they are missing)."""
    stats_file = Path(importance_dataset) / "stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.is_file() else {}
    traces_dir = (stats.get("config") or {}).get("traces_dir")
    traces_file = Path(traces_dir) / "stats.json" if traces_dir else None
    traces = json.loads(traces_file.read_text()) if traces_file is not None and traces_file.is_file() else {}
    out = {k: v for k, v in (traces.get("config") or {}).items() if k in TRACE_FIELDS}
    if "questions" in traces and isinstance(traces["questions"], int):
        out["questions_used"] = traces["questions"]
    if "records" in stats:
        out["kept_traces"] = stats["records"]
    label = (stats.get("config") or {}).get("label")
    if label is not None:
        out["importance label"] = label
    return out


LABEL_SENTENCES = {  # the first line of the card's label paragraph (dynts.importance.LABELS)
    "answer": "Labels: answer-to-thinking attention importance from one forward per trace (`dynts.importance`),",
    "future": "Labels: the far reads later thinking rows make of each token, from one forward per trace (`dynts.importance.future`),",
    "golden": "Labels: the share of a replayed bounded cache's events an oracle keeps each token at (`dynts.importance.golden`),",
    "counterfactual": "Labels: the rise in the continuation's loss when each token is evicted (`dynts.importance.counterfactual`),",
}


def _row(values: dict[str, Any]) -> str:
    cell = lambda v: f"`{v}`" if isinstance(v, str) else str(v)  # noqa: E731  (code spans: `</think>` stays visible)
    return "\n".join(f"| {k} | {cell(v)} |" for k, v in values.items() if v is not None)


def model_card(
    config: PredictorConfig,
    metrics: dict[str, Any],
    *,
    traces: dict[str, Any] | None = None,
    split: dict[str, Any] | None = None,
    command: str | None = None,
    source: str | None = None,
    top_percent: float = 30.0,
    parameters: int | None = None,
) -> str:
    """The card's markdown.

    Args:
        config: the predictor's config (its ``base_model`` fingerprint, ``label_transform``).
        metrics: ``val/kendall``, ``val/overlap`` (held-out), ``epoch``, ``global_step``.
        traces: trace settings and counts (:func:`traces_settings`).
        split: held-out split sizes (``train_traces``, ``heldout_traces``, ``heldout_questions``).
        command: the command that trained it.
        source: where the held-out numbers were measured (a script or report).
        top_percent: ``p`` of the overlap metric.
        parameters: the predictor's parameter count.
    """
    base = config.base_model or BaseModelFingerprint(name_or_path=config.backbone, hidden_size=config.hidden_size)
    name = base.name_or_path or config.backbone or "an unnamed backbone"
    d = config.hidden_size
    size = f", {parameters:,} parameters" if parameters else ""
    kendall, overlap = metrics.get("val/kendall"), metrics.get("val/overlap")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "not measured"  # noqa: E731
    lines = [
        f"# DynTS importance predictor for `{name}`",
        "",
        f"An MLP {d}-{2 * d}-{d // 2}-1 ({config.activation}{size}) that scores each token's importance for the",
        f"final answer from `{name}`'s final hidden state. Load it with",
        f"`dynts.generate(model, tokenizer, prompts, method=\"dynts\", predictor=\"<this directory>\", ...)`;",
        "it refuses any other base model (the fingerprint below, saved in `predictor_config.json`).",
        "",
        "## Base model",
        "",
        "| field | value |",
        "|---|---|",
        _row({"name or path": base.name_or_path or None, "revision": base.revision, "layers": base.num_hidden_layers,
              "hidden size": base.hidden_size, "vocabulary": base.vocab_size,
              "final-norm sha256 (bf16-rounded)": base.final_norm_sha256}),
        "",
        "## Training data",
        "",
        LABEL_SENTENCES[(traces or {}).get("importance label", "answer")],
        f"normalised with `{config.label_transform}`; the predictor sees thinking tokens only.",
        "",
    ]
    if traces:
        lines += ["| traces | value |", "|---|---|", _row(traces), ""]
    if split:
        lines += ["| split (by question) | value |", "|---|---|", _row(split), ""]
    lines += [
        "## Held-out results",
        "",
        f"| Kendall tau-b (per trace, mean) | top-{top_percent:g}% overlap | epoch | step |",
        "|---|---|---|---|",
        f"| {fmt(kendall)} | {fmt(overlap)} | {metrics.get('epoch', '-')} | {metrics.get('global_step', '-')} |",
        "",
        f"Measured by {source}." if source else "Measured on the held-out questions during training (`val/*`).",
        "",
        "## Training command",
        "",
        "```",
        command or "not recorded",
        "```",
        "",
    ]
    return "\n".join(lines)


def write_model_card(directory: str | Path, text: str) -> Path:
    """Write ``README.md`` into a predictor directory (atomically)."""
    path = Path(directory) / CARD_NAME
    write_atomic(path, text)
    return path


def bind_predictor(directory: str | Path, fingerprint: BaseModelFingerprint) -> PredictorConfig:
    """Record ``fingerprint`` in a saved predictor's ``predictor_config.json`` (weights untouched)."""
    cfg_file = Path(directory) / CONFIG_NAME
    values = json.loads(cfg_file.read_text())
    values["base_model"] = asdict(fingerprint)
    config = PredictorConfig(**values)  # validates (hidden sizes agree)
    write_atomic(cfg_file, json.dumps(asdict(config), indent=2))
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.predictor_card", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictor", required=True, help="a directory written by ImportancePredictor.save_pretrained")
    parser.add_argument("--backbone", required=True, help="the dynts.load name or path it was trained on")
    parser.add_argument("--pipeline", default=None, help="the pipeline YAML that trained it (its traces section goes on the card)")
    parser.add_argument("--dataset", default=None, help="the importance dataset it trained on (settings from its stats.json)")
    parser.add_argument("--report", default=None, help="a JSON report of its held-out numbers (scripts/report_testbed_predictor.py)")
    parser.add_argument("--command", default=None, help="the training command")
    args = parser.parse_args(argv)
    import dynts

    model, _ = dynts.load(args.backbone)
    config = bind_predictor(args.predictor, BaseModelFingerprint.from_model(model, args.backbone))
    parameters = sum(p.numel() for p in ImportancePredictor.from_pretrained(args.predictor).parameters())
    metrics_file = Path(args.predictor) / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else dict(config.extra.get("metrics") or {})
    traces = traces_settings(args.dataset) if args.dataset else {}
    if args.pipeline:
        section = (yaml.safe_load(Path(args.pipeline).read_text()) or {}).get("traces") or {}
        traces = {**{k: v for k, v in section.items() if k in TRACE_FIELDS}, **traces}
    split: dict[str, Any] = {}
    source = None
    if args.report:
        report = json.loads(Path(args.report).read_text())
        traces.setdefault("kept_traces", report.get("traces"))
        split = {"heldout_questions": report.get("heldout_questions"), "heldout_traces": report.get("heldout_traces")}
        metrics = {**metrics, "val/kendall": report.get("predictor_heldout_kendall", metrics.get("val/kendall")),
                   "val/overlap": report.get("predictor_heldout_top30_overlap", metrics.get("val/overlap"))}
        source = f"`scripts/report_testbed_predictor.py` (`{args.report}`) and `val/*` at export (`metrics.json`)"
    top = float((config.extra.get("hparams") or {}).get("top_percent", 30.0))
    card = model_card(config, metrics, traces=traces, split=split, command=args.command, source=source,
                      top_percent=top, parameters=parameters)
    print(write_model_card(args.predictor, card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
