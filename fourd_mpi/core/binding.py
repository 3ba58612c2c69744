"""Which CPUs each rank may run on, and whether the ranks were pinned (pure, except :func:`own_cpus`: no MPI).

Every rank reads its CPU affinity at set-up (``os.sched_getaffinity(0)``, Linux: the CPUs the kernel may
schedule this process on, as the launcher's binding left them) and the CPU count of its node
(``os.cpu_count()``); :func:`fourd_mpi.core.grid.gather_placement` gathers both in the allgather that
collects the node assignment. Where a rank cannot read its affinity (no ``sched_getaffinity``: macOS,
Windows) nothing is recorded: the binding of the run is unknown.

**The rule** (:data:`RULE`): a run's ranks are **pinned** when

- every rank may run on fewer CPUs than its node has (``len(cpus[r]) < node_cpus[node of r]``), and
- no two ranks of one node share a CPU (the CPU sets of a node's ranks are pairwise disjoint).

CPU numbers are compared only within a node. A rank bound to a socket or a NUMA domain of its own counts as
pinned (its CPUs are its own); ranks bound to cores but more ranks than cores (``mpiexec -n 3 -bind-to core``
on 2 cores) are not: two of them share a core. Why it matters: unpinned ranks can be moved by the kernel, and
for a while two ranks may share one core, which widens the spread of run medians (measured: 2 ranks on 2 cores,
run medians 3.13-3.35 ms pinned, 3.18-4.84 ms not; docs/guide/regressions.md).

>>> b = Binding.from_ranks([[0], [1]], [0, 0], [2])
>>> b.pinned, b.describe()
(True, 'each rank on 1 CPU, no CPU shared by two ranks of a node (pinned)')
>>> Binding.from_ranks([[0, 1], [0, 1]], [0, 0], [2]).pinned
False
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from fourd_mpi.util.text import int_ranges

#: a CPU set in the kernel's cpulist format (``[0, 1, 2, 5] -> "0-2,5"``)
cpu_ranges = int_ranges

#: how the CPU sets were obtained (stored with them in the trace metadata)
SOURCE = ("os.sched_getaffinity(0) of each rank at set-up (the CPUs the kernel may run it on, as the launcher's "
          "binding left them); node_cpus: os.cpu_count() on that node")
#: the definition of "pinned", in words (stored with it)
RULE = ("pinned: every rank may run on fewer CPUs than its node has, and no two ranks of one node share a CPU "
        "(CPU numbers compared within a node only)")
#: how to pin, for the notes of run and compare
HOW_TO_PIN = ("MPICH/Hydra: mpiexec -bind-to core; Open MPI: mpiexec --bind-to core; Slurm: srun --cpu-bind=cores")
#: why it matters, for the notes
WHY = "run-to-run noise is larger, see docs/guide/regressions.md"


def own_cpus() -> Optional[List[int]]:
    """This process's CPU affinity, sorted; ``None`` where the system cannot say (no ``sched_getaffinity``)."""
    try:
        return sorted(int(c) for c in os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def parse_ranges(text: str) -> List[int]:
    """Inverse of :func:`cpu_ranges`: ``"0-2,5" -> [0, 1, 2, 5]``; raises ``ValueError`` on anything else."""
    cpus: List[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        a, b = int(low), int(high) if high else int(low)
        if a < 0 or b < a:
            raise ValueError(f"CPU range {part!r}")
        cpus.extend(range(a, b + 1))
    return sorted(set(cpus))


def _count(values: Sequence[int]) -> str:
    """``[1, 1] -> "1"``, ``[1, 2] -> "1-2"`` (least to most)."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


@dataclass
class Binding:
    """The CPU sets of a run's ranks: ``cpus[r]`` (sorted CPU numbers of world rank ``r``), ``nodes[r]`` (its node
    index, :mod:`fourd_mpi.core.placement`), ``node_cpus[k]`` (CPUs of node ``k``, ``os.cpu_count()``)."""

    cpus: List[List[int]]
    nodes: List[int]
    node_cpus: List[int]
    source: str = SOURCE
    #: per rank: shares a CPU with another rank of its node / may run on every CPU of its node
    shared: List[bool] = field(default_factory=list)
    free: List[bool] = field(default_factory=list)

    @classmethod
    def from_ranks(cls, cpus: Sequence[Optional[Sequence[int]]], nodes: Sequence[int],
                   node_cpus: Sequence[Optional[int]]) -> Optional["Binding"]:
        """The binding of ranks with CPU sets ``cpus`` on ``nodes`` (0-based, numbered by lowest rank) whose node
        ``k`` has ``node_cpus[k]`` CPUs; ``None`` (unknown) when some rank has no CPU set. A node's CPU count that
        is missing (0 or None) is taken as the highest CPU number named there + 1."""
        if not len(cpus) or any(c is None or not len(c) for c in cpus) or len(cpus) != len(nodes):
            return None
        sets = [sorted(set(int(c) for c in cpu)) for cpu in cpus]
        count = [int(n) if n else 0 for n in node_cpus] + [0] * max(0, max(nodes) + 1 - len(node_cpus))
        named = {}
        for r, k in enumerate(nodes):
            named.setdefault(k, set()).update(sets[r])
        for k, seen in named.items():
            count[k] = count[k] or max(seen) + 1  # unknown: at least every CPU named there
        owners: Dict[tuple, int] = {}
        for r, k in enumerate(nodes):
            for c in sets[r]:
                owners[(k, c)] = owners.get((k, c), 0) + 1
        shared = [any(owners[(k, c)] > 1 for c in sets[r]) for r, k in enumerate(nodes)]
        free = [len(sets[r]) >= count[k] for r, k in enumerate(nodes)]
        return cls(sets, [int(k) for k in nodes], count, SOURCE, shared, free)

    @property
    def cpus_per_rank(self) -> float:
        """The fewest CPUs per rank on a node: the distinct CPUs in its ranks' sets / its ranks (below 1: the
        node is oversubscribed)."""
        per_node: Dict[int, set] = {}
        ranks: Dict[int, int] = {}
        for cpus, k in zip(self.cpus, self.nodes):
            per_node.setdefault(k, set()).update(cpus)
            ranks[k] = ranks.get(k, 0) + 1
        return min(len(per_node[k]) / ranks[k] for k in per_node)

    @property
    def pinned(self) -> bool:
        """:data:`RULE`: no rank on every CPU of its node, no CPU shared by two ranks of a node."""
        return not any(self.shared) and not any(self.free)

    def describe(self) -> str:
        """One line for the run header: ``each rank on 1 CPU, no CPU shared by two ranks of a node (pinned)``, or
        what is not pinned: ``2 rank(s) may run on every CPU of their node (2 CPUs), 2 rank(s) share a CPU with
        another rank of their node (not pinned)`` (:meth:`advice`: why it matters, how to pin)."""
        sizes = _count([len(c) for c in self.cpus])
        each = f"each rank on {sizes} CPU{'' if sizes == '1' else 's'}"
        if self.pinned:
            return f"{each}, no CPU shared by two ranks of a node (pinned)"
        why = []
        if any(self.free):
            free = [r for r, f in enumerate(self.free) if f]
            why.append(f"{len(free)} rank(s) may run on every CPU of their node "
                       f"({_count([self.node_cpus[self.nodes[r]] for r in free])} CPUs)")
        if any(self.shared):
            why.append(f"{sum(self.shared)} rank(s) share a CPU with another rank of their node")
        return f"{each}; {', '.join(why)} (not pinned)"

    def advice(self) -> str:
        """``""`` when pinned, else one line: why it matters and how to pin."""
        if self.pinned:
            return ""
        if not any(self.free):  # bound, but to shared CPUs: more ranks on a node than the cores bound to
            return (f"ranks not pinned: {WHY}; each rank is bound, but some share CPUs (more ranks on a node than "
                    f"cores, or overlapping masks): run fewer ranks per node, each bound to its own cores "
                    f"({HOW_TO_PIN})")
        return f"ranks not pinned: {WHY}; to pin: {HOW_TO_PIN}"

    def as_dict(self) -> Dict:
        """The trace metadata key ``binding`` (docs/trace-format.md)."""
        return {"pinned": self.pinned, "num_cpus": [len(c) for c in self.cpus],
                "cpus": [cpu_ranges(c) for c in self.cpus], "node_cpus": list(self.node_cpus),
                "shared_ranks": int(sum(self.shared)), "free_ranks": int(sum(self.free)),
                "summary": self.describe(), "rule": RULE, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping, nodes: Sequence[int]) -> Optional["Binding"]:
        """The binding stored by :meth:`as_dict`, ranks on ``nodes`` (the trace's placement); ``None`` when
        unreadable."""
        try:
            cpus = [parse_ranges(c) for c in d.get("cpus") or []]
        except ValueError:
            return None
        return cls.from_ranks(cpus, list(nodes), list(d.get("node_cpus") or []))


def pinned_of(metadata: Mapping) -> Optional[bool]:
    """Whether a trace's ranks were pinned: its metadata ``binding.pinned``; ``None`` (unknown) for traces
    without the key (older than the key, or ranks that could not read their affinity)."""
    binding = metadata.get("binding") if isinstance(metadata, Mapping) else None
    value = binding.get("pinned") if isinstance(binding, Mapping) else None
    return value if isinstance(value, bool) else None
