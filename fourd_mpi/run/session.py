"""A traced training run from start to summary: what ``fourd-mpi run`` does.

Order: build the run (clocks aligned) -> rank 0 reserves the run id and the
spool directory -> every rank opens its spool files -> optional peak GEMM
measurement -> steps (each appended to the spool) -> merge into the HDF5 trace
-> summary. A user error at any stage is raised on every rank before anyone
enters a collective that the others would miss.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from fourd_mpi.run.display import StepDisplay
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.kernels import standalone_gemm_tflops
from fourd_mpi.run.metadata import rank_metadata, run_metadata
from fourd_mpi.core.mpiutil import agree, on_root
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import RunOptions
from fourd_mpi.core.watchdog import Watchdog
from fourd_mpi.trace.clocks import DriftModel, measure_offsets
from fourd_mpi.trace.store import (RankSpool, check_name, merge_run, new_run_id, now_iso, prepare_spool, read_records,
                         trace_paths)
from fourd_mpi.trace.events import LEVELS, RANK_STEP_DTYPE
from fourd_mpi.trace.summary import summarize

FAULT_MODES = ("kill", "raise")


@dataclass(frozen=True)
class TraceOptions:
    level: str = "op"
    results_dir: str = "results"
    run_id: Optional[str] = None
    label: Optional[str] = None
    force: bool = False
    group_size: int = 0  #: ``--trace-group-size`` (0: ranks per node, see :mod:`fourd_mpi.trace.merge`)

    def validate(self) -> "TraceOptions":
        if self.level not in LEVELS:
            raise ConfigError(f"unknown trace level {self.level!r}: choose one of {', '.join(LEVELS)}")
        if self.run_id is not None:
            check_name("run id", self.run_id)
        if self.label is not None:
            check_name("label", self.label)
        return self


@dataclass(frozen=True)
class Fault:
    """Testing aid: rank ``rank`` fails at the start of step ``step`` (``kill``: SIGKILL; ``raise``: exception).

    Every rank meets in a barrier first, so all steps before ``step`` are on disk on every rank.
    """

    rank: int
    step: int
    mode: str = "kill"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, step = int(parts[0]), int(parts[1])
            mode = parts[2] if len(parts) == 3 else "kill"
        except ValueError:
            raise ConfigError(f"--inject-fault expects RANK:STEP[:MODE], got {text!r}") from None
        if mode not in FAULT_MODES or rank < 0 or step < 0:
            raise ConfigError(f"--inject-fault {text!r}: rank and step >= 0, mode one of {', '.join(FAULT_MODES)}")
        return cls(rank, step, mode)

    def trigger(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault (--inject-fault {self.rank}:{self.step}:{self.mode})")


def measure_peak(run: Run) -> float:
    """Median over ranks of the standalone TFLOP/s of the step's largest local GEMM (all ranks at once)."""
    layer = max(run.model.fc_layers(), key=lambda fc: fc.block_shape[0] * fc.block_shape[1])
    cfg, shape = run.options.model, run.options.grid
    m = cfg.batch * cfg.seq // (shape.data * shape.z)
    n, k = layer.block_shape
    tflops = standalone_gemm_tflops(run.backend, m, n, k)
    return float(np.median(run.grid.cart.allgather(tflops)))


def end_alignment(run, rank_meta: Dict):
    """Offsets to rank 0 measured again after the steps: this rank's :class:`DriftModel` (None when
    the run was not traced), its drift and residual uncertainty added to ``rank_meta``. Collective."""
    if run.clock_start is None:
        return None
    offset0, uncertainty0, origin, at0 = run.clock_start
    offset1, uncertainty1, at1 = measure_offsets(run.grid.cart)
    drift = DriftModel(offset0, at0, offset1, at1, origin, uncertainty0, uncertainty1)
    rank_meta.update(clock_offset_end_ns=offset1, clock_drift_ppm=drift.ppm, clock_residual_ns=drift.residual_ns)
    return drift


def traced_run(world, options: RunOptions, trace: TraceOptions, config: Dict, say: Callable[[str], None],
               display: str = "auto", peak_tflops: Optional[float] = None, fault: Optional[Fault] = None,
               header: Callable[[Run], None] = None, step_timeout: float = 0.0):
    """Run ``options.steps`` traced steps; returns ``(trace path, Summary)`` (Summary on rank 0 only).

    ``step_timeout`` > 0: a :class:`~fourd_mpi.core.watchdog.Watchdog` aborts the job when a rank
    waits longer than that in one collective, after marking its spool ``hung``.
    """
    rank = world.Get_rank()
    run = Run.build(world, options, trace_level=trace.level)
    run.comm.watchdog = Watchdog(step_timeout, rank)
    start_time = now_iso()
    run_id = on_root(world, lambda: trace.run_id or new_run_id(trace.label))
    trace_path, _ = trace_paths(trace.results_dir, run_id)
    metadata = run_metadata(run, run_id, config, trace.level, start_time) if rank == 0 else None
    spool_dir = on_root(world, lambda: prepare_spool(trace.results_dir, run_id, trace.force, metadata))
    rank_meta = rank_metadata(run, *run.clock)
    spool = None
    try:
        spool = agree(world, lambda: RankSpool(spool_dir, rank, rank_meta))
        run.comm.watchdog.on_hang = spool.mark_failed  # a hang from here on is recorded in the spool
    finally:
        if spool is None:  # some rank could not open its files: nothing was recorded, remove the spool
            _remove_spool_dir(world, spool_dir)
    try:
        if header is not None:
            header(run)
        if peak_tflops is None:
            peak, source = measure_peak(run), "measured standalone GEMM, median over ranks"
        else:
            peak, source = peak_tflops, "--peak-tflops"
        say(f"tracing: level {trace.level}, run id {run_id}, per-rank files in {spool_dir}")
        out = StepDisplay(display, options.steps, options.warmup, say, active=rank == 0)
        record = np.zeros(1, dtype=RANK_STEP_DTYPE)
        for i in range(options.steps):
            if fault is not None and fault.step == i:
                world.Barrier()  # every rank has spooled the steps before: the test knows what survives
                if fault.rank == rank:
                    fault.trigger()
            result = run.trainer.step(i)
            shift = run.comm.tracer.shift_ns
            record[0] = (rank, i, i < options.warmup, result.start_ns - shift, result.end_ns - shift, result.loss,
                         result.seconds, result.compute_ns, result.wait_ns, len(result.events), result.mpi_ns)
            spool.append(result.events, record)
            out.update(i, result.loss, result.seconds)
        out.close()
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            spool.mark_failed(f"{type(exc).__name__}: {exc}")
        raise
    all_steps = world.gather(_spooled_steps(spool), root=0)
    summary = None
    if rank == 0:
        summary = summarize(np.concatenate(all_steps), world.Get_size(), options.model.flops_per_step(),
                            options.model.tokens, peak, source, data_prep_s=run.data_prep_seconds,
                            data_batches=run.data.batches)
        metadata["summary"] = summary.as_dict()
        metadata["array_pool"] = run.backend.pool_stats()  # rank 0's, after the last step
    drift = end_alignment(run, rank_meta)
    path = merge_run(world, spool, rank_meta, trace_path, metadata, run.comm.tracer.layer_names, trace.force,
                     correct=drift.correct_records if drift is not None else None, group_size=trace.group_size)
    run.comm.watchdog.close()
    run.close()
    return path, summary


def _spooled_steps(spool: RankSpool) -> np.ndarray:
    return read_records(spool.steps_path, RANK_STEP_DTYPE)


def _remove_spool_dir(world, spool_dir: str) -> None:
    world.Barrier()
    if world.Get_rank() == 0:
        import shutil

        shutil.rmtree(spool_dir, ignore_errors=True)
