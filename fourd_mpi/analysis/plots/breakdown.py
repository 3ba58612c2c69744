"""Stacked bars of where the step time goes, per run (:func:`plot_breakdown`, :func:`breakdown_data`).

Part of :mod:`fourd_mpi.analysis.plots` (its docstring states the style and the conventions)."""

from __future__ import annotations

import math
from typing import Iterable, Optional

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

    Long: one figure, top to bottom: frame, scale, stacked bars, error bars, labels, legend; they share most locals.
    """
    if orientation not in ("vertical", "horizontal"):
        raise ValueError(f"plot_breakdown: orientation must be 'vertical' or 'horizontal', got {orientation!r}")
    path = _check_path(path)
    _check_frame(breakdown_df, "plot_breakdown", ["run_id", "phase", "category", "seconds_per_step"])
    data = breakdown_data(breakdown_df, phase)
    stats = data[["step_s", "step_q1_s", "step_q3_s"]]
    table = data.drop(columns=["step_s", "step_q1_s", "step_q3_s"])
    run_ids = list(table.index)
    if runs_df is not None and hasattr(runs_df, "columns") and "run_id" in runs_df.columns:
        run_ids = sorted_runs(run_ids, runs_df)  # by rank count, grid, step time
        table = table.loc[run_ids]
        stats = stats.loc[run_ids]
    labels = run_labels(run_ids, runs_df)
    values = table.to_numpy(dtype=float)
    negative = values < 0
    clipped = bool(negative.any())
    values = np.where(negative, 0.0, values)
    totals = values.sum(axis=1)
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

    fallback = iter(list(PALETTE) * 4)
    segments = list(table.columns)
    nbars = len(run_ids)
    vertical = orientation == "vertical"
    with plt.rc_context(_RC):
        longest = max(len(line) for text in labels.values() for line in text.split("\n"))
        if vertical:
            # sized to the bars: the plot area grows with them, plus room for the axis and the legend
            width_in = min(20.0, 3.2 + max(1.2, nbars * max(0.8, 0.075 * longest)))
            fig, ax = plt.subplots(figsize=(width_in, 4.8))
        else:
            fig, ax = plt.subplots(figsize=(9.0, max(2.6, 0.9 + 0.62 * nbars * max(1, max(
                t.count("\n") + 1 for t in labels.values()) / 2))))
        pos = np.arange(nbars)
        bottom = np.zeros(nbars)
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
        top = float(bottom.max()) if nbars else 1.0
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
            text = f"{total:.0f} %" if normalize else f"{total:.3g} {unit}"
            at = total if errors is None or not np.isfinite(errors[0][i]) else errors[0][i] + errors[2][i]
            if vertical:
                ax.text(pos[i], at + 0.01 * top, text, ha="center", va="bottom", fontsize=8)
            else:
                ax.text(at + 0.01 * top, pos[i], text, ha="left", va="center", fontsize=8)
        ticklabels = [labels[r] for r in run_ids]
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
        fig.tight_layout()
        return _save(fig, path)
