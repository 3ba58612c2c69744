"""The one table of collectives: per kind, the MPI calls and the ring-algorithm factors.

In the spirit of nccl-tests' per-collective ``testColl`` hooks, every fact about a
collective that the suite needs in more than one place lives in one :class:`CollectiveKind`
entry, and the communication layer (which MPI call it issues), the trace recorder, the
analysis, the performance model and the micro-benchmark read it from here. Pure: no MPI, no
arrays (``wire_bytes`` also works elementwise on NumPy integer arrays).

Conventions (nccl-tests ``doc/PERFORMANCE.md``): the message size ``S`` of a collective is
the gathered buffer of an all-gather, the full input of a reduce-scatter, the buffer of an
all-reduce. With ``p`` ranks and ``k`` rounds (2 for all-reduce = reduce-scatter + all-gather,
1 for all-gather and reduce-scatter), a ring algorithm

- sends ``k * (p-1)/p * S`` bytes per rank (the *wire factor* ``k(p-1)/p``);
- takes ``k * (p-1)`` latency steps, so ``t = k(p-1)*alpha + k(p-1)/p*S*beta``;
- has bus bandwidth ``busbw = algbw * k(p-1)/p`` with ``algbw = S / t``.

A group of one rank sends nothing: every factor is 0 for ``p <= 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class CollectiveKind:
    """One collective: its name in traces, its MPI calls and its ring-algorithm factors."""

    name: str  #: ``allgather`` | ``reduce_scatter`` | ``allreduce`` (the trace's op names)
    nonblocking: str  #: the mpi4py method issued by the step and the benchmark, e.g. ``Iallgather``
    blocking: str  #: its blocking form, e.g. ``Allgather``
    rounds: int  #: k: 2 for all-reduce, 1 otherwise
    #: the operation class whose device-buffer route it follows (:data:`fourd_mpi.core.gpuaware.OP_CLASSES`)
    route_class: str = "nb_reduce"

    def wire_factor(self, p: int) -> float:
        """Bytes a rank sends per byte of message: ``k(p-1)/p``."""
        return self.rounds * (p - 1) / p if p > 1 else 0.0

    def wire_bytes(self, message_bytes: int, p: int) -> int:
        """Bytes a rank sends for one message of ``message_bytes``, in exact integers:
        ``S*k*(p-1) // p`` (what the traces store; 0 for ``p == 1``). Elementwise on integer
        arrays of sizes and group sizes too (the trace recorder's vectorized path)."""
        return message_bytes * self.rounds * (p - 1) // p

    def bus_factor(self, p: int) -> float:
        """nccl-tests: ``busbw = algbw * bus_factor`` (the wire factor)."""
        return self.wire_factor(p)

    def alpha_count(self, p: int) -> int:
        """Latency steps of the ring algorithm: ``k(p-1)``."""
        return self.rounds * (p - 1) if p > 1 else 0

    def ring_time(self, p: int, message_bytes: float, alpha_s: float, beta_s_per_byte: float,
                  link_share: float = 1.0) -> float:
        """Seconds of one message under the alpha-beta model: ``k(p-1)*alpha + k(p-1)/p*S*beta*share``
        (``link_share``: how many times more ranks share the link than when beta was measured; 0 for ``p <= 1``)."""
        if p <= 1:
            return 0.0
        return self.alpha_count(p) * alpha_s + self.wire_factor(p) * message_bytes * beta_s_per_byte * link_share


COLLECTIVES: Dict[str, CollectiveKind] = {c.name: c for c in (
    CollectiveKind("allgather", "Iallgather", "Allgather", 1, "nb_gather"),
    CollectiveKind("reduce_scatter", "Ireduce_scatter_block", "Reduce_scatter_block", 1),
    CollectiveKind("allreduce", "Iallreduce", "Allreduce", 2),
)}

#: the formulas printed next to measured or predicted numbers
BUSBW_FORMULA = ("busbw = algbw * k * (n - 1) / n, k = 2 for allreduce, 1 for allgather and reduce_scatter, "
                 "n = size of the axis")
#: the same, in the micro-benchmark's report (``p`` ranks)
BUSBW_FORMULA_SHORT = "busbw = algbw * (p-1)/p (allgather, reduce_scatter), algbw * 2(p-1)/p (allreduce)"
ALPHA_BETA_FORMULA = "t = k(p-1)*alpha + k(p-1)/p*S*beta, k = 2 for allreduce else 1"


def collective(op: str) -> CollectiveKind:
    """The entry of ``op``: a trace name (``allreduce``) or a benchmark name with the nonblocking
    ``i`` prefix (``iallreduce``). Raises :class:`KeyError` naming the known ones."""
    if op in COLLECTIVES:
        return COLLECTIVES[op]
    if op.startswith("i") and op[1:] in COLLECTIVES:
        return COLLECTIVES[op[1:]]
    raise KeyError(f"unknown collective {op!r} (known: {', '.join(COLLECTIVES)}, and their i-prefixed forms)")


def wire_factor(op: str, p: int) -> float:
    """:meth:`CollectiveKind.wire_factor` of ``op``."""
    return collective(op).wire_factor(p)
