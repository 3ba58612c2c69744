"""Calibration of a machine profile (:mod:`fourd_mpi.perf.machine`) from the measurements of ``fourd-mpi bench
collectives`` (:mod:`fourd_mpi.run.collbench`, which runs them under mpiexec). Pure: no MPI, tested without it.

Alpha and beta per collective and placement level (intra-node axes, inter-node axes) fitted to the
nonblocking latencies by least squares on relative error, ``t = k(p-1)*alpha + k(p-1)/p*S*beta``, overall
and per group size; the GEMM rate per dtype of one rank alone (the others sleep) and of all ranks at once
(their ratio is the oversubscription factor), element-wise bandwidth and the cost of one NumPy call; the
overlap efficiency = OSU overlap with polling at the largest sizes / 100. A fit whose relative rms error
reaches :data:`MAX_FIT_RMS` (``--max-fit-error``) keeps the profile from being written unless the caller
accepts it (:func:`poor_fits`). Only what was measured is fitted: with ``--ops`` a subset, a collective
whose nonblocking form is missing has no fit and is listed under ``calibration.missing_ops`` (the model
takes it from the fallback profile or refuses); without any nonblocking op no profile is written.

Rows: :class:`Row`, one (communicator, op, size, placement) measurement, nccl-tests conventions
(``S`` = the gathered buffer of an all-gather, the full input of a reduce-scatter, the buffer of an
all-reduce; ``busbw = algbw * bus factor``, nccl-tests PERFORMANCE.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Dict, List, Optional, Tuple

import numpy as np

from fourd_mpi.core.colltable import COLLECTIVES, collective
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.text import human_bytes

OPS = ("iallgather", "ireduce_scatter", "iallreduce", "allgather", "reduce_scatter", "allreduce")
KIND_OF = {op: collective(op).name for op in OPS}


def bus_factor(kind: str, p: int) -> float:
    """nccl-tests: busbw = algbw * factor (:meth:`~fourd_mpi.core.colltable.CollectiveKind.bus_factor`)."""
    return collective(kind).bus_factor(p)


def fit_alpha_beta(points: List[Tuple[str, int, int, float]]) -> Optional[Dict[str, float]]:
    """Least squares on relative error of ``t = k(p-1)*alpha + k(p-1)/p*S*beta`` for points
    ``(kind, p, S, t)``; non-negative (a negative coefficient is set to 0 and the other refitted).
    Returns ``{"alpha_s", "beta_s_per_byte", "points", "rms_rel_error"}`` or None without points."""
    pts = [(k, p, s, t) for k, p, s, t in points if p > 1 and t > 0]
    if not pts:
        return None
    a = np.array([[collective(k).alpha_count(p), collective(k).wire_factor(p) * s] for k, p, s, _ in pts],
                 dtype=float)
    t = np.array([pt[3] for pt in pts])
    w = a / t[:, None]
    ones = np.ones(len(t))
    coef = np.linalg.lstsq(w, ones, rcond=None)[0] if len(t) >= 2 else np.array([t[0] / a[0, 0], 0.0])
    if coef[0] < 0 or coef[1] < 0:
        j = 1 if coef[0] < 0 else 0  # keep the other term
        c = float(np.dot(w[:, j], ones) / max(np.dot(w[:, j], w[:, j]), 1e-300))
        coef = np.array([0.0, c]) if j == 1 else np.array([c, 0.0])
    rel = a @ coef / t - 1
    return {"alpha_s": float(coef[0]), "beta_s_per_byte": float(coef[1]), "points": len(t),
            "rms_rel_error": float(np.sqrt(np.mean(rel ** 2)))}


def measured_points(rows: List["Row"]) -> Dict[str, List[List[float]]]:
    """The profile's ``measured`` table of one collective: per group (a string key: ``"p"`` for a
    group on one node, ``"p@g"`` for ``p`` ranks across nodes with ``g`` on each, :attr:`Row.per_node`),
    the ``[bytes, seconds]`` of every measured size, seconds = the median of the rows of that size and
    group (several communicators of one size and placement: their median); only sizes with a positive
    finite time, and only groups with at least 2 such sizes (what interpolation needs). Groups of one
    size but another placement are kept apart: on 4 nodes of 2 ranks, 4 ranks on 2 nodes (g = 2) and 4
    ranks on 4 nodes (g = 1) load each node's link differently."""
    by_key: Dict[Tuple[int, int], Dict[int, List[float]]] = {}
    for r in rows:
        if r.p > 1 and math.isfinite(r.lat_s) and r.lat_s > 0:
            g = r.per_node if r.level == "inter" and 0 < r.per_node < r.p else 0
            by_key.setdefault((r.p, g), {}).setdefault(r.size, []).append(r.lat_s)
    return {(f"{p}@{g}" if g else str(p)): [[int(size), float(np.median(ts))] for size, ts in sorted(sizes.items())]
            for (p, g), sizes in sorted(by_key.items()) if len(sizes) >= 2}


#: a level's alpha-beta fit is written as a machine profile only when its relative rms error is below this
MAX_FIT_RMS = 0.25


def poor_fits(profile: Dict, limit: float = MAX_FIT_RMS) -> List[Tuple[str, str, str, float]]:
    """The fits of a machine profile mapping whose relative rms error is at least ``limit``, worst
    first: ``(level, collective, group size, rms)``. Checked: the per-group-size fits
    (``levels.L.by_size``, what the model uses for a measured group size), and a collective's fit
    over all group sizes where it has no per-size fit (``p`` = the measured sizes joined by ``,``)."""
    bad = []
    for level, entry in profile.get("levels", {}).items():
        for kind in COLLECTIVES:
            if kind not in entry:
                continue
            per_p = (entry.get("by_size") or {}).get(kind) or {}
            fits = per_p.items() if per_p else [(",".join((entry.get("measured") or {}).get(kind, {})) or "all",
                                                 entry[kind])]
            bad += [(level, kind, p, float(f["rms_rel_error"])) for p, f in fits if f["rms_rel_error"] >= limit]
    return sorted(bad, key=lambda b: -b[3])


def poor_fit_line(bad: List[Tuple[str, str, str, float]], limit: float = MAX_FIT_RMS,
                  window: Optional[Tuple[int, int, float]] = None, searched: bool = False) -> str:
    """One line saying why no profile is written: the worst fit (level, collective, group size, error),
    how many others miss too, which sizes would pass (``window``, :func:`fit_window`; ``searched`` without
    one: none would), and the override."""
    level, kind, p, rms = bad[0]
    more = f" ({len(bad) - 1} more fit(s) at or over the limit)" if len(bad) > 1 else ""
    if window is not None:
        lo, hi, worst = window
        sizes = (f"; the fits pass over the sizes {human_bytes(lo)} - {human_bytes(hi)} (worst {100 * worst:.0f}% "
                 f"rms): measure those with --min-size {size_option(lo)} --max-size {size_option(hi)}")
    elif searched:
        sizes = ("; no range of 3 or more measured sizes passes (a link that is not alpha-beta, e.g. shaped by a "
                 "token bucket)")
    else:
        sizes = ""
    return (f"no machine profile written: the alpha-beta fit of {kind} at the {level}-node level on p = {p} misses "
            f"its measurements by {100 * rms:.0f}% rms (limit {100 * limit:g}%, --max-fit-error){more}{sizes}; "
            f"--accept-poor-fit writes it "
            f"anyway (the model then uses the stored measured points, levels.{level}.measured)")


@dataclass
class Row:
    """One (communicator, op, size, placement) measurement; latencies in seconds."""

    comm: str
    level: str
    p: int
    op: str
    size: int
    iters: int
    lat_s: float  # max over ranks of the per-rank median (nccl-tests "time")
    inplace: bool = False
    avg_s: float = float("nan")  # OSU: average / min / max over ranks of the per-rank median
    min_s: float = float("nan")
    max_s: float = float("nan")
    wrong: int = 0  # result elements that differ from the expected ones, summed over ranks
    axes: str = ""  # every axis this communicator stands for (same size measured once)
    per_node: int = 0  # the group's ranks on one node (most on any node); 0: not known

    @property
    def count(self) -> int:
        """Elements of the nccl-tests "count" (float32): size / 4."""
        return self.size // 4

    @property
    def redop(self) -> str:
        return "none" if self.kind == "allgather" else "sum"

    def as_dict(self) -> Dict:
        return {"comm": self.comm, "axes": self.axes, "level": self.level, "p": self.p, "op": self.op,
                "per_node": self.per_node,
                "placement": "in-place" if self.inplace else "out-of-place", "size": self.size,
                "count": self.count, "type": "float", "redop": self.redop, "root": -1, "iters": self.iters,
                "time_us": self.lat_s * 1e6, "algbw_gbps": self.algbw, "busbw_gbps": self.busbw,
                "wrong": self.wrong, "avg_lat_us": self.avg_s * 1e6, "min_lat_us": self.min_s * 1e6,
                "max_lat_us": self.max_s * 1e6}

    @property
    def kind(self) -> str:
        return KIND_OF[self.op]

    @property
    def algbw(self) -> float:
        return self.size / self.lat_s / 1e9 if self.lat_s > 0 else float("nan")

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.kind, self.p)


def missing_kinds(result: Dict) -> List[str]:
    """Nonblocking collectives a complete machine profile needs that this run did not measure
    (``--ops`` a subset): the profile has no fit of them (the model takes them from the fallback)."""
    measured = {r.op for r in result["rows"]}
    return [f"i{k}" for k in COLLECTIVES if f"i{k}" not in measured]


def profile_problem(result: Dict) -> Optional[str]:
    """Why no machine profile can be written from ``result`` (no nonblocking collective measured), or None."""
    if any(r.op.startswith("i") and r.p > 1 for r in result["rows"]):
        return None
    measured = sorted({r.op for r in result["rows"]}) or ["nothing"]
    return (f"no machine profile written: its alpha-beta fits come from the nonblocking collectives "
            f"(iallgather, ireduce_scatter, iallreduce) and --ops measured {', '.join(measured)}")


def level_fits(rows: List[Row]) -> Dict[str, Dict]:
    """The alpha-beta fits a machine profile holds, per placement level with nonblocking out-of-place rows:
    ``{"fits": {kind: fit over every group size}, "by_size": {kind: {p: fit}}`` (group sizes with 2 or more
    points) ``, "measured": {kind: measured_points}, "rows": how many}``; only what was measured is fitted."""
    out: Dict[str, Dict] = {}
    for level in ("intra", "inter"):
        mine = [r for r in rows if r.level == level and r.op.startswith("i") and not r.inplace]
        fits: Dict[str, Dict] = {}
        by_size: Dict[str, Dict] = {}
        measured: Dict[str, Dict] = {}
        for kind in COLLECTIVES:  # only what was measured: a kind without points gets no fit
            pts = [(r.kind, r.p, r.size, r.lat_s) for r in mine if r.kind == kind]
            fit = fit_alpha_beta(pts)
            if fit is None:
                continue
            fits[kind] = fit
            per_p = {}
            for p in sorted({pt[1] for pt in pts}):
                f = fit_alpha_beta([pt for pt in pts if pt[1] == p])
                if f is not None and f["points"] >= 2:
                    per_p[str(p)] = f
            if per_p:
                by_size[kind] = per_p
            points = measured_points([r for r in mine if r.kind == kind])
            if points:
                measured[kind] = points
        if fits:
            out[level] = {"fits": fits, "by_size": by_size, "measured": measured, "rows": len(mine)}
    return out


def fits_profile(rows: List[Row]) -> Dict:
    """The part of a machine profile :func:`poor_fits` reads, from ``rows``."""
    return {"levels": {level: dict(f["fits"], by_size=f["by_size"], measured=f["measured"])
                       for level, f in level_fits(rows).items()}}


def fit_window(rows: List[Row], limit: float = MAX_FIT_RMS, least: int = 3) -> Optional[Tuple[int, int, float]]:
    """The range of message sizes over which every fit the profile would use passes the gate (relative rms
    below ``limit``): ``(smallest, largest bytes, worst rms)``, or None when no range does. Ranges run between
    measured sizes and must hold ``least`` or more sizes of every group they fit (two points always fit a
    line); the widest (by the ratio of its ends) wins, then the one of the larger messages. The gate's line
    names it (:func:`poor_fit_line`): on a link shaped by a token bucket, the sizes above its burst fit a line
    that the sizes across it do not."""
    nonblocking = [r for r in rows if r.op.startswith("i") and not r.inplace and r.p > 1
                   and math.isfinite(r.lat_s) and r.lat_s > 0]
    sizes = sorted({r.size for r in nonblocking})
    best = None
    for a, lo in enumerate(sizes):
        for hi in sizes[a + 1:]:
            inside = [r for r in nonblocking if lo <= r.size <= hi]
            groups: Dict[Tuple, set] = {}
            for r in inside:
                groups.setdefault((r.level, r.kind, r.p), set()).add(r.size)
            if not groups or min(len(g) for g in groups.values()) < least:
                continue
            profile = fits_profile(inside)
            if poor_fits(profile, limit):
                continue
            worst = max((f["rms_rel_error"] for entry in profile["levels"].values()
                         for per_p in entry["by_size"].values() for f in per_p.values()), default=0.0)
            key = (hi / lo, hi)
            if best is None or key > best[0]:
                best = (key, (lo, hi, worst))
    return best[1] if best else None


def size_option(size: int) -> str:
    """A size as ``--min-size`` / ``--max-size`` take it: ``2K``, ``64M``, ``12``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def build_profile(result: Dict, name: str, hostname: str, fallback: Optional[str] = None,
                  backend: str = "numpy", cores: Optional[int] = None, mpi_library: str = "") -> Dict:
    """The machine-profile mapping (:data:`fourd_mpi.perf.machine.PROFILE_SCHEMA`) from a benchmark result
    (:func:`fourd_mpi.run.collbench.run_bench`); ``mpi_library``: the MPI library that measured it (the first line
    of ``MPI_Get_library_version``, :func:`fourd_mpi.run.collbench.mpi_library`), stored as ``calibration.mpi``."""
    levels: Dict[str, Dict] = {}
    for level, fits in level_fits(result["rows"]).items():
        entry: Dict = {"shared_by": int(result["ranks_per_node"])}
        entry.update(fits["fits"])
        lacking = [k for k in COLLECTIVES if k not in fits["fits"]]
        entry["description"] = (f"fitted to {fits['rows']} nonblocking latencies"
                                + (f"; no fit of {', '.join(lacking)} (not measured)" if lacking else ""))
        if fits["by_size"]:
            entry["by_size"] = fits["by_size"]
        if fits["measured"]:
            entry["measured"] = fits["measured"]
        runs = measured_points([r for r in result.get("runs", []) if r.level == level])
        if runs:  # back-to-back all-reduce runs (_time_run): what the model prices the step's data all-reduces with
            entry["measured_runs"] = {"allreduce": runs}
        syncs = {}
        for y in result.get("syncs", []):
            if y["level"] == level:
                syncs.setdefault(str(y["p"]), []).append(y["sync_s"])
        if syncs:
            entry["sync_s"] = {p: float(np.median(v)) for p, v in syncs.items()}
        levels[level] = entry
    if not levels:
        raise ConfigError(profile_problem(result) or "no nonblocking collective was measured")
    c = result["compute"]
    oversub = float(np.median([c["alone"][d] / c["all"][d] for d in c["alone"]]))
    polled = [o["osu_poll"] for o in result["overlap"] if math.isfinite(o["osu_poll"])]
    # the larger half is representative
    top = sorted(min(100.0, v) for v in polled)[len(polled) // 2:] if polled else []
    efficiency = float(np.clip(np.median(top) / 100.0, 0.0, 1.0)) if top else 0.0
    profile = {
        "name": name,
        "description": f"calibrated on {hostname}: {result['world_size']} ranks, {result['num_nodes']} node(s)",
        "source": ("calibrated by fourd-mpi bench collectives at "
                   f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}"),
        "backend": backend,
        "node": {"ranks_per_node": int(result["ranks_per_node"]), "cores_per_node": int(cores or os.cpu_count() or 0),
                 "hostname": hostname},
        "compute": {
            "gemm_tflops": {d: float(v) for d, v in c["alone"].items()},
            "mem_bandwidth_gbs": float(c["mem_bandwidth_gbs"]["alone"]),
            "op_overhead_s": float(c["op_overhead_s"]["alone"]),
            "oversubscription": max(1.0, oversub),
        },
        "progress": {"overlap_efficiency": efficiency, "host_driven": backend == "numpy",
                     "description": "median OSU overlap % / 100 with Testall between GEMMs, larger half of the "
                                    "measured sizes"},
        "levels": levels,
        "calibration": {"grids": result["grids"], "world_size": result["world_size"],
                        "num_nodes": result["num_nodes"],
                        "mpi": mpi_library,
                        "gemm_tflops_all_ranks": {d: float(v) for d, v in c["all"].items()}},
    }
    measured = sorted({r.op for r in result["rows"]}, key=OPS.index)
    profile["calibration"]["measured_ops"] = measured
    if result.get("rule"):
        profile["calibration"]["iterations"] = result["rule"]
    missing_ops = missing_kinds(result)
    if missing_ops:  # --ops a subset: the model takes these from the fallback profile, or refuses
        profile["calibration"]["missing_ops"] = missing_ops
    if "inter" not in levels:
        profile["calibration"]["missing"] = ("inter: measured on one node; predictions for grids that cross "
                                             "nodes need a fallback profile or a multi-node calibration")
    if not result["overlap"]:
        profile["progress"]["description"] = ("not measured (--overlap-sizes 0 or no nonblocking op): 0 assumed, "
                                              "nothing hidden")
    if fallback:
        profile["fallback"] = fallback
    return profile
