"""Rendering cell results: ``results.json`` / ``results.csv`` (data first), ``results.md`` (a
markdown table) and accuracy plots (matplotlib, Agg backend): accuracy vs budget always, and vs local
window / retention when a run sweeps them (paper Fig. 6 and 8)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Sequence

from dynts.io import write_atomic

__all__ = ["COLUMNS", "markdown_table", "plot_sweep", "write_reports"]

# (column, header, format) for CSV and markdown.
COLUMNS: list[tuple[str, str, str]] = [
    ("benchmark", "benchmark", "{}"),
    ("method", "method", "{}"),
    ("budget", "budget", "{}"),
    ("local_window", "local window", "{}"),
    ("retention", "retention", "{}"),
    ("n_keep", "kept/event", "{}"),
    ("budget_vs_full", "B / full seq", "{:.2f}"),
    ("pass@1", "pass@1 %", "{:.1f}"),
    ("pass@1_se", "± 1 SE", "{:.1f}"),
    ("pass@1_std", "± (k runs)", "{:.1f}"),
    ("parse_rate", "parsed %", "{:.1f}"),
    ("mean_generated_tokens", "mean gen tokens", "{:.0f}"),
    ("tokens_vs_full", "tokens vs full", "{:.2f}"),
    ("truncated_rate", "truncated %", "{:.1f}"),
    ("loop_rate", "loop %", "{:.1f}"),
    ("evictions_per_sample", "evictions/sample", "{:.1f}"),
    ("tokens_per_second", "tokens/s", "{:.1f}"),
    ("peak_kv_mib_per_sequence", "peak KV MiB/seq", "{:.3f}"),
    ("peak_cache_tokens", "peak cache tokens", "{}"),
    ("questions", "questions", "{}"),
    ("k", "k", "{}"),
]
PERCENT = {"pass@1", "pass@1_se", "pass@1_std", "parse_rate", "truncated_rate", "loop_rate"}


def against_full(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells with two ratios to the full-cache cell of their benchmark (when the run has one):
    ``tokens_vs_full`` (mean generated tokens / full's) and ``budget_vs_full`` (``B`` / full's mean
    sequence, prompt included: kvpress's ``1 - compression_ratio``)."""
    full = {r["benchmark"]: r for r in results if r.get("budget") is None and r.get("mean_generated_tokens")}
    out = []
    for r in results:
        ref = full.get(r["benchmark"])
        extra: dict[str, Any] = {}
        if ref is not None:
            extra["tokens_vs_full"] = r["mean_generated_tokens"] / ref["mean_generated_tokens"]
            if r.get("budget") is not None and ref.get("mean_prompt_tokens") is not None:
                extra["budget_vs_full"] = r["budget"] / (ref["mean_prompt_tokens"] + ref["mean_generated_tokens"])
        out.append({**r, **extra})
    return out


def row_values(result: dict[str, Any]) -> dict[str, Any]:
    """The flat row of one cell (method as its label, missing settings as ``-``)."""
    row = {}
    for key, _, _ in COLUMNS:
        value = result["method"]["label"] if key == "method" else result.get(key)
        row[key] = "-" if value is None else value
    return row


def markdown_table(results: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> str:
    """One row per cell, in the given order; percentages as percent. ``keys``: a subset of
    :data:`COLUMNS` (default all)."""
    columns = COLUMNS if keys is None else [c for k in keys for c in COLUMNS if c[0] == k]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for result in against_full(results):
        row = row_values(result)
        cells = []
        for key, _, fmt in columns:
            value = row[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = fmt.format(100 * value if key in PERCENT else value)
            cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _csv(results: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    extra = ["seconds", "evictions", "evicted_tokens", "samples", "max_new_tokens", "key"]
    writer = csv.DictWriter(buf, fieldnames=[k for k, _, _ in COLUMNS] + extra, lineterminator="\n")
    writer.writeheader()
    for result in against_full(results):
        writer.writerow({**row_values(result), **{k: result.get(k) for k in extra}})
    return buf.getvalue()


def plot_sweep(results: Sequence[dict[str, Any]], x: str, path: Path) -> Path | None:
    """Accuracy vs ``x`` (``budget``, ``local_window`` or ``retention``), one panel per benchmark,
    one line per method setting; the full cache is a dashed horizontal line. A panel with a single
    value of ``x`` (e.g. the demo's one budget) shows bars per method instead. ``None`` if nothing
    to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [p for p in ("budget", "local_window", "retention") if p != x]
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in results))
    if not any(r.get(x) is not None for r in results):
        return None
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(7.5 * len(benchmarks), 4.2), squeeze=False)
    for ax, bench in zip(axes[0], benchmarks):
        rows = [r for r in results if r["benchmark"] == bench]
        if len({r[x] for r in rows if r.get(x) is not None}) == 1:
            _bars(ax, rows, x)  # one setting: a line plot would be a column of dots
            continue
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r.get(x) is None:
                ax.axhline(100 * r["pass@1"], ls="--", color="gray", label=f"{r['method']['label']} (no eviction)")
                continue
            fixed = ", ".join(f"{p}={r[p]}" for p in others if len({q[p] for q in rows if q.get(p) is not None}) > 1)
            label = r["method"]["label"] + (f" ({fixed})" if fixed else "")
            series.setdefault(label, []).append((r[x], 100 * r["pass@1"]))
        markers, styles = "os^vDPX*", ("-", "--", "-.", ":")
        for i, (label, points) in enumerate(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers[i % len(markers)],
                    ls=styles[(i // 10) % len(styles)], label=label)
        ax.set_title(bench)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel("pass@1 (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_atomic(path, png.getvalue())
    return path


def _bars(ax: Any, rows: Sequence[dict[str, Any]], x: str) -> None:
    """Accuracy per method at a single value of ``x``: horizontal bars, best at the top; the full
    cache is a dashed vertical line."""
    value = next(r[x] for r in rows if r.get(x) is not None)
    bounded = sorted((r for r in rows if r.get(x) is not None), key=lambda r: r["pass@1"])
    varying = [p for p in ("budget", "local_window", "retention") if p != x and len({r.get(p) for r in bounded}) > 1]
    labels = [r["method"]["label"] + "".join(f", {p}={r[p]}" for p in varying) for r in bounded]
    accuracy = [100 * r["pass@1"] for r in bounded]
    ax.barh(range(len(bounded)), accuracy, color="tab:blue")
    for i, a in enumerate(accuracy):
        ax.text(a + 1, i, f"{a:.1f}", va="center", fontsize=7)
    for r in rows:
        if r.get(x) is None:
            ax.axvline(100 * r["pass@1"], ls="--", color="gray", label=f"{r['method']['label']} (no eviction)")
            ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(range(len(bounded)), labels, fontsize=8)
    ax.set_xlim(0, 105)
    ax.set_xlabel("pass@1 (%)")
    ax.set_title(f"{rows[0]['benchmark']}, {x.replace('_', ' ')} {value}")
    ax.grid(axis="x", alpha=0.3)


def write_reports(run_dir: str | Path, results: Sequence[dict[str, Any]], plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and (``plots``) the PNG plots;
    returns their paths."""
    run_dir = Path(run_dir)
    paths = {"json": run_dir / "results.json", "csv": run_dir / "results.csv", "markdown": run_dir / "results.md"}
    if not results:
        return {}
    write_atomic(paths["json"], json.dumps(list(results), indent=2))
    write_atomic(paths["csv"], _csv(results))
    write_atomic(paths["markdown"], markdown_table(results) + "\n")
    for x in ("budget", "local_window", "retention") if plots else ():
        values = {r.get(x) for r in results if r.get(x) is not None}
        if x == "budget" or len(values) > 1:
            plot = plot_sweep(results, x, run_dir / f"accuracy_vs_{x}.png")
            if plot is not None:
                paths[f"plot_{x}"] = plot
    return paths
