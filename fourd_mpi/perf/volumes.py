"""Communication of one training step, per layer, axis and operation (pure, no MPI).

Every collective the step issues (:mod:`fourd_mpi.step.layers`, :mod:`fourd_mpi.step.model`,
:mod:`fourd_mpi.step.schedule`), per rank, with docs/design.md section 2's ring volumes. For a 4D
layer ``W[n, k]`` (``out``/``in`` the axes sharding its output/input dimension: ``y``/``x``
for a normal layer, ``x``/``y`` for a transposed one), ``m = B*s/(G_data*G_z)``, ``e`` bytes
per element:

======================  ======  ==========================  ==============================
collective              axis    message (nccl-tests size)   count per step
======================  ======  ==========================  ==============================
weight all-gather       z       ``n*k/(G_out*G_in) * e``    2 (forward, backward); 1 cached
dW reduce-scatter       z       ``n*k/(G_out*G_in) * e``    1
forward all-reduce      in      ``m*n/G_out * e``           1 (``chunks`` pieces with od)
backward all-reduce     out     ``m*k/G_in * e``            1
gradient all-reduce     data    ``n*k/(G_x*G_y*G_z) * e``   1
======================  ======  ==========================  ==============================

GPT blocks add per LayerNorm: two forward all-reduces over X of ``[m, 1]`` and one backward
of ``[m, 2]``; ``gamma, beta`` ``[h/G_x]`` are all-reduced over Z and then data. The loss is
summed over data, Z and X (one float64 each, blocking).

Wire bytes (what a rank sends with ring algorithms) = message * ``(p-1)/p`` for all-gather
and reduce-scatter, ``2(p-1)/p`` for all-reduce (:mod:`fourd_mpi.core.colltable`),
rounded down per message as the trace does. Over-decomposition changes the message count,
not the volume; ``cache`` removes the backward all-gather.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.colltable import collective
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.memory import block_elements, fc_weights, local_tokens
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

#: which overlap option can hide each kind of collective
OVERLAPS = {"weight_allgather": "oag", "dw_reduce_scatter": "ors", "fwd_allreduce": "od",
            "bwd_allreduce": "oar", "grad_allreduce": "dp"}


@dataclass(frozen=True)
class Collective:
    """One kind of collective of one layer, per rank and step.

    layer: ``block0.fc1``; role: ``weight_allgather``, ``dw_reduce_scatter``,
    ``fwd_allreduce``, ``bwd_allreduce``, ``grad_allreduce``, ``ln_allreduce``,
    ``ln_grad_allreduce``, ``loss``; op: MPI operation (``allgather``,
    ``reduce_scatter``, ``allreduce``); axis and its size p; phase (``forward``,
    ``backward``); count: messages per step; message_bytes: bytes of one message
    (nccl-tests size); wire_bytes: bytes a rank sends for all ``count`` messages.
    """

    layer: str
    role: str
    op: str
    axis: str
    p: int
    phase: str
    count: int
    message_bytes: int

    @property
    def bytes(self) -> int:
        """All messages' bytes (nccl-tests size x count)."""
        return self.count * self.message_bytes

    @property
    def wire_bytes(self) -> int:
        return self.count * collective(self.op).wire_bytes(self.message_bytes, self.p)

    @property
    def steps(self) -> int:
        """Latency terms of the ring algorithm for all messages: ``count * k * (p-1)``."""
        return self.count * collective(self.op).alpha_count(self.p)


def step_collectives(cfg: ModelConfig, grid: GridShape, overlap: Optional[OverlapConfig] = None,
                     dtype: str = "float32") -> List[Collective]:
    """Every collective of one training step on one rank, in program order per layer.

    Collectives over an axis of size 1 are not issued and not listed. The list is built once per
    ``(cfg, grid, overlap, dtype)`` (all frozen; :class:`Collective` too) and copied: a search predicts
    the same micro-batch step many times (``tune``, the pipeline's slot and its wire bytes).
    """
    return list(_step_collectives(cfg, grid, overlap or OverlapConfig(), dtype))


@lru_cache(maxsize=4096)
def _step_collectives(cfg: ModelConfig, grid: GridShape, overlap: OverlapConfig, dtype: str) -> Tuple[Collective, ...]:
    return tuple(Collective(*row) for row in collective_rows(cfg, grid, overlap, dtype))


def collective_rows(cfg: ModelConfig, grid: GridShape, overlap: OverlapConfig, dtype: str) -> List[tuple]:
    """:func:`step_collectives` as plain tuples ``(layer, role, op, axis, p, phase, count, message_bytes)``
    (the fields of :class:`Collective`, in order): what a search prices without building the objects."""
    e = dtype_bytes(dtype)
    m = local_tokens(cfg, grid)
    out: List[tuple] = []
    sizes = {"data": grid.data, "z": grid.z, "y": grid.y, "x": grid.x}

    def add(layer, role, op, axis, phase, count, message):
        p = sizes[axis]
        if p > 1 and count > 0:
            out.append((layer, role, op, axis, p, phase, count, int(message)))

    for b in range(cfg.layers):
        if cfg.kind == "gpt":
            for ln in ("ln1", "ln2"):
                name = f"block{b}.{ln}"
                add(name, "ln_allreduce", "allreduce", "x", "forward", 2, m * e)
                add(name, "ln_allreduce", "allreduce", "x", "backward", 1, 2 * m * e)
                shard = cfg.hidden // grid.x
                add(name, "ln_grad_allreduce", "allreduce", "z", "backward", 2, shard * e)
                add(name, "ln_grad_allreduce", "allreduce", "data", "backward", 2, shard * e)
        for lname, n, k, transposed in fc_weights(cfg, grid):
            name = f"block{b}.{lname}"
            in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
            block = block_elements(n, k, transposed, grid)
            add(name, "weight_allgather", "allgather", "z", "forward", 1, block * e)
            add(name, "weight_allgather", "allgather", "z", "backward", 0 if overlap.cache else 1, block * e)
            add(name, "dw_reduce_scatter", "reduce_scatter", "z", "backward", 1, block * e)
            chunks = min(overlap.chunks, m) if overlap.od else 1
            fwd = m * (n // sizes[out_axis]) * e
            add(name, "fwd_allreduce", "allreduce", in_axis, "forward", chunks, fwd / chunks)
            add(name, "bwd_allreduce", "allreduce", out_axis, "backward", 1, m * (k // sizes[in_axis]) * e)
            add(name, "grad_allreduce", "allreduce", "data", "backward", 1, block // grid.z * e)
    for axis in ("data", "z", "x"):
        add("loss", "loss", "allreduce", axis, "forward", 1, 8)
    return out


def totals(collectives: List[Collective], by: Tuple[str, ...] = ("op", "axis")) -> Dict[tuple, Dict[str, int]]:
    """Sums per key: ``{(op, axis): {"messages", "bytes", "wire_bytes"}}``."""
    acc: Dict[tuple, Dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0, "wire_bytes": 0})
    for c in collectives:
        key = tuple(getattr(c, f) for f in by)
        acc[key]["messages"] += c.count
        acc[key]["bytes"] += c.bytes
        acc[key]["wire_bytes"] += c.wire_bytes
    return dict(acc)


def design_volume_elements(cfg: ModelConfig, grid: GridShape, cache: bool = False) -> Dict[str, float]:
    """docs/design.md section 2's per-rank wire volume per axis, in elements, summed over the 4D layers
    (no LayerNorm, no loss): the formulas as written, for cross-checking."""
    m = local_tokens(cfg, grid)
    gd, gz, gy, gx = grid.dims
    vol = {"z": 0.0, "x": 0.0, "y": 0.0, "data": 0.0}
    for _, n, k, transposed in fc_weights(cfg, grid) * cfg.layers:
        nk = n * k / (gx * gy)
        vol["z"] += (1 if cache else 2) * (gz - 1) / gz * nk + (gz - 1) / gz * nk
        fwd_axis, bwd_axis = ("y", "x") if transposed else ("x", "y")
        g_fwd, g_bwd = grid[fwd_axis], grid[bwd_axis]
        vol[fwd_axis] += 2 * (g_fwd - 1) / g_fwd * m * n / g_bwd
        vol[bwd_axis] += 2 * (g_bwd - 1) / g_bwd * m * k / g_fwd
        vol["data"] += 2 * (gd - 1) / gd * n * k / (gx * gy * gz)
    return vol
