"""The one style of every figure of :mod:`fourd_mpi.analysis.plots` and the helpers the plot families share:
colours (:data:`PALETTE`, :data:`CATEGORY_COLORS`, :data:`OP_COLORS`), captions, the rc settings
(:data:`_RC`), checking a path and a frame, saving, run labels and their order."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from fourd_mpi.algorithms.registry import ALGORITHMS, DEFAULT_ALGORITHM, display_name
from fourd_mpi.util.text import short_label

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

OVERLAP_CAPTION = ("overlap_pct = 100 \u00d7 host compute in flight / in-flight time, over the measured steps and "
                   "ranks: 100 \u00d7 \u03a3 overlap_ns / \u03a3 (complete_ns \u2212 call_ns).\n"
                   "An UPPER BOUND of the hidden communication: compute beside a collective that would have "
                   "finished anyway hides nothing. Give a run without overlap (--baseline) for hidden_pct.")
HIDDEN_CAPTION = ("hidden_pct = 100 \u00d7 clip(1 \u2212 exposed / exposed of the baseline run, 0, 1), exposed = "
                  "host time in MPI for the collective per step\n(OSU's overlap with the baseline, a run without "
                  "overlap, as t_pure): the communication time that stopped being exposed.")

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
