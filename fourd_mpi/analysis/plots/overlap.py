"""Overlap (or hidden) percentage per collective and run (:func:`plot_overlap`, :func:`overlap_matrix`).

Part of :mod:`fourd_mpi.analysis.plots` (its docstring states the style and the conventions)."""

from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter

from fourd_mpi.analysis.plots._style import (
    _AXIS_ORDER,
    _COLLECTIVE_ORDER,
    _RC,
    HIDDEN_CAPTION,
    OVERLAP_CAPTION,
    PALETTE,
    _check_frame,
    _check_path,
    _nice_ceiling,
    _save,
    _wrapped,
    algorithm_title,
    run_labels,
    sorted_runs,
)


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
