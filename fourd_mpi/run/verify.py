"""Check a distributed run against the serial single-rank reference.

The same model (same seed, same global tensors) runs on the grid with the checked
algorithm and on one rank with grid 1x1x1x1 as the serial 4D model (``axonn4d``). The reference is
blocking and recomputes nothing; every variant (overlap, progress, activation recompute) is checked
against it. Rank 0 assembles the distributed forward output and every gradient from the pieces of all
ranks and compares them with the reference, then both train for a few steps and the losses are compared.

Error measure: norm-wise relative error ``||a - b||_2 / ||b||_2`` per tensor
(the max over tensors is reported). Tolerances: 1e-10 for float64, 1e-4 for float32
(2e-2 with ``--tf32``: 10-bit mantissa products), 1e-2 otherwise (float16, bfloat16).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM
from fourd_mpi.core.grid import GridShape
from fourd_mpi.core.mpiutil import idle_barrier
from fourd_mpi.core.watchdog import Watchdog
from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import RunOptions
from fourd_mpi.step.overlap import OverlapConfig

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
TF32_TOLERANCE = 2e-2


def tolerance(options: RunOptions) -> float:
    """Relative-error tolerance of a verification in ``options.dtype`` (and TF32 setting)."""
    if options.tf32:
        return TF32_TOLERANCE
    return TOLERANCE.get(options.dtype, 1e-2)


def gather_global(mpi_comm, index: np.ndarray, values: np.ndarray, global_shape) -> Optional[np.ndarray]:
    """Assemble a global tensor on rank 0 from every rank's ``(flat global index, values)`` piece.

    Replicas write the same values. Collective over ``mpi_comm``; returns None off rank 0.
    """
    pieces = mpi_comm.gather((index, np.asarray(values, dtype=np.float64).ravel()), root=0)
    if mpi_comm.Get_rank() != 0:
        return None
    out = np.full(int(np.prod(global_shape)), np.nan)
    for idx, val in pieces:
        out[idx] = val
    return out.reshape(global_shape)


def snapshot(run: Run, mpi_comm, steps: int) -> Optional[Dict[str, object]]:
    """Forward output, loss and gradients of step 0, then losses of ``steps`` training steps.

    Collective over ``mpi_comm``; the dict is returned on rank 0 only.
    """
    host = run.backend.to_host
    loss, y = run.trainer.forward_backward(0)
    with run.comm.watch("a gather of the output to rank 0"):
        tensors = {"output": gather_global(mpi_comm, run.data.global_index(), host(y), run.data.global_shape)}
    # every parameter by name, from whichever ranks hold it (pipeline stages hold different ones): the list,
    # in one order on every rank, comes from an allgather, so every rank joins every gather
    mine = {p.name: p for p in run.model.parameters()}
    shapes: Dict[str, tuple] = {}
    for listing in mpi_comm.allgather([(p.name, tuple(p.global_shape)) for p in mine.values()]):
        for name, shape in listing:
            shapes.setdefault(name, shape)
    nothing = np.zeros(0, dtype=np.int64)
    for name, shape in shapes.items():
        p = mine.get(name)
        index, values = (p.global_index(), host(p.grad)) if p is not None else (nothing, nothing)
        with run.comm.watch(f"a gather of the gradient of {name} to rank 0"):
            tensors[f"grad:{name}"] = gather_global(mpi_comm, index, values, shape)
    losses = [run.trainer.step(i, last=i == steps - 1).loss for i in range(steps)]
    if mpi_comm.Get_rank() != 0:
        return None
    return {"loss0": loss, "tensors": tensors, "losses": losses}


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    if np.isnan(a).any():
        return float("inf")  # a piece was never written: a layout bug
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom else 1.0))


@dataclass
class GridCheck:
    grid: str
    overlap: str
    progress: str
    output_error: float
    grad_error: float
    worst_grad: str
    loss_error: float
    tolerance: float
    recompute: str = "none"
    #: the axes whose communicators span more than one node in this run (:mod:`fourd_mpi.core.placement`)
    across_nodes: str = "-"
    #: nodes the run's ranks were on (the launcher's assignment)
    nodes: int = 1
    #: the attention kernels of the checked run (the reference's are always ``unfused``)
    attention: str = "unfused"

    @property
    def ok(self) -> bool:
        return max(self.output_error, self.grad_error, self.loss_error) <= self.tolerance


def serial_options(options: RunOptions) -> RunOptions:
    """The single-rank reference of any algorithm: the serial step (``axonn4d`` on 1x1x1x1, no pipeline
    stages, one micro-batch), the same global model and data."""
    return replace(options, grid=GridShape(1, 1, 1, 1), algorithm=DEFAULT_ALGORITHM, ginter=1, microbatches=1)


def serial_reference(options: RunOptions, steps: int, world, watchdog: Optional[Watchdog] = None
                     ) -> Optional[Dict[str, object]]:
    """The single-rank reference, computed on rank 0 while the others sleep in a barrier.

    A user error on rank 0 (memory admission of the whole model on one rank) is raised on every rank."""
    ref, error = None, None
    if world.Get_rank() == 0:
        try:
            run = Run.build(MPI.COMM_SELF, serial_options(options))
            ref = snapshot(run, MPI.COMM_SELF, steps)
            run.close()
        except (ConfigError, BackendError) as exc:
            error = (type(exc), f"the serial reference on rank 0: {exc}")
    with _watch(watchdog, f"a barrier while rank 0 computes the serial reference ({steps} steps on one rank)"):
        idle_barrier(world)
    error = world.bcast(error, root=0)
    if error is not None:
        raise error[0](error[1])
    return ref


def _watch(watchdog: Optional[Watchdog], what: str):
    return watchdog.watching(what) if watchdog is not None else contextlib.nullcontext()


def check_grid(options: RunOptions, reference, steps: int, world,
               watchdog: Optional[Watchdog] = None) -> Optional[GridCheck]:
    """Compare ``options.grid`` on ``world`` with ``reference``. Collective; result on rank 0."""
    run = Run.build(world, options)
    run.comm.watchdog = watchdog  # the steps' collectives and the gathers of snapshot()
    placement = run.placement if run.placement is not None else run.grid.placement
    attention = run.backend.attention
    ran = run.comm.progress.name  # what --progress auto chose, said with it
    progress = f"{ran} (auto)" if options.progress == "auto" else ran
    got = snapshot(run, world, steps)
    run.close()
    if world.Get_rank() != 0:
        return None
    errors = {name: relative_error(got["tensors"][name], ref) for name, ref in reference["tensors"].items()}
    grads = {k: v for k, v in errors.items() if k.startswith("grad:")}
    worst = max(grads, key=grads.get)
    ref_losses = np.array([reference["loss0"]] + reference["losses"])
    got_losses = np.array([got["loss0"]] + got["losses"])
    loss_error = float(np.max(np.abs(got_losses - ref_losses) / np.abs(ref_losses)))
    overlap = ",".join(options.overlap.enabled) or "none"
    return GridCheck(str(options.grid), overlap, progress, errors["output"], grads[worst], worst[5:],
                     loss_error, tolerance(options), options.recompute,
                     ",".join(placement.inter_node_axes) or "-", placement.num_nodes, attention)


def verify(variants: List[RunOptions], grids: List[GridShape], steps: int, world,
           reference_backend: Optional[str] = None, step_timeout: float = 0.0) -> List[GridCheck]:
    """Check every grid in ``grids`` (each must factor ``world``) with every variant's
    overlap, progress and recompute options against one blocking single-rank reference without
    recompute. Results on rank 0.

    The reference's attention is always the unfused one (scores, softmax, two GEMMs), so a fused
    kernel is checked against it.
    ``reference_backend``: compute the reference on this backend (``"numpy"``: the CuPy
    step against the NumPy one; TF32 is then off in the reference); None: the variants' own.
    ``step_timeout`` > 0: a :class:`~fourd_mpi.core.watchdog.Watchdog` aborts the job when a rank
    waits longer than that in one collective (or in the barrier around the serial reference).
    """
    watchdog = Watchdog(step_timeout, world.Get_rank())
    # the reference is the serial 4D model whatever the algorithm checked (every algorithm holds the same
    # global parameters): an algorithm is never checked against itself on one rank
    first = variants[0].overlap
    blocking = replace(variants[0], algorithm=DEFAULT_ALGORITHM,
                       overlap=OverlapConfig(prefetch_depth=first.prefetch_depth, chunks=first.chunks),
                       progress="none", recompute="none", attention="unfused")
    if reference_backend is not None:
        blocking = replace(blocking, backend=reference_backend, device_buffers="auto",
                           tf32=blocking.tf32 and reference_backend != "numpy")
        if reference_backend == "numpy" and blocking.dtype == "bfloat16":  # NumPy has none: float32 reference
            blocking = replace(blocking, dtype="float32")
    reference = serial_reference(blocking, steps, world, watchdog)
    results = []
    for shape in grids:
        for options in variants:
            results.append(check_grid(replace(options, grid=shape), reference, steps, world, watchdog))
    watchdog.close()
    return results
