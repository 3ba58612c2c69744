"""Which node each rank ran on, and which grid axes cross nodes (pure: no MPI).

The node of a rank comes from the launcher, never from an assumption: the ranks that share
memory (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, which MPICH and Open MPI answer from the
launcher's node assignment) form one node, numbered by its lowest world rank (node 0 holds rank 0);
its name is ``MPI_Get_processor_name`` of that rank (:func:`fourd_mpi.core.grid.gather_placement`
collects both).

World ranks are laid out row-major over named axes, outermost first: ``data, z, y, x`` for the 4D
grid (:data:`fourd_mpi.core.grid.AXES`), ``data, inter, z, y, x`` with pipeline stages. The
communicator of rank ``r`` along axis ``a`` holds the ranks whose coordinates equal ``r``'s on every
other axis (``MPI_Cart_sub`` keeping ``a``). Its *node span* is the number of distinct nodes among
them. An axis **crosses nodes** when any of its communicators spans more than one node (the maximum
span over ranks is > 1); a collective of rank ``r`` over ``a`` is *inter-node* when ``r``'s own
communicator spans more than one node (its bytes cross a node boundary), else *intra-node*.

>>> p = NodePlacement.from_nodes([0, 0, 0, 0, 1, 1, 1, 1], {"data": 1, "z": 2, "y": 2, "x": 2})
>>> p.inter_node_axes
['z']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from fourd_mpi.util.text import int_ranges

#: how the node assignment was obtained (stored with it in the trace metadata)
SOURCE = ("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) over the world (the launcher's node assignment); node k is "
          "numbered by its lowest world rank, its name is MPI_Get_processor_name of that rank")
#: the definition of a crossing axis and of an inter-node collective, in words
RULE = ("an axis crosses nodes when any of its communicators spans more than one node; a collective of rank r "
        "over axis a is inter-node when r's communicator along a spans more than one node (node_span[a][r] > 1)")
#: the pseudo-axis of world-wide collectives (the loss all-reduce: axis "none" in the trace)
WORLD = "none"


def canonical_nodes(node_ids: Sequence) -> List[int]:
    """Node labels of any kind (node leaders' ranks, host names) -> 0-based node indices numbered by
    their lowest rank: ``["b", "b", "a", "a"] -> [0, 0, 1, 1]``."""
    order: Dict[object, int] = {}
    for label in node_ids:
        order.setdefault(label, len(order))
    return [order[label] for label in node_ids]


def axis_node_spans(nodes: Sequence[int], dims: Mapping[str, int]) -> Dict[str, List[int]]:
    """Node span of every rank's communicator along every axis.

    ``nodes[r]``: node index of world rank ``r`` (``len(nodes)`` = product of ``dims``);
    ``dims``: axis -> size, outermost first (world ranks row-major over them).
    Returns ``{axis: [span of rank r's communicator along axis, for r in ranks]}``, plus
    ``"none"`` (:data:`WORLD`): the world's node count for every rank.
    Shapes: reshape ``nodes`` to ``dims``; for axis ``a`` count distinct values along dimension ``a``.
    """
    names = list(dims)
    sizes = [int(dims[a]) for a in names]
    world = int(np.prod(sizes)) if sizes else 1
    if len(nodes) != world:
        raise ValueError(f"node assignment has {len(nodes)} ranks but the grid {'x'.join(map(str, sizes))} "
                         f"has {world}")
    cube = np.asarray(nodes, dtype=np.int64).reshape(sizes)
    spans: Dict[str, List[int]] = {}
    for i, axis in enumerate(names):
        ordered = np.sort(np.moveaxis(cube, i, -1), axis=-1)  # each row: one communicator's nodes
        distinct = 1 + (np.diff(ordered, axis=-1) != 0).sum(axis=-1)
        spans[axis] = _back(distinct, i, sizes)
    spans[WORLD] = [len(set(int(n) for n in nodes))] * world
    return spans


def _back(distinct: np.ndarray, axis: int, sizes: List[int]) -> List[int]:
    """Spread a per-communicator value (the grid without ``axis``) back to every rank, in rank order."""
    full = np.repeat(np.expand_dims(distinct, axis), sizes[axis], axis=axis)
    return [int(v) for v in full.reshape(-1)]


def inter_node_axes(spans: Mapping[str, Sequence[int]]) -> List[str]:
    """Axes (in the order of ``spans``) whose communicators span more than one node somewhere."""
    return [a for a, s in spans.items() if a != WORLD and len(s) and max(s) > 1]


@dataclass
class NodePlacement:
    """Where the ranks of a run are: ``nodes[r]`` (0-based, numbered by lowest rank), ``hosts[k]`` (name of
    node ``k``), ``dims`` (axis -> size, outermost first), ``spans`` (:func:`axis_node_spans`)."""

    nodes: List[int]
    dims: Dict[str, int]
    hosts: List[str] = field(default_factory=list)
    spans: Dict[str, List[int]] = field(default_factory=dict)
    source: str = SOURCE
    #: each rank's CPU affinity and whether the ranks were pinned (:class:`~fourd_mpi.core.binding.Binding`), set by
    #: :func:`fourd_mpi.core.grid.gather_placement`; ``None``: unknown (stored as its own metadata key ``binding``)
    binding: Optional[object] = None

    @classmethod
    def from_nodes(cls, nodes: Sequence, dims: Mapping[str, int], hosts: Optional[Sequence[str]] = None,
                   source: str = SOURCE) -> "NodePlacement":
        canon = canonical_nodes(list(nodes))
        return cls(canon, dict(dims), list(hosts or []), axis_node_spans(canon, dims), source)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def ranks_per_node(self) -> List[int]:
        """Ranks on each node, sorted ascending."""
        return sorted(self.nodes.count(k) for k in set(self.nodes))

    @property
    def inter_node_axes(self) -> List[str]:
        return inter_node_axes(self.spans)

    def crosses(self, axis: str) -> bool:
        return max(self.spans.get(axis, [1]) or [1]) > 1

    def span(self, axis: str, rank: int) -> int:
        """Nodes spanned by ``rank``'s communicator along ``axis`` (1 for an axis it does not know)."""
        s = self.spans.get(axis)
        return int(s[rank]) if s is not None and rank < len(s) else 1

    def describe(self) -> str:
        """One line: ``2 node(s) (h2n1: ranks 0-3, h2n2: ranks 4-7); axes across nodes: z``."""
        parts = []
        for k in range(self.num_nodes):
            ranks = [r for r, n in enumerate(self.nodes) if n == k]
            name = self.hosts[k] if k < len(self.hosts) else f"node {k}"
            parts.append(f"{name}: ranks {int_ranges(ranks)}")
        crossing = ", ".join(self.inter_node_axes) or "none"
        return f"{self.num_nodes} node(s) ({'; '.join(parts)}); axes across nodes: {crossing}"

    def as_dict(self) -> Dict:
        """The trace metadata key ``placement`` (docs/trace-format.md, schema 7)."""
        return {"num_nodes": self.num_nodes, "hosts": list(self.hosts), "nodes": list(self.nodes),
                "axes": list(self.dims), "dims": dict(self.dims),
                "node_span": {a: list(s) for a, s in self.spans.items()},
                "max_node_span": {a: max(s) if len(s) else 1 for a, s in self.spans.items()},
                "inter_node_axes": self.inter_node_axes, "source": self.source, "rule": RULE}

    @classmethod
    def from_dict(cls, d: Mapping) -> "NodePlacement":
        spans = {str(a): [int(v) for v in s] for a, s in (d.get("node_span") or {}).items()}
        return cls([int(n) for n in d.get("nodes", [])], {str(a): int(v) for a, v in (d.get("dims") or {}).items()},
                   [str(h) for h in d.get("hosts", [])], spans, str(d.get("source", SOURCE)))
