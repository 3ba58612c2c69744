"""NVTX ranges for Nsight Systems (``fourd-mpi run --nvtx``): the step, its phases, layers and ops.

With ``--nvtx`` the tracer (:class:`fourd_mpi.trace.events.Tracer`) pushes and pops ranges of NVIDIA's
``nvtx`` Python package (``pip install nvtx``; optional) in the domain ``fourd_mpi``:

- ``step N`` around each step (``Tracer.begin_step`` .. ``end_step``);
- ``phase NAME`` (forward, backward, recompute, optimizer) inside the step, one after the other;
- ``layer NAME (PHASE)`` around a layer's forward or backward (``Tracer.layer``);
- ``op NAME`` around a host op scope (attention, gelu, layernorm, loss, optimizer, ...; ``Tracer.op``).

The ranges nest as the scopes do and are balanced on every path: a scope's ``__exit__`` pops its range
also when an exception leaves it, and :meth:`Ranges.unwind` pops whatever is still open (the engine
calls it when a step raises; the run calls it before it ends). Without the package ``--nvtx`` prints
one line and the run goes on without ranges. NVTX calls cost well under a microsecond each when no
tool is attached; under ``nsys profile --trace=nvtx,cuda,mpi`` they appear as the rows of the
``fourd_mpi`` domain.
"""

from __future__ import annotations

from typing import Callable, List, Optional

DOMAIN = "fourd_mpi"
MISSING = "--nvtx: NVIDIA's nvtx package is not installed (pip install nvtx): the run goes on without NVTX ranges"
#: colours per kind of range (Nsight Systems shows them)
COLORS = {"step": "blue", "phase": "green", "layer": "purple", "op": "orange"}


class Ranges:
    """Push/pop NVTX ranges through ``module`` (``nvtx``, or a stand-in with ``push_range``/``pop_range``),
    keeping the stack so that it can always be balanced."""

    def __init__(self, module, domain: str = DOMAIN):
        self.module = module
        self.domain = domain
        self.stack: List[str] = []

    def push(self, kind: str, name: str) -> None:
        """Open the range ``name`` (``kind``: step, phase, layer or op: its colour)."""
        self.module.push_range(message=name, color=COLORS.get(kind, "grey"), domain=self.domain)
        self.stack.append(name)

    def pop(self) -> None:
        """Close the innermost open range (none open: nothing)."""
        if self.stack:
            self.stack.pop()
            self.module.pop_range(domain=self.domain)

    def pop_to(self, depth: int) -> None:
        """Close ranges until ``depth`` are open."""
        while len(self.stack) > depth:
            self.pop()

    def unwind(self) -> None:
        """Close every open range (a step that raised, the end of the run)."""
        self.pop_to(0)


def make_ranges(enabled: bool, say: Callable[[str], None]) -> Optional[Ranges]:
    """:class:`Ranges` over the ``nvtx`` package when ``enabled`` and installed; None otherwise (when it is
    missing, ``say`` gets :data:`MISSING`, once)."""
    if not enabled:
        return None
    try:
        import nvtx
    except ImportError:
        say(MISSING)
        return None
    return Ranges(nvtx)
