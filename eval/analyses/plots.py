"""Figures of the analyses (:mod:`eval.harness.figures`: labels inside the image): each writes a PNG and the plotted data as CSV.

- :func:`plot_pareto`: accuracy vs. share of thinking tokens kept, top / bottom / random, with the
  full-thinking accuracy as a dashed line (DynTS paper Fig. 3 left, Fig. 12).
- :func:`plot_pos_deciles`: content vs. function words per importance decile (Fig. 9).
- :func:`plot_importance_strips`: one heat strip per trace, importance over decoding steps
  (Fig. 2 right, Fig. 10/11).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from eval.harness.figures import new_figure, save_png

__all__ = ["plot_importance_strips", "plot_pareto", "plot_pos_deciles", "write_csv"]

COLORS = {"top": "tab:red", "bottom": "tab:blue", "random": "tab:green"}


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``rows`` (dicts with the keys of the first) to ``path`` as CSV with a header."""
    if not rows:
        raise ValueError(f"nothing to write to {path}")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _paths(out: str | Path, stem: str) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{stem}.png", out / f"{stem}.csv"


def plot_pareto(summary: Sequence[dict[str, Any]], out: str | Path, *, stem: str = "pareto", title: str = "") -> tuple[Path, Path]:
    """Accuracy vs. ``percent`` per strategy from :meth:`eval.analyses.pareto.ParetoResult.summary` rows.

    Returns ``(png, csv)`` paths under the directory ``out``.
    """
    png, table = _paths(out, stem)
    rows = list(summary)
    write_csv(table, rows)
    fig, ax = new_figure(5.5, 3.8)
    for strategy in ("top", "bottom", "random"):
        pts = sorted((r["percent"], r["accuracy"]) for r in rows if r["strategy"] == strategy)
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="o", color=COLORS[strategy], label=f"{strategy}-p%")
    full = [r["accuracy"] for r in rows if r["strategy"] == "full"]
    if full:
        ax.axhline(full[0], color="grey", linestyle="--", label=f"full thinking ({full[0]:.1%})")
    ax.set_xlabel("thinking tokens kept (%)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "Pareto retention: question + p% of thinking")
    save_png(fig, png)
    return png, table


def plot_pos_deciles(rows: Sequence[dict[str, Any]], out: str | Path, *, stem: str = "pos_deciles", title: str = "") -> tuple[Path, Path]:
    """Stacked bars of content / function word ratio per importance part (:meth:`PosDeciles.rows`)."""
    png, table = _paths(out, stem)
    rows = list(rows)
    write_csv(table, rows)
    parts = [r["part"] for r in rows]
    content = np.nan_to_num(np.array([r["content_ratio"] for r in rows], dtype=float))
    function = np.nan_to_num(np.array([r["function_ratio"] for r in rows], dtype=float))
    fig, ax = new_figure(5.5, 3.8)
    ax.bar(parts, content, color="tab:orange", label="content words (NOUN, VERB, ADJ, ADV, PROPN)")
    ax.bar(parts, function, bottom=content, color="tab:grey", alpha=0.6, label="function words")
    for x, c in zip(parts, content):
        ax.text(x, c / 2, f"{c:.0%}", ha="center", va="center", fontsize=7)
    ax.set_xticks(parts)
    ax.set_xlabel("importance part (1 = top 10%)")
    ax.set_ylabel("share of tokens")
    ax.set_ylim(0, 1.18)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or "Content-word ratio by importance decile")
    save_png(fig, png)
    return png, table


def plot_importance_strips(
    strips: np.ndarray | Sequence[Sequence[float]],
    out: str | Path,
    *,
    labels: Sequence[str] | None = None,
    stem: str = "importance_strips",
    title: str = "",
) -> tuple[Path, Path]:
    """One row per trace: importance over decoding steps (``[traces, bins]``, e.g. from
    :func:`eval.analyses.sparsity.importance_over_steps` with ``bins``), normalised per row."""
    png, table = _paths(out, stem)
    matrix = np.asarray(strips, dtype=float)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(f"strips must be a non-empty [traces, bins] matrix, got shape {matrix.shape}")
    labels = list(labels) if labels is not None else [str(i) for i in range(matrix.shape[0])]
    if len(labels) != matrix.shape[0]:
        raise ValueError(f"{len(labels)} labels for {matrix.shape[0]} strips")
    write_csv(table, [{"trace": lab, **{f"bin_{j}": float(v) for j, v in enumerate(row)}} for lab, row in zip(labels, matrix)])
    fig, ax = new_figure(7, 0.35 * matrix.shape[0] + 1.2)
    im = ax.imshow(matrix, aspect="auto", cmap="magma", interpolation="nearest", vmin=0.0)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.set_xlabel("decoding step (binned; left = first thinking token)")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01, label="importance / max")
    ax.set_title(title or "Importance of thinking tokens over decoding steps")
    save_png(fig, png)
    return png, table
