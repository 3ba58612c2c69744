"""Process grids of named axes on MPI's Cartesian topology; the 4D grid ``G_data x G_z x G_y x G_x``.

A :class:`ProcessGrid` has named, ordered axes (default :data:`AXES`: ``data, z, y, x``, outermost first)
and gives the communicator of any subset of them (:meth:`ProcessGrid.axes_comm`), as Megatron-core's
``HyperCommGrid`` does; the pipeline's grid is the same class with one more axis, ``inter``
(``data, inter, z, y, x``), and each stage's 4D grid is its :meth:`ProcessGrid.sub` over :data:`AXES`.

Rank order, innermost (consecutive world ranks) to outermost: X, Y, Z, data.
``Create_cart(dims=[G_data, G_z, G_y, G_x])`` is row-major (last dimension varies
fastest), which gives exactly that order; ``Sub`` gives one communicator per axis (or per subset of axes).
Put the innermost axes inside a node: with ``r`` ranks per node the X axis (and
then Y, ...) stays on a node while the product of the inner sizes divides ``r``.

Which axis communicates (:data:`ROLES`): X and Y the tensor-parallel all-reduces, Z the weight all-gather and
gradient reduce-scatter, data the gradient all-reduce, inter the pipeline's point-to-point messages.

The arithmetic (inferring missing sizes, enumerating factorizations) is in pure
functions so it can be tested without MPI.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from fourd_mpi.core.binding import Binding, cpu_ranges, own_cpus, parse_ranges
from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.table import render

#: Axis names in Cartesian-dimension order (outermost first).
AXES: Tuple[str, ...] = ("data", "z", "y", "x")


@dataclass(frozen=True)
class GridShape:
    """Sizes of the four axes. ``str()`` gives ``data x z x y x x`` as ``1x2x2x2``."""

    data: int
    z: int
    y: int
    x: int

    @property
    def dims(self) -> Tuple[int, int, int, int]:
        """Sizes in Cartesian order ``(G_data, G_z, G_y, G_x)``."""
        return (self.data, self.z, self.y, self.x)

    @property
    def size(self) -> int:
        return self.data * self.z * self.y * self.x

    def __getitem__(self, axis: str) -> int:
        return getattr(self, axis)

    def __str__(self) -> str:
        return "x".join(str(d) for d in self.dims)

    @classmethod
    def parse(cls, text: str) -> "GridShape":
        """Parse ``"G_data x G_z x G_y x G_x"`` written as ``2x1x2x2``."""
        parts = text.lower().replace("*", "x").split("x")
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            dims = []
        if len(dims) != 4 or min(dims) < 1:
            raise ConfigError(
                f"grid {text!r} is not four positive sizes G_data x G_z x G_y x G_x, e.g. 1x2x2x2"
            )
        return cls(*dims)


def launch_hint(ranks: int, world_size: int) -> str:
    """The launch that gives a grid of ``ranks`` its ranks, when the world is smaller (one process
    outside a launcher, or too few ranks): ``; or run under mpiexec -n 4``."""
    if ranks <= world_size:
        return ""
    alone = " (one process: not started under mpiexec or srun?)" if world_size == 1 else ""
    return f"; or run under mpiexec -n {ranks} (or srun -n {ranks}){alone}"


def infer_grid_shape(
    world_size: int,
    data: Optional[int] = None,
    z: Optional[int] = None,
    y: Optional[int] = None,
    x: Optional[int] = None,
) -> GridShape:
    """Complete a partially given grid so that its product is ``world_size``.

    Rules: omitted tensor-parallel axes (x, y, z) default to 1 and an omitted data
    axis absorbs the rest (as Megatron's data-parallel size does). When the data
    size is given and several tensor axes are omitted, the rest is ambiguous unless
    it is 1; when exactly one axis is omitted it takes the rest.

    Raises :class:`ConfigError` with the values and what to change.
    """
    given = {"data": data, "z": z, "y": y, "x": x}
    for axis, size in given.items():
        if size is not None and size < 1:
            raise ConfigError(f"--g{axis} must be a positive integer, got {size}")
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    known = 1
    for size in given.values():
        if size is not None:
            known *= size
    missing = [a for a, s in given.items() if s is None]
    spelled = " x ".join(f"G_{a}={given[a] if given[a] is not None else '?'}" for a in AXES)
    if not missing and known != world_size:
        raise ConfigError(
            f"grid {spelled} has product {known} but the world size is {world_size}: "
            f"choose sizes whose product is {world_size} (or omit one to infer it)" + launch_hint(known, world_size)
        )
    if world_size % known != 0:
        raise ConfigError(
            f"grid {spelled} has product {known}, which does not divide the world size "
            f"{world_size}: choose sizes whose product divides {world_size}" + launch_hint(known, world_size)
        )
    rest = world_size // known
    if len(missing) == 1:
        given[missing[0]] = rest
    elif "data" in missing:
        for axis in missing:
            given[axis] = 1
        given["data"] = rest
    else:  # several tensor axes omitted, or none (then rest is 1 and nothing changes)
        if rest != 1:
            raise ConfigError(
                f"grid {spelled}: {rest} ranks are left for the omitted axes "
                f"{', '.join(missing)}; give all but one of them explicitly"
            )
        for axis in missing:
            given[axis] = 1
    return GridShape(given["data"], given["z"], given["y"], given["x"])


def divisors(n: int) -> List[int]:
    """The divisors of ``n >= 1`` in increasing order (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def grid_count(world_size: int) -> int:
    """How many grids :func:`grid_factorizations` yields, without listing them: ordered 4-factor
    products are multiplicative, ``C(e + 3, 3)`` for each prime power ``p^e`` of ``world_size``."""
    count, n, p = 1, world_size, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        count *= math.comb(e + 3, 3)
        p += 1
    return count * (4 if n > 1 else 1)


def grid_factorizations(world_size: int) -> Iterator[GridShape]:
    """Every ordered ``(G_data, G_z, G_y, G_x)`` whose product is ``world_size``."""
    for data in divisors(world_size):
        for z in divisors(world_size // data):
            for y in divisors(world_size // (data * z)):
                yield GridShape(data, z, y, world_size // (data * z * y))


#: what each axis communicates in a training step (:meth:`ProcessGrid.describe`)
ROLES: Dict[str, str] = {
    "x": "fwd all-reduce (normal), bwd all-reduce (transposed)",
    "y": "bwd all-reduce (normal), fwd all-reduce (transposed)",
    "z": "weight all-gather, gradient reduce-scatter",
    "data": "gradient all-reduce",
    "inter": "activations forward, their gradients backward (point to point between adjacent stages)",
}


def grid_dims(dims) -> Dict[str, int]:
    """Axis name -> size, outermost first: a :class:`GridShape` gives :data:`AXES`; a mapping is taken in its
    order. A :class:`ConfigError` for a size below 1 or a repeated name."""
    if isinstance(dims, GridShape):
        return dict(zip(AXES, dims.dims))
    named = {str(axis): int(size) for axis, size in dict(dims).items()}
    if len(named) != len(dims) or not named or min(named.values()) < 1:
        raise ConfigError(f"grid axes {dict(dims)} are not distinct names with positive sizes")
    return named


def _spelled(dims: Mapping[str, int]) -> str:
    """``1x2x2x2``: the sizes in axis order."""
    return "x".join(str(v) for v in dims.values())


def gather_placement(comm, dims: Dict[str, int], node_comm=None) -> NodePlacement:
    """The node of every rank of ``comm`` and each axis' node span (:class:`NodePlacement`).

    Nodes come from ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` (``node_comm``, split here when not
    given), i.e. from the launcher's node assignment; a node is labelled by the ``comm`` rank of its
    first rank and named by that rank's ``MPI_Get_processor_name``. ``dims``: axis -> size, outermost
    first, with ``comm``'s ranks row-major over them. The same allgather collects each rank's CPU affinity and
    its node's CPU count: ``placement.binding`` (:class:`~fourd_mpi.core.binding.Binding`, ``None`` where some
    rank cannot read its affinity). Collective over ``comm`` (one allgather).
    """
    from mpi4py import MPI

    own = node_comm if node_comm is not None else comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = own.bcast(comm.Get_rank(), root=0)
        cpus = own_cpus()  # sent as a cpulist string ("0-63"): a few bytes a rank, not one int per CPU
        pairs = comm.allgather((leader, MPI.Get_processor_name(), cpu_ranges(cpus) if cpus else None,
                                os.cpu_count()))
    finally:
        if node_comm is None:
            own.Free()
    hosts: Dict[int, str] = {}
    for leader_rank, *_ in pairs:
        hosts.setdefault(leader_rank, pairs[leader_rank][1])
    leaders = [p[0] for p in pairs]
    placement = NodePlacement.from_nodes(leaders, dims, [hosts[k] for k in dict.fromkeys(leaders)])
    node_cpus = [0] * placement.num_nodes
    for node, (_, _, _, count) in zip(placement.nodes, pairs):
        node_cpus[node] = max(node_cpus[node], int(count or 0))
    placement.binding = Binding.from_ranks([parse_ranges(p[2]) if p[2] else None for p in pairs], placement.nodes,
                                           node_cpus)
    return placement


class ProcessGrid:
    """A process grid of named, ordered axes on MPI's Cartesian topology, and the communicator of any subset
    of its axes (as Megatron-core's ``HyperCommGrid``, NVIDIA/Megatron-LM ``megatron/core/hyper_comm_grid.py``:
    named dimensions, one process group per subset, created once and cached; here with MPI_Cart_create and
    MPI_Cart_sub, whose rank order is row-major, last axis fastest, where HyperCommGrid lists its first
    dimension fastest).

    The 4D grid is ``ProcessGrid(comm, GridShape(G_data, G_z, G_y, G_x))``, axes :data:`AXES`. A pipeline is
    the same class with one more axis: ``ProcessGrid(world, {"data": D, "inter": P, "z": Z, "y": Y, "x": X})``
    (:func:`fourd_mpi.algorithms.pipeline_plan.grid_dims`); its stages' 4D grid is :meth:`sub` ``(AXES)``.

    Parameters
    ----------
    comm:
        The communicator to arrange (the CLI passes ``COMM_WORLD``; tests may pass a sub-communicator).
        Collective: all its ranks must call with equal sizes.
    dims:
        A :class:`GridShape` (the axes :data:`AXES`) or a mapping axis name -> size, outermost first, whose
        product equals ``comm.Get_size()``.

    Rank placement: ``comm`` rank ``r`` has the coordinates of ``r`` row-major over ``dims``
    (``Create_cart(reorder=False)``: cart rank == comm rank). The communicator of a subset ``S`` of the axes
    (:meth:`axes_comm`, ``MPI_Cart_sub`` keeping ``S``) holds the ranks whose coordinates equal this rank's on
    every axis outside ``S``, ranked row-major over ``S`` in grid order.

    Attributes
    ----------
    dims: axis -> size, outermost first; axes: their names in that order.
    cart: the Cartesian communicator over all axes (of a :meth:`sub` grid: its ``MPI_Cart_sub``).
    coords: axis -> this rank's coordinate; rank, world_size: within :attr:`cart`.
    world: the communicator of the whole run (end-of-step agreements span it): the root grid's ``comm``.
    root: the grid over all axes this one was cut from (:meth:`sub`), itself for a root grid.
    local_rank, local_size: rank and size within this node (``COMM_TYPE_SHARED`` split of :attr:`cart`).
    num_nodes: number of distinct nodes in the grid.
    intra_node: ``axis -> True`` when every communicator along that axis lies on one node.
    """

    def __init__(self, comm, dims):
        from fourd_mpi.core.mpiutil import derived

        named = grid_dims(dims)
        size = math.prod(named.values())
        if size != comm.Get_size():
            raise ConfigError(
                f"grid {_spelled(named)} ({' x '.join(named)}) has {size} ranks but the world size is "
                f"{comm.Get_size()}: choose sizes whose product is {comm.Get_size()}"
            )
        self.root = self
        self.comm = comm
        self.world = comm
        #: axes subset (in grid order) -> its communicator (:meth:`axes_comm`)
        self._comms: Dict[Tuple[str, ...], object] = {}
        n = len(named)
        self._setup(derived(comm, comm.Create_cart(dims=list(named.values()), periods=[False] * n, reorder=False)),
                    named)
        for axis in self.axes:  # one communicator per axis, created eagerly in grid order on every rank
            self.axes_comm((axis,))

    def _setup(self, cart, dims: Dict[str, int]) -> None:
        """The facts of a grid on ``cart`` (coordinates, node, placement). Collective over ``cart``."""
        from mpi4py import MPI

        self.dims = dict(dims)
        self.axes = tuple(dims)
        self.cart = cart
        self.rank = cart.Get_rank()
        self.world_size = cart.Get_size()
        self.coords: Dict[str, int] = dict(zip(self.axes, cart.Get_coords(self.rank)))
        self.node_comm = cart.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        self.hostname = socket.gethostname()
        #: where this grid's ranks run (the launcher's node assignment) and each axis' node span
        self.placement = gather_placement(cart, self.dims, self.node_comm)
        self.node_index = self.placement.nodes[self.rank]
        self.num_nodes = self.placement.num_nodes
        self.ranks_per_node = self.placement.ranks_per_node
        self.intra_node = {axis: not self.placement.crosses(axis) for axis in self.axes}

    def _ordered(self, axes) -> Tuple[str, ...]:
        """``axes`` in grid order (a subset names the same communicator in any order); KeyError for an axis
        this grid lacks."""
        wanted = set(axes)
        unknown = wanted - set(self.root.axes)
        if unknown:
            raise KeyError(f"axes {sorted(unknown)} not in the grid's {', '.join(self.root.axes)}")
        return tuple(a for a in self.root.axes if a in wanted)

    def axes_comm(self, axes):
        """The communicator over the named ``axes`` (any subset, any order; ``MPI_Cart_sub`` of the root grid
        keeping them): the ranks equal to this one on every other axis, ranked row-major over ``axes`` in grid
        order. Created on first request and cached; the root grid creates one per axis when built, any other
        subset on its first request, which every rank of the root grid must make, in the same order."""
        from fourd_mpi.core.mpiutil import derived

        key = self._ordered(axes)
        root = self.root
        if key not in root._comms:
            root._comms[key] = derived(root.cart, root.cart.Sub([a in key for a in root.axes]))
        return root._comms[key]

    def axis_comm(self, axis: str):
        """The communicator along ``axis`` only (:meth:`axes_comm` of ``(axis,)``)."""
        return self.axes_comm((axis,))

    @property
    def axis_comms(self) -> Dict[str, object]:
        """``axis -> communicator`` along that axis only, for this grid's axes."""
        return {axis: self.axis_comm(axis) for axis in self.axes}

    def sub(self, axes) -> "ProcessGrid":
        """The grid of the named ``axes`` that holds this rank (the same class; its :attr:`cart` is
        :meth:`axes_comm` ``(axes)``, its axis communicators the root's, its :attr:`world` the root's).
        ``sub(AXES)`` of a pipeline's grid is this rank's stage: ``G_data x G_z x G_y x G_x`` ranks with
        equal ``inter`` coordinate. Collective over that sub-grid (it splits its node communicator and
        gathers its placement); the grid itself when ``axes`` are all of its axes."""
        key = self._ordered(axes)
        if key == self.axes:
            return self
        grid = object.__new__(ProcessGrid)
        grid.root, grid.world = self.root, self.root.comm
        cart = self.axes_comm(key)
        grid.comm = cart
        grid._setup(cart, {a: self.root.dims[a] for a in key})
        return grid

    @property
    def shape(self) -> GridShape:
        """The 4D sizes ``G_data x G_z x G_y x G_x`` (an axis this grid lacks has size 1)."""
        return GridShape(*(self.dims.get(a, 1) for a in AXES))

    def size(self, axis: str) -> int:
        return self.dims[axis] if axis in self.dims else self.shape[axis]

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def stride(self, axis: str) -> int:
        """Distance in this grid's ranks between neighbours along ``axis``: the product of the sizes of
        the axes inside it."""
        stride = 1
        for a in reversed(self.axes):
            if a == axis:
                return stride
            stride *= self.dims[a]
        raise KeyError(axis)

    def free(self) -> None:
        """Free the communicators this grid created (a root grid: every cached one). Collective over the grid."""
        comms = [self.node_comm]
        if self.root is self:
            comms += list(self._comms.values()) + [self.cart]
            self._comms = {}
        for c in comms:
            c.Free()

    def describe(self, placement: Optional[NodePlacement] = None) -> str:
        """A multi-line, human-readable description (same text on every rank).

        ``placement``: the whole run's (pipeline stages: the world's, whose axes include ``inter``);
        default this grid's. An axis is ``inter-node`` when any of its communicators spans more than
        one node (:mod:`fourd_mpi.core.placement`). The binding line: each rank's CPU affinity and whether the
        ranks were pinned (:mod:`fourd_mpi.core.binding`), with a note on how to pin when they were not."""
        placement = placement if placement is not None else self.placement
        binding = placement.binding
        per_node = placement.ranks_per_node
        per_node_text = str(per_node[0]) if per_node[0] == per_node[-1] else f"{per_node[0]}-{per_node[-1]}"
        if self.axes == AXES:
            title = f"4D grid G_data x G_z x G_y x G_x = {self.shape}"
        else:
            title = f"grid {' x '.join('G_' + a for a in self.axes)} = {_spelled(self.dims)}"
        lines = [
            f"{title} on {self.world_size} ranks, "
            f"{placement.num_nodes} node(s), {per_node_text} rank(s) per node",
            f"  nodes (from MPI_COMM_TYPE_SHARED, the launcher's assignment): {placement.describe()}",
            f"  binding (CPU affinity of each rank): "
            + (binding.describe() if binding is not None else "unknown (no sched_getaffinity)"),
        ]
        if binding is not None and binding.advice():
            lines.append(f"  note: {binding.advice()}")
        rows = []
        for axis in reversed(self.axes):
            place = "inter-node" if placement.crosses(axis) else "intra-node"
            rows.append([axis, self.dims[axis], self.stride(axis), "-" if self.dims[axis] == 1 else place,
                         ROLES.get(axis, "-")])
        lines.append(render(rows, ["axis", "size", "stride", "placement", "communicates"],
                            align=["left", "right", "right", "left", "left"], indent="  "))
        return "\n".join(lines)

    def __repr__(self) -> str:
        c = ", ".join(f"{a}={self.coords[a]}" for a in self.axes)
        return f"ProcessGrid({_spelled(self.dims)}, rank={self.rank}, coords=({c}))"
