"""A traced training run from start to summary: what ``fourd-mpi run`` does.

Order (:func:`_traced_run`, one named step each): build the run, clocks aligned (:func:`build_run`) -> rank 0
reserves the run id and the spool directory, every rank opens its spool files (:func:`open_spool`) -> the
measured GEMM and rated peaks (:func:`measure_peaks`) -> the steps, each appended to the spool
(:func:`run_steps`) -> rank 0's summary (:func:`summarize_on_root`) -> the merge into the HDF5 trace
(:func:`merge_trace`). An exception is recorded in the spool (:func:`record_failure`); whatever ends the run,
:func:`close_run` closes it. A user error at any stage is raised on every rank before anyone enters a
collective that the others would miss. Test-only faults (``--inject-fault``) are hooks the steps and the
merge call (:mod:`fourd_mpi.run.faults`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from fourd_mpi.core.mpiutil import agree, on_root
from fourd_mpi.core.watchdog import Watchdog
from fourd_mpi.errors import ConfigError, Terminated, TraceError
from fourd_mpi.perf.peaks import runtime_peak
from fourd_mpi.run.build import Run
from fourd_mpi.run.display import StepDisplay
from fourd_mpi.run.faults import Fault, Faults
from fourd_mpi.run.metadata import rank_metadata, run_metadata
from fourd_mpi.run.options import RunOptions
from fourd_mpi.run.sentinel import start as start_sentinel
from fourd_mpi.step.kernels import standalone_gemm_tflops
from fourd_mpi.trace.clocks import DriftModel, measure_offsets
from fourd_mpi.trace.events import LEVELS, RANK_STEP_DTYPE
from fourd_mpi.trace.files import (
    LABEL_OVERHEAD,
    RUN_ID_OVERHEAD,
    check_name,
    check_name_fits,
    new_run_id,
    now_iso,
    trace_paths,
)
from fourd_mpi.trace.merge import merge_run
from fourd_mpi.trace.nvtx import make_ranges
from fourd_mpi.trace.spool import RankSpool, prepare_spool, published_trace
from fourd_mpi.trace.summary import summarize
from fourd_mpi.util.signals import deferred
from fourd_mpi.util.text import int_ranges

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TraceOptions:
    level: str = "op"
    results_dir: str = "results"
    run_id: Optional[str] = None
    label: Optional[str] = None
    force: bool = False
    group_size: int = 0  #: ``--trace-group-size`` (0: ranks per node, see :mod:`fourd_mpi.trace.merge`)
    nvtx: bool = False  #: ``--nvtx``: NVTX ranges of steps, phases, layers and ops (:mod:`fourd_mpi.trace.nvtx`)

    def validate(self) -> "TraceOptions":
        if self.level not in LEVELS:
            raise ConfigError(f"unknown trace level {self.level!r}: choose one of {', '.join(LEVELS)}")
        if self.run_id is not None:
            check_name("run id", self.run_id)
            check_name_fits(self.results_dir, "--run-id", self.run_id)
        if self.label is not None:
            check_name("label", self.label)
            check_name_fits(self.results_dir, "--label", self.label, RUN_ID_OVERHEAD + LABEL_OVERHEAD)
        return self


def device_name(backend) -> Optional[str]:
    """The GPU's name as its runtime gives it (None on the NumPy backend: a CPU)."""
    name = getattr(backend, "device_name", None)
    return name() if callable(name) else None


def measure_peak(run: Run) -> float:
    """Median over ranks of the standalone TFLOP/s of the step's largest local GEMM (all ranks at once)."""
    layer = max(run.model.fc_layers(), key=lambda fc: fc.block_shape[0] * fc.block_shape[1])
    cfg, shape = run.options.model, run.options.grid
    m = cfg.batch * cfg.seq // (shape.data * shape.z)
    n, k = layer.block_shape
    tflops = standalone_gemm_tflops(run.backend, m, n, k)
    return float(np.median(run.world.allgather(tflops)))


def end_alignment(run, rank_meta: Dict):
    """Offsets to rank 0 measured again after the steps: this rank's :class:`DriftModel` (None when
    the run was not traced), its drift and residual uncertainty added to ``rank_meta``. Collective."""
    if run.clock_start is None:
        return None
    offset0, uncertainty0, origin, at0 = run.clock_start
    offset1, uncertainty1, at1 = measure_offsets(run.world)
    drift = DriftModel(offset0, at0, offset1, at1, origin, uncertainty0, uncertainty1)
    rank_meta.update(clock_offset_end_ns=offset1, clock_drift_ppm=drift.ppm, clock_residual_ns=drift.residual_ns)
    return drift


def interrupt_name(exc: BaseException) -> str:
    """How an interruption is named in the spool and on stderr."""
    if isinstance(exc, Terminated) and getattr(exc, "signum", None) == signal.SIGHUP:
        return "SIGHUP (the terminal or the ssh session of the run closed)"
    if isinstance(exc, Terminated):
        return "SIGTERM (scheduler time limit, scancel or kill)"
    return "SIGINT (Ctrl-C)"


def traced_run(world, options: RunOptions, trace: TraceOptions, config: Dict, say: Callable[[str], None],
               display: str = "auto", peak_tflops: Optional[float] = None, fault: Optional[Fault] = None,
               header: Callable[[Run], None] = None, step_timeout: float = 0.0):
    """Run ``options.steps`` traced steps; returns ``(trace path, Summary)`` (Summary on rank 0 only).

    ``step_timeout`` > 0: a :class:`~fourd_mpi.core.watchdog.Watchdog` aborts the job when a rank
    waits longer than that in one collective, after marking its spool ``hung``.

    SIGTERM raises :class:`~fourd_mpi.errors.Terminated` in the main thread meanwhile (as Ctrl-C
    raises ``KeyboardInterrupt``): the run records ``interrupted: SIGTERM ...`` in its spool, a merge
    in progress removes its temporary files, and the CLI exits with 143. Python runs the handler
    between bytecodes, so a rank blocked in an MPI call raises only when the call returns; a rank
    that raised calls ``MPI_Abort`` (the CLI), which ends the ranks still blocked without a report of
    their own. The handler never calls MPI.
    """
    import threading

    if fault is not None:  # on every rank, before any collective
        fault.check(trace.results_dir, options.steps)
    args = (world, options, trace, config, say, display, peak_tflops, fault, header, step_timeout)
    if threading.current_thread() is not threading.main_thread():
        return _traced_run(*args)
    from fourd_mpi.util.signals import handler

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}  # nohup: SIGHUP stays ignored
    try:
        return _traced_run(*args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _traced_run(world, options: RunOptions, trace: TraceOptions, config: Dict, say: Callable[[str], None],
                display: str = "auto", peak_tflops: Optional[float] = None, fault: Optional[Fault] = None,
                header: Callable[[Run], None] = None, step_timeout: float = 0.0):
    """:func:`traced_run`'s work, with SIGTERM raising: the story of a run (the module doc gives its order).

    Whatever ends it, :func:`close_run` runs; what an exception leaves is :func:`record_failure`'s."""
    run = build_run(world, options, trace, config, step_timeout)
    rank = world.Get_rank()
    start_time = now_iso()
    run_id = on_root(world, lambda: trace.run_id or new_run_id(trace.label))
    trace_path, _ = trace_paths(trace.results_dir, run_id)
    metadata = run_metadata(run, run_id, config, trace.level, start_time) if rank == 0 else None
    rank_meta = rank_metadata(run, *run.clock)
    at = Progress()
    spool = sentinel = None
    failed = False
    try:
        # the spool and every rank's files come into being whole: a signal meanwhile is raised once they exist
        # (and recorded in them), never between rank 0 creating the directory and the ranks their files
        with deferred():
            spool = open_spool(run, trace, run_id, metadata, rank_meta)
            # records the run as interrupted should mpiexec end first (SIGHUP), when no handler of this rank runs
            sentinel = start_sentinel(spool.dir, rank, options.steps, RANK_STEP_DTYPE.itemsize,
                                      int(rank_meta.get("local_rank", 0) or 0))
        faults = Faults.of(fault, world, spool.dir, trace.results_dir)
        if header is not None:
            header(run, run_id, trace_path, spool.dir)
        peaks = measure_peaks(run, peak_tflops)
        out = StepDisplay(display, options.steps, options.warmup, say, active=rank == 0)
        last, bubbles = run_steps(run, spool, faults, out, at)
        summary, recreated = summarize_on_root(run, spool, last, bubbles, peaks, metadata)
        path = merge_trace(run, spool, sentinel, faults, at, trace, trace_path, metadata, rank_meta)
    except BaseException as exc:
        failed = True
        record_failure(exc, spool, at, run, trace_path)
        raise
    finally:
        close_run(run, spool, sentinel, failed)
    if recreated:
        warning_line(f"spool files in {spool.dir} were deleted during the run; {recreated} of {world.Get_size()} "
                     "rank(s) re-created theirs from the files they still had open, no step was lost (trace "
                     "metadata spool_recreated)")
    return path, summary


def build_run(world, options: RunOptions, trace: TraceOptions, config: Dict, step_timeout: float) -> Run:
    """The run's live objects (:meth:`Run.build`, clocks aligned), its watchdog (``--step-timeout``) and NVTX
    ranges (``--nvtx``); ``config["attention"]`` becomes the kernels that run and ``config["progress"]`` the
    progress strategy (``auto`` resolves per machine and placement: the header, metadata and key say which).
    Collective."""
    started = time.perf_counter()
    run = Run.build(world, options, trace_level=trace.level)
    log.debug("built the run in %.3f s: communicators, model, data, clocks aligned", time.perf_counter() - started)
    if "attention" in config:
        config["attention"] = run.backend.attention
    if "progress" in config:
        config["progress"] = run.comm.progress.name
    rank = world.Get_rank()
    run.comm.watchdog = Watchdog(step_timeout, rank)
    run.comm.tracer.ranges = make_ranges(trace.nvtx, log.warning if rank == 0 else lambda text: None)
    return run


def open_spool(run: Run, trace: TraceOptions, run_id: str, metadata: Optional[Dict], rank_meta: Dict) -> RankSpool:
    """Rank 0 reserves the spool directory (:func:`prepare_spool`), then every rank opens its files in it; when
    any rank cannot, the directory is removed (nothing was recorded) and every rank raises the same error.
    A hang from here on is recorded in the spool. Collective."""
    world = run.world
    spool_dir = on_root(world, lambda: prepare_spool(trace.results_dir, run_id, trace.force, metadata))
    spool = None
    try:
        spool = agree(world, lambda: RankSpool(spool_dir, world.Get_rank(), rank_meta))
    finally:
        if spool is None:
            _remove_spool_dir(world, spool_dir)
    run.comm.watchdog.on_hang = spool.mark_failed
    return spool


def measure_peaks(run: Run, peak_tflops: Optional[float]) -> Tuple[float, Optional[float], str]:
    """``(gemm, peak, source)``: the measured GEMM TFLOP/s of :func:`measure_peak` (the "% of measured GEMM"
    column, always) and the peak behind MFU and HFU, ``--peak-tflops`` or the device's data-sheet peak
    (:func:`fourd_mpi.perf.peaks.runtime_peak`; none on a CPU) with where it came from. Collective."""
    gemm = measure_peak(run)
    log.debug("standalone GEMM of the step's largest local shape: %.4g TFLOP/s per rank (median over ranks)", gemm)
    if peak_tflops is not None:
        return gemm, peak_tflops, "--peak-tflops"
    peak, source = runtime_peak(device_name(run.backend), run.options.dtype, run.options.tf32)
    return gemm, peak, source


@dataclass
class Progress:
    """Where this rank's run is, for the record of an interruption: ``step``, the step in progress (None
    before the first; the number of steps once past the last), and whether the final merge began."""

    step: Optional[int] = None
    merging: bool = False

    def stopped(self, steps: int) -> str:
        """When a run of ``steps`` steps stopped and what its spool keeps: ``"during step 2; the steps before
        it are"`` (the record goes on with where)."""
        if self.merging:
            return "during the final merge; every step is"
        if self.step is None:
            return "before the first step; the steps before it are"
        if self.step == steps:
            return "after the last step, before the final merge; every step is"
        return f"during step {self.step}; the steps before it are"


def run_steps(run: Run, spool: RankSpool, faults: Faults, out: StepDisplay, at: Progress):
    """The steps, each appended to this rank's spool as one :data:`RANK_STEP_DTYPE` record and its events;
    ``(the last step's StepResult, {step: ns this rank was blocked on another pipeline stage})``.

    The spool's health is agreed on one step late (:class:`SpoolHealth`); a non-finite loss stops every
    rank at the same step (:func:`non_finite_loss`). Collective."""
    options, rank = run.options, run.world.Get_rank()
    record = np.zeros(1, dtype=RANK_STEP_DTYPE)
    health = SpoolHealth(run.world, spool, run.comm.watchdog)
    bubbles = {}
    result = None
    for i in range(options.steps + 1):
        at.step = i
        faults.before_step(i)
        if i == options.steps:
            break
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # reported below, in one line
            result = run.trainer.step(i, last=i == options.steps - 1)
        shift = run.comm.tracer.shift_ns
        record[0] = (rank, i, i < options.warmup, result.start_ns - shift, result.end_ns - shift, result.loss,
                     result.seconds, result.compute_ns, result.wait_ns, len(result.events), result.mpi_ns)
        spool.append(result.events, record)
        bubbles[i] = result.bubble_ns
        out.update(i, result.loss, result.seconds)
        if health.failed_before(i):  # every rank stops here, with the next step's all-gather (oup) waited
            run.trainer.weights.drain()
            break
        if not np.isfinite(result.loss):  # reduced to every rank: all stop here, without a collective
            health.settle()  # no agreement left in flight at exit
            run.trainer.weights.drain()  # nor the next step's all-gather (--overlap oup)
            raise non_finite_loss(result.loss, i, options, spool)
    out.close()
    spool.ensure_present()  # deleted after the last step: re-created before the merge
    health.finish()
    return result, bubbles


def summarize_on_root(run: Run, spool: RankSpool, last, bubbles: Dict[int, int], peaks, metadata: Optional[Dict]):
    """Rank 0 gathers every rank's step records, activation bytes (of ``last``, the last step) and pipeline
    bubbles, summarizes the run (:func:`fourd_mpi.trace.summary.summarize`: ``peaks`` = ``(gemm, peak, source)``
    of :func:`measure_peaks`) and adds it to ``metadata``. Returns ``(Summary on rank 0 else None, how many
    ranks re-created deleted spool files)``. Collective."""
    world, options = run.world, run.options
    notes = world.gather(spool.recreated, root=0)
    try:
        my_steps = spool.read_steps()
    except OSError:  # an I/O error reading back: merge_run meets it again and stops every rank with it
        my_steps = np.zeros(0, dtype=RANK_STEP_DTYPE)
    all_steps = world.gather(my_steps, root=0)
    held = world.gather((last.saved_activation_bytes, last.peak_activation_bytes), root=0)
    all_bubbles = world.gather(bubbles, root=0)
    summary = None
    if world.Get_rank() == 0:
        gemm, peak, source = peaks
        cfg = options.model
        activations = {"recompute": options.recompute, "saved_bytes_max": max(s for s, _ in held),
                       "saved_bytes_min": min(s for s, _ in held), "peak_bytes_max": max(p for _, p in held),
                       "saved_bytes_by_rank": [s for s, _ in held],
                       "measured": "bytes of the distinct arrays (views counted once) the last step kept from the "
                                   "end of the forward pass for the backward pass; peak: the most held at once "
                                   "during the backward pass (blocks not yet back-propagated + the rebuilt one)"}
        rank_steps = np.concatenate(all_steps)
        bubble = np.array([all_bubbles[r].get(st, 0) for r, st in zip(rank_steps["rank"].tolist(),
                                                                        rank_steps["step"].tolist())],
                          dtype=np.float64)
        summary = summarize(rank_steps, world.Get_size(), cfg.flops_per_step(),
                            cfg.tokens, peak, source, data_prep_s=run.data_prep_seconds,
                            data_batches=run.data.batches,
                            hardware_flops_per_step=cfg.hardware_flops_per_step(options.recompute),
                            recompute=options.recompute,
                            formulas=(cfg.flops_formula(), cfg.hardware_flops_formula(options.recompute)),
                            activations=activations, bubble=bubble if bubble.any() else None,
                            gemm_tflops=gemm)
        metadata["summary"] = summary.as_dict()
        metadata["activations"] = activations
        metadata["array_pool"] = run.backend.pool_stats()  # rank 0's, after the last step
        metadata["progress_end"] = run.comm.progress.describe()  # rank 0's: --poll-flops auto's chunk now
        metadata["spool_recreated"] = [note for mine in notes for note in mine]
    recreated = world.bcast(sum(1 for mine in notes if mine) if world.Get_rank() == 0 else None, root=0)
    return summary, recreated


def merge_trace(run: Run, spool: RankSpool, sentinel, faults: Faults, at: Progress, trace: TraceOptions,
                trace_path: str, metadata: Optional[Dict], rank_meta: Dict) -> str:
    """The final merge of every rank's spool files into the HDF5 trace ``trace_path``
    (:func:`fourd_mpi.trace.merge.merge_run`), clocks corrected for drift (:func:`end_alignment`); rank 0 indexes
    the run in the same signal-held stretch as the publication (no complete trace unindexed). Not when any rank's
    watchdog fired: an aborted run publishes no trace. Returns the trace's path. Collective."""
    world, rank = run.world, run.world.Get_rank()
    drift = end_alignment(run, rank_meta)
    force = trace.force or on_root(world, lambda: _replaces_live_recovery(trace_path, spool.dir))
    # every fire is marked before its wait ends, and no wait is watched from here on (the merge's collectives are
    # not), so none can fire after this check
    run.comm.watchdog.hold_if_fired(world)
    if rank == 0:
        _note_stale_temporaries(trace_path)
    at.merging = True
    started = time.perf_counter()
    if sentinel is not None:
        sentinel.merging()

    def indexed(path: str) -> None:  # rank 0
        index_line(metadata, path, trace.results_dir)
        faults.after_published()

    path = merge_run(world, spool, rank_meta, trace_path, metadata, run.comm.tracer.layer_names, force,
                     correct=drift.correct_records if drift is not None else None, group_size=trace.group_size,
                     after_open=faults.in_merge, on_published=indexed if rank == 0 else None,
                     on_temporaries=sentinel.temporaries if sentinel is not None else None)
    log.debug("merged the per-rank files into %s in %.3f s", path, time.perf_counter() - started)
    return path


def record_failure(exc: BaseException, spool: Optional[RankSpool], at: Progress, run: Run, trace_path: str) -> None:
    """What a run that raised ``exc`` leaves in this rank's spool and on stderr, before it propagates:

    - no spool yet (or it could not be made): nothing;
    - interrupted (Ctrl-C, SIGTERM, SIGHUP) after the merge published the trace: the spool is left over and
      removed, one line says the trace is complete;
    - interrupted after this rank's watchdog aborted the job (the launcher then ends every rank, Open MPI's with
      SIGTERM): the spool's ``hung`` report stays the reason;
    - interrupted otherwise (mpiexec forwards SIGINT and SIGTERM to every rank): the spool is marked
      ``interrupted: <signal> <when>; <what is kept> in <spool>`` and the same line goes to stderr;
    - any other failure but a :class:`TraceError` (recorded already) or ``SystemExit``: the spool is marked
      ``<type>: <message>``.

    An interruption's line is the one the command line gives (``exc.reported``)."""
    interrupted = isinstance(exc, (KeyboardInterrupt, Terminated))
    if spool is None:
        return
    if at.merging and (not os.path.exists(spool.steps_path) or published_trace(spool.dir) is not None):
        if interrupted:  # the merge published the trace (and maybe removed this rank's files)
            _remove_left_over(spool)  # every rank's files: the abort may end the others before they remove theirs
            _report(exc, f"interrupted: {interrupt_name(exc)} after the final merge; the trace {trace_path} is "
                         "complete")
    elif interrupted and run.comm.watchdog.fired is not None:
        pass
    elif interrupted:
        note = (f"interrupted: {interrupt_name(exc)} {at.stopped(run.options.steps)} in {spool.dir} "
                f"(fourd-mpi trace recover {spool.dir})")
        spool.mark_failed(note)
        _report(exc, note)
    elif not isinstance(exc, (SystemExit, TraceError)):
        spool.mark_failed(f"{type(exc).__name__}: {exc}")


def _report(exc: BaseException, note: str) -> None:
    """``fourd-mpi: <note>`` on stderr, written at once; ``exc`` is marked ``reported`` (the command line adds no
    line of its own)."""
    with contextlib.suppress(OSError):  # stderr gone (its reader killed too): the exit status still says it
        os.write(2, f"fourd-mpi: {note}\n".encode())
    exc.reported = True


def close_run(run: Run, spool: Optional[RankSpool], sentinel, failed: bool = False) -> None:
    """The end of every run, whatever ended it: this rank's spool files are closed (their lock released:
    ``trace recover`` may take them), the NVTX ranges end, the watchdog stops and the run's communicators are freed
    (:meth:`Run.close`: ``MPI_Comm_free``, collective by the standard but local in MPICH and Open MPI, so a rank
    that failed alone frees its own and goes on to abort the job). ``failed``: the run ended in an exception; a
    collective issued ahead is waited for at most :data:`~fourd_mpi.run.build.FAILED_DRAIN_S` (:meth:`Run.close`).
    Last, the sentinel is told the run ended in order."""
    try:
        if spool is not None:
            spool.close()  # idempotent: the merge or the spool's health check may have closed it
        if run.comm.tracer.ranges is not None:
            run.comm.tracer.ranges.unwind()
        run.comm.watchdog.close()
        run.close(failed)
    finally:
        # last: until here a hang-up of mpiexec (its proxy's SIGKILL) can still end this rank, and only the
        # sentinel can then record it ('interrupted'); told earlier, it would exit and the trace say 'partial'
        if sentinel is not None:
            sentinel.close()


class NonFiniteLoss(TraceError):
    """The loss became NaN or infinite: a run failure, already recorded in the spool."""


def non_finite_loss(loss: float, step: int, options: RunOptions, spool: RankSpool) -> NonFiniteLoss:
    """The one-line error of a NaN or infinite ``loss`` after ``step``, recorded in this rank's spool.

    The loss is all-reduced inside the step, so every rank holds the same value and stops at the same
    step without a collective; ``trace recover`` then gives a ``failed`` trace of the steps so far
    (this one included) with this reason.
    """
    lr = f"--lr {options.lr:g}" if options.lr is not None else f"the default of {options.optimizer}"
    reason = (f"the loss became non-finite ({float(loss)}) at step {step}: the learning rate ({lr}) is too large "
              "or the model diverged")
    spool.mark_failed(reason)
    return NonFiniteLoss(f"{reason}; the steps so far are kept in {spool.dir} ('fourd-mpi trace recover "
                         f"{spool.dir}' merges them into a failed trace)")


class SpoolHealth:
    """Agreement on the spool's health without a blocking collective per step.

    After each step every rank contributes whether its spool failed (:attr:`RankSpool.error`) to a
    non-blocking MAX all-reduce over ``world``, completed after the next step (MPI progresses it
    inside that step's communication), so a failure stops every rank one step later and in the same
    step. Then every rank raises the same :class:`TraceError` (one line), naming the ranks that failed
    and their first error; the failed ranks record it in the spool first. Collective over ``world``.
    """

    def __init__(self, world, spool: RankSpool, watchdog=None):
        self.world, self.spool, self.watchdog = world, spool, watchdog
        self._flag, self._any = np.zeros(1, np.int32), np.zeros(1, np.int32)
        self._request = None
        self._step = -1  # the last step done
        self._failed = False

    def _wait(self) -> None:
        if self._request is None:
            return
        if self.watchdog is not None:
            with self.watchdog.watch(f"the spool health agreement (MPI_Iallreduce over world) after step "
                                     f"{self._step}"):
                self._request.Wait()
        else:
            self._request.Wait()
        self._request = None
        self._failed = self._failed or bool(self._any[0])

    def failed_before(self, step: int) -> bool:
        """After ``step``: True if a failure was agreed on for ``step - 1`` (call :meth:`finish` next)."""
        from mpi4py import MPI

        self._wait()
        self._step = step
        if self._failed:
            return True
        self._flag[0] = self.spool.error is not None
        self._request = self.world.Iallreduce(self._flag, self._any, op=MPI.MAX)
        return False

    def settle(self) -> None:
        """Complete the agreement in flight (every rank calls it at the same step), raising nothing."""
        self._wait()

    def finish(self) -> None:
        """Complete the last agreement; raise the agreed :class:`TraceError` if any rank failed."""
        from mpi4py import MPI

        self._wait()
        # a failure of the final re-creation check (after the last agreement) is agreed on here
        if not self._failed and not self.world.allreduce(int(self.spool.error is not None), op=MPI.MAX):
            return
        states = self.world.allgather((self.spool.error, self.spool.lost()))
        failed = [r for r, (e, _) in enumerate(states) if e is not None]
        gone = [r for r, (_, lost) in enumerate(states) if lost]
        first = states[failed[0]][0]
        if self.spool.error is not None:
            self.spool.mark_failed(self.spool.error)
        self.spool.close()
        others = f" (ranks {int_ranges(failed)} failed)" if len(failed) > 1 else ""
        if gone:  # deleted and not re-created: what was in them went with the descriptors
            kept = (f"the spool files of rank(s) {int_ranges(gone)} were deleted and could not be re-created: "
                    "their steps are lost")
        else:  # a full disk (or quota) frees up; any other I/O error (EIO: a failing disk) must be repaired
            when = "once there is space" if "(ENOSPC)" in first or "(EDQUOT)" in first else \
                "once the file system works again"
            kept = (f"the steps every rank completed are kept in {self.spool.dir} ('fourd-mpi trace recover "
                    f"{self.spool.dir}' merges them {when})")
        raise TraceError(f"{first}{others}; the run stops after step {self._step}; {kept}")


def _replaces_live_recovery(trace_path: str, spool_dir: str) -> bool:
    """Rank 0, before the final merge: True (and a note) if ``trace_path`` is a trace that ``trace recover
    --force`` made from this run's own spool while the run was live: the run's trace replaces it."""
    from fourd_mpi.trace.recover import live_recovery_of

    if not live_recovery_of(trace_path, spool_dir):
        return False
    log.info(f"note: {trace_path} is a partial trace recovered from {spool_dir} while this run was running "
             "(trace recover --force); the run's own trace replaces it")
    return True


def index_line(metadata: Dict, path: str, results_dir: str) -> None:
    """Rank 0, after the merge: the run's line in ``<results-dir>/index.jsonl``
    (:mod:`fourd_mpi.results.index`); a failure to write it is a warning, the trace stands."""
    from fourd_mpi.results.index import index_run
    from fourd_mpi.trace.read import read_status

    try:
        index_run(metadata, read_status(path), path, results_dir)
    except (OSError, ValueError) as exc:  # TraceError is a ValueError
        warning_line(f"the run was not added to {results_dir}/index.jsonl: {exc}")


def warning_line(text: str) -> None:
    """One ``fourd-mpi: warning:`` line on this rank's stderr (a WARNING record of :mod:`fourd_mpi.util.log`:
    every rank that has one says it)."""
    log.warning("%s", " ".join(text.split()))


def _note_stale_temporaries(trace_path: str) -> None:
    """Rank 0, before its merge: one line naming the temporary files or staged parts of ``trace_path`` that another
    merge left (one killed before it could remove them), left as they are: they are not this merge's, whose own
    names hold its pid and a random token."""
    from fourd_mpi.trace.recover import merge_temporaries

    found = merge_temporaries(trace_path)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        warning_line(f"{len(found)} temporary file(s) of another merge of {trace_path} are next to it (a merge killed "
                     f"before it removed them): {shown}; left as they are ('fourd-mpi trace recover' of that run's "
                     "per-rank files removes them once its processes are gone)")


def _remove_left_over(spool: RankSpool) -> None:
    """A rank interrupted after the final merge published the trace: the whole spool is left over (its data is in
    the trace); remove it, as far as it goes (other ranks may remove theirs at the same time)."""
    import shutil

    spool.close()
    shutil.rmtree(spool.dir, ignore_errors=True)


def _remove_spool_dir(world, spool_dir: str) -> None:
    world.Barrier()
    if world.Get_rank() == 0:
        import shutil

        shutil.rmtree(spool_dir, ignore_errors=True)
