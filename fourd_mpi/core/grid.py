"""The 4D process grid ``G_data x G_z x G_y x G_x`` on MPI's Cartesian topology.

Rank order, innermost (consecutive world ranks) to outermost: X, Y, Z, data.
``Create_cart(dims=[G_data, G_z, G_y, G_x])`` is row-major (last dimension varies
fastest), which gives exactly that order; ``Sub`` gives one communicator per axis.
Put the innermost axes inside a node: with ``r`` ranks per node the X axis (and
then Y, ...) stays on a node while the product of the inner sizes divides ``r``.

The arithmetic (inferring missing sizes, enumerating factorizations) is in pure
functions so it can be tested without MPI.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

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
    """The 4D Cartesian communicator and its four axis communicators.

    Parameters
    ----------
    comm:
        The communicator to arrange (the CLI passes ``COMM_WORLD``; tests may pass
        a sub-communicator). Collective: all its ranks must call with equal shapes.
    shape:
        A :class:`GridShape` whose product equals ``comm.Get_size()``.

    Attributes
    ----------
    cart: the Cartesian communicator (``reorder=False``: cart rank == comm rank).
    axis_comms: ``{"data", "z", "y", "x"} -> communicator`` along that axis only.
    coords: ``{"data", "z", "y", "x"} -> this rank's coordinate``.
    local_rank, local_size: rank and size within this node (``COMM_TYPE_SHARED``).
    num_nodes: number of distinct nodes in the grid.
    intra_node: ``axis -> True`` when every communicator along that axis lies on one node.
    """

    def __init__(self, comm, shape: GridShape):
        from mpi4py import MPI

        if shape.size != comm.Get_size():
            raise ConfigError(
                f"grid {shape} (data x z x y x x) has {shape.size} ranks but the world size is "
                f"{comm.Get_size()}: choose sizes whose product is {comm.Get_size()}"
            )
        self.shape = shape
        self.comm = comm
        #: the communicator of the whole run this grid belongs to (end-of-step agreements span it): ``comm``
        #: itself, unless the run splits its world first (pipeline stages: :meth:`fourd_mpi.run.build.Run.build`)
        self.world = comm
        from fourd_mpi.core.mpiutil import derived

        self.cart = derived(comm, comm.Create_cart(dims=list(shape.dims), periods=[False] * 4, reorder=False))
        self.rank = self.cart.Get_rank()
        self.world_size = self.cart.Get_size()
        cart_coords = self.cart.Get_coords(self.rank)
        self.coords: Dict[str, int] = dict(zip(AXES, cart_coords))
        self.axis_comms = {}
        for i, axis in enumerate(AXES):
            keep = [j == i for j in range(4)]
            self.axis_comms[axis] = derived(self.cart, self.cart.Sub(keep))

        self.node_comm = self.cart.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        self.hostname = socket.gethostname()
        #: where this grid's ranks run (the launcher's node assignment) and each axis' node span
        self.placement = gather_placement(self.cart, dict(zip(AXES, shape.dims)), self.node_comm)
        self.node_index = self.placement.nodes[self.rank]
        self.num_nodes = self.placement.num_nodes
        self.ranks_per_node = self.placement.ranks_per_node
        self.intra_node = {axis: not self.placement.crosses(axis) for axis in AXES}

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def axis_comm(self, axis: str):
        return self.axis_comms[axis]

    def stride(self, axis: str) -> int:
        """Distance in world ranks between neighbours along ``axis``."""
        stride = 1
        for a in reversed(AXES):
            if a == axis:
                return stride
            stride *= self.shape[a]
        raise KeyError(axis)

    def free(self) -> None:
        """Free the communicators this grid created. Collective over the grid."""
        for c in list(self.axis_comms.values()) + [self.node_comm, self.cart]:
            c.Free()
        self.axis_comms = {}

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
        lines = [
            f"4D grid G_data x G_z x G_y x G_x = {self.shape} on {self.world_size} ranks, "
            f"{placement.num_nodes} node(s), {per_node_text} rank(s) per node",
            f"  nodes (from MPI_COMM_TYPE_SHARED, the launcher's assignment): {placement.describe()}",
            f"  binding (CPU affinity of each rank): "
            + (binding.describe() if binding is not None else "unknown (no sched_getaffinity)"),
        ]
        if binding is not None and binding.advice():
            lines.append(f"  note: {binding.advice()}")
        roles = {
            "x": "fwd all-reduce (normal), bwd all-reduce (transposed)",
            "y": "bwd all-reduce (normal), fwd all-reduce (transposed)",
            "z": "weight all-gather, gradient reduce-scatter",
            "data": "gradient all-reduce",
        }
        rows = []
        for axis in reversed(AXES):
            place = "inter-node" if placement.crosses(axis) else "intra-node"
            rows.append([axis, self.shape[axis], self.stride(axis), "-" if self.shape[axis] == 1 else place,
                         roles[axis]])
        lines.append(render(rows, ["axis", "size", "stride", "placement", "communicates"],
                            align=["left", "right", "right", "left", "left"], indent="  "))
        return "\n".join(lines)

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"ProcessGrid({self.shape}, rank={self.rank}, coords=(data={c['data']}, z={c['z']}, "
            f"y={c['y']}, x={c['x']}))"
        )
