"""Optimus-CUBE's grid and layouts as pure arithmetic (no MPI, no array library).

The tensor ranks form a cube ``q x q x q`` with axes ``(i, j, l)`` (Bian, Xu, Wang, You 2021;
Colossal-AI's ``parallel_3d``: ``i`` = its *weight* group, ``j`` its *input* group and ``l`` its
*output* group of the first layer). They are mapped onto the 4D grid's communicators as

=========  ========  =================================  ==========================================
cube axis  grid      Colossal-AI group (even layers)    communicates
=========  ========  =================================  ==========================================
``i``      ``x``     ``PARALLEL_3D_WEIGHT``             all-gather of W, reduce-scatter of dW
``j``      ``y``     ``PARALLEL_3D_INPUT``              even layers: all-gather of X, reduce-scatter
                                                         of dX; odd layers: reduce-scatter of Y,
                                                         all-gather of dY
``l``      ``z``     ``PARALLEL_3D_OUTPUT``             the other way round; LayerNorm statistics
``-``      ``data``  data parallelism                   gradient all-reduce
=========  ========  =================================  ==========================================

so the rank order is Colossal-AI's: world rank ``= i + q*j + q^2*l + q^3*d`` (``x`` innermost,
:mod:`fourd_mpi.core.grid`), and a grid ``G_data x q x q x q`` is one cube per data replica.

Layouts (``m`` local tokens, whole sequences; ``W[n, k]`` with ``y = x W^T``). Even layers
(parity 0: ``qkv``, ``fc1``, the 4D model's *normal* layers) gather the input over ``j = y`` and
scatter the output over ``l = z``; odd layers (parity 1: ``proj``, ``fc2``, the *transposed*
ones) swap ``y`` and ``z`` (Colossal-AI's ``swap_in_out_group`` after every ``Linear3D``):

=============  ===========================  ===========================
tensor         parity 0                     parity 1
=============  ===========================  ===========================
input ``X``    tokens/(data,x,y), k/z       tokens/(data,x,z), k/y
weight ``W^T`` k/(z,x), n/y  [k/q^2, n/q]   k/(y,x), n/z  [k/q^2, n/q]
output ``Y``   tokens/(data,x,z), n/y       tokens/(data,x,y), n/z
=============  ===========================  ===========================

(``a/(u,v)``: dimension ``a`` split over ``u`` (outer) and ``v`` (inner) in contiguous blocks.)
Between blocks activations are ``[B*s/(G_data q^2), h/q]``: tokens over ``(data, x, y)``, hidden
over ``z``, with no replicas. LayerNorm ``gamma, beta`` are ``[h/q]`` over ``z``, replicated over
``x`` and ``y`` (Colossal-AI's ``LayerNorm3D``).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.presets import size_problems

#: the cube axes and the grid axes they run on
CUBE_AXES: Dict[str, str] = {"i": "x", "j": "y", "l": "z"}


def integer_cube_root(n: int) -> Optional[int]:
    """``q`` with ``q**3 == n``, or None."""
    if n < 1:
        return None
    q = round(n ** (1.0 / 3.0))
    for c in (q - 1, q, q + 1):
        if c >= 1 and c ** 3 == n:
            return c
    return None


def _hint(world_size: int) -> str:
    return (f"try 8 or 27 ranks (or G_data times q^3), or --gdata {world_size} for q = 1 (plain data "
            f"parallelism)")


def cube_shape(world_size: int, grid_sizes: Mapping[str, Optional[int]]) -> GridShape:
    """The grid ``G_data x q x q x q`` of ``world_size`` ranks from the given ``--g*`` sizes (None: omitted).

    Rules: the given tensor sizes must be equal (they are q); with none given and ``--gdata`` given,
    ``world_size / G_data`` must be a cube; with nothing given, the largest ``q > 1`` whose cube divides
    the world (data takes the rest; one rank is ``1x1x1x1``). Pure; raises :class:`ConfigError` with one
    line saying what to change.
    """
    what = "optimus3d needs a cube of tensor ranks (G_z = G_y = G_x = q) times G_data"
    for axis, size in grid_sizes.items():
        if size is not None and size < 1:
            raise ConfigError(f"--g{axis} must be a positive integer, got {size}")
    tensor = {a: grid_sizes.get(a) for a in ("z", "y", "x") if grid_sizes.get(a) is not None}
    data = grid_sizes.get("data")
    if len(set(tensor.values())) > 1:
        given = ", ".join(f"--g{a} {s}" for a, s in tensor.items())
        raise ConfigError(f"{what}: {given} are not equal")
    if tensor:
        q = next(iter(tensor.values()))
        if world_size % q ** 3:
            raise ConfigError(f"{what}: q = {q} needs a multiple of q^3 = {q ** 3} ranks, the world size is "
                              f"{world_size}; {_hint(world_size)}")
        rest = world_size // q ** 3
        if data is not None and data != rest:
            raise ConfigError(f"{what}: G_data {data} x {q}^3 = {data * q ** 3} ranks, but the world size is "
                              f"{world_size}")
        return GridShape(rest, q, q, q)
    if data is not None:
        if world_size % data:
            raise ConfigError(f"{what}: --gdata {data} does not divide the world size {world_size}")
        q = integer_cube_root(world_size // data)
        if q is None:
            raise ConfigError(f"{what}: {world_size} ranks / --gdata {data} = {world_size // data} is not a cube "
                              f"q^3; {_hint(world_size)}")
        return GridShape(data, q, q, q)
    if world_size == 1:  # one rank is the trivial cube (the serial step; sweep specs check options on it)
        return GridShape(1, 1, 1, 1)
    q = max((c for c in range(2, world_size + 1) if c ** 3 <= world_size and world_size % c ** 3 == 0),
            default=None)
    if q is None:
        raise ConfigError(f"{what}: {world_size} ranks is not q^3 x G_data for any q > 1; {_hint(world_size)}")
    return GridShape(world_size // q ** 3, q, q, q)


def cube_grids(world_size: int) -> List[GridShape]:
    """Every grid ``G_data x q x q x q`` of ``world_size`` ranks, largest ``q`` first (``tune`` ranks them)."""
    return [GridShape(world_size // q ** 3, q, q, q) for q in range(world_size, 0, -1)
            if q ** 3 <= world_size and world_size % q ** 3 == 0]


def describe(grid: GridShape) -> str:
    """The header line's note: the cube's edge and axes on the grid."""
    return f"cube q = {grid.x}: axes i, j, l on X, Y, Z; the 4D roles above do not apply"


def model_problems(cfg, grid: GridShape) -> List[str]:
    """Everything wrong with running ``cfg`` (:class:`~fourd_mpi.step.presets.ModelConfig`) as Optimus-CUBE
    on ``grid``, as actionable sentences (empty when fine)."""
    if not (grid.x == grid.y == grid.z):
        return [f"optimus3d needs a cube G_z = G_y = G_x = q, grid {grid} is not one"]
    if cfg.kind not in ("gpt", "mlp"):
        return [f"model kind {cfg.kind!r} is not one of gpt, mlp"]
    if cfg.batch is None:
        return [f"preset {cfg.name} needs the global batch: give --batch SEQUENCES"]
    problems = size_problems(cfg)
    if problems:
        return problems
    q, d = grid.x, grid.data

    def need(value, divisor, what, fix):
        if value % divisor:
            problems.append(f"{what} {value} is not divisible by {divisor}: {fix}")

    need(cfg.batch, d * q * q, "global batch",
         f"whole sequences are split over data and two cube axes: give --batch a multiple of G_data*q^2 = "
         f"{d}*{q}^2")
    need(cfg.hidden, q * q, "hidden size", f"weights split their input dimension q^2 ways: give --hidden a "
         f"multiple of q^2 = {q * q}")
    need(cfg.ffn_hidden, q * q, "MLP hidden size", f"give --ffn-hidden a multiple of q^2 = {q * q}")
    if cfg.kind == "gpt":
        need(cfg.hidden, cfg.heads, "hidden size", f"give --hidden a multiple of --heads = {cfg.heads}")
        need(cfg.heads, q, "head count", f"attention splits whole heads over one cube axis: give --heads a "
             f"multiple of q = {q}")
    return problems


def check_model(cfg, grid: GridShape) -> None:
    """Raise :class:`ConfigError` naming every problem of :func:`model_problems`."""
    problems = model_problems(cfg, grid)
    if problems:
        raise ConfigError(f"optimus3d: model {cfg.name} on grid {grid} (G_data x q x q x q): " + "; ".join(problems))


def checker(algorithm, options) -> None:
    """The registry's cross-check of resolved options (pure): the model rules (again, for options built
    without :func:`~fourd_mpi.run.options.resolve`)."""
    check_model(options.model, options.grid)


# -- layouts ----------------------------------------------------------------------------------

def axes_of(parity: int) -> Tuple[str, str]:
    """``(gather, scatter)``: the grid axes that gather a layer's input (and reduce-scatter its dX) and
    that reduce-scatter its output (and gather its dY); parity 0 ``(y, z)``, parity 1 ``(z, y)``."""
    return ("y", "z") if parity == 0 else ("z", "y")


def token_axes(scatter_axis: str) -> Tuple[str, str, str]:
    """Axes splitting the tokens of an activation whose hidden dimension is over the other cube axis,
    outer first: ``(data, x, scatter_axis)``."""
    return ("data", "x", scatter_axis)


def sequence_range(batch: int, grid: GridShape, coords: Mapping[str, int], inner_axis: str) -> Tuple[int, int]:
    """``[first, stop)`` of the whole sequences an activation split over ``(data, x, inner_axis)`` holds."""
    q = grid.x
    per = batch // (grid.data * q * q)
    block = (coords["data"] * q + coords["x"]) * q + coords[inner_axis]
    return block * per, (block + 1) * per


def hidden_range(width: int, grid: GridShape, coords: Mapping[str, int], axis: str) -> Tuple[int, int]:
    """``[start, stop)`` of a hidden dimension of ``width`` split over ``axis`` (q blocks)."""
    per = width // grid[axis]
    return coords[axis] * per, (coords[axis] + 1) * per


def weight_shard_index(n_out: int, k_in: int, parity: int, grid: GridShape,
                       coords: Mapping[str, int]):
    """Global flat indices into ``W[n_out, k_in]`` (row-major) of this rank's stored shard of ``W^T``,
    ``[k/q^2, n/q]`` in row-major order: rows ``k`` over (scatter axis outer, ``x`` inner), columns ``n``
    over the gather axis. All-gathering the flat shards over ``x`` gives ``W^T``'s block
    ``[k/q, n/q]`` in row-major order. Returns a 1-D int64 NumPy array."""
    import numpy as np  # only here: the registry imports this module and stays free of array libraries

    gather, scatter = axes_of(parity)
    q = grid.x
    kq, kq2, nq = k_in // q, k_in // (q * q), n_out // q
    k0 = coords[scatter] * kq + coords["x"] * kq2
    n0 = coords[gather] * nq
    rows = np.arange(k0, k0 + kq2, dtype=np.int64)[:, None]
    cols = np.arange(n0, n0 + nq, dtype=np.int64)[None, :]
    return (cols * k_in + rows).ravel()
