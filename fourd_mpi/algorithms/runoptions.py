"""The resolved options of a run, :class:`RunOptions`: what defines it, stored with its results.

Declared once as command-line options and resolved (pure validation) by :mod:`fourd_mpi.run.options`;
the class sits here, below the run package, because the algorithms' own checks
(:meth:`fourd_mpi.algorithms.registry.Algorithm.check`) and the model's candidate grids
(:func:`fourd_mpi.perf.algorithms.candidates`) take it, and neither may import ``fourd_mpi.run``
(docs/design.md section 7: the package order). Pure: no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional, Union

from fourd_mpi.algorithms.pipeline_plan import SCHEDULES as PIPELINE_SCHEDULES
from fourd_mpi.core.grid import GridShape
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig


@dataclass(frozen=True)
class RunOptions:
    """Everything that defines a run (stored with results by later tools; declared and resolved by
    :mod:`fourd_mpi.run.options`).

    Every field is required: the defaults are the option table's (:data:`fourd_mpi.run.options.RUN_OPTIONS`),
    filled in by :func:`fourd_mpi.run.options.resolve` (validated) or :func:`fourd_mpi.run.options.run_options`
    (as given, for tests and benchmarks); this module may not import them (the package order)."""

    model: ModelConfig
    grid: GridShape
    #: ``--algorithm`` (:mod:`fourd_mpi.algorithms.registry`)
    algorithm: str
    #: ``--algorithm pipeline``: stages (``grid`` is then each stage's 4D grid), micro-batches per batch
    #: shard, schedule (:mod:`fourd_mpi.algorithms.pipeline_plan`)
    ginter: int
    microbatches: int
    pipeline_schedule: str
    dtype: str
    backend: str
    device_buffers: str
    #: ``--attention`` as given (:data:`~fourd_mpi.step.fusedattention.ATTENTION_MODES`; what ran: the backend's)
    attention: str
    #: float32 GEMMs in TF32 on tensor cores (cupy backend only)
    tf32: bool
    seed: int
    optimizer: str
    lr: Optional[float]
    #: bytes each rank may use (None: measured; 0: no admission check), :mod:`fourd_mpi.run.admission`
    memory_limit: Optional[int]
    steps: int
    warmup: int
    #: distinct synthetic batches prepared before the steps (step i uses batch i mod data_batches)
    data_batches: int
    #: ``--overlap``, ``--prefetch-depth``, ``--chunks`` and ``--cache-weights``, parsed once (by ``resolve``)
    overlap: OverlapConfig
    progress: str
    #: ``"auto"`` or FLOPs per chunk (:class:`fourd_mpi.core.progress.AutoChunk`)
    poll_flops: Union[str, float]
    check_buffers: bool
    #: activation recompute: none, selective, full (:data:`~fourd_mpi.step.presets.RECOMPUTE_MODES`)
    recompute: str

    def as_dict(self) -> Dict:
        """Plain values for traces and ``check_same``, as before the overlap was typed: ``overlap`` is its
        ``--overlap`` text (:attr:`OverlapConfig.option_text`), with ``cache_weights``, ``prefetch_depth``
        and ``chunks`` as keys of their own, in the order of the stored ``run_options`` of older traces."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model"] = self.model.as_dict()  # the model-only fields (kv_heads, mlp) only when set
        d["grid"] = {"data": self.grid.data, "z": self.grid.z, "y": self.grid.y, "x": self.grid.x}
        ov = self.overlap
        out: Dict = {}
        for key, value in d.items():
            if key == "steps":
                out["cache_weights"] = ov.cache
            if key == "overlap":
                out.update(overlap=ov.option_text, prefetch_depth=ov.prefetch_depth, chunks=ov.chunks)
            else:
                out[key] = value
        return out


@dataclass(frozen=True)
class GridCheckOptions:
    """What an algorithm's pure checks (:meth:`~fourd_mpi.algorithms.registry.Algorithm.check` and
    ``grid_problem``) read, for planners that list grids before any run is configured (``tune``, sweep
    specs): not run options and no defaults of them. ``pipeline_schedule`` is any valid schedule (the
    checks test only that it is one); ``ginter`` and ``microbatches`` are what the planner asks about."""

    model: ModelConfig
    grid: GridShape
    algorithm: str
    ginter: int = 1
    microbatches: int = 1
    pipeline_schedule: str = PIPELINE_SCHEDULES[0]
