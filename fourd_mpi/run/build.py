"""Build a run from resolved options: the grid, backend, model, data and trainer on a communicator.

All validation that depends only on the options and the world size happened before, in
:func:`fourd_mpi.run.options.resolve` (pure, on every rank before any collective), so bad
input fails on every rank with the same message.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

from mpi4py import MPI

from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.core.backend import cupy_usable, make_backend, parse_dtype
from fourd_mpi.core.collectives import Collectives
from fourd_mpi.core.gpuaware import OP_CLASSES, GpuAwareness, smoke_test
from fourd_mpi.core.gpuaware import detect as detect_gpu_awareness
from fourd_mpi.core.grid import AXES, ProcessGrid
from fourd_mpi.core.mpiutil import agree, check_same
from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.core.progress import make_progress
from fourd_mpi.errors import BackendError
from fourd_mpi.run.admission import MemoryNeed, admit, allocate
from fourd_mpi.run.options import RunOptions
from fourd_mpi.step import fusedattention
from fourd_mpi.step.engine import Trainer
from fourd_mpi.step.kernels import ComputeCounter
from fourd_mpi.step.model import Model, SyntheticData  # the 4D family's types, for annotations
from fourd_mpi.step.optim import make_optimizer
from fourd_mpi.trace.events import Tracer, align_clocks


def choose_attention(comm, options: RunOptions, backend):
    """``(implementation, why)`` of ``--attention`` on every rank of ``comm`` (collective): an explicit fused
    mode that some rank cannot run is one error on every rank; ``auto`` runs fused only where every rank can."""
    if options.model.kind != "gpt":
        return "unfused", "no attention in an mlp model"
    mine = agree(comm, lambda: fusedattention.choose(options.attention, backend, options.model.head_dim))
    everyone = comm.allgather(mine)
    if all(choice == everyone[0] for choice in everyone):
        return everyone[0]
    rank, (_, why) = next((r, c) for r, c in enumerate(everyone) if c[0] == "unfused")
    return "unfused", f"{why} (rank {rank})"


@dataclass(frozen=True)
class MpiBuffers:
    """Which buffers MPI gets in this run, and why (stored in the trace metadata as ``mpi_buffers``).

    requested: ``--device-buffers`` (auto, direct, staged); mode: ``direct``, ``staged`` or ``mixed``;
    emulated: staging on the NumPy backend (host copies, for testing); reason: one sentence;
    routes: per operation class (:data:`~fourd_mpi.core.gpuaware.OP_CLASSES`) ``direct`` or ``staged``.
    """

    requested: str
    mode: str
    emulated: bool
    reason: str
    routes: Dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> Dict:
        return asdict(self)


def resolved_settings(options: RunOptions) -> Dict[str, str]:
    """``options`` flattened for :func:`~fourd_mpi.core.mpiutil.check_same`: ``"model.hidden" -> "768"``,
    ``"grid.x" -> "2"``, ``"steps" -> "10"`` ... (every resolved value, as its ``repr``)."""
    out: Dict[str, str] = {}
    for name, value in options.as_dict().items():
        if isinstance(value, dict):
            out.update({f"{name}.{key}": repr(inner) for key, inner in value.items()})
        else:
            out[name] = repr(value)
    return out


#: testing hook: ``CLASS=ROUTE,...`` (e.g. ``nb_gather=staged``) overrides the routes of those operation
#: classes after the decision (on NumPy a staged class is emulated), so one class's routing can be checked
TEST_ROUTES_ENV = "FOURD_MPI_TEST_ROUTES"


def parse_test_routes(text: str) -> Dict[str, str]:
    """``"nb_gather=staged,p2p=direct"`` -> ``{"nb_gather": "staged", "p2p": "direct"}`` (:data:`TEST_ROUTES_ENV`)."""
    out: Dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        cls, _, route = item.partition("=")
        if cls not in OP_CLASSES or route not in ("direct", "staged"):
            raise BackendError(f"{TEST_ROUTES_ENV}: {item!r} is not CLASS=direct|staged with CLASS one of "
                               f"{', '.join(OP_CLASSES)}")
        out[cls] = route
    return out


#: ``1``: ``--device-buffers direct`` hands device pointers to every operation class, also those the library's
#: documentation says stage (:func:`check_forced_direct`): for testing whether that documentation is out of date
FORCE_DIRECT_ENV = "FOURD_MPI_FORCE_DIRECT"


def check_forced_direct(requested: str, backend: str, documented: Dict[str, str], why: str,
                        env: Dict[str, str]) -> None:
    """Refuse ``--device-buffers direct`` on CuPy where the MPI's documentation says some operation classes
    do not take device buffers (``documented``: per class of :data:`OP_CLASSES` the route the rules give,
    ``staged`` where a document says so; classes without a rule are absent and not refused).

    Why refuse rather than let the smoke test decide: Open MPI 4.1.4 built with CUDA segfaulted inside the
    smoke test's ``MPI_Iallreduce`` on a device buffer (``mca_coll_libnbc`` -> ``mca_op_avx``: the reduction
    ran on the host over a device pointer), on one H200, 2026-11-28
    (results/benchmarks/gpu/h200-2026-11-28-openmpi/cverify2.log): no Python guard catches that.
    ``env[FORCE_DIRECT_ENV] == "1"`` lets it through. Pure; raises :class:`BackendError` (one line).
    """
    if requested != "direct" or backend != "cupy" or env.get(FORCE_DIRECT_ENV) == "1":
        return
    staged = [cls for cls in OP_CLASSES if documented.get(cls) == "staged"]
    if staged:
        raise BackendError(f"--device-buffers direct, but this MPI's documentation says {', '.join(staged)} do not "
                           f"take device buffers ({why}); forced, Open MPI 4.1 crashes in them: use "
                           f"--device-buffers auto (direct for the other classes) or staged "
                           f"({FORCE_DIRECT_ENV}=1 forces it anyway)")


def _uniform(route: str) -> Dict[str, str]:
    return {cls: route for cls in OP_CLASSES}


def choose_mpi_buffers(requested: str, backend: str, evidence_ok: bool, evidence_reason: str,
                       smoke: Optional[Dict], routes: Optional[Dict[str, str]] = None,
                       override: Optional[Dict[str, str]] = None) -> MpiBuffers:
    """The buffer mode from the request, the backend, the detection verdict of every rank
    (``evidence_ok``: all ranks' :attr:`GpuAwareness.direct_ok`; ``routes``: per operation class, direct
    only where the rules say so on every rank; None: every class as ``evidence_ok``) and the smoke test
    (None: not run). ``override``: :data:`TEST_ROUTES_ENV` (testing).

    Pure (the tests feed it cases). Raises :class:`BackendError` when ``direct`` was forced on
    CuPy and the smoke test failed: results would be garbage.
    """
    chosen = _choose(requested, backend, evidence_ok, evidence_reason, smoke, routes)
    if not override:
        return chosen
    new = dict(chosen.routes, **override)
    kinds = set(new.values())
    mode = kinds.pop() if len(kinds) == 1 else "mixed"
    text = ",".join(f"{cls}={route}" for cls, route in override.items())
    return MpiBuffers(requested, mode, backend == "numpy" and "staged" in new.values(),
                      f"{chosen.reason}; test hook {TEST_ROUTES_ENV}={text}", new)


def _choose(requested: str, backend: str, evidence_ok: bool, evidence_reason: str,
            smoke: Optional[Dict], routes: Optional[Dict[str, str]]) -> MpiBuffers:
    picked = _choose_uniform(requested, backend, evidence_ok, evidence_reason, smoke)
    if requested != "auto" or backend == "numpy" or routes is None:
        return picked
    if smoke is not None and not smoke.get("ok"):
        return picked  # the smoke test failed: everything staged
    if all(route == "direct" for route in routes.values()):
        return picked
    if all(route == "staged" for route in routes.values()):
        return MpiBuffers(requested, "staged", False, f"auto: {evidence_reason}", _uniform("staged"))
    direct = [cls for cls in OP_CLASSES if routes.get(cls) == "direct"]
    staged = [cls for cls in OP_CLASSES if routes.get(cls) != "direct"]
    smoke_note = "; device-buffer smoke test passed" if smoke is not None else \
        " (no smoke test: it uses Iallreduce, staged here)"
    return MpiBuffers(requested, "mixed", False, f"auto: direct for {', '.join(direct)}, staged for "
                      f"{', '.join(staged)} ({evidence_reason}){smoke_note}",
                      {cls: ("direct" if cls in direct else "staged") for cls in OP_CLASSES})


def _choose_uniform(requested: str, backend: str, evidence_ok: bool, evidence_reason: str,
                    smoke: Optional[Dict]) -> MpiBuffers:
    """Every class the same way (the rules before per-operation routing, and the forced modes)."""
    picked = _choose_mode(requested, backend, evidence_ok, evidence_reason, smoke)
    return MpiBuffers(picked.requested, picked.mode, picked.emulated, picked.reason, _uniform(picked.mode))


def _choose_mode(requested: str, backend: str, evidence_ok: bool, evidence_reason: str,
                 smoke: Optional[Dict]) -> MpiBuffers:
    if backend == "numpy":
        if requested == "staged":
            return MpiBuffers(requested, "staged", True, "numpy backend: staging emulated with host copies "
                              "(--device-buffers staged; for testing the staged path)")
        return MpiBuffers(requested, "direct", False, "numpy backend: host arrays go to MPI as they are")
    if requested == "staged":
        return MpiBuffers(requested, "staged", False, "--device-buffers staged")
    if requested == "direct":
        if smoke is not None and not smoke.get("ok"):
            raise BackendError(f"--device-buffers direct, but the smoke-test Iallreduce on a device buffer failed "
                               f"({smoke.get('detail')}); use --device-buffers staged or auto")
        return MpiBuffers(requested, "direct", False, "--device-buffers direct" + (
            " (smoke test passed)" if smoke is not None else ""))
    if not evidence_ok:
        return MpiBuffers(requested, "staged", False, f"auto: {evidence_reason}")
    if smoke is None or not smoke.get("ok"):
        why = smoke.get("detail") if smoke is not None else "not run"
        return MpiBuffers(requested, "staged", False, f"auto: {evidence_reason}, but the device-buffer smoke test "
                          f"failed ({why}): staging through host memory")
    return MpiBuffers(requested, "direct", False, f"auto: {evidence_reason}; device-buffer smoke test passed")


#: seconds a failed run's close waits for a collective issued ahead of a step that never ran (OUP's gather):
#: where every rank failed at the same step (a non-finite loss, an injected fault) it completes at once
FAILED_DRAIN_S = 5.0


def _make_tracer(mpi_comm, backend, trace_level: Optional[str]):
    """``(tracer, clock, clock_start)`` of a run: with ``trace_level`` None a tracer of per-step totals and no
    clock alignment (``clock`` ``(0, 0)``, ``clock_start`` None); else the clocks aligned to rank 0's
    (:func:`align_clocks`, collective over ``mpi_comm``), ``clock`` ``(offset_ns, uncertainty_ns)`` and a
    tracer at that level on the aligned clock (synchronizing the device first under CuPy)."""
    if trace_level is None:
        return Tracer(level="step"), (0, 0), None
    clock_start = align_clocks(mpi_comm)
    offset, uncertainty, origin, _ = clock_start
    sync = backend.synchronize if backend.name == "cupy" else None
    tracer = Tracer(level=trace_level, rank=mpi_comm.Get_rank(), clock_offset_ns=offset,
                    origin_ns=origin, synchronize=sync)
    return tracer, (offset, uncertainty), clock_start


@dataclass
class Run:
    """The live objects of a run on one communicator. Collective to build and to :meth:`close`."""

    options: RunOptions
    grid: ProcessGrid
    backend: object
    comm: Collectives
    model: Model
    data: SyntheticData
    trainer: Trainer
    counter: ComputeCounter = field(default=None)

    #: this rank's clock offset to rank 0 and its uncertainty (ns), when traced
    clock: tuple = (0, 0)
    #: what this rank's MPI says about device buffers (:mod:`fourd_mpi.core.gpuaware`)
    gpu_awareness: Optional[GpuAwareness] = None
    #: the buffers MPI gets, and why
    mpi_buffers: Optional[MpiBuffers] = None
    #: seconds to prepare the synthetic batches before the first step, max over ranks
    data_prep_seconds: float = 0.0
    #: the start alignment ``(offset_ns, uncertainty_ns, origin_ns, at_ns)`` (:func:`align_clocks`), when traced
    clock_start: Optional[tuple] = None
    #: the memory model's estimate per rank that admission checked (:mod:`fourd_mpi.run.admission`)
    memory_need: Optional[MemoryNeed] = None
    #: the communicator the run was built on (all its ranks), ``grid.world``; ``grid`` is the 4D grid the step
    #: runs on, ``grid.root`` the run's grid over all axes (pipeline stages: ``data, inter, z, y, x``)
    world: object = None
    #: the node of every world rank and each axis' node span over the whole run (:mod:`fourd_mpi.core.placement`;
    #: pipeline stages: axes ``data, inter, z, y, x``)
    placement: Optional[NodePlacement] = None

    @classmethod
    def build(cls, mpi_comm, options: RunOptions, count_flops: bool = False,
              skip_communication: bool = False, trace_level: Optional[str] = None) -> "Run":
        """Build the run. ``count_flops`` times every GEMM (benchmarks);
        ``skip_communication`` replaces every collective by a local stand-in of the
        right shape (benchmarks of compute alone: the numbers are then meaningless).
        ``trace_level``: record events at that level (:data:`fourd_mpi.trace.events.LEVELS`)
        on clocks aligned to rank 0's; None keeps only per-step totals.
        """
        # the same command line can resolve differently on some ranks (a stale preset table or defaults in an
        # older install on some nodes): compare what it resolved to, before the first other collective here
        check_same(mpi_comm, resolved_settings(options), what="resolved configurations",
                   hint="the same arguments resolved differently: every rank must run the same installation "
                        "of fourd_mpi; a stale copy on some nodes?")
        algorithm = get_algorithm(options.algorithm)
        impl = algorithm.module()
        # the run's grid over the whole world (the pipeline: one more axis, inter) and the 4D grid the step runs
        # on, this rank's part of it (the whole grid, or its pipeline stage); every agreement below spans
        # mpi_comm, the whole run, never only the 4D grid
        grid = ProcessGrid(mpi_comm, algorithm.grid_dims(options)).sub(AXES)
        # where every rank of the run is (the launcher's node assignment), over all the run grid's axes
        placement = grid.root.placement
        awareness = detect_gpu_awareness()
        backend_name = options.backend
        if backend_name == "auto":  # cupy only when every rank has a usable GPU
            backend_name = "cupy" if all(mpi_comm.allgather(cupy_usable())) else "numpy"
        # CuPy starts staged; direct only once detection (and the smoke test) allow it
        first_mode = "staged" if options.device_buffers == "staged" or backend_name == "cupy" else "direct"
        backend = agree(mpi_comm, lambda: make_backend(
            backend_name, parse_dtype(options.dtype), grid.root.local_rank, first_mode, options.tf32))
        evidence = mpi_comm.allgather((awareness.direct_ok, awareness.reason, awareness.cuda_aware,
                                       {cls: r["route"] for cls, r in awareness.routes.items()}))
        evidence_ok = all(ok for ok, _, _, _ in evidence)
        evidence_reason = next((why for ok, why, _, _ in evidence if not ok), evidence[0][1])
        # per operation class: direct only where the rules say so on every rank
        rule_routes = {cls: "direct" if all(r.get(cls) == "direct" for *_, r in evidence) else "staged"
                       for cls in OP_CLASSES}
        override = agree(mpi_comm, lambda: parse_test_routes(os.environ.get(TEST_ROUTES_ENV, "")))
        wants_direct = options.device_buffers == "direct" or (options.device_buffers == "auto" and evidence_ok)
        if backend_name == "cupy" and wants_direct:
            refused = next((why for _, why, aware, _ in evidence if aware is False), None)
            if options.device_buffers == "direct" and refused:  # a device pointer would crash this MPI
                raise BackendError(f"--device-buffers direct, but this MPI cannot take device buffers: {refused}; "
                                   "use --device-buffers staged or auto")
            # a class the library documents as staged: a device pointer crashes it (before the smoke test)
            documented = {cls: "staged" for *_, r in evidence for cls, route in r.items() if route == "staged"}
            check_forced_direct(options.device_buffers, backend_name, documented, evidence_reason, os.environ)
            awareness.smoke_test = smoke_test(grid.cart, backend)
        buffers = agree(mpi_comm, lambda: choose_mpi_buffers(options.device_buffers, backend_name, evidence_ok,
                                                             evidence_reason, awareness.smoke_test, rule_routes,
                                                             override))
        if buffers.mode == "mixed":
            backend.set_routes(buffers.routes)
        else:
            backend.set_staged(buffers.mode == "staged")
        backend.attention, backend.attention_reason = choose_attention(mpi_comm, options, backend)
        # memory admission before anything that grows with the model is allocated (same error on every rank)
        need, _ = admit(mpi_comm, options, backend)
        binding = placement.binding
        progress = agree(mpi_comm, lambda: make_progress(  # auto: the same choice on every rank (placement is global)
            options.progress, options.poll_flops, backend=backend_name, inter_node_axes=placement.inter_node_axes,
            thread_multiple=MPI.Query_thread() >= MPI.THREAD_MULTIPLE, overlap=bool(options.overlap.enabled),
            cpus_per_rank=binding.cpus_per_rank if binding is not None else None))
        tracer, clock, clock_start = _make_tracer(mpi_comm, backend, trace_level)
        comm = Collectives(grid, backend, progress=progress, check_buffers=options.check_buffers,
                           skip_communication=skip_communication, tracer=tracer)
        counter = ComputeCounter(backend=backend, enabled=count_flops, tracer=tracer)

        def allocate_state():
            model, data = impl.build_state(options, grid, backend, counter)
            optimizer = make_optimizer(options.optimizer, model.parameters(), options.lr, empty=backend.empty)
            return model, data, optimizer

        # a MemoryError on any rank (the model counts no temporaries) is one line on every rank
        model, data, optimizer = allocate(mpi_comm, "the model, optimizer state and data", allocate_state, need)
        data_prep = mpi_comm.allreduce(data.prep_seconds, op=MPI.MAX)
        trainer = impl.make_trainer(model, data, comm, optimizer, options)
        return cls(options, grid, backend, comm, model, data, trainer, counter, clock, awareness, buffers, data_prep,
                   clock_start=clock_start, memory_need=need, world=mpi_comm, placement=placement)

    def overlap_notes(self):
        """Overlap options that are no-ops on this grid, with the reason."""
        return self.trainer.overlap.inapplicable(self.options.grid)

    def close(self, failed: bool = False) -> None:
        """Collective over :attr:`world`. The trainer's close first: it may wait for a collective (OUP's
        all-gather issued ahead), which needs the progress engine. ``failed``: the run ended in an exception,
        perhaps on this rank alone, whose peers may never complete that collective: wait at most
        :data:`FAILED_DRAIN_S` for it, then leave it (the rank goes on to abort the job)."""
        closing = getattr(self.trainer, "close", None)
        if closing is not None and failed:
            closing(FAILED_DRAIN_S)
        elif closing is not None:
            closing()
        self.comm.progress.close()
        self.grid.free()
        if self.grid.root is not self.grid:
            self.grid.root.free()
