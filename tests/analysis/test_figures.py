"""Figures fit for a paper: every ``plot`` kind, drawn from the committed sample traces
(no MPI) and from hand-built frames, opened as a file and as a figure:

- the written PNG has a size within bounds and sized to the data (one bar is narrow, eight are wider);
- every axis has a label that names its unit (or, for an axis of categories, what they are) in parentheses;
- no two labels overlap: tick labels of one axis, axis labels, titles and legend texts, by the window
  extents matplotlib computes for the tight bounding box;
- error bars are drawn wherever the data has quartiles (scaling: step time and efficiency; breakdown);
- run labels carry the rank count and the grid, in order of ranks, grid, step time;
- the overlap figure plots hidden_pct with a baseline and calls overlap_pct an upper bound without one;
- one colour-blind-safe palette; PNG, SVG and PDF.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd
import pytest

matplotlib = pytest.importorskip("matplotlib")

import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from conftest import REPO  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

from fourd_mpi.analysis import (
    plots,  # noqa: E402
    tables,  # noqa: E402
)
from fourd_mpi.trace.read import load_trace  # noqa: E402

SAMPLES = REPO / "results" / "samples"
GRIDS = sorted(SAMPLES.glob("grid-*.h5"))
UNIT = re.compile(r"\(([^)]+)\)")


@pytest.fixture(scope="module")
def grid_traces():
    return [load_trace(str(p)) for p in GRIDS]


@pytest.fixture(scope="module")
def weak_traces():
    return [load_trace(str(p)) for p in sorted(SAMPLES.glob("weak-*.h5"))]


@pytest.fixture(autouse=True)
def closed():
    plt.close("all")
    yield
    plt.close("all")


def texts_of(fig):
    """Every visible, non-empty text of ``fig`` with its window extent, grouped by what it is."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        for kind, items in (("xtick", ax.get_xticklabels()), ("ytick", ax.get_yticklabels()),
                            ("label", [ax.xaxis.label, ax.yaxis.label]), ("title", [ax.title])):
            out += [(kind, t, t.get_window_extent(renderer)) for t in items if t.get_visible() and t.get_text()]
        legend = ax.get_legend()
        if legend is not None:
            out += [("legend", t, t.get_window_extent(renderer)) for t in legend.get_texts() if t.get_text()]
    for legend in fig.legends:
        out += [("legend", t, t.get_window_extent(renderer)) for t in legend.get_texts() if t.get_text()]
    return out


def overlapping(fig):
    """Pairs of labels whose extents overlap by more than a pixel (tick labels of one axis among themselves,
    and every label against the axis labels and titles)."""
    fig.canvas.draw()
    found = []
    items = texts_of(fig)
    for (k1, t1, b1), (k2, t2, b2) in itertools.combinations(items, 2):
        comparable = (k1 == k2 and k1 in ("xtick", "ytick") and t1.axes is t2.axes) or \
            ({k1, k2} & {"label", "title"} and t1.axes is t2.axes)
        if not comparable:
            continue
        w = min(b1.x1, b2.x1) - max(b1.x0, b2.x0)
        h = min(b1.y1, b2.y1) - max(b1.y0, b2.y0)
        if w > 1 and h > 1:
            found.append((t1.get_text(), t2.get_text()))
    return found


def check_axes(fig, min_axes: int = 1):
    """Every data axes: both axis labels set, each with a parenthesised unit or description."""
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert len(axes) >= min_axes
    for ax in axes:
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert label and UNIT.search(label), f"axis label without a unit: {label!r}"
    assert overlapping(fig) == [], overlapping(fig)


def errorbars(ax) -> int:
    return sum(isinstance(c, ErrorbarContainer) for c in ax.containers)


def png_size(fig_function, tmp_path, name):
    path = str(tmp_path / f"{name}.png")
    fig_function(path)
    h, w = mpimg.imread(path).shape[:2]
    assert 250 <= h <= 3000 and 300 <= w <= 3000, (w, h)
    return w, h


# ---------------------------------------------------------------------------

def test_scaling_has_units_error_bars_on_both_panels_and_readable_keys(weak_traces, tmp_path):
    runs = tables.runs_table(weak_traces)
    frame = tables.scaling(runs, "weak")
    fig = plots.plot_scaling(frame, None, mode="weak")
    check_axes(fig, min_axes=2)
    time_ax, eff_ax = fig.axes[:2]
    assert errorbars(time_ax) >= 1 and errorbars(eff_ax) >= 1  # quartiles exist: both panels have bars
    keys = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert keys == ["gpt-tiny, overlap none, progress poll"]  # not gpt-tiny/none/poll
    png_size(lambda p: plots.plot_scaling(frame, p, mode="weak"), tmp_path, "scaling")


def test_breakdown_is_sized_to_the_data_labelled_with_ranks_and_grid_and_sorted(grid_traces, tmp_path):
    one = tables.breakdown(grid_traces[0])
    runs = tables.runs_table(grid_traces)
    w1, _ = png_size(lambda p: plots.plot_breakdown(one, runs.iloc[:1], p), tmp_path, "one")
    assert w1 <= 1000  # one bar is no longer a wide canvas of legend and white space
    frame = pd.concat([tables.breakdown(t) for t in grid_traces])
    w4, _ = png_size(lambda p: plots.plot_breakdown(frame, runs, p), tmp_path, "four")
    assert w4 > w1
    fig = plots.plot_breakdown(frame, runs, None)
    check_axes(fig)
    ax = fig.axes[0]
    assert errorbars(ax) == 1
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert all(re.search(r"^8 ranks, grid \d+x\d+x\d+x\d+", label) for label in labels), labels
    order = [runs.set_index("run_id").loc[r] for r in plots.sorted_runs(list(runs.run_id), runs)]
    keys = [(r.world_size, r.grid, r.step_median_s) for r in order]
    assert keys == sorted(keys)
    assert [label.split("\n")[0] for label in labels] == [f"8 ranks, grid {r.grid}" for r in order]


def test_overlap_plots_hidden_pct_with_a_baseline_and_calls_overlap_pct_an_upper_bound(grid_traces, tmp_path):
    runs = tables.runs_table(grid_traces)
    overlapped = [t for t in grid_traces if "overlap" in t.path]
    comm = pd.concat([tables.comm_table(t) for t in overlapped])
    fig = plots.plot_overlap(comm, None, runs)
    check_axes(fig)
    ax = fig.axes[0]
    assert "upper bound" in ax.get_ylabel() and "overlap_pct" in ax.get_ylabel()
    assert any("UPPER BOUND" in t.get_text() for t in fig.texts)
    plt.close(fig)
    baseline = tables.comm_table(next(t for t in grid_traces if "1x2x2x2" not in t.path and "overlap" not in t.path))
    hidden = tables.hidden_vs_baseline(comm, baseline)
    fig = plots.plot_overlap(hidden, None, runs)
    check_axes(fig)
    ax = fig.axes[0]
    assert "hidden_pct" in ax.get_ylabel() and any("hidden_pct = 100" in t.get_text() for t in fig.texts)
    values = hidden["hidden_pct"].astype(float)
    top = float(values[np.isfinite(values)].max()) if np.isfinite(values).any() else 0.0
    assert ax.get_ylim()[1] <= max(5.0, 1.3 * top) * 1.1 + 1e-9  # the axis ends near the data, not at 100 %
    # many runs: the figure stays within bounds and has no rotated value labels
    many = pd.concat([tables.comm_table(t).assign(run_id=f"{t.path}-{i}") for t in grid_traces for i in range(2)])
    w, _ = png_size(lambda p: plots.plot_overlap(many, p), tmp_path, "many")
    assert w <= 2000
    fig = plots.plot_overlap(many, None)
    assert not any(t.get_rotation() for t in fig.axes[0].texts)
    check_axes(fig)


def test_timeline_has_units_and_no_overlaps(grid_traces):
    trace = next(t for t in grid_traces if "overlap" in t.path)
    fig = plots.plot_timeline(trace, None)
    check_axes(fig)


def test_one_colour_blind_safe_style(weak_traces, grid_traces):
    frame = tables.scaling(tables.runs_table(weak_traces), "weak")
    fig = plots.plot_scaling(frame, None)
    colours = {to_hex(line.get_color()) for line in fig.axes[0].get_lines() if line.get_linestyle() == "-"}
    assert colours <= {c.lower() for c in plots.PALETTE}
    plt.close(fig)
    comm = pd.concat([tables.comm_table(t) for t in grid_traces])
    fig = plots.plot_overlap(comm, None)
    bars = {to_hex(p.get_facecolor()) for p in fig.axes[0].patches}
    assert bars <= {c.lower() for c in plots.PALETTE}
    # no red-green pair: compute is blue / bluish green, waits vermillion to yellow, and hatched
    assert plots.COMPUTE_COLORS["gemm"] == plots.PALETTE[0] and plots.WAIT_COLORS["x"] == "#D55E00"


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_every_kind_writes_every_format(grid_traces, weak_traces, tmp_path, fmt):
    runs = tables.runs_table(grid_traces)
    made = [plots.plot_scaling(tables.scaling(tables.runs_table(weak_traces), "weak"), str(tmp_path / f"s.{fmt}")),
            plots.plot_breakdown(tables.breakdown(grid_traces[0]), runs, str(tmp_path / f"b.{fmt}")),
            plots.plot_overlap(tables.comm_table(grid_traces[1]), str(tmp_path / f"o.{fmt}"), runs),
            plots.plot_timeline(grid_traces[1], str(tmp_path / f"t.{fmt}"))]
    for path in made:
        head = open(path, "rb").read(8)
        assert head.startswith({"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF-"}[fmt]), path
        if fmt == "svg":
            text = open(path, encoding="utf-8").read()
            assert UNIT.search(text)  # the axis labels are text, with their units
