"""Figures of traces and of the frames of :mod:`fourd_mpi.analysis.tables` (matplotlib, Agg backend).

>>> plot_scaling(scaling(runs, "weak"), "weak.png", mode="weak")   # step time + efficiency vs ranks
>>> plot_breakdown(breakdown_df, runs, "breakdown.svg")             # stacked bars per run
>>> plot_timeline(load_trace("run.h5"), "timeline.pdf")              # Gantt chart of one step
>>> plot_overlap(comm_df, "overlap.png")                             # overlap_pct per collective

Every function writes one file, whose format comes from the suffix of ``path`` (``.png``,
``.svg`` or ``.pdf``), closes its figure and returns ``path``; with ``path=None`` it returns the open
figure instead (for inspection: the caller closes it). Invalid input (an empty
frame, a missing column, an unknown step, a rank out of range, another suffix) raises
``ValueError`` with the reason.

One style for every figure (:data:`_RC`), colour-blind safe: runs and lines take the Okabe-Ito palette
(:data:`PALETTE`, distinguishable with protanopia, deuteranopia and tritanopia), compute ops blues and
bluish greens, exposed communication (waits) vermillion/orange/yellow shades (one per grid axis) and
always hatched, so that no figure relies on telling red from green; collectives reddish purple, brown
and orange; harness work sand; everything else grey. Every axis label names its unit; every run is
labelled with its rank count and grid.

Step times are the one statistic of :func:`fourd_mpi.trace.summary.step_stats` (median over the
measured steps of the max over ranks of the step span), as in every table and the run summary;
error bars span its quartiles q1-q3 (of the same per-step max-over-ranks series).
"""

from __future__ import annotations

import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg", force=False)  # no display needed; harmless if pyplot already chose Agg

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

from fourd_mpi.algorithms.registry import ALGORITHMS, DEFAULT_ALGORITHM, display_name, of_metadata  # noqa: E402
from fourd_mpi.util.text import short_label  # noqa: E402

__all__ = ["plot_scaling", "plot_breakdown", "plot_timeline", "plot_overlap", "FORMATS",
           "CATEGORY_COLORS", "OP_COLORS"]

FORMATS = (".png", ".svg", ".pdf")

#: Okabe & Ito's colour-blind-safe palette (Color Universal Design, 2008): runs and lines, in this order
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")

#: breakdown categories (compute ops, then the aggregate "compute" of traces below level op)
COMPUTE_COLORS = {
    "gemm": "#0072B2",
    "attention": "#56B4E9",
    "layernorm": "#a6d1ef",
    "gelu": "#009E73",
    "residual": "#7fcdb8",
    "loss": "#005a43",
    "optimizer": "#003a63",
    "compute": "#56B4E9",
}
#: harness work inside a step (synthetic data of schema <= 2 traces): not compute
HARNESS_COLOR = "#d9c89e"
#: exposed communication (waits) per grid axis
WAIT_COLORS = {
    "x": "#D55E00",
    "y": "#E69F00",
    "z": "#F0E442",
    "data": "#f7e9a8",
    "all": "#D55E00",
    "none": "#D55E00",
    "": "#D55E00",
}
OTHER_COLOR = "#9e9e9e"
#: collectives on the comm lanes of the timeline
COLLECTIVE_COLORS = {"allgather": "#CC79A7", "reduce_scatter": "#8c6d31", "allreduce": "#E69F00"}
WAIT_COLOR = "#D55E00"

CATEGORY_COLORS = dict(COMPUTE_COLORS, other=OTHER_COLOR, harness=HARNESS_COLOR,
                       **{f"exposed_comm:{a}": c for a, c in WAIT_COLORS.items() if a})
OP_COLORS = dict(COMPUTE_COLORS, wait=WAIT_COLOR, data=HARNESS_COLOR, **COLLECTIVE_COLORS)

_COMPUTE_ORDER = ("gemm", "attention", "layernorm", "gelu", "residual", "loss", "optimizer", "compute")
_AXIS_ORDER = ("x", "y", "z", "data", "all", "none", "")
_COLLECTIVE_ORDER = ("allgather", "reduce_scatter", "allreduce")
_AGGREGATE_PHASES = ("all", "total", "step")

RUN_AXIS_LABEL = "run (ranks, grid, overlap; sorted by ranks, grid, step time)"
STEP_CAPTION = ("step time: median over the measured steps of the max over ranks of the step span; "
                "error bars: quartiles q1-q3 of the same per-step series")

OVERLAP_CAPTION = ("overlap_pct = 100 \u00d7 host compute in flight / in-flight time, over the measured steps and ranks: "
                   "100 \u00d7 \u03a3 overlap_ns / \u03a3 (complete_ns \u2212 call_ns).\n"
                   "An UPPER BOUND of the hidden communication: compute beside a collective that would have "
                   "finished anyway hides nothing. Give a run without overlap (--baseline) for hidden_pct.")
HIDDEN_CAPTION = ("hidden_pct = 100 \u00d7 clip(1 \u2212 exposed / exposed of the baseline run, 0, 1), exposed = host "
                  "time in MPI for the collective per step\n(OSU's overlap with the baseline, a run without overlap, as "
                  "t_pure): the communication time that stopped being exposed.")

_RC = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "axes.prop_cycle": matplotlib.cycler(color=list(PALETTE)),
    "svg.fonttype": "none",  # text stays text in SVG (searchable, smaller)
    "pdf.fonttype": 42,
    "hatch.linewidth": 0.6,
}


# ---------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------

def _check_path(path) -> Optional[str]:
    if path is None:  # the caller wants the figure itself
        return None
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the figure format from {path!r}: the file name must end in "
                         f"{', '.join(FORMATS)}")
    return path


def _save(fig: Figure, path: Optional[str]):
    """Write ``fig`` to ``path`` in the one style and close it; ``path=None``: return the open figure."""
    if path is None:
        return fig
    try:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with plt.rc_context(_RC):
            fig.savefig(path, format=os.path.splitext(path)[1].lower()[1:], bbox_inches="tight", pad_inches=0.08)
    finally:
        plt.close(fig)
    return path


def _check_frame(df, name: str, columns: Sequence[str]) -> None:
    if df is None or not hasattr(df, "columns"):
        raise ValueError(f"{name}: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{name}: missing column(s) {', '.join(missing)} (has {', '.join(map(str, df.columns))})")
    if len(df) == 0:
        raise ValueError(f"{name}: the frame is empty, nothing to plot")


def _time_unit(max_seconds: float) -> Tuple[float, str]:
    """Scale factor and unit name so that the largest value reads comfortably."""
    if not np.isfinite(max_seconds) or max_seconds >= 1.0:
        return 1.0, "s"
    if max_seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "\u00b5s"




def _shown_algorithms(frame) -> List[str]:
    """The algorithms of a frame's rows worth naming in a figure: all of them when they differ or one
    that is not the default (a figure of ``axonn4d`` runs alone reads as before); else none."""
    if frame is None or not hasattr(frame, "columns") or "algorithm" not in frame.columns:
        return []
    names = list(dict.fromkeys(str(a) for a in frame["algorithm"] if isinstance(a, str) and a))
    return names if len(names) > 1 or (names and names[0] != DEFAULT_ALGORITHM) else []


def algorithm_title(frame) -> str:
    """``", Megatron-LM 1D"`` when every row is of one non-default algorithm, else ``""``."""
    names = _shown_algorithms(frame)
    return f", {display_name(names[0])}" if len(names) == 1 else ""


def run_labels(run_ids: Sequence[str], runs_df=None) -> Dict[str, str]:
    """``algorithm · grid · overlap · label`` per run id (run id when unknown; made unique if needed);
    the algorithm by its usual name (:func:`~fourd_mpi.algorithms.registry.display_name`) when the runs
    are not all ``axonn4d``."""
    info = {}
    if runs_df is not None and hasattr(runs_df, "columns") and "run_id" in runs_df.columns:
        for _, row in runs_df.drop_duplicates("run_id").iterrows():
            info[str(row["run_id"])] = row
    named = bool(_shown_algorithms(runs_df))
    labels = {}
    for rid in run_ids:
        row = info.get(str(rid))
        if row is None:
            labels[rid] = str(rid)
            continue
        parts = []
        if named and "algorithm" in row.index:
            parts.append(display_name(row["algorithm"]))
        where = []
        if "world_size" in row.index and np.isfinite(float(row["world_size"])):
            where.append(f"{int(row['world_size'])} ranks")
        if "grid" in row.index and short_label(row["grid"]):
            where.append(f"grid {row['grid']}")
        if where:
            parts.append(", ".join(where))
        if "overlap" in row.index:
            parts.append("overlap " + short_label(row["overlap"], "none").replace(",", ", "))
        if "label" in row.index and short_label(row["label"]):
            parts.append(short_label(row["label"]))
        labels[rid] = "\n".join(parts) if parts else str(rid)
    counts: Dict[str, int] = {}
    for text in labels.values():
        counts[text] = counts.get(text, 0) + 1
    for rid, text in list(labels.items()):
        if counts[text] > 1:  # two runs of the same configuration: tell them apart
            labels[rid] = f"{text}\n{str(rid)[-6:]}"
    return labels


def sorted_runs(run_ids: Sequence[str], runs_df=None) -> List[str]:
    """``run_ids`` by rank count, then grid, then median step time (as given where the runs table lacks them)."""
    if runs_df is None or not hasattr(runs_df, "columns") or "run_id" not in runs_df.columns:
        return list(run_ids)
    info = runs_df.drop_duplicates("run_id").set_index(runs_df.drop_duplicates("run_id")["run_id"].astype(str))

    def key(rid):
        if rid not in info.index:
            return (1, 0.0, "", 0.0)
        row = info.loc[rid]
        size = float(row["world_size"]) if "world_size" in row.index else 0.0
        step = float(row["step_median_s"]) if "step_median_s" in row.index else 0.0
        return (0, size, str(row["grid"]) if "grid" in row.index else "", step if np.isfinite(step) else math.inf)

    return sorted(run_ids, key=key)


def config_label(key: str) -> str:
    """A scaling line's ``model[/algorithm]/overlap/progress[/label]`` key in words: ``gpt-tiny, overlap none,
    progress poll`` (a key of another form as is)."""
    parts = str(key).split("/")
    if len(parts) < 3:
        return str(key)
    at = 2 if parts[1] in ALGORITHMS else 1
    if len(parts) < at + 2:
        return str(key)
    words = [parts[0]] + ([display_name(parts[1])] if at == 2 else []) + [f"overlap {parts[at]}",
                                                                         f"progress {parts[at + 1]}"]
    label = "/".join(parts[at + 2:])
    return ", ".join(words) + (f" ({label})" if label else "")


# ---------------------------------------------------------------------------
# 1. scaling
# ---------------------------------------------------------------------------

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
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"plot_scaling: mode must be 'weak' or 'strong', got {mode!r}")
    path = _check_path(path)
    _check_frame(scaling_df, "plot_scaling", ["config_key", "world_size", "step_median_s", "efficiency"])
    df = scaling_df.copy()
    df["world_size"] = df["world_size"].astype(float)
    df["step_median_s"] = df["step_median_s"].astype(float)
    df["efficiency"] = df["efficiency"].astype(float)
    df = df[np.isfinite(df["step_median_s"]) & (df["world_size"] > 0)]
    if not len(df):
        raise ValueError("plot_scaling: no row has a finite step time and a positive world size")
    key = "group" if "group" in df.columns and df["group"].notna().all() else "config_key"
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
            rest = g.drop(best.index)
            n = best["world_size"].to_numpy()
            t = best["step_median_s"].to_numpy()
            base = n[0]
            if "ideal_step_s" in best.columns and np.isfinite(best["ideal_step_s"].astype(float)).all():
                ideal = best["ideal_step_s"].astype(float).to_numpy()
            else:
                ideal = np.full(len(n), t[0]) if mode == "weak" else t[0] * base / n
            shown = config_label(name)
            if named and display_name(g["algorithm"].iloc[0]) not in shown:
                shown = f"{display_name(g['algorithm'].iloc[0])}: {shown}"
            ax_t.plot(n, t * scale, "-o", color=color, lw=1.8, ms=6, label=shown, zorder=3)
            if {"step_q1_s", "step_q3_s"} <= set(g.columns):  # quartiles of the per-step max over ranks
                for part, face in ((best, color), (g.drop(best.index), "none")):
                    q1 = part["step_q1_s"].to_numpy(dtype=float)
                    q3 = part["step_q3_s"].to_numpy(dtype=float)
                    mid = part["step_median_s"].to_numpy(dtype=float)
                    ok = np.isfinite(q1) & np.isfinite(q3)
                    if ok.any():
                        ax_t.errorbar(part["world_size"].to_numpy()[ok], mid[ok] * scale,
                                      yerr=[np.maximum(mid - q1, 0)[ok] * scale, np.maximum(q3 - mid, 0)[ok] * scale],
                                      fmt="none", ecolor=color, elinewidth=1.0, capsize=3, zorder=3)
            ax_t.plot(n, ideal * scale, "--", color=color, lw=1.2, alpha=0.8, zorder=2)
            eff = best["efficiency"].to_numpy()
            ax_e.plot(n, eff, "-o", color=color, lw=1.8, ms=6, label=shown, zorder=3)
            if {"step_q1_s", "step_q3_s"} <= set(best.columns):  # efficiency at the quartiles of T(N)
                mid = best["step_median_s"].to_numpy(dtype=float)
                q1, q3 = (best[c].to_numpy(dtype=float) for c in ("step_q1_s", "step_q3_s"))
                ok = np.isfinite(q1) & np.isfinite(q3) & (q1 > 0) & np.isfinite(eff)
                if ok.any():  # efficiency ~ 1/T(N): q3 gives the low end, q1 the high end
                    low, high = eff * mid / np.where(ok, q3, 1.0), eff * mid / np.where(ok, q1, 1.0)
                    ax_e.errorbar(n[ok], eff[ok], yerr=[np.maximum(eff - low, 0)[ok], np.maximum(high - eff, 0)[ok]],
                                  fmt="none", ecolor=color, elinewidth=1.0, capsize=3, zorder=3)
                    eff_max = max(eff_max, float(np.nanmax(high[ok])))
            if len(rest):
                ax_t.plot(rest["world_size"], rest["step_median_s"] * scale, "o", mfc="none", color=color, ms=6,
                          zorder=3)
                ax_e.plot(rest["world_size"], rest["efficiency"], "o", mfc="none", color=color, ms=6, zorder=3)
            finite = np.concatenate([eff, rest["efficiency"].to_numpy()])
            finite = finite[np.isfinite(finite)]
            if len(finite):
                eff_max = max(eff_max, float(finite.max()))
            if "grid" in g.columns and len(groups) <= 3:
                # weak lines rise: text above the point; strong lines fall: above and to the right
                offset, ha = ((0, 7), "center") if mode == "weak" else ((6, 3), "left")
                for _, row in g.iterrows():
                    ax_t.annotate(str(row["grid"]), (row["world_size"], row["step_median_s"] * scale),
                                  textcoords="offset points", xytext=offset, ha=ha, va="bottom", fontsize=7,
                                  color=color)
        ax_e.axhline(1.0, ls="--", color="0.35", lw=1.2, zorder=1)

        for ax in (ax_t, ax_e):
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
        if mode == "strong":
            ax_t.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax_t.yaxis.set_major_formatter(plain)
            ax_t.yaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
            lo, hi = ax_t.get_ylim()
            ax_t.set_ylim(lo / 1.15, hi * 1.35)
            ax_t.grid(True, which="minor", axis="y", color="0.94", lw=0.6)
        else:
            top = float(df["step_median_s"].max())
            if "step_q3_s" in df.columns and np.isfinite(df["step_q3_s"].astype(float)).any():
                top = max(top, float(np.nanmax(df["step_q3_s"].astype(float))))
            ax_t.set_ylim(0, top * scale * 1.18)
        ax_t.set_ylabel(f"step time ({unit}): median of max over ranks, bars q1-q3")
        ax_t.set_title(f"{mode.capitalize()} scaling{algorithm_title(df)}: step time (dashed: ideal)")
        ax_e.set_ylim(0, max(1.05, eff_max * 1.05))
        ax_e.set_ylabel("parallel efficiency (%), bars: at q3-q1 of T(N)")
        ax_e.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:.0f} %"))
        ideal_text = "T(base) / T(N)" if mode == "weak" else "T(base) \u00b7 base / (N \u00b7 T(N))"
        ax_e.set_title(f"Efficiency = {ideal_text} (dashed: ideal)")
        handles, labels = ax_t.get_legend_handles_labels()
        ncol = 1 if len(groups) <= 4 else 2
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False,
                   title="configuration (model, overlap options, MPI progress)")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return _save(fig, path)


# ---------------------------------------------------------------------------
# 2. breakdown
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# 3. timeline
# ---------------------------------------------------------------------------

_TIMELINE_MAX_RANKS = 16
_TIMELINE_DEFAULT_RANKS = 8


def _default_step(trace) -> int:
    steps = trace.steps
    if not len(steps):
        raise ValueError(f"plot_timeline: {trace.path}: the trace has no steps")
    measured = steps["step"][steps["warmup"] == 0]
    return int(measured[0]) if len(measured) else int(steps["step"][-1])


def _select_ranks(trace, ranks) -> Tuple[List[int], Optional[str]]:
    world = int(trace.world_size)
    if ranks is None:
        if world <= _TIMELINE_MAX_RANKS:
            return list(range(world)), None
        return list(range(_TIMELINE_DEFAULT_RANKS)), f"ranks 0-{_TIMELINE_DEFAULT_RANKS - 1} of {world}"
    if isinstance(ranks, (int, np.integer)):
        ranks = [ranks]
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise ValueError(f"plot_timeline: ranks must be integers, got {r!r}")
        if not 0 <= int(r) < world:
            raise ValueError(f"plot_timeline: rank {int(r)} is out of range: the trace has ranks 0..{world - 1}")
        if int(r) not in out:
            out.append(int(r))
    if not out:
        raise ValueError("plot_timeline: ranks is empty")
    note = None if len(out) == world else f"ranks {_compact(out)} of {world}"
    return out, note


def _compact(values: Sequence[int]) -> str:
    values = sorted(values)
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def timeline_events(trace, step: Optional[int] = None, ranks=None):
    """The events :func:`plot_timeline` draws: ``(events, step, ranks, note)``.

    ``events`` are the host-lane (compute ops, waits) and comm-lane (collectives) rows of
    ``trace.events`` of that step and those ranks.
    """
    from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST

    if step is None:
        step = _default_step(trace)
    elif isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"plot_timeline: step must be an integer, got {step!r}")
    known = trace.steps["step"]
    if int(step) not in set(int(s) for s in known):
        steps_text = _compact([int(s) for s in known]) if len(known) else "none"
        raise ValueError(f"plot_timeline: step {step} is not in the trace (steps: {steps_text})")
    step = int(step)
    shown, note = _select_ranks(trace, ranks)
    ev = trace.events
    mask = (ev["step"] == step) & np.isin(ev["rank"], np.asarray(shown, dtype=ev["rank"].dtype))
    mask &= (ev["lane"] == LANE_HOST) | (ev["lane"] >= LANE_COMM0)
    selected = ev[mask]
    if not len(selected):
        level = trace.metadata.get("level", "?")
        raise ValueError(f"plot_timeline: step {step} of ranks {_compact(shown)} has no op events "
                         f"(trace level {level!r}; the timeline needs --trace-level op)")
    return selected, step, shown, note


def timeline_figure(trace, step: Optional[int] = None, ranks=None):
    """Build the Gantt figure; returns ``(fig, info)`` with the numbers of bars drawn.

    ``info``: ``step``, ``ranks``, ``events`` (rows selected), ``bars`` (dict: host compute
    bars, wait bars, comm bars), ``collections`` (the PolyCollections of event bars, each with
    ``gid`` ``"event:<rank>:<row>:<op>"``).
    """
    from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST

    ev, step, shown, note = timeline_events(trace, step, ranks)
    ops = list(trace.vocab["ops"])
    axes_vocab = list(trace.vocab["axes"])
    rs = trace.rank_steps
    rs = rs[(rs["step"] == step) & np.isin(rs["rank"], np.asarray(shown, dtype=rs["rank"].dtype))]
    if len(rs):
        t0 = int(rs["start_ns"].min())
    else:
        t0 = int(ev["start_ns"].min())
    t_end = max(int(ev["end_ns"].max()), int(rs["end_ns"].max()) if len(rs) else 0)
    span_ms = max((t_end - t0) * 1e-6, 1e-6)

    lanes = ev["lane"].astype(np.int64)
    is_comm = lanes >= LANE_COMM0
    n_comm_lanes = int(lanes[is_comm].max() - LANE_COMM0 + 1) if is_comm.any() else 1
    host_h, comm_h, gap = 0.8, max(0.6, min(1.4, 0.17 * n_comm_lanes)), 0.45
    block = host_h + comm_h + gap
    sub_h = comm_h / n_comm_lanes

    nranks = len(shown)
    height = 1.4 + nranks * block * 0.55
    info = {"step": step, "ranks": shown, "events": int(len(ev)),
            "bars": {"compute": 0, "wait": 0, "comm": 0}, "collections": []}
    used_ops: List[str] = []
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(13.0, height))
        yticks, yticklabels = [], []
        min_text_ms = 0.035 * span_ms
        for i, rank in enumerate(shown):
            y_host = i * block  # top of the rank's block, axis inverted below
            y_comm = y_host + host_h + 0.08
            yticks += [y_host + host_h / 2, y_comm + comm_h / 2]
            yticklabels += [f"rank {rank}  host", "comm"]
            mine = ev[ev["rank"] == rank]
            span = rs[rs["rank"] == rank]
            if len(span):  # the rank's step span, light background
                s0 = (int(span["start_ns"][0]) - t0) * 1e-6
                s1 = (int(span["end_ns"][0]) - t0) * 1e-6
                ax.broken_barh([(s0, s1 - s0)], (y_host - 0.04, host_h + comm_h + 0.16), facecolors="0.95",
                               edgecolors="0.8", linewidth=0.5, zorder=0, gid=f"span:{rank}")
            host = mine[mine["lane"] == LANE_HOST]
            for code in np.unique(host["op"]):
                name = ops[int(code)]
                rows = host[host["op"] == code]
                x = (rows["start_ns"] - t0).astype(np.float64) * 1e-6
                w = (rows["end_ns"] - rows["start_ns"]).astype(np.float64) * 1e-6
                if name == "wait":
                    kw = dict(facecolors="#f6b3b3", edgecolors=WAIT_COLOR, hatch="////", linewidth=0.5)
                    info["bars"]["wait"] += len(rows)
                else:
                    kw = dict(facecolors=OP_COLORS.get(name, OTHER_COLOR), edgecolors="none", linewidth=0)
                    info["bars"]["compute"] += len(rows)
                coll = ax.broken_barh(np.column_stack([x, w]), (y_host, host_h), zorder=2,
                                      gid=f"event:{rank}:host:{name}", **kw)
                info["collections"].append(coll)
                if name not in used_ops:
                    used_ops.append(name)
            comm = mine[mine["lane"] >= LANE_COMM0]
            for lane in np.unique(comm["lane"]):
                on_lane = comm[comm["lane"] == lane]
                k = int(lane) - LANE_COMM0
                y = y_comm + k * sub_h
                for code in np.unique(on_lane["op"]):
                    name = ops[int(code)]
                    rows = on_lane[on_lane["op"] == code]
                    x = (rows["start_ns"] - t0).astype(np.float64) * 1e-6
                    w = (rows["end_ns"] - rows["start_ns"]).astype(np.float64) * 1e-6
                    coll = ax.broken_barh(np.column_stack([x, w]), (y + 0.06 * sub_h, 0.88 * sub_h), zorder=2,
                                          facecolors=COLLECTIVE_COLORS.get(name, OTHER_COLOR), alpha=0.7,
                                          edgecolors="white", linewidth=0.3,
                                          gid=f"event:{rank}:comm{k}:{name}")
                    info["collections"].append(coll)
                    info["bars"]["comm"] += len(rows)
                    if name not in used_ops:
                        used_ops.append(name)
                    wide = w >= min_text_ms
                    if sub_h >= 0.13 and wide.any():
                        for xs, ws, a in zip(x[wide], w[wide], rows["axis"][wide]):
                            ax.text(xs + ws / 2, y + sub_h / 2, axes_vocab[int(a)], ha="center", va="center",
                                    fontsize=6, color="black", zorder=3, clip_on=True)
        ax.set_yticks(yticks)
        ax.set_yticklabels(yticklabels, fontsize=8 if nranks <= 8 else 7)
        ax.set_ylim(nranks * block - gap + 0.15, -0.2)
        ax.set_xlim(-0.01 * span_ms, span_ms * 1.01)
        ax.set_xlabel("time from the step start (ms; earliest start over the shown ranks)")
        ax.set_ylabel("MPI rank (lanes: host, communication)")
        ax.grid(True, axis="x", color="0.9", lw=0.6)
        ax.set_axisbelow(True)
        for i in range(1, nranks):
            ax.axhline(i * block - gap / 2, color="0.75", lw=0.6)
        meta = trace.metadata
        run_id = meta.get("run_id") or trace.attrs.get("run_id") or os.path.basename(trace.path)
        warm = trace.steps["warmup"][trace.steps["step"] == step]
        step_text = f"step {step}" + (" (warm-up)" if len(warm) and warm[0] else "")
        overlap = short_label(meta.get("overlap"), "")
        head = f"{run_id}: {display_name(of_metadata(meta))}, grid {meta.get('grid', '?')}, {step_text}"
        if overlap:
            head += f", overlap {overlap}"
        if note:
            head += f"\nshowing {note}"
        ax.set_title(head)
        order = [o for o in _COMPUTE_ORDER if o in used_ops] + (["wait"] if "wait" in used_ops else []) + \
                [o for o in _COLLECTIVE_ORDER if o in used_ops] + \
                [o for o in used_ops if o not in _COMPUTE_ORDER + _COLLECTIVE_ORDER + ("wait",)]
        handles = []
        for name in order:
            if name == "wait":
                handles.append(Patch(facecolor="#f6b3b3", edgecolor=WAIT_COLOR, hatch="////",
                                     label="wait (blocked)"))
            elif name in COLLECTIVE_COLORS:
                handles.append(Patch(facecolor=COLLECTIVE_COLORS[name], alpha=0.7,
                                     label=f"{name} (in flight)"))
            else:
                handles.append(Patch(facecolor=OP_COLORS.get(name, OTHER_COLOR), label=name))
        handles.append(Patch(facecolor="0.95", edgecolor="0.8", label="step span of the rank"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="host: op\n"
                  "comm: collective on its lane\n(letter = grid axis)")
        fig.tight_layout()
    return fig, info


def plot_timeline(trace, path, step: Optional[int] = None, ranks=None) -> str:
    """Gantt chart of one step of a trace loaded with :func:`fourd_mpi.trace.read.load_trace`.

    One row group per rank: ``host`` (compute ops colored by op, waits hatched red) and
    ``comm`` (collectives from issue to observed completion on their ``comm<i>`` packing
    lanes, colored by op, axis letter on the wider bars). x: milliseconds from the earliest
    step start over the shown ranks. ``step``: default the first measured (non-warm-up) step,
    else the last. ``ranks``: an int or a list of ints; default all ranks up to 16, else ranks
    0-7 (noted in the title). Needs a trace at level ``op``.
    """
    path = _check_path(path)
    fig, _info = timeline_figure(trace, step, ranks)
    return _save(fig, path)


# ---------------------------------------------------------------------------
# 4. overlap
# ---------------------------------------------------------------------------

def overlap_matrix(comm_df, value: str = "overlap_pct"):
    """``value`` (``overlap_pct`` or ``hidden_pct``) as a (collective ``op axis``) x run_id frame: the data
    behind :func:`plot_overlap`.

    Rows with extra keys (``phase``, ``layer``) are merged: ``overlap_pct`` from ``wait_s_per_step`` and
    ``inflight_s_per_step`` when present (exactly the aggregate formula), else (and ``hidden_pct`` always)
    weighted by ``messages_per_step``.
    """
    import pandas as pd

    df = comm_df.copy()
    df["collective"] = df["op"].astype(str) + " " + df["axis"].astype(str)
    df["overlap_pct"] = df[value].astype(float)
    rows = []
    for (coll, rid), g in df.groupby(["collective", "run_id"], sort=False):
        if len(g) == 1:
            value_ = float(g["overlap_pct"].iloc[0])
        elif value == "overlap_pct" and {"wait_s_per_step", "inflight_s_per_step"} <= set(g.columns):
            flight = float(g["inflight_s_per_step"].astype(float).sum())
            value_ = 100.0 * (1.0 - float(g["wait_s_per_step"].astype(float).sum()) / flight) if flight > 0 \
                else float("nan")
        else:
            weight = g["messages_per_step"].astype(float) if "messages_per_step" in g.columns \
                else pd.Series(1.0, index=g.index)
            ok = np.isfinite(g["overlap_pct"])
            value_ = float(np.average(g["overlap_pct"][ok], weights=weight[ok])) if ok.any() else float("nan")
        rows.append((coll, str(rid), value_))
    out = pd.DataFrame(rows, columns=["collective", "run_id", "overlap_pct"])
    table = out.pivot(index="collective", columns="run_id", values="overlap_pct")
    op_rank = {name: i for i, name in enumerate(_COLLECTIVE_ORDER)}
    axis_rank = {name: i for i, name in enumerate(_AXIS_ORDER)}

    def sort_key(name):
        op, _, axis = name.partition(" ")
        return (op_rank.get(op, 99), axis_rank.get(axis, 99), name)

    table = table.loc[sorted(table.index, key=sort_key)]
    return table[list(dict.fromkeys(df["run_id"].astype(str)))]


def plot_overlap(comm_df, path, runs_df=None, title: Optional[str] = None) -> str:
    """Grouped bars per collective (op + axis), one bar per run: ``hidden_pct`` when ``comm_df`` has it
    (:func:`fourd_mpi.analysis.tables.hidden_vs_baseline`: a baseline run without overlap was given), else
    ``overlap_pct``, labelled as the upper bound it is (compute beside a collective is not proof that the
    collective was hidden; see the caption).

    ``comm_df``: :func:`fourd_mpi.analysis.tables.comm_table` of one or more runs (concatenated).
    ``runs_df`` (optional): runs table for the legend labels (rank count, grid, overlap, label) and their
    order. The value axis ends just above the largest value (at least 5 %, at most 100 %); values are
    written on the bars while there are few bars, horizontally.
    """
    path = _check_path(path)
    _check_frame(comm_df, "plot_overlap", ["run_id", "op", "axis", "overlap_pct"])
    hidden = "hidden_pct" in comm_df.columns and np.isfinite(comm_df["hidden_pct"].astype(float)).any()
    table = overlap_matrix(comm_df, "hidden_pct" if hidden else "overlap_pct")
    collectives = list(table.index)
    run_ids = sorted_runs(list(table.columns), runs_df)
    table = table[run_ids]
    labels = run_labels(run_ids, runs_df)
    ncoll, nruns = len(collectives), len(run_ids)
    values = table.to_numpy(dtype=float)
    finite = values[np.isfinite(values)]
    top = float(finite.max()) if len(finite) else 0.0
    ymax = min(100.0, max(5.0, _nice_ceiling(top * 1.15)))
    with plt.rc_context(_RC):
        widest = max(len(c.partition(" ")[0]) for c in collectives)  # tick labels: op over axis
        width_in = max(4.5, min(12.0, 1.4 + ncoll * max(0.12 * widest + 0.2, 0.35 + 0.22 * nruns)))
        fig, ax = plt.subplots(figsize=(width_in, 4.2))
        group_w = 0.8
        bar_w = group_w / nruns
        x = np.arange(ncoll)
        annotate = ncoll * nruns <= 16
        for j, rid in enumerate(run_ids):
            offs = x - group_w / 2 + (j + 0.5) * bar_w
            v = values[:, j]
            drawn = np.where(np.isfinite(v), np.clip(v, 0, 100), 0.0)
            ax.bar(offs, drawn, width=bar_w * 0.92, color=PALETTE[j % len(PALETTE)], edgecolor="white",
                   linewidth=0.5, label=labels[rid].replace("\n", " \u00b7 "))
            if annotate:
                for xo, val, d in zip(offs, v, drawn):
                    text = "n/a" if not np.isfinite(val) else f"{val:.0f}" if nruns > 2 else f"{val:.1f} %"
                    ax.text(xo, d + 0.015 * ymax, text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels([c.replace(" ", "\n", 1) for c in collectives])
        ax.set_xlim(-0.6, ncoll - 0.4)
        ax.set_ylim(0, ymax * (1.1 if annotate else 1.0))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} %"))
        ax.set_ylabel("hidden_pct: communication hidden vs the baseline (%)" if hidden else
                      "overlap_pct: upper bound of hidden communication (%)", fontsize=9)
        ax.set_xlabel("collective (op, grid axis)")
        ax.grid(True, axis="y", color="0.88")
        ax.set_axisbelow(True)
        ax.set_title(title or ("Communication hidden behind compute" if hidden else
                               "Overlap of collectives with compute (upper bound)") + algorithm_title(runs_df))
        if nruns > 1 or runs_df is not None:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="run", fontsize=8)
        fig.tight_layout()
        fig.text(0.01, -0.01, _wrapped(HIDDEN_CAPTION if hidden else OVERLAP_CAPTION, width_in, 7), ha="left",
                 va="top", fontsize=7, color="0.25", wrap=False)
        return _save(fig, path)


def _wrapped(text: str, width_in: float, points: float) -> str:
    """``text`` broken into lines that fit ``width_in`` inches at ``points`` (a character ~0.55 em wide), so a
    caption never widens the figure."""
    import textwrap

    chars = max(30, int(width_in * 72 / (0.55 * points)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above ``value`` (> 0)."""
    if not value > 0:
        return 0.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if step * power >= value:
            return step * power
    return 10.0 * power
