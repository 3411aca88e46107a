"""Every method is named inside the plots ``dynts eval`` and ``dynts demo`` write (``eval/harness/figures.py``,
``eval.harness.report``): each label's drawn extent lies inside the figure."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from eval.harness.figures import labels_outside, new_figure, save_png
from eval.harness.report import display_labels, plot_sweep, sweep_figure

ROOT = Path(__file__).resolve().parents[1]


def demo_results(family: str) -> list[dict]:
    return json.loads((ROOT / "reports" / "demo" / family / "results.json").read_text())


@pytest.mark.parametrize("family", ["copy", "chain"])
def test_demo_bars_name_every_method_inside_the_figure(family):
    results = demo_results(family)
    fig = sweep_figure(results, "budget")
    (ax,) = fig.axes
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    bounded = [r for r in results if r["budget"] is not None]
    assert sorted(ticks) == sorted(display_labels([r["method"]["label"] for r in bounded]))
    assert "dynts" in ticks and all(":" not in t for t in ticks)  # short names, settings left to results.md
    assert labels_outside(fig) == []


def test_long_labels_and_a_legend_beside_the_axes_stay_inside():
    """A budget sweep whose methods keep their full labels (two settings of one method share a short name) and
    whose legend sits right of the axes: the figure widens to the measured labels, nothing is cut."""
    results = demo_results("copy")
    rows = [results[0]]
    for budget in (64, 96, 128):
        for result in results[1:5]:
            rows.append({**copy.deepcopy(result), "budget": budget})
    twin = copy.deepcopy(rows[1])
    twin["method"]["label"] = "dynts:local_window_share=0.3556,retention=0.2,selection=a_long_option_value_for_this_test"
    rows.append(twin)
    fig = sweep_figure(rows, "budget")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(text.startswith(twin["method"]["label"]) for text in legend)
    assert labels_outside(fig) == []


def test_a_label_past_the_edge_is_reported(tmp_path):
    """The check itself: text drawn outside the figure is listed, and the written PNG keeps it (tight bbox)."""
    fig, ax = new_figure(3, 2)
    fig.text(1.1, 0.5, "far to the right of the figure")
    assert any("far to the right" in entry for entry in labels_outside(fig))
    png = save_png(fig, tmp_path / "cut.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_sweep_writes_the_png(tmp_path):
    path = plot_sweep(demo_results("chain"), "budget", tmp_path / "accuracy_vs_budget.png")
    assert path == tmp_path / "accuracy_vs_budget.png" and path.stat().st_size > 10_000
