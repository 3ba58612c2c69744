"""Overlap options of the training step, named as in AxoNN and Tensor3D.

``oag``   prefetch the next layers' weight all-gathers (over Z), ``prefetch_depth`` ahead,
          in forward and (for the previous layers) in backward.
``ors``   keep the weight-gradient reduce-scatters (over Z) in flight for the rest
          of the backward pass; wait before the optimizer.
``oar``   keep the backward all-reduce of dX (over Y for normal, X for transposed
          layers) in flight while dW is computed.
``dp``    issue each gradient shard's data-parallel all-reduce as soon as its
          reduce-scatter has completed; wait before the optimizer.
``od``    over-decomposition: split the tokens in ``chunks`` pieces so the forward
          all-reduce of one piece overlaps the GEMM of the next.
``oup``   overlap the optimizer update: each parameter is updated as soon as its own gradient
          collectives (reduce-scatter over Z, then all-reduce over data) complete, in the order
          they complete, so the last reduce-scatter and the data all-reduces after it fly behind
          the other parameters' updates; and the first layer's weight all-gather of the next
          step's forward is issued right after that layer's update (a prefetch across the step
          boundary, hidden by the remaining updates and the next step's start). Without it the
          optimizer waits for every gradient first. Sources: PyTorch's FSDP notes, "FSDP Prefetch
          Nuances" (https://pytorch.org/docs/stable/notes/fsdp.html: with prefetching inside a pass
          "the 1st all-gather will not be able to overlap with anything") and FSDP2's explicit
          prefetch API (``set_modules_to_forward_prefetch``, pytorch/pytorch PR #128884); AxoNN (Singh et al.,
          arXiv 2305.13525v3, SC'24), the section on overlapping the non-blocking collectives with computation
          (OAG, ORS, OAR), whose first gather and last reduce-scatter have no compute of their own.
``cache`` keep the weights gathered in forward for backward (memory for communication).

``all`` is ``oag,ors,oar,dp,od,oup`` (caching trades memory and is asked for separately).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError

OVERLAP_NAMES = ("oag", "ors", "oar", "dp", "od", "oup", "cache")
ALL = ("oag", "ors", "oar", "dp", "od", "oup")
#: layers ahead that oag issues weight all-gathers: the default of :class:`OverlapConfig` and of the option
#: table's ``--prefetch-depth`` (:data:`fourd_mpi.run.options.RUN_OPTIONS` reads it here)
DEFAULT_PREFETCH_DEPTH = 1
#: token chunks of od's forward all-reduce: the default of :class:`OverlapConfig` and of ``--chunks``
DEFAULT_CHUNKS = 2


@dataclass(frozen=True)
class OverlapConfig:
    oag: bool = False
    ors: bool = False
    oar: bool = False
    dp: bool = False
    od: bool = False
    oup: bool = False
    cache: bool = False
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    chunks: int = DEFAULT_CHUNKS

    @classmethod
    def parse(cls, text: str, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
              chunks: int = DEFAULT_CHUNKS) -> "OverlapConfig":
        """``none``, ``all`` or a comma list such as ``oag,ors`` (``all,cache`` is allowed)."""
        names = [t.strip().lower() for t in text.split(",") if t.strip()]
        chosen = set()
        for name in names:
            if name == "none":
                continue
            if name == "all":
                chosen.update(ALL)
            elif name in OVERLAP_NAMES:
                chosen.add(name)
            else:
                raise ConfigError(
                    f"unknown overlap {name!r}: use none, all, or a comma list of {', '.join(OVERLAP_NAMES)}"
                )
        if prefetch_depth < 1:
            raise ConfigError(f"--prefetch-depth must be at least 1, got {prefetch_depth}")
        if chunks < 1:
            raise ConfigError(f"--chunks must be at least 1, got {chunks}")
        return cls(**{n: n in chosen for n in OVERLAP_NAMES}, prefetch_depth=prefetch_depth, chunks=chunks)

    @property
    def enabled(self) -> List[str]:
        return [name for name in OVERLAP_NAMES if getattr(self, name)]

    @property
    def option_text(self) -> str:
        """The ``--overlap`` value of this configuration without ``cache`` (stored as ``cache_weights``), in one
        spelling: ``none``, ``all`` (exactly :data:`ALL`), else the comma list in :data:`OVERLAP_NAMES` order.
        What traces, sweep specs and config files store: ``parse(option_text + (",cache" if cache else ""),
        prefetch_depth, chunks)`` is this configuration again."""
        on = [name for name in self.enabled if name != "cache"]
        return "all" if tuple(on) == ALL else ",".join(on) or "none"

    def __str__(self) -> str:
        on = self.enabled
        text = ",".join(on) if on else "none"
        extras = []
        if self.oag:
            extras.append(f"prefetch depth {self.prefetch_depth}")
        if self.od:
            extras.append(f"{self.chunks} token chunks")
        return text + (f" ({', '.join(extras)})" if extras else "")

    def inapplicable(self, grid: GridShape) -> List[str]:
        """Options that do nothing on ``grid``, with the reason (they stay on as no-ops)."""
        notes = []
        if self.oag and grid.z == 1:
            notes.append("oag has no effect: G_z = 1, weights are not all-gathered")
        if self.ors and grid.z == 1:
            notes.append("ors has no effect: G_z = 1, gradients are not reduce-scattered")
        if self.oar and grid.x == 1 and grid.y == 1:
            notes.append("oar has no effect: G_x = G_y = 1, there is no backward all-reduce")
        if self.dp and grid.data == 1:
            notes.append("dp has no effect: G_data = 1, there is no data-parallel all-reduce")
        if self.od and grid.x == 1 and grid.y == 1:
            notes.append("od has no effect: G_x = G_y = 1, there is no forward all-reduce")
        if self.oup and grid.z == 1 and grid.data == 1:
            notes.append("oup has no effect: G_z = G_data = 1, no gradient collective and no weight all-gather "
                         "to overlap with the update")
        if self.cache and grid.z == 1:
            notes.append("cache has no effect: G_z = 1, weights are never all-gathered")
        return notes
