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

__all__ = ["COLUMNS", "compact_table", "display_labels", "markdown_table", "plot_sweep", "settings_note", "short_label", "sweep_figure",
           "write_reports"]

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


# The compact table's columns: (header, value of a cell of against_full(...)), numbers right-aligned.
COMPACT: list[tuple[str, Any]] = [
    ("pass@1 % ± SE", lambda r: f"{100 * r['pass@1']:.1f} ± {100 * r['pass@1_se']:.1f}"
     if r.get("pass@1_se") is not None else f"{100 * r['pass@1']:.1f}"),
    ("tokens vs full", lambda r: _number(r.get("tokens_vs_full"), "{:.2f}")),
    ("loops %", lambda r: _number(r.get("loop_rate"), "{:.1f}", 100)),
    ("evictions/sample", lambda r: _number(r.get("evictions_per_sample"), "{:.1f}")),
    ("tokens/s", lambda r: _number(r.get("tokens_per_second"), "{:.0f}")),
    ("peak KV MiB/seq", lambda r: _number(r.get("peak_kv_mib_per_sequence"), "{:.3f}")),
]


def _number(value: Any, fmt: str, scale: float = 1) -> str:
    return "-" if value is None else fmt.format(scale * value)


def compact_table(results: Sequence[dict[str, Any]]) -> str:
    """A narrow markdown table, columns padded to line up in a terminal: each method by its short name
    (:func:`display_labels`), pass@1 ± one standard error, generated tokens vs the full cache's, the share of
    samples that looped, evictions per sample, tokens/s and peak KV MiB per sequence. The settings behind the
    names are :func:`settings_note`'s; every column is in :func:`markdown_table`'s."""
    rows = against_full(results)
    names = display_labels([r["method"]["label"] for r in rows])
    cells = [["method", *(h for h, _ in COMPACT)]] + [[name, *(f(r) for _, f in COMPACT)] for name, r in zip(names, rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    pad = lambda row: "| " + " | ".join(  # noqa: E731 - method left, numbers right
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([pad(cells[0]), rule, *map(pad, cells[1:])])


def _csv(results: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    extra = ["seconds", "evictions", "evicted_tokens", "samples", "max_new_tokens", "key"]
    writer = csv.DictWriter(buf, fieldnames=[k for k, _, _ in COLUMNS] + extra, lineterminator="\n")
    writer.writeheader()
    for result in against_full(results):
        writer.writerow({**row_values(result), **{k: result.get(k) for k in extra}})
    return buf.getvalue()


def short_label(label: str) -> str:
    """A method's label without its settings, its form kept: ``snapkv-head+q:kernel_size=1,...`` -> ``snapkv
    (head+q)``, ``rkv+q:mix_lambda=0.2,...`` -> ``rkv (token+q)``, ``h2o:local_window_share=0.36`` -> ``h2o``."""
    name = label.partition(":")[0]
    keep_question = name.endswith("+q")
    base = name.removesuffix("+q")
    per_head = base.endswith("-head")
    base = base.removesuffix("-head")
    if not (keep_question or per_head):
        return base
    return f"{base} ({'head' if per_head else 'token'}{'+q' if keep_question else ''})"


def display_labels(labels: Sequence[str]) -> list[str]:
    """Each label's :func:`short_label` where no other label of ``labels`` shortens to the same name, else the
    label itself (a sweep over one method's settings keeps them)."""
    short = [short_label(label) for label in labels]
    owners: dict[str, set[str]] = {}
    for label, name in zip(labels, short):
        owners.setdefault(name, set()).add(label)
    return [name if len(owners[name]) == 1 else label for label, name in zip(labels, short)]


def settings_note(results: Sequence[dict[str, Any]]) -> str:
    """The settings behind the short names, one clause per method that has its own (tuned) settings:
    ``h2o (head+q): W_l=51 retention=0.6; rkv (token+q): W_l=25 retention=0.6 mix_lambda=0.2 ...``."""
    clauses = []
    for result in results:
        method = result["method"]
        if ":" not in method["label"]:
            continue
        options = [f"{k}={v}" for k, v in method.get("options", {}).items() if k not in ("per_head", "keep_question")]
        cache = [f"W_l={result['local_window']}"] if result.get("local_window") is not None else []
        cache += [f"retention={result['retention']}"] if result.get("retention") is not None else []
        clauses.append(f"{short_label(method['label'])}: " + " ".join(cache + options))
    return "; ".join(clauses)


BAR_FONTSIZE = 8
LEGEND_FONTSIZE = 7


def _lines(rows: Sequence[dict[str, Any]], x: str, names: dict[str, str]) -> tuple[list, dict[str, list]]:
    """A line panel's content: ``(references, series)``, the full-cache cells as ``(label, pass@1 %)`` and one
    ``label -> [(x, pass@1 %)]`` per method setting (settings that vary within the panel named in the label)."""
    others = [p for p in ("budget", "local_window", "retention") if p != x]
    references, series = [], {}
    for r in rows:
        if r.get(x) is None:
            references.append((f"{names[r['method']['label']]} (no eviction)", 100 * r["pass@1"]))
            continue
        fixed = ", ".join(f"{p}={r[p]}" for p in others if len({q[p] for q in rows if q.get(p) is not None}) > 1)
        label = names[r["method"]["label"]] + (f" ({fixed})" if fixed else "")
        series.setdefault(label, []).append((r[x], 100 * r["pass@1"]))
    return references, series


def sweep_figure(results: Sequence[dict[str, Any]], x: str) -> Any | None:
    """The figure of :func:`plot_sweep` (``None`` if nothing to plot): each panel is as wide as its bars or
    lines need plus its widest tick label or legend entry, so every method is named inside the figure."""
    from eval.harness.figures import new_figure, text_width_inches

    benchmarks = list(dict.fromkeys(r["benchmark"] for r in results))
    if not any(r.get(x) is not None for r in results):
        return None
    names = dict(zip((r["method"]["label"] for r in results), display_labels([r["method"]["label"] for r in results])))
    panels = []
    for bench in benchmarks:
        rows = [r for r in results if r["benchmark"] == bench]
        bars = len({r[x] for r in rows if r.get(x) is not None}) == 1  # one setting: a line would be a column of dots
        panels.append((bench, rows, None if bars else _lines(rows, x, names)))
    tick_width = text_width_inches([names[r["method"]["label"]] for _, rows, lines in panels if lines is None
                                    for r in rows], BAR_FONTSIZE)
    legend_width = text_width_inches([label for _, _, lines in panels if lines is not None
                                      for label in [*(ref for ref, _ in lines[0]), *lines[1]]], LEGEND_FONTSIZE)
    panel_width = 4.5 + max(tick_width + 0.5, legend_width + 0.9)
    tallest = max(len(rows) for _, rows, _ in panels)
    height = max(3.2, 0.3 * tallest + 1.4) if any(lines is None for *_, lines in panels) else 4.2
    fig, axes = new_figure(panel_width * len(panels), height, len(panels), squeeze=False)
    markers, styles = "os^vDPX*", ("-", "--", "-.", ":")
    for ax, (bench, rows, lines) in zip(axes[0], panels):
        if lines is None:
            _bars(ax, rows, x, names)
            continue
        references, series = lines
        for label, value in references:
            ax.axhline(value, ls="--", color="gray", label=label)
        for i, (label, points) in enumerate(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers[i % len(markers)],
                    ls=styles[(i // 10) % len(styles)], label=label)
        ax.set_title(bench)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel("pass@1 (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=LEGEND_FONTSIZE, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_sweep(results: Sequence[dict[str, Any]], x: str, path: Path) -> Path | None:
    """Accuracy vs ``x`` (``budget``, ``local_window`` or ``retention``), one panel per benchmark,
    one line per method setting; the full cache is a dashed horizontal line. A panel with a single
    value of ``x`` (e.g. the demo's one budget) shows bars per method instead. Methods go by their
    short names (:func:`display_labels`). ``None`` if nothing to plot."""
    from eval.harness.figures import save_png

    fig = sweep_figure(results, x)
    return None if fig is None else save_png(fig, path)


def _bars(ax: Any, rows: Sequence[dict[str, Any]], x: str, names: dict[str, str] | None = None) -> None:
    """Accuracy per method at a single value of ``x``: horizontal bars, best at the top, each named on its
    tick (``names``: label -> displayed name, default :func:`display_labels`); the full cache is a dashed
    vertical line."""
    if names is None:
        labels = [r["method"]["label"] for r in rows]
        names = dict(zip(labels, display_labels(labels)))
    value = next(r[x] for r in rows if r.get(x) is not None)
    bounded = sorted((r for r in rows if r.get(x) is not None), key=lambda r: r["pass@1"])
    labels = [names[r["method"]["label"]] for r in bounded]
    if len(set(labels)) < len(labels):  # one method at several settings of the run: name them
        varying = [p for p in ("budget", "local_window", "retention") if p != x and len({r.get(p) for r in bounded}) > 1]
        labels = [label + "".join(f", {p}={r[p]}" for p in varying) for label, r in zip(labels, bounded)]
    accuracy = [100 * r["pass@1"] for r in bounded]
    ax.barh(range(len(bounded)), accuracy, color="tab:blue")
    for i, a in enumerate(accuracy):  # the value inside the bar's end (outside a short one)
        inside = a >= 12
        ax.text(a - 1 if inside else a + 1, i, f"{a:.1f}", va="center", ha="right" if inside else "left", fontsize=7,
                color="white" if inside else "black")
    for r in rows:
        if r.get(x) is None:
            ax.axvline(100 * r["pass@1"], ls="--", color="gray",
                       label=f"{names[r['method']['label']]} (no eviction): {100 * r['pass@1']:.1f}")
            ax.legend(fontsize=LEGEND_FONTSIZE, loc="lower right")
    ax.set_yticks(range(len(bounded)), labels, fontsize=BAR_FONTSIZE)
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
