"""The resolved options of a run, :class:`RunOptions`: what defines it, stored with its results.

Declared once as command-line options and resolved (pure validation) by :mod:`fourd_mpi.run.options`;
the class sits here, below the run package, because the algorithms' own checks
(:meth:`fourd_mpi.algorithms.registry.Algorithm.check`) and the model's candidate grids
(:func:`fourd_mpi.perf.algorithms.candidates`) take it, and neither may import ``fourd_mpi.run``
(docs/design.md section 7: the package order). Pure: no MPI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Union

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM
from fourd_mpi.core.grid import GridShape
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig


@dataclass(frozen=True)
class RunOptions:
    """Everything that defines a run (stored with results by later tools; declared and resolved by
    :mod:`fourd_mpi.run.options`)."""

    model: ModelConfig
    grid: GridShape
    #: ``--algorithm`` (:mod:`fourd_mpi.algorithms.registry`)
    algorithm: str = DEFAULT_ALGORITHM
    #: ``--algorithm pipeline``: stages (``grid`` is then each stage's 4D grid), micro-batches per batch
    #: shard, schedule (:mod:`fourd_mpi.algorithms.pipeline_plan`)
    ginter: int = 1
    microbatches: int = 1
    pipeline_schedule: str = "axonn"
    dtype: str = "float32"
    backend: str = "auto"
    device_buffers: str = "auto"
    #: ``--attention`` as given (:data:`~fourd_mpi.step.fusedattention.ATTENTION_MODES`; what ran: the backend's)
    attention: str = "auto"
    #: float32 GEMMs in TF32 on tensor cores (cupy backend only)
    tf32: bool = False
    seed: int = 0
    optimizer: str = "adam"
    lr: Optional[float] = None
    #: bytes each rank may use (None: measured; 0: no admission check), :mod:`fourd_mpi.run.admission`
    memory_limit: Optional[int] = None
    cache_weights: bool = False
    steps: int = 10
    warmup: int = 1
    #: distinct synthetic batches prepared before the steps (step i uses batch i mod data_batches)
    data_batches: int = 4
    overlap: str = "none"
    prefetch_depth: int = 1
    chunks: int = 2
    progress: str = "poll"
    #: ``"auto"`` or FLOPs per chunk (:class:`fourd_mpi.core.progress.AutoChunk`)
    poll_flops: Union[str, float] = "auto"
    check_buffers: bool = False
    #: activation recompute: none, selective, full (:data:`~fourd_mpi.step.presets.RECOMPUTE_MODES`)
    recompute: str = "none"

    def overlap_config(self) -> OverlapConfig:
        text = self.overlap + (",cache" if self.cache_weights else "")
        return OverlapConfig.parse(text, prefetch_depth=self.prefetch_depth, chunks=self.chunks)

    def as_dict(self) -> Dict:
        d = asdict(self)
        d["model"] = self.model.as_dict()  # the model-only fields (kv_heads, mlp) only when set
        d["grid"] = {"data": self.grid.data, "z": self.grid.z, "y": self.grid.y, "x": self.grid.x}
        return d
