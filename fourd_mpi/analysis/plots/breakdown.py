"""Stacked bars of where the step time goes, per run (:func:`plot_breakdown`, :func:`breakdown_data`).

Part of :mod:`fourd_mpi.analysis.plots` (its docstring states the style and the conventions)."""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional, Tuple

import matplotlib.pyplot as plt
import numpy as np

from fourd_mpi.analysis.plots._style import (
    _COMPUTE_ORDER,
    _RC,
    CATEGORY_COLORS,
    PALETTE,
    RUN_AXIS_LABEL,
    STEP_CAPTION,
    _check_frame,
    _check_path,
    _save,
    _time_unit,
    _wrapped,
    algorithm_title,
    run_labels,
    sorted_runs,
)


def _segment_key(category: str, axis) -> str:
    category = str(category)
    if category == "exposed_comm":
        a = "" if axis is None or (isinstance(axis, float) and math.isnan(axis)) else str(axis)
        return f"exposed_comm:{a if a in ('x', 'y', 'z', 'data') else 'all'}"
    return category


def _segment_label(key: str) -> str:
    if key.startswith("exposed_comm:"):
        axis = key.split(":", 1)[1]
        return "exposed comm (all axes)" if axis == "all" else f"exposed comm, {axis} axis"
    return {"other": "other (overhead, issue, copies)", "compute": "compute (all ops)",
            "harness": "harness (synthetic data)"}.get(key, key)


def _segment_color(key: str, fallback: Iterable) -> str:
    if key in CATEGORY_COLORS:
        return CATEGORY_COLORS[key]
    return next(fallback)


def breakdown_matrix(breakdown_df, phase: Optional[str] = None):
    """Seconds per step as a (run_id x segment) frame: the segments of :func:`plot_breakdown`.

    The rows of each (run, segment) are summed over phases (``phase`` selects one phase instead).
    Segments are compute categories, then ``harness``, then ``exposed_comm:<axis>``, then
    ``other``, then unknown categories. Over all phases a run's segments sum to its step time
    ``step_s`` (:func:`fourd_mpi.analysis.tables.breakdown`). :func:`breakdown_data` adds the
    step time and its quartiles.
    """
    import pandas as pd

    df = breakdown_df.copy()
    if phase is not None:
        df = df[df["phase"].astype(str) == str(phase)]
        if not len(df):
            raise ValueError(f"plot_breakdown: no rows of phase {phase!r} "
                             f"(phases: {', '.join(sorted(set(breakdown_df['phase'].astype(str))))})")
    df["segment"] = [_segment_key(c, a) for c, a in zip(df["category"], df.get("axis", [""] * len(df)))]
    df["seconds_per_step"] = df["seconds_per_step"].astype(float)
    table = df.pivot_table(index="run_id", columns="segment", values="seconds_per_step", aggfunc="sum",
                           fill_value=0.0, sort=False)
    known = ([c for c in _COMPUTE_ORDER] + ["harness"] + [f"exposed_comm:{a}" for a in ("x", "y", "z", "data", "all")]
             + ["other"])
    order = [c for c in known if c in table.columns] + [c for c in table.columns if c not in known]
    return pd.DataFrame(table[order])


def breakdown_data(breakdown_df, phase: Optional[str] = None):
    """The data frame :func:`plot_breakdown` draws: :func:`breakdown_matrix` (seconds per step per
    segment, one row per run) plus the columns ``step_s``, ``step_q1_s``, ``step_q3_s`` (the run's
    median step time and its quartiles, :func:`fourd_mpi.trace.summary.step_stats`; the bar's
    height and error bar). With ``phase``, ``step_s`` is still the whole step's (the bar is the
    phase's part of it) and no error bar is drawn.
    """
    table = breakdown_matrix(breakdown_df, phase)
    for column in ("step_s", "step_q1_s", "step_q3_s"):
        if column in breakdown_df.columns:
            values = breakdown_df.groupby(breakdown_df["run_id"].astype(str), sort=False)[column].first()
            table[column] = values.reindex(table.index.astype(str)).to_numpy(dtype=float)
        else:
            table[column] = float("nan")
    return table


def plot_breakdown(breakdown_df, runs_df, path, normalize: bool = False, phase: Optional[str] = None,
                   orientation: str = "vertical", title: Optional[str] = None) -> str:
    """Stacked bars of where the step time goes, one bar per run.

    ``breakdown_df``: long frame of :func:`fourd_mpi.analysis.tables.breakdown` (``run_id, phase,
    category, axis, seconds_per_step, share``), several runs concatenated; phases are summed
    (``phase=`` picks one). ``runs_df``: :func:`fourd_mpi.analysis.tables.runs_table` rows, used for the
    bar labels (rank count, grid, overlap, label) and the bar order (rank count, grid, step time); may be
    ``None`` (labels = run ids, in the frame's order). The figure's width follows the number of bars.
    Segments: compute ops (blues/greens), exposed communication per axis (reds/oranges),
    ``other`` (grey). A bar's height is the run's step time (median over measured steps of the max
    over ranks), split by the categories' shares; its error bar spans the quartiles q1-q3 of the
    same per-step series (:func:`breakdown_data` is the frame drawn). ``normalize=True`` shows
    percent of the step instead of time per step (no error bars). ``orientation`` ``"vertical"``
    (value on y) or ``"horizontal"``.

    Steps, top to bottom: the bars' numbers (:func:`_ordered_runs`, :func:`_bar_values`), the frame
    (:func:`_breakdown_frame`), the stacked bars (:func:`_draw_segments`), error bars and totals
    (:func:`_draw_spread_and_totals`), axes and legend (:func:`_label_axes`), title and caption
    (:func:`_title_and_caption`).
    """
    if orientation not in ("vertical", "horizontal"):
        raise ValueError(f"plot_breakdown: orientation must be 'vertical' or 'horizontal', got {orientation!r}")
    path = _check_path(path)
    _check_frame(breakdown_df, "plot_breakdown", ["run_id", "phase", "category", "seconds_per_step"])
    run_ids, labels, table, stats = _ordered_runs(breakdown_df, runs_df, phase)
    bars = _bar_values(table, stats, normalize, phase)
    vertical = orientation == "vertical"
    with plt.rc_context(_RC):
        fig, ax = _breakdown_frame(labels, len(run_ids), vertical)
        pos = np.arange(len(run_ids))
        bottom = _draw_segments(ax, pos, list(table.columns), bars.values, vertical)
        top = _draw_spread_and_totals(ax, pos, bottom, bars, normalize, vertical)
        _label_axes(ax, pos, [labels[r] for r in run_ids], bars.unit_label, top, normalize, vertical)
        _title_and_caption(fig, ax, runs_df, phase, normalize, bars.clipped, title)
        fig.tight_layout()
        return _save(fig, path)


class _Bars(NamedTuple):
    """The numbers drawn: ``values`` (runs x segments, in the axis unit, negatives as 0), the axis unit
    (``scale`` seconds -> unit, ``unit``, ``unit_label``), ``errors`` (``(centre, below, above)`` per run in
    the axis unit, NaN centre: none) or None, and whether a negative segment was ``clipped``."""

    values: np.ndarray
    scale: float
    unit: str
    unit_label: str
    errors: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]
    clipped: bool


def _ordered_runs(breakdown_df, runs_df, phase: Optional[str]):
    """``(run_ids, labels, table, stats)``: the runs in bar order (by rank count, grid, step time when
    ``runs_df`` has ``run_id``, else the frame's), their labels, the seconds per step per segment
    (runs x segments) and the step time columns ``step_s, step_q1_s, step_q3_s`` in that order."""
    data = breakdown_data(breakdown_df, phase)
    stats = data[["step_s", "step_q1_s", "step_q3_s"]]
    table = data.drop(columns=["step_s", "step_q1_s", "step_q3_s"])
    run_ids = list(table.index)
    if runs_df is not None and hasattr(runs_df, "columns") and "run_id" in runs_df.columns:
        run_ids = sorted_runs(run_ids, runs_df)  # by rank count, grid, step time
        table = table.loc[run_ids]
        stats = stats.loc[run_ids]
    return run_ids, run_labels(run_ids, runs_df), table, stats


def _bar_values(table, stats, normalize: bool, phase: Optional[str]) -> _Bars:
    """The segments in percent of the bar (``normalize``) or in a time unit read comfortably at the highest
    of the bars and the q3 values; the q1-q3 error bars of whole-step bars (no ``phase``, not ``normalize``)."""
    values = table.to_numpy(dtype=float)
    negative = values < 0
    clipped = bool(negative.any())
    values = np.where(negative, 0.0, values)
    totals = values.sum(axis=1)
    unit = ""
    if normalize:
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(totals[:, None] > 0, 100.0 * values / totals[:, None], 0.0)
        scale, unit_label = 1.0, "share of the step (%)"
    else:
        q3 = stats["step_q3_s"].to_numpy(dtype=float)
        high = max([float(totals.max())] + [float(v) for v in q3 if np.isfinite(v)]) if len(totals) else 0.0
        scale, unit = _time_unit(high)
        values = values * scale
        unit_label = f"step time ({unit}): median of max over ranks"
    errors = None
    if not normalize and phase is None:
        median, q1, q3 = (stats[c].to_numpy(dtype=float) * scale for c in ("step_s", "step_q1_s", "step_q3_s"))
        ok = np.isfinite(median) & np.isfinite(q1) & np.isfinite(q3)
        if ok.any():
            errors = (np.where(ok, median, np.nan), np.where(ok, np.maximum(median - q1, 0), 0.0),
                      np.where(ok, np.maximum(q3 - median, 0), 0.0))
    return _Bars(values, scale, unit, unit_label, errors, clipped)


def _breakdown_frame(labels, nbars: int, vertical: bool):
    """``(fig, ax)`` sized to the bars: vertical bars widen the plot area with their count and their
    longest label line (plus room for the axis and the legend); horizontal ones heighten it."""
    longest = max(len(line) for text in labels.values() for line in text.split("\n"))
    if vertical:
        # sized to the bars: the plot area grows with them, plus room for the axis and the legend
        width_in = min(20.0, 3.2 + max(1.2, nbars * max(0.8, 0.075 * longest)))
        return plt.subplots(figsize=(width_in, 4.8))
    return plt.subplots(figsize=(9.0, max(2.6, 0.9 + 0.62 * nbars * max(1, max(
        t.count("\n") + 1 for t in labels.values()) / 2))))


def _draw_segments(ax, pos, segments, values, vertical: bool):
    """One stacked bar per run, a segment per column of ``values`` (exposed communication hatched); returns
    the bars' totals (their tops)."""
    fallback = iter(list(PALETTE) * 4)
    bottom = np.zeros(len(pos))
    for j, seg in enumerate(segments):
        color = _segment_color(seg, fallback)
        kw = dict(color=color, edgecolor="white", linewidth=0.6, label=_segment_label(seg))
        if seg.startswith("exposed_comm"):
            kw.update(hatch="///", edgecolor="white")
        if vertical:
            ax.bar(pos, values[:, j], bottom=bottom, width=0.62, **kw)
        else:
            ax.barh(pos, values[:, j], left=bottom, height=0.62, **kw)
        bottom += values[:, j]
    return bottom


def _draw_spread_and_totals(ax, pos, bottom, bars: _Bars, normalize: bool, vertical: bool) -> float:
    """The q1-q3 error bars (when ``bars.errors``) and each bar's total written past its end (past the
    error bar where there is one); returns the highest value drawn."""
    errors = bars.errors
    top = float(bottom.max()) if len(pos) else 1.0
    if errors is not None:
        centre, below, above = errors
        shown = np.isfinite(centre)
        if vertical:
            ax.errorbar(pos[shown], centre[shown], yerr=[below[shown], above[shown]], fmt="none",
                        ecolor="black", elinewidth=1.0, capsize=4, zorder=4, label="q1-q3 of step time")
        else:
            ax.errorbar(centre[shown], pos[shown], xerr=[below[shown], above[shown]], fmt="none",
                        ecolor="black", elinewidth=1.0, capsize=4, zorder=4, label="q1-q3 of step time")
        top = max(top, float(np.nanmax(centre + above)))
    for i, total in enumerate(bottom):
        text = f"{total:.0f} %" if normalize else f"{total:.3g} {bars.unit}"
        at = total if errors is None or not np.isfinite(errors[0][i]) else errors[0][i] + errors[2][i]
        if vertical:
            ax.text(pos[i], at + 0.01 * top, text, ha="center", va="bottom", fontsize=8)
        else:
            ax.text(at + 0.01 * top, pos[i], text, ha="left", va="center", fontsize=8)
    return top


def _label_axes(ax, pos, ticklabels, unit_label: str, top: float, normalize: bool, vertical: bool) -> None:
    """Run labels on the category axis, the unit on the value axis, limits with room for the totals, a
    grid along the values, and the legend right of the axes (vertical: in stacking order, top first)."""
    nbars = len(pos)
    if vertical:
        ax.set_xticks(pos)
        ax.set_xticklabels(ticklabels, fontsize=8)
        ax.set_xlabel(RUN_AXIS_LABEL)
        ax.set_ylabel(unit_label)
        ax.set_ylim(0, 100 * 1.07 if normalize else top * 1.1)
        ax.set_xlim(-0.6, nbars - 0.4)
        ax.grid(True, axis="y", color="0.88")
    else:
        ax.set_yticks(pos)
        ax.set_yticklabels(ticklabels, fontsize=8)
        ax.invert_yaxis()
        ax.set_ylabel(RUN_AXIS_LABEL)
        ax.set_xlabel(unit_label)
        ax.set_xlim(0, 100 * 1.1 if normalize else top * 1.15)
        ax.grid(True, axis="x", color="0.88")
    ax.set_axisbelow(True)
    handles, leg_labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1] if vertical else handles, leg_labels[::-1] if vertical else leg_labels,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="category")


def _title_and_caption(fig, ax, runs_df, phase: Optional[str], normalize: bool, clipped: bool,
                       title: Optional[str]) -> None:
    """The title (``title``, else what is drawn: algorithm, phase, share) and the grey caption under the
    figure: what a bar is (time bars) and that negative segments were drawn as 0."""
    head = title or ("Step time breakdown" + algorithm_title(runs_df) + (f", phase {phase}" if phase else "")
                     + (" (share of the step)" if normalize else ""))
    ax.set_title(head)
    notes = [] if normalize else [STEP_CAPTION + "; segments: the step time split by each category's "
                                                  "share of all ranks' time"]
    if clipped:
        notes.append("negative segments (clock rounding) were drawn as 0")
    if notes:
        fig.text(0.01, -0.02, _wrapped("\n".join(notes), fig.get_figwidth(), 7), fontsize=7, color="0.4",
                 va="top")
