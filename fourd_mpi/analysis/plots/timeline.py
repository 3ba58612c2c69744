"""Gantt chart of one step of a trace, one row per rank (:func:`plot_timeline`, :func:`timeline_events`).

Part of :mod:`fourd_mpi.analysis.plots` (its docstring states the style and the conventions)."""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from fourd_mpi.algorithms.registry import display_name, of_metadata
from fourd_mpi.analysis.plots._style import (
    _COLLECTIVE_ORDER,
    _COMPUTE_ORDER,
    _RC,
    COLLECTIVE_COLORS,
    OP_COLORS,
    OTHER_COLOR,
    WAIT_COLOR,
    _check_path,
    _save,
)
from fourd_mpi.util.text import short_label

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

    Steps: the events (:func:`timeline_events`), the time window and the lane heights
    (:func:`_window`, :func:`_lanes`), per rank its step span, host bars and comm bars
    (:func:`_draw_rank`), the axes (:func:`_timeline_axes`), the title (:func:`_timeline_title`)
    and the legend of the ops drawn (:func:`_timeline_legend`).
    """
    ev, step, shown, note = timeline_events(trace, step, ranks)
    rs = trace.rank_steps
    rs = rs[(rs["step"] == step) & np.isin(rs["rank"], np.asarray(shown, dtype=rs["rank"].dtype))]
    t0, span_ms = _window(ev, rs)
    lanes = _lanes(ev)
    nranks = len(shown)
    height = 1.4 + nranks * lanes.block * 0.55
    info = {"step": step, "ranks": shown, "events": int(len(ev)),
            "bars": {"compute": 0, "wait": 0, "comm": 0}, "collections": []}
    used_ops: List[str] = []
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(13.0, height))
        yticks, yticklabels = [], []
        for i, rank in enumerate(shown):
            y_host = i * lanes.block  # top of the rank's block, axis inverted below
            y_comm = y_host + lanes.host_h + 0.08
            yticks += [y_host + lanes.host_h / 2, y_comm + lanes.comm_h / 2]
            yticklabels += [f"rank {rank}  host", "comm"]
            _draw_rank(ax, trace, ev[ev["rank"] == rank], rs[rs["rank"] == rank], rank, (y_host, y_comm), t0,
                       lanes, 0.035 * span_ms, info, used_ops)
        _timeline_axes(ax, yticks, yticklabels, nranks, lanes, span_ms)
        _timeline_title(ax, trace, step, note)
        _timeline_legend(ax, used_ops)
        fig.tight_layout()
    return fig, info


class _Lanes(NamedTuple):
    """Heights in y units of a rank's block: its host row, its comm row split in ``n_comm`` packing lanes of
    ``sub_h`` each, the gap to the next rank, and ``block``, the three together."""

    n_comm: int
    host_h: float
    comm_h: float
    gap: float
    block: float
    sub_h: float


def _window(ev, rs) -> Tuple[int, float]:
    """``(t0, span_ms)``: the earliest step start of the shown ranks (their first event without step spans)
    in ns, and the milliseconds from it to the last event or step end (at least 1 ns)."""
    if len(rs):
        t0 = int(rs["start_ns"].min())
    else:
        t0 = int(ev["start_ns"].min())
    t_end = max(int(ev["end_ns"].max()), int(rs["end_ns"].max()) if len(rs) else 0)
    return t0, max((t_end - t0) * 1e-6, 1e-6)


def _lanes(ev) -> _Lanes:
    """The lane heights for the comm lanes used: the comm row grows with them (0.6 to 1.4)."""
    from fourd_mpi.trace.events import LANE_COMM0

    lanes = ev["lane"].astype(np.int64)
    is_comm = lanes >= LANE_COMM0
    n_comm_lanes = int(lanes[is_comm].max() - LANE_COMM0 + 1) if is_comm.any() else 1
    host_h, comm_h, gap = 0.8, max(0.6, min(1.4, 0.17 * n_comm_lanes)), 0.45
    return _Lanes(n_comm_lanes, host_h, comm_h, gap, host_h + comm_h + gap, comm_h / n_comm_lanes)


def _draw_rank(ax, trace, mine, span, rank: int, rows_y, t0: int, lanes: _Lanes, min_text_ms: float, info,
               used_ops: List[str]) -> None:
    """One rank's block: its step span as a light background, then its host bars (compute ops by color,
    waits hatched) and its comm bars (a row per packing lane, the axis letter on bars at least
    ``min_text_ms`` wide). Counts bars and collects their collections in ``info``, op names in ``used_ops``."""
    from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST

    y_host, y_comm = rows_y
    if len(span):  # the rank's step span, light background
        s0 = (int(span["start_ns"][0]) - t0) * 1e-6
        s1 = (int(span["end_ns"][0]) - t0) * 1e-6
        ax.broken_barh([(s0, s1 - s0)], (y_host - 0.04, lanes.host_h + lanes.comm_h + 0.16), facecolors="0.95",
                       edgecolors="0.8", linewidth=0.5, zorder=0, gid=f"span:{rank}")
    ops = list(trace.vocab["ops"])
    host = mine[mine["lane"] == LANE_HOST]
    for code in np.unique(host["op"]):
        name = ops[int(code)]
        rows = host[host["op"] == code]
        x, w = _bar_spans(rows, t0)
        if name == "wait":
            kw = dict(facecolors="#f6b3b3", edgecolors=WAIT_COLOR, hatch="////", linewidth=0.5)
            info["bars"]["wait"] += len(rows)
        else:
            kw = dict(facecolors=OP_COLORS.get(name, OTHER_COLOR), edgecolors="none", linewidth=0)
            info["bars"]["compute"] += len(rows)
        coll = ax.broken_barh(np.column_stack([x, w]), (y_host, lanes.host_h), zorder=2,
                              gid=f"event:{rank}:host:{name}", **kw)
        info["collections"].append(coll)
        if name not in used_ops:
            used_ops.append(name)
    axes_vocab = list(trace.vocab["axes"])
    comm = mine[mine["lane"] >= LANE_COMM0]
    for lane in np.unique(comm["lane"]):
        on_lane = comm[comm["lane"] == lane]
        k = int(lane) - LANE_COMM0
        y, sub_h = y_comm + k * lanes.sub_h, lanes.sub_h
        for code in np.unique(on_lane["op"]):
            name = ops[int(code)]
            rows = on_lane[on_lane["op"] == code]
            x, w = _bar_spans(rows, t0)
            coll = ax.broken_barh(np.column_stack([x, w]), (y + 0.06 * sub_h, 0.88 * sub_h), zorder=2,
                                  facecolors=COLLECTIVE_COLORS.get(name, OTHER_COLOR), alpha=0.7,
                                  edgecolors="white", linewidth=0.3, gid=f"event:{rank}:comm{k}:{name}")
            info["collections"].append(coll)
            info["bars"]["comm"] += len(rows)
            if name not in used_ops:
                used_ops.append(name)
            wide = w >= min_text_ms
            if sub_h >= 0.13 and wide.any():
                for xs, ws, a in zip(x[wide], w[wide], rows["axis"][wide]):
                    ax.text(xs + ws / 2, y + sub_h / 2, axes_vocab[int(a)], ha="center", va="center",
                            fontsize=6, color="black", zorder=3, clip_on=True)


def _bar_spans(rows, t0: int):
    """``(x, w)``: the events' starts from ``t0`` and their durations, in ms."""
    x = (rows["start_ns"] - t0).astype(np.float64) * 1e-6
    w = (rows["end_ns"] - rows["start_ns"]).astype(np.float64) * 1e-6
    return x, w


def _timeline_axes(ax, yticks, yticklabels, nranks: int, lanes: _Lanes, span_ms: float) -> None:
    """Row labels (rank, host / comm), the y range (top down) and x range, axis labels, an x grid and a
    line between ranks."""
    ax.set_yticks(yticks)
    ax.set_yticklabels(yticklabels, fontsize=8 if nranks <= 8 else 7)
    ax.set_ylim(nranks * lanes.block - lanes.gap + 0.15, -0.2)
    ax.set_xlim(-0.01 * span_ms, span_ms * 1.01)
    ax.set_xlabel("time from the step start (ms; earliest start over the shown ranks)")
    ax.set_ylabel("MPI rank (lanes: host, communication)")
    ax.grid(True, axis="x", color="0.9", lw=0.6)
    ax.set_axisbelow(True)
    for i in range(1, nranks):
        ax.axhline(i * lanes.block - lanes.gap / 2, color="0.75", lw=0.6)


def _timeline_title(ax, trace, step: int, note: Optional[str]) -> None:
    """Run id, algorithm, grid, step (warm-up or not), overlap options, and which ranks when not all."""
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


def _timeline_legend(ax, used_ops: List[str]) -> None:
    """A legend entry per op drawn, compute ops first, then wait, collectives, others; then the step span."""
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
