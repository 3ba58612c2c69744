"""Step time and parallel efficiency against the rank count (:func:`plot_scaling`).

Part of :mod:`fourd_mpi.analysis.plots` (its docstring states the style and the conventions)."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from fourd_mpi.algorithms.registry import display_name
from fourd_mpi.analysis.plots._style import (
    _RC,
    PALETTE,
    _check_frame,
    _check_path,
    _save,
    _shown_algorithms,
    _time_unit,
    algorithm_title,
    config_label,
)


def plot_scaling(scaling_df, path, mode: str = "weak", title: Optional[str] = None) -> str:
    """Step time and parallel efficiency against the number of ranks, one line per ``config_key``.

    ``scaling_df``: :func:`fourd_mpi.analysis.tables.scaling` (columns ``config_key, world_size, grid,
    step_median_s, speedup, efficiency, ideal_step_s``; ``group`` is used instead of
    ``config_key`` when present). Left: the step time ``step_median_s`` (median over measured steps
    of the max over ranks), with error bars from ``step_q1_s``/``step_q3_s`` when the frame has them
    (log2 rank axis; weak: linear time axis from 0, strong: log time axis); the ideal is dashed:
    ``T(base)`` for weak scaling, ``T(base) * base / N`` for strong. Right: efficiency with the
    ideal 1.0 dashed. Where a line has several runs of one rank count (several grids), the line
    goes through the fastest and the others are shown as open markers. Points are annotated with
    their grid.

    Steps: the points (:func:`_scaling_points`), per line its step times (:func:`_draw_times`) and
    efficiencies (:func:`_draw_efficiencies`) from the same points, the rank axes (:func:`_rank_axes`),
    the value axes and titles (:func:`_time_axis`, :func:`_efficiency_axis`), the legend below both.
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"plot_scaling: mode must be 'weak' or 'strong', got {mode!r}")
    path = _check_path(path)
    _check_frame(scaling_df, "plot_scaling", ["config_key", "world_size", "step_median_s", "efficiency"])
    df, key = _scaling_points(scaling_df)
    scale, unit = _time_unit(float(df["step_median_s"].max()))
    sizes = sorted(set(int(v) for v in df["world_size"]))
    groups = list(dict.fromkeys(df[key].astype(str)))
    named = bool(_shown_algorithms(df))  # legend entries start with the algorithm's usual name

    with plt.rc_context(_RC):
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11.5, 4.4))
        eff_max = 1.0
        for i, name in enumerate(groups):
            color = PALETTE[i % len(PALETTE)]
            g = df[df[key].astype(str) == name].sort_values(["world_size", "step_median_s"], kind="stable")
            best = g.groupby("world_size", sort=True).head(1)  # fastest run per rank count
            shown = config_label(name)
            if named and display_name(g["algorithm"].iloc[0]) not in shown:
                shown = f"{display_name(g['algorithm'].iloc[0])}: {shown}"
            _draw_times(ax_t, g, best, mode, scale, color, shown, annotate=len(groups) <= 3)
            eff_max = max(eff_max, _draw_efficiencies(ax_e, g, best, color, shown))
        ax_e.axhline(1.0, ls="--", color="0.35", lw=1.2, zorder=1)
        _rank_axes((ax_t, ax_e), sizes)
        _time_axis(ax_t, df, mode, scale, unit)
        _efficiency_axis(ax_e, eff_max, mode)
        handles, labels = ax_t.get_legend_handles_labels()
        ncol = 1 if len(groups) <= 4 else 2
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False,
                   title="configuration (model, overlap options, MPI progress)")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return _save(fig, path)


def _scaling_points(scaling_df):
    """``(df, key)``: the rows with a finite step time and a positive world size (numbers as floats), and
    the column that names a line (``group`` when every row has one, else ``config_key``)."""
    df = scaling_df.copy()
    df["world_size"] = df["world_size"].astype(float)
    df["step_median_s"] = df["step_median_s"].astype(float)
    df["efficiency"] = df["efficiency"].astype(float)
    df = df[np.isfinite(df["step_median_s"]) & (df["world_size"] > 0)]
    if not len(df):
        raise ValueError("plot_scaling: no row has a finite step time and a positive world size")
    key = "group" if "group" in df.columns and df["group"].notna().all() else "config_key"
    return df, key


def _draw_times(ax, g, best, mode: str, scale: float, color, shown: str, annotate: bool) -> None:
    """One line's step times on ``ax``: the line through the fastest run per rank count (``best``), q1-q3
    error bars (the others' too), the dashed ideal (weak: ``T(base)``; strong: ``T(base) * base / N``,
    or the frame's ``ideal_step_s``), the other runs as open markers and, when ``annotate``, each point's
    grid."""
    rest = g.drop(best.index)
    n = best["world_size"].to_numpy()
    t = best["step_median_s"].to_numpy()
    base = n[0]
    if "ideal_step_s" in best.columns and np.isfinite(best["ideal_step_s"].astype(float)).all():
        ideal = best["ideal_step_s"].astype(float).to_numpy()
    else:
        ideal = np.full(len(n), t[0]) if mode == "weak" else t[0] * base / n
    ax.plot(n, t * scale, "-o", color=color, lw=1.8, ms=6, label=shown, zorder=3)
    if {"step_q1_s", "step_q3_s"} <= set(g.columns):  # quartiles of the per-step max over ranks
        for part, face in ((best, color), (rest, "none")):
            q1 = part["step_q1_s"].to_numpy(dtype=float)
            q3 = part["step_q3_s"].to_numpy(dtype=float)
            mid = part["step_median_s"].to_numpy(dtype=float)
            ok = np.isfinite(q1) & np.isfinite(q3)
            if ok.any():
                ax.errorbar(part["world_size"].to_numpy()[ok], mid[ok] * scale,
                            yerr=[np.maximum(mid - q1, 0)[ok] * scale, np.maximum(q3 - mid, 0)[ok] * scale],
                            fmt="none", ecolor=color, elinewidth=1.0, capsize=3, zorder=3)
    ax.plot(n, ideal * scale, "--", color=color, lw=1.2, alpha=0.8, zorder=2)
    if len(rest):
        ax.plot(rest["world_size"], rest["step_median_s"] * scale, "o", mfc="none", color=color, ms=6, zorder=3)
    if "grid" in g.columns and annotate:
        # weak lines rise: text above the point; strong lines fall: above and to the right
        offset, ha = ((0, 7), "center") if mode == "weak" else ((6, 3), "left")
        for _, row in g.iterrows():
            ax.annotate(str(row["grid"]), (row["world_size"], row["step_median_s"] * scale),
                        textcoords="offset points", xytext=offset, ha=ha, va="bottom", fontsize=7, color=color)


def _draw_efficiencies(ax, g, best, color, shown: str) -> float:
    """One line's parallel efficiencies on ``ax``: the line through ``best``, error bars at the quartiles of
    T(N) (efficiency ~ 1/T(N): q3 gives the low end, q1 the high end), the other runs as open markers;
    returns the highest efficiency drawn (at least 1)."""
    rest = g.drop(best.index)
    n = best["world_size"].to_numpy()
    eff = best["efficiency"].to_numpy()
    eff_max = 1.0
    ax.plot(n, eff, "-o", color=color, lw=1.8, ms=6, label=shown, zorder=3)
    if {"step_q1_s", "step_q3_s"} <= set(best.columns):  # efficiency at the quartiles of T(N)
        mid = best["step_median_s"].to_numpy(dtype=float)
        q1, q3 = (best[c].to_numpy(dtype=float) for c in ("step_q1_s", "step_q3_s"))
        ok = np.isfinite(q1) & np.isfinite(q3) & (q1 > 0) & np.isfinite(eff)
        if ok.any():
            low, high = eff * mid / np.where(ok, q3, 1.0), eff * mid / np.where(ok, q1, 1.0)
            ax.errorbar(n[ok], eff[ok], yerr=[np.maximum(eff - low, 0)[ok], np.maximum(high - eff, 0)[ok]],
                        fmt="none", ecolor=color, elinewidth=1.0, capsize=3, zorder=3)
            eff_max = max(eff_max, float(np.nanmax(high[ok])))
    if len(rest):
        ax.plot(rest["world_size"], rest["efficiency"], "o", mfc="none", color=color, ms=6, zorder=3)
    finite = np.concatenate([eff, rest["efficiency"].to_numpy()])
    finite = finite[np.isfinite(finite)]
    if len(finite):
        eff_max = max(eff_max, float(finite.max()))
    return eff_max


def _rank_axes(axes, sizes) -> None:
    """The rank axis of both panels: log2, a tick per rank count present (rotated past 8), a grid."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v))}"))
        lo, hi = min(sizes), max(sizes)
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.set_xlabel("MPI ranks (count, log\u2082 scale)")
        ax.grid(True, which="major", color="0.88", lw=0.8)
        ax.set_axisbelow(True)
        if len(sizes) > 8:
            plt.setp(ax.get_xticklabels(), rotation=45, ha="right")


def _time_axis(ax, df, mode: str, scale: float, unit: str) -> None:
    """The step time axis: strong, log with plain labels (minor ones at 2 and 5); weak, linear from 0 to
    above the highest median or q3; its label and the panel's title."""
    if mode == "strong":
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo / 1.15, hi * 1.35)
        ax.grid(True, which="minor", axis="y", color="0.94", lw=0.6)
    else:
        top = float(df["step_median_s"].max())
        if "step_q3_s" in df.columns and np.isfinite(df["step_q3_s"].astype(float)).any():
            top = max(top, float(np.nanmax(df["step_q3_s"].astype(float))))
        ax.set_ylim(0, top * scale * 1.18)
    ax.set_ylabel(f"step time ({unit}): median of max over ranks, bars q1-q3")
    ax.set_title(f"{mode.capitalize()} scaling{algorithm_title(df)}: step time (dashed: ideal)")


def _efficiency_axis(ax, eff_max: float, mode: str) -> None:
    """The efficiency axis in percent from 0 to above ``eff_max`` (at least 105 %), its label and the
    panel's title with the efficiency's formula."""
    ax.set_ylim(0, max(1.05, eff_max * 1.05))
    ax.set_ylabel("parallel efficiency (%), bars: at q3-q1 of T(N)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:.0f} %"))
    ideal_text = "T(base) / T(N)" if mode == "weak" else "T(base) \u00b7 base / (N \u00b7 T(N))"
    ax.set_title(f"Efficiency = {ideal_text} (dashed: ideal)")
