"""Layouts as values, and the block arithmetic of the 3D matrix multiplication.

Pure functions (no MPI), testable on their own.

A tensor's layout says, per tensor dimension, which grid axes shard it, and which
axes hold replicas. Activations between GPT blocks are ``[tokens/(data,z),
hidden/x] replicated over y``; a normal layer's output is ``[tokens/(data,z),
out/y] replicated over x``. A weight ``W[n_out, k_in]`` of a normal layer is split
in blocks ``[n/y, k/x]``, and each block is flattened and split in ``G_z`` shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from fourd_mpi.core.grid import AXES, GridShape


@dataclass(frozen=True)
class Layout:
    """How a tensor is distributed: ``shards[d]`` are the axes splitting dim ``d``.

    ``flat_shard`` names an axis that splits the flattened local block (the Z
    sharding of weights). Axes that shard nothing hold replicas.
    """

    dims: Tuple[str, ...]
    shards: Tuple[Tuple[str, ...], ...]
    flat_shard: Tuple[str, ...] = ()

    @property
    def replicated(self) -> Tuple[str, ...]:
        used = {a for s in self.shards for a in s} | set(self.flat_shard)
        return tuple(a for a in AXES if a not in used)

    def __str__(self) -> str:
        parts = []
        for name, axes in zip(self.dims, self.shards):
            parts.append(f"{name}/{'*'.join(axes)}" if axes else name)
        text = "[" + ", ".join(parts) + "]"
        if self.flat_shard:
            text += f" flat/{'*'.join(self.flat_shard)}"
        if self.replicated:
            text += f" rep({','.join(self.replicated)})"
        return text


def activation_layout(hidden_axis: str, name: str = "hidden") -> Layout:
    """Layout of an activation whose hidden dimension is sharded over ``hidden_axis``."""
    return Layout(("tokens", name), (("data", "z"), (hidden_axis,)))


def weight_layout(out_axis: str, in_axis: str) -> Layout:
    """Layout of a weight ``[out, in]`` with out sharded over ``out_axis`` and in over ``in_axis``."""
    return Layout(("out", "in"), ((out_axis,), (in_axis,)), flat_shard=("z",))


def block_range(length: int, parts: int, index: int) -> Tuple[int, int]:
    """``[start, stop)`` of block ``index`` when ``length`` is split in ``parts`` equal blocks."""
    if length % parts:
        raise ValueError(f"length {length} is not divisible into {parts} blocks")
    size = length // parts
    return index * size, (index + 1) * size


def weight_shard_indices(n_out: int, k_in: int, out_parts: int, out_index: int,
                         in_parts: int, in_index: int, z_parts: int, z_index: int):
    """Global ``(rows, cols)`` (1-D integer arrays) of the elements in one weight shard.

    The block ``(out_index, in_index)`` of ``W[n_out, k_in]`` is flattened in row-major
    order and split in ``z_parts`` equal pieces; piece ``z_index`` is the shard.
    """
    import numpy as np

    r0, r1 = block_range(n_out, out_parts, out_index)
    c0, c1 = block_range(k_in, in_parts, in_index)
    block_cols = c1 - c0
    p0, p1 = block_range((r1 - r0) * block_cols, z_parts, z_index)
    flat = np.arange(p0, p1, dtype=np.int64)
    return r0 + flat // block_cols, c0 + flat % block_cols


def local_sequences(global_batch: int, grid: GridShape, data_index: int, z_index: int) -> Tuple[int, int]:
    """``[first, stop)`` of the whole sequences held by ranks with coordinates ``(data, z)``.

    Batches are split by whole sequences over data (outer) and Z (inner).
    """
    parts = grid.data * grid.z
    return block_range(global_batch, parts, data_index * grid.z + z_index)


def shard_counts(n_out: int, k_in: int, grid: GridShape, transposed: bool) -> Dict[str, int]:
    """Sizes of one rank's pieces of a layer's weight (block rows, block cols, shard)."""
    out_axis, in_axis = ("x", "y") if transposed else ("y", "x")
    rows, cols = n_out // grid[out_axis], k_in // grid[in_axis]
    return {"block_rows": rows, "block_cols": cols, "shard": rows * cols // grid.z}
