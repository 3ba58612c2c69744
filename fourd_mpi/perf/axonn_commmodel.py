"""AxoNN's published communication model, and ours costed the same way (pure, no MPI).

AxoNN (Singh et al., SC'24, arXiv 2305.13525) picks its 4D grid with a communication-only model,
published as ``examples/comm_model.py`` of axonn-ai/Megatron-AxoNN (branch ``gordon-bell-perlmutter``;
/work/shared/REFERENCES.md section 3). This module writes that model again from its formulas, in our
notation (AxoNN's ``Gc, Gr, Gd, Gdata`` are our ``G_x, G_y, G_z, G_data``; placement order X, Y, Z,
data from inside out), so that ``fourd-mpi model compare-axonn`` can put its ranking next to ours.

Per fully connected layer of width multiplier ``K`` (QKV: 3, projection: 1, FC1: 4, FC2: 4), ``B``
sequences of ``S`` tokens, hidden ``H``, ``m = B S/(G_data G_z)`` tokens per rank, 2 bytes per
element, volumes in GiB (``2^30`` bytes) per rank:

=======  =====================================================  ====================================
axis     normal layer (QKV, FC1)                                transposed layer (projection, FC2)
=======  =====================================================  ====================================
data     ``4 (G_d-1)/G_d * K H^2/(G_x G_y G_z) * 2``            same
z        ``3 (G_z-1)/G_z * K H^2/(G_x G_y) * 2``                same
y        ``2 (G_y-1)/G_y * m H/G_x * 2``                         ``4 (G_y-1)/G_y * m K H/G_x * 2``
x        ``4 (G_x-1)/G_x * m K H/G_y * 2``                       ``2 (G_x-1)/G_x * m H/G_y * 2``
=======  =====================================================  ====================================

(``G_d`` = ``G_data``.) The time of an axis term is ``volume / get_bw(ip, G_axis)``, where ``ip`` is
the product of the axes placed inside it (X: 1, Y: ``G_x``, Z: ``G_x G_y``, data: ``G_x G_y G_z``) and
``get_bw`` the machine's bandwidth table in GB/s (a profile's ``network.placement_gbs``, see
:meth:`fourd_mpi.perf.machine.MachineProfile.placement_gbs`). AxoNN divides GiB by GB/s; ours below is
costed in the same units, so both columns are in the same (AxoNN's) seconds. A step is the sum over
the four layers of a block times the layer count: communication only, nothing overlapped, no
compute. A grid for which ``get_bw`` has no value is left out, as AxoNN's code does.

Ours (:func:`our_comm_time`) costs every collective that :func:`fourd_mpi.perf.volumes.step_collectives`
lists (the step's real messages, checked against traces) with the same table: ``wire_bytes / 2^30 /
get_bw(ip, p)`` (wire bytes = ring volume ``k (p-1)/p * S``).

The terms that differ (:func:`explain_grid` prints them per grid):

- **forward all-reduces**: AxoNN counts ``4 (p-1)/p`` for the forward all-reduce of every layer, twice
  the ring all-reduce's ``2 (p-1)/p``: a forward pass run twice, as with AxoNN's full activation
  recompute. Our step runs the forward once (``2 (p-1)/p``, one message per layer).
- **transposed layers**: AxoNN's formula puts the ``K`` of FC2 on the forward all-reduce over Y
  (``m K H/G_x``) and leaves the backward all-reduce over X at ``m H/G_y``; the transposed layer's
  output is ``[m, H/G_x]`` and its input gradient ``[m, K H/G_y]``, so our step sends ``m H/G_x`` over
  Y and ``m K H/G_y`` over X (docs/design.md section 2; the same as AxoNN's later
  sc2025-pccl-reproducer model, which swaps the axes of a transposed layer instead).
- **data**: AxoNN's ``4 (p-1)/p`` at 2 bytes is the ring all-reduce of 4-byte (fp32) gradients; our
  step all-reduces gradients in the training dtype: ``2 (p-1)/p`` at 2 bytes for bf16.
- **depth**: both count two all-gathers and one reduce-scatter (``3 (p-1)/p``); with ``cache`` our
  backward all-gather goes (``2 (p-1)/p``).
- **ours only**: the LayerNorm statistics all-reduces over X (``[m, 1]`` twice forward, ``[m, 2]``
  backward), the LayerNorm parameter gradients over Z and data (``[H/G_x]``), the loss (8 bytes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.machine import axis_inner_products as inner_products
from fourd_mpi.step.presets import ModelConfig, model_problems
from fourd_mpi.util.table import render
from fourd_mpi.util.units import GIB

#: ``get_bw(ip, group) -> GB/s`` or None (no value: the grid is left out)
BandwidthFn = Callable[[int, int], Optional[float]]
#: AxoNN's layers of a transformer block: (name, K, transposed)
AXONN_LAYERS = (("qkv", 3, False), ("proj", 1, True), ("fc1", 4, False), ("fc2", 4, True))
#: how the printed time is formed (both columns)
TIME_FORMULA = "t = sum over terms of volume[GiB] / get_bw(ip, group)[GB/s], times the layer count"


def axonn_layer_volumes(B: int, S: int, K: int, H: int, grid: GridShape, transposed: bool) -> Dict[str, float]:
    """GiB per rank of one layer, per axis (the module docstring's table; AxoNN's ``model_v2``)."""
    gd, gz, gy, gx = grid.dims
    m = B / gd / gz * S
    vol = {"data": 4 * (gd - 1) / gd * K * H * H / (gx * gy * gz) * 2 / GIB,
           "z": 3 / 2 * 2 * (gz - 1) / gz * K * H * H / (gx * gy) * 2 / GIB}
    if not transposed:
        vol["y"] = 2 * (gy - 1) / gy * (m * H / gx) * 2 / GIB
        vol["x"] = 2 * 2 * (gx - 1) / gx * (m * K * H / gy) * 2 / GIB
    else:
        vol["y"] = 2 * 2 * (gy - 1) / gy * (m * K * H / gx) * 2 / GIB
        vol["x"] = 2 * (gx - 1) / gx * (m * H / gy) * 2 / GIB
    return vol


def axonn_terms(cfg: ModelConfig, grid: GridShape) -> Dict[Tuple[str, str], float]:
    """GiB per rank and step of AxoNN's model by ``(layer, axis)`` (all blocks; axes of size 1 omitted)."""
    out: Dict[Tuple[str, str], float] = {}
    for name, K, transposed in AXONN_LAYERS:
        for axis, v in axonn_layer_volumes(cfg.batch, cfg.seq, K, cfg.hidden, grid, transposed).items():
            if grid[axis] > 1:
                out[(name, axis)] = v * cfg.layers
    return out


def axonn_comm_time(cfg: ModelConfig, grid: GridShape, get_bw: BandwidthFn) -> Optional[float]:
    """AxoNN's communication time of one step (its seconds), or None when ``get_bw`` has no value."""
    ip = inner_products(grid)
    total = 0.0
    for name, K, transposed in AXONN_LAYERS:
        vol = axonn_layer_volumes(cfg.batch, cfg.seq, K, cfg.hidden, grid, transposed)
        for axis in ("x", "y", "z", "data"):  # AxoNN's order of summation: col, row, depth, data
            if grid[axis] > 1:
                bw = get_bw(ip[axis], grid[axis])
                if bw is None:
                    return None
                total += vol[axis] / bw
    return total * cfg.layers


def our_terms(cfg: ModelConfig, grid: GridShape, cache: bool = False,
              dtype: str = "bfloat16") -> Dict[Tuple[str, str, str], float]:
    """GiB per rank and step that our step sends, by ``(layer kind, axis, role)`` (all blocks summed):
    the wire bytes of :func:`~fourd_mpi.perf.volumes.step_collectives`, no overlap."""
    from fourd_mpi.perf.volumes import step_collectives
    from fourd_mpi.step.overlap import OverlapConfig

    out: Dict[Tuple[str, str, str], float] = defaultdict(float)
    # every block sends the same: list one block (and the loss) and multiply by the layer count
    for c in step_collectives(replace(cfg, layers=1), grid, OverlapConfig(cache=cache), dtype):
        kind = c.layer.split(".")[-1]
        out[(kind, c.axis, c.role)] += c.wire_bytes * (1 if c.layer == "loss" else cfg.layers) / GIB
    return dict(out)


def our_comm_time(cfg: ModelConfig, grid: GridShape, get_bw: BandwidthFn, cache: bool = False,
                  dtype: str = "bfloat16") -> Optional[float]:
    """Our step's communication time costed with AxoNN's table (same units), or None as AxoNN's."""
    ip = inner_products(grid)
    total = 0.0
    for (_, axis, _), gib in our_terms(cfg, grid, cache, dtype).items():
        bw = get_bw(ip[axis], grid[axis])
        if bw is None:
            return None
        total += gib / bw
    return total


def candidate_grids(ranks: int, batch: int, min_tp: int) -> Iterator[GridShape]:
    """AxoNN's candidates in its loop order (``Gc``, ``Gr``, ``Gd``, ``Gdata`` nested, powers of two):
    product ``ranks``, ``G_x G_y G_z >= min_tp``, ``batch`` divisible by ``G_data G_z``."""
    powers = [2 ** i for i in range(ranks.bit_length()) if 2 ** i <= ranks]
    for gx in powers:
        for gy in powers:
            for gz in powers:
                for gd in powers:
                    if gx * gy * gz * gd == ranks and gx * gy * gz >= min_tp and batch % (gd * gz) == 0:
                        yield GridShape(gd, gz, gy, gx)


@dataclass
class Comparison:
    """Both rankings over the same candidates: ``(grid, seconds)`` best first; ``dropped``: candidates
    our step cannot run (``(grid, first problem)``), ranked by AxoNN's model only."""

    axonn: List[Tuple[GridShape, float]]
    ours: List[Tuple[GridShape, float]]
    ours_cache: List[Tuple[GridShape, float]]
    dropped: List[Tuple[GridShape, str]] = field(default_factory=list)


def compare(cfg: ModelConfig, ranks: int, min_tp: int, get_bw: BandwidthFn) -> Comparison:
    """Rank AxoNN's candidates by AxoNN's model and by ours (without and with ``cache``), stable sorts
    over AxoNN's loop order (its tie order)."""
    axonn, ours, cached, dropped = [], [], [], []
    for grid in candidate_grids(ranks, cfg.batch, min_tp):
        t = axonn_comm_time(cfg, grid, get_bw)
        if t is not None:
            axonn.append((grid, t))
        problems = model_problems(cfg, grid)
        if problems:
            dropped.append((grid, problems[0]))
            continue
        for cache, bucket in ((False, ours), (True, cached)):
            t = our_comm_time(cfg, grid, get_bw, cache)
            if t is not None:
                bucket.append((grid, t))
    key = lambda item: item[1]  # noqa: E731
    return Comparison(sorted(axonn, key=key), sorted(ours, key=key), sorted(cached, key=key), dropped)


def default_explained(comp: Comparison) -> List[GridShape]:
    """The grids worth a term-by-term table: AxoNN's best, ours, and AxoNN's best with ``G_x, G_y > 1``
    (where both tensor axes, hence the transposed-layer terms, show)."""
    grids = [lst[0][0] for lst in (comp.axonn, comp.ours) if lst]
    grids += [g for g, _ in comp.axonn if g.x > 1 and g.y > 1][:1]
    return list(dict.fromkeys(grids))


#: why each of our terms differs from AxoNN's (printed by explain_grid)
REASONS = {
    "fwd_x": "forward all-reduce: AxoNN 4(p-1)/p (forward counted twice, as with full recompute), ours 2(p-1)/p",
    "fwd_y": "forward all-reduce: AxoNN 4(p-1)/p (forward counted twice, as with full recompute), ours 2(p-1)/p",
    "bwd": "backward all-reduce: both 2(p-1)/p",
    "data": "gradient all-reduce: AxoNN 4(p-1)/p at 2 B (= fp32 gradients), ours 2(p-1)/p in the training dtype",
    "z": "depth: both 2 all-gathers + 1 reduce-scatter = 3(p-1)/p (ours 2(p-1)/p with cache)",
}


EXTRA_REASONS = {
    "ln_allreduce": "ours only: LayerNorm statistics over X ([m, 1] x2 forward, [m, 2] backward per LayerNorm)",
    "ln_grad_allreduce": "ours only: LayerNorm gamma, beta gradients [H/G_x] (AxoNN leaves LayerNorm out)",
    "loss": "ours only: the loss (8 bytes per axis)",
}


def explain_grid(cfg: ModelConfig, grid: GridShape, get_bw: BandwidthFn, cache: bool = False) -> List[Dict]:
    """Term-by-term rows for one grid: per layer and axis AxoNN's GiB and ours, their ratio, the seconds
    each costs with the table, and why they differ. Our LayerNorm and loss collectives get their own
    rows (AxoNN has none)."""
    ip = inner_products(grid)
    ax = axonn_terms(cfg, grid)
    ours = our_terms(cfg, grid, cache)
    rows = []
    layer_kind = {name: transposed for name, _, transposed in AXONN_LAYERS}
    for (name, axis), a_gib in ax.items():
        o_gib = sum(v for (k, ax_, _), v in ours.items() if k == name and ax_ == axis)
        transposed = layer_kind[name]
        fwd_axis = "y" if transposed else "x"
        if axis == "data":
            why = REASONS["data"]
        elif axis == "z":
            why = REASONS["z"]
        elif axis == fwd_axis:
            why = REASONS["fwd_" + axis]
            if transposed and name == "fc2":
                why += "; AxoNN's message m*K*H/G_x, ours m*H/G_x (the output is [m, H/G_x])"
        else:
            why = REASONS["bwd"]
            if transposed and name == "fc2":
                why += "; AxoNN's message m*H/G_y, ours m*K*H/G_y (dX is [m, K*H/G_y])"
        bw = get_bw(ip[axis], grid[axis])
        rows.append({"term": f"{name} {axis}", "axonn_gib": a_gib, "ours_gib": o_gib,
                     "ratio": (o_gib / a_gib) if a_gib else float("nan"), "gbs": bw,
                     "axonn_s": a_gib / bw, "ours_s": o_gib / bw, "why": why})
    extra: Dict[Tuple[str, str], float] = defaultdict(float)
    for (kind, axis, role), gib in ours.items():
        if kind not in layer_kind:
            extra[(role, axis)] += gib
    for (role, axis), gib in sorted(extra.items()):
        bw = get_bw(ip[axis], grid[axis])
        rows.append({"term": f"{role} {axis}", "axonn_gib": 0.0, "ours_gib": gib, "ratio": float("inf"),
                     "gbs": bw, "axonn_s": 0.0, "ours_s": gib / bw, "why": EXTRA_REASONS[role]})
    return rows


def format_comparison(cfg: ModelConfig, ranks: int, min_tp: int, comp: Comparison, top: int,
                      profile_name: str) -> str:
    """The two top-``top`` lists side by side (and ours with ``cache``), with the formula and what was
    left out."""
    lines = [f"{cfg.name}: {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq}, global batch {cfg.batch}; "
             f"{ranks} GPUs, G_x G_y G_z >= {min_tp}, powers of two; communication only, nothing overlapped; "
             f"bandwidth table: {profile_name} network.placement_gbs (AxoNN's get_bw)",
             f"time = {TIME_FORMULA} (AxoNN's units: GiB over GB/s)",
             f"{len(comp.axonn)} candidate grids; {len(comp.dropped)} of them our step cannot run"
             + (f" (e.g. {comp.dropped[0][0]}: {comp.dropped[0][1]})" if comp.dropped else "")]
    rows = []
    for i in range(top):
        cells = [i + 1]
        for lst in (comp.axonn, comp.ours, comp.ours_cache):
            grid, seconds = lst[i] if i < len(lst) else ("", None)
            cells += [str(grid), "" if seconds is None else f"{seconds:.3f}"]
        rows.append(cells)
    lines.append(render(rows, ["#", "AxoNN model DxZxYxX", "s/step", "ours DxZxYxX", "s/step", "ours, cache DxZxYxX",
                               "s/step"],
                        align=["right"] * 7))
    return "\n".join(lines)


def format_explanation(rows: List[Dict], grid: GridShape, cache: bool = False) -> str:
    """:func:`explain_grid`'s rows as a table, with the totals."""
    head = (f"grid {grid} ({'ours with cache' if cache else 'ours without cache'}): per term, GiB per rank and "
            f"step, ratio ours/AxoNN, table GB/s, seconds")
    body = [[r["term"], f"{r['axonn_gib']:.3f}", f"{r['ours_gib']:.3f}", f"{r['ratio']:.2f}", f"{r['gbs']:g}",
             f"{r['axonn_s']:.3f}", f"{r['ours_s']:.3f}", r["why"]] for r in rows]
    body.append(["total"] + [f"{sum(r[k] for r in rows):.3f}" for k in ("axonn_gib", "ours_gib")] + ["", ""]
                + [f"{sum(r[k] for r in rows):.3f}" for k in ("axonn_s", "ours_s")] + [""])
    return head + "\n" + render(body, ["term", "AxoNN GiB", "ours GiB", "ratio", "GB/s", "AxoNN s", "ours s", "why"],
                                 align=["left"] + ["right"] * 6 + ["left"], indent="  ")
