"""Figures whose every label lies inside the image: what each plot of ``eval/`` is made and saved with.

Figures use matplotlib's constrained layout (axes shrink to make room for tick labels, titles and legends
placed beside them, where ``tight_layout`` gives up with a warning and cuts them) and are saved with
``bbox_inches="tight"``. A panel whose tick labels are long (method names with their settings) is sized from
the labels' measured width (:func:`text_width_inches`) rather than a fixed guess, and
:func:`labels_outside` lists any text drawn past the figure's edge (the tests check every plot with it).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from dynts.io import write_atomic  # noqa: E402

__all__ = ["labels_outside", "new_figure", "save_png", "text_width_inches"]


def new_figure(width: float, height: float, ncols: int = 1, **subplots: Any) -> tuple[Figure, Any]:
    """``plt.subplots(1, ncols)`` with constrained layout, ``width`` x ``height`` inches in all; returns
    ``(fig, axes)`` (``axes`` a single Axes when ``ncols == 1`` and ``squeeze`` is not given)."""
    return plt.subplots(1, ncols, figsize=(width, height), layout="constrained", **subplots)


def text_width_inches(texts: Sequence[str], fontsize: float) -> float:
    """Width in inches of the widest of ``texts`` drawn at ``fontsize`` (0 for none), measured by the Agg renderer."""
    if not texts:
        return 0.0
    fig = plt.figure()
    try:
        renderer = fig.canvas.get_renderer()
        widths = [fig.text(0, 0, t, fontsize=fontsize).get_window_extent(renderer).width for t in texts]
        return max(widths) / fig.dpi
    finally:
        plt.close(fig)


def labels_outside(fig: Figure, tolerance: float = 1.0) -> list[str]:
    """The visible, non-empty texts of ``fig`` (tick labels, titles, axis labels, legends, annotations) whose
    drawn extent leaves the figure by more than ``tolerance`` pixels: each as ``'text' [x0, x1] outside [0, W]``."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    unshown = set()  # labels of ticks past the axis' view limits: matplotlib keeps them but does not draw them
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    unshown.update((id(tick.label1), id(tick.label2)))
    outside = []
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in unshown:
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -tolerance or box.y0 < -tolerance or box.x1 > width + tolerance or box.y1 > height + tolerance:
            outside.append(f"{text.get_text()!r} x [{box.x0:.0f}, {box.x1:.0f}] y [{box.y0:.0f}, {box.y1:.0f}] "
                           f"outside [0, {width:.0f}] x [0, {height:.0f}]")
    return outside


def save_png(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG at ``path`` (atomically, parent directories made) and close it."""
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=dpi, bbox_inches="tight", pad_inches=0.1)
    finally:
        plt.close(fig)
    path = Path(path)
    write_atomic(path, png.getvalue())
    return path
