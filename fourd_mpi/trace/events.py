"""In-process event recording: what each rank did, when, in which layer and phase.

The schema (vocabularies and record layouts) is documented in
``docs/trace-format.md``; this module is its single source in code. Recording
only: files are :mod:`fourd_mpi.trace.spool` and :mod:`fourd_mpi.trace.writer`, reading is
:mod:`fourd_mpi.trace.read`.

Lanes (``lane`` column) keep the events of one rank on one lane disjoint in time:

==========  ==================================================================
``step``    one span per training step
``layer``   one span per (layer, phase) visit; the model never nests layers
``host``    leaf work of the main thread: compute ops and time blocked in waits
``comm<i>`` collectives from issue to observed completion (blocking ones, the loss
            all-reduce, too), and in staged mode their ``d2h`` copy just before
            and ``h2d`` copy just after, on the same lane; several may be in
            flight, so each (with its copies) goes to the lowest-numbered free
            lane of its step
==========  ==================================================================

Cost model: at level ``step`` an op scope is two ``perf_counter_ns`` calls and two
additions (the per-step compute and wait totals are always kept); at ``op`` level
each op also appends one tuple. Events become a NumPy structured array once per step.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.core.colltable import COLLECTIVES

SCHEMA = "fourd_mpi.trace"
#: 2: ops ``d2h`` and ``h2d`` appended to the vocabulary (codes of version 1 unchanged)
#: 3: op ``residual`` appended; synthetic data is prepared before the steps (metadata ``data``),
#:    so version-3 steps contain no ``data`` op (versions 1-2 timed it inside every step)
#: 4: event columns ``call_ns`` (return of a collective's ``MPI_I*`` call; ``issue_ns`` is its entry) and
#:    ``mpi_ns`` (collectives: host time inside MPI calls during the in-flight window ``[call_ns,
#:    complete_ns]``; host compute events: MPI calls made inside them, e.g. polls between GEMM chunks,
#:    excluded from their compute time); rank-step column ``mpi_ns`` (host time inside MPI calls: issues,
#:    tests, waits). Older traces are read with ``call_ns = issue_ns`` and ``mpi_ns = wait_ns``
#:    (:func:`fourd_mpi.trace.read.load_trace`): they cannot separate the ``I*`` call or the tests from overlap.
#:    ``overlap_ns`` (collectives): host compute time (:data:`COMPUTE_OPS`, MPI calls inside them excluded)
#:    during the in-flight window; older traces get ``complete_ns - issue_ns - wait_ns`` (their definition).
#: 5: phase ``recompute`` appended to the vocabulary (``--recompute``: a block's forward run again inside
#:    the backward pass; codes of version 4 unchanged); metadata keys ``recompute``,
#:    ``hardware_flops_per_step`` and ``activations``
#:    and root attribute ``parts``: 0 = events in this file (the v4 layout), P > 0 = ``/events`` is a
#:    virtual dataset over P part files in ``<name>.parts/`` described by ``/parts`` (:mod:`fourd_mpi.trace.merge`)
#: 6: ops ``send``, ``recv`` and ``bubble`` and axis ``inter`` appended (codes of version 5 unchanged):
#:    ``--algorithm pipeline``'s point-to-point messages between stages (on comm lanes; ``wire_bytes`` = bytes
#:    for a send, 0 for a receive) and its bubbles (host lane: time blocked waiting for another stage's message);
#:    metadata keys ``grid5d`` and ``pipeline``
#: 7: metadata key ``placement`` (the node of every rank from the launcher's assignment, each axis' node span per
#:    rank, the axes that cross nodes: :mod:`fourd_mpi.core.placement`); ``/ranks`` ``node`` is numbered over the
#:    whole run (version 6 pipeline traces numbered nodes within each stage). Older traces: the reader derives the
#:    placement from ``/ranks`` (host names, coordinates)
SCHEMA_VERSION = 7

LEVELS = ("step", "layer", "op")
PHASES = ("none", "forward", "backward", "optimizer", "recompute")
OPS = ("step", "layer", "data", "gemm", "attention", "layernorm", "gelu", "loss", "optimizer",
       "allgather", "reduce_scatter", "allreduce", "wait", "d2h", "h2d", "residual", "send", "recv", "bubble")
AXES = ("none", "data", "z", "y", "x", "inter")
LANE_STEP, LANE_LAYER, LANE_HOST, LANE_COMM0 = 0, 1, 2, 3
COLLECTIVE_OPS = tuple(COLLECTIVES)  # allgather, reduce_scatter, allreduce
#: staging copies of a collective's buffers (staged mode), on its comm lane
COPY_OPS = ("d2h", "h2d")
#: host-lane compute ops (the share of step time "in compute"). ``data`` (synthetic data made inside
#: the step by traces of schema <= 2) is harness work, not compute: it counts as "other"
#: point-to-point messages between pipeline stages (comm lanes, axis ``inter``)
P2P_OPS = ("send", "recv")
#: host-lane time blocked waiting for another pipeline stage's message (its own category, not "wait")
BUBBLE_OPS = ("bubble",)
COMPUTE_OPS = ("gemm", "attention", "layernorm", "gelu", "residual", "loss", "optimizer")

EVENT_DTYPE = np.dtype([
    ("rank", "<u4"), ("step", "<i4"), ("layer", "<i2"), ("phase", "u1"), ("op", "u1"), ("axis", "u1"),
    ("lane", "u1"), ("start_ns", "<i8"), ("end_ns", "<i8"), ("bytes", "<i8"), ("wire_bytes", "<i8"),
    ("flops", "<f8"), ("issue_ns", "<i8"), ("complete_ns", "<i8"), ("wait_ns", "<i8"),
    ("call_ns", "<i8"), ("mpi_ns", "<i8"), ("overlap_ns", "<i8"),
])

#: one record per rank and step (appended after the step's events: its presence marks the step complete)
RANK_STEP_DTYPE = np.dtype([
    ("rank", "<u4"), ("step", "<i4"), ("warmup", "u1"), ("start_ns", "<i8"), ("end_ns", "<i8"),
    ("loss", "<f8"), ("seconds", "<f8"), ("compute_ns", "<i8"), ("wait_ns", "<i8"), ("events", "<i8"),
    ("mpi_ns", "<i8"),
])
#: the event columns that hold codes, and the vocabulary of a trace file (``/vocab``) each code indexes
VOCAB_OF = {"op": "ops", "phase": "phases", "axis": "axes", "layer": "layers"}

OP_CODE = {name: i for i, name in enumerate(OPS)}
PHASE_CODE = {name: i for i, name in enumerate(PHASES)}
AXIS_CODE = {name: i for i, name in enumerate(AXES)}
_COMPUTE_CODES = frozenset(OP_CODE[name] for name in COMPUTE_OPS)


def lane_name(code: int) -> str:
    return ("step", "layer", "host")[code] if code < LANE_COMM0 else f"comm{code - LANE_COMM0}"


def align_clocks(comm, rounds: int = 8, clock=time.perf_counter_ns):
    """Offsets of every rank's clock to rank 0's at the start of a run (Cristian's algorithm,
    :func:`fourd_mpi.trace.clocks.measure_offsets`).

    Returns ``(offset_ns, uncertainty_ns, origin_ns, at_ns)`` for this rank: an aligned time is
    ``t - offset_ns - origin_ns`` (ns since the run's origin, taken on rank 0 after a barrier); the
    uncertainty is half the best round trip; ``at_ns``: this rank's clock when the offset was
    measured (the start point of the drift model). Collective over ``comm``.
    """
    from fourd_mpi.trace.clocks import measure_offsets

    offset, uncertainty, at = measure_offsets(comm, rounds, clock)
    comm.Barrier()
    origin = comm.bcast(clock() if comm.Get_rank() == 0 else None, root=0)
    return offset, uncertainty, origin, at


class _Span:
    """A context manager that records one host or layer span."""

    __slots__ = ("tracer", "op", "lane", "layer", "phase", "saved", "t0", "flops", "mpi")

    def __init__(self, tracer, op, lane, layer=0, phase=0):
        self.tracer, self.op, self.lane, self.layer, self.phase = tracer, op, lane, layer, phase
        self.flops = 0.0
        self.mpi = 0  # ns inside MPI calls made within this span (polls between GEMM chunks)

    def __enter__(self):
        tr = self.tracer
        if tr.ranges is not None:  # NVTX (--nvtx): the same scope as a range, popped in __exit__
            tr.ranges.push(*tr.range_name(self))
        if self.lane == LANE_LAYER:
            self.saved = (tr.where_layer, tr.where_phase)
            tr.where_layer, tr.where_phase = self.layer, self.phase
        else:
            tr._open = self
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        tr = self.tracer
        if tr.ranges is not None:
            tr.ranges.pop()  # also when an exception leaves the scope: ranges stay balanced
        if tr.synchronize is not None and tr.keep_ops and self.lane == LANE_HOST:
            tr.synchronize()
        t1 = time.perf_counter_ns()
        if self.lane == LANE_LAYER:
            if tr.keep_layers:
                tr.events.append((tr.rank, tr.step, self.layer, self.phase, OP_CODE["layer"], 0, LANE_LAYER,
                                  self.t0, t1, 0, 0, 0.0, 0, 0, 0, 0, 0, 0))
            tr.where_layer, tr.where_phase = self.saved
        else:
            tr._open = None
            tr.compute_ns += t1 - self.t0 - self.mpi
            if tr.keep_ops:
                tr.events.append((tr.rank, tr.step, tr.where_layer, tr.where_phase, self.op, 0, LANE_HOST,
                                  self.t0, t1, 0, 0, self.flops, 0, 0, 0, 0, self.mpi, 0))
        return False


class Tracer:
    """Collects one rank's events of the current step.

    ``layers``: the vocabulary of layer names (index 0 is the empty name, "no
    layer"); ``level``: one of :data:`LEVELS`. The model opens layer scopes
    (:meth:`layer`) and op scopes (:meth:`op`); GEMMs report through
    :meth:`compute`; collectives are turned into events from their records at the
    end of the step (:meth:`end_step`). Host-lane ops never nest: a GEMM inside
    an op scope (attention) adds its FLOPs to the scope instead.
    """

    def __init__(self, layers: Sequence[str] = (), level: str = "op", rank: int = 0,
                 clock_offset_ns: int = 0, origin_ns: int = 0, synchronize=None):
        if level not in LEVELS:
            raise ValueError(f"unknown trace level {level!r}: choose one of {', '.join(LEVELS)}")
        self.set_layers(layers)
        self.rank = rank
        self.shift_ns = clock_offset_ns + origin_ns
        #: GPU backends: called before each host timestamp of an op (op level only), so that
        #: asynchronous kernels are timed where they run
        self.synchronize = synchronize
        self.set_level(level)
        self.step = -1
        self.where_layer = 0
        self.where_phase = 0
        self._open: Optional[_Span] = None
        self.events: list = []
        self._deferred: list = []
        self.compute_ns = 0
        self.wait_ns = 0
        self.mpi_ns = 0
        self.bubble_ns = 0
        self.mpi_spans: list = []
        #: where each comm lane's last collective ended (aligned clock), over the steps so far
        self._comm_lane_ends: list = []
        #: NVTX ranges (:class:`fourd_mpi.trace.nvtx.Ranges`, ``--nvtx``) or None
        self.ranges = None

    def range_name(self, span: "_Span") -> Tuple[str, str]:
        """``(kind, name)`` of the NVTX range of a scope: ``layer NAME (PHASE)`` or ``op NAME``."""
        if span.lane == LANE_LAYER:
            return "layer", f"layer {self.layer_names[span.layer]} ({PHASES[span.phase]})"
        return "op", f"op {OPS[span.op]}"

    def set_level(self, level: str) -> None:
        """Change what is kept from the next event on (benchmarks alternate levels in one run)."""
        self.level = level
        self.keep_layers = LEVELS.index(level) >= 1
        self.keep_ops = level == "op"

    # vocabulary -------------------------------------------------------------
    def set_layers(self, layers: Sequence[str]) -> None:
        """The layer vocabulary (the model's layer names; code 0 is "no layer")."""
        self.layer_names: List[str] = [""] + [name for name in layers if name]
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}

    def layer_index(self, name: str) -> int:
        return self._layer_index[name]

    def phase_name(self, code: int) -> str:
        """The name of phase ``code`` (:data:`PHASES`; an unknown code as its number)."""
        return PHASES[code] if 0 <= code < len(PHASES) else str(code)

    def tag(self, layer: str, phase: str):
        """``(layer, phase)`` codes for :meth:`Collectives` records issued out of program order."""
        return self._layer_index.get(layer, 0), PHASE_CODE.get(phase, 0)

    # scopes -----------------------------------------------------------------
    def layer(self, name: str, phase: str) -> _Span:
        """Scope of one layer's forward or backward: sets the layer and phase of everything inside."""
        return _Span(self, 0, LANE_LAYER, self._layer_index[name], PHASE_CODE[phase])

    def enter_phase(self, phase: str) -> None:
        """From here on, work outside any layer scope belongs to ``phase``."""
        self.where_layer, self.where_phase = 0, PHASE_CODE[phase]
        if self.ranges is not None:  # the previous phase's range ends here: phases follow one another
            self.ranges.pop_to(1)
            self.ranges.push("phase", f"phase {phase}")

    def op(self, name: str) -> _Span:
        """Scope of one host compute op (``attention``, ``gelu``, ...). Must not contain a wait."""
        if self.synchronize is not None and self.keep_ops:
            self.synchronize()
        return _Span(self, OP_CODE[name], LANE_HOST)

    def compute(self, kind: str, t0: int, t1: int, flops: float, mpi_ns: int = 0) -> None:
        """A GEMM ran from ``t0`` to ``t1`` (``perf_counter_ns``), ``mpi_ns`` of it inside MPI calls
        (progress polls between its chunks: :meth:`mpi_call` counted them; not compute)."""
        if self._open is not None:
            self._open.flops += flops
            return
        self.compute_ns += t1 - t0 - mpi_ns
        if self.keep_ops:
            self.events.append((self.rank, self.step, self.where_layer, self.where_phase,
                                OP_CODE.get(kind, OP_CODE["gemm"]), 0, LANE_HOST, t0, t1, 0, 0, flops,
                                0, 0, 0, 0, mpi_ns, 0))

    def compute_deferred(self, kind: str, watch, flops: float) -> None:
        """A GEMM timed by CUDA events (``watch``), not synchronized: its duration joins the step's
        compute total at :meth:`end_step`, after the step synchronized the device (levels below
        ``op``; at level ``op`` GEMMs are bracketed by synchronizations and reported by :meth:`compute`)."""
        if self._open is not None:
            self._open.flops += flops
            return
        self._deferred.append(watch)

    def blocked(self, t0: int, t1: int) -> None:
        """The main thread was blocked in a wait from ``t0`` to ``t1`` (MPI time, and exposed communication)."""
        self.wait_ns += t1 - t0
        self.mpi_call(t0, t1)

    def bubble(self, t0: int, t1: int, nbytes: int = 0) -> None:
        """The main thread was blocked from ``t0`` to ``t1`` waiting for another pipeline stage's message (a
        bubble: MPI time, not exposed communication). At level ``op`` one host-lane ``bubble`` event (axis
        ``inter``)."""
        self.bubble_ns += t1 - t0
        self.mpi_call(t0, t1)
        if self.keep_ops:
            self.events.append((self.rank, self.step, self.where_layer, self.where_phase, OP_CODE["bubble"],
                                AXIS_CODE["inter"], LANE_HOST, t0, t1, nbytes, 0, 0.0, 0, 0, 0, 0, t1 - t0, 0))

    def mpi_call(self, t0: int, t1: int) -> None:
        """The main thread was inside an MPI call (``MPI_I*``, ``Test``/``Testsome``, ``Wait``) from
        ``t0`` to ``t1``. Kept for every step at every level: the overlap of each collective is its
        in-flight time outside these spans (:meth:`end_step`)."""
        self.mpi_ns += t1 - t0
        self.mpi_spans.append((t0, t1))
        if self._open is not None:
            self._open.mpi += t1 - t0

    # steps ------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self.ranges is not None:
            self.ranges.unwind()  # whatever a step that raised left open
            self.ranges.push("step", f"step {step}")
        self.step = step
        self.events = []
        self._deferred = []
        self.compute_ns = self.wait_ns = self.mpi_ns = self.bubble_ns = 0
        self.mpi_spans = []
        self.where_layer = self.where_phase = 0

    def end_step(self, t_start: int, t_end: int, records: Sequence, group_sizes) -> np.ndarray:
        """This step's events as an :data:`EVENT_DTYPE` array on the aligned clock.

        ``records``: the step's :class:`~fourd_mpi.core.commlog.CommRecord` list;
        ``group_sizes``: axis name -> communicator size (for ``wire_bytes``).
        """
        if self.ranges is not None:
            self.ranges.unwind()  # the step's range and its last phase's
        if self._deferred:  # event-timed GEMMs (GPU, below level op): the device has finished them
            self.compute_ns += sum(w.elapsed_ns() for w in self._deferred)
            self._deferred = []
        rows = [(self.rank, self.step, 0, 0, OP_CODE["step"], 0, LANE_STEP, t_start, t_end, 0, 0, 0.0,
                 0, 0, 0, 0, 0, 0)]
        rows += self.events
        out = np.array(rows, dtype=EVENT_DTYPE)
        out["start_ns"] -= self.shift_ns
        out["end_ns"] -= self.shift_ns
        if self.keep_ops and records:
            out = np.concatenate([out, *self._collective_rows(records, group_sizes)])
        return out

    def _compute_inside(self, start, end) -> np.ndarray:
        """Host compute time (compute-op events of this step, less the MPI calls made inside them)
        within each window ``[start[i], end[i]]`` (``perf_counter_ns``, before alignment)."""
        compute = [(e[7], e[8]) for e in self.events if e[6] == LANE_HOST and e[4] in _COMPUTE_CODES]
        if not compute:
            return np.zeros(len(start), dtype=np.int64)
        inside = time_inside(compute, start, end)
        spans = np.asarray(compute, dtype=np.int64)
        spans = spans[np.argsort(spans[:, 0])]
        polls = [(a, b) for a, b in self.mpi_spans  # MPI calls made inside a compute event
                 if (i := np.searchsorted(spans[:, 0], a, side="right") - 1) >= 0 and b <= spans[i, 1]]
        return inside - time_inside(polls, start, end) if polls else inside

    def _comm_lanes(self, begins, ends) -> list:
        """The comm lane (from 0) of each unit ``[begins[i], ends[i]]``, in order of start: the lowest-numbered
        free lane; lanes still busy from the previous step stay so (a collective issued at the end of a step
        for the next one, OUP, starts before the previous step's last collectives end). More lanes than the
        one-byte lane column holds: ``RuntimeError``."""
        lanes, free_at = [], list(self._comm_lane_ends)
        for begin, end in zip(begins, ends):
            for lane, free in enumerate(free_at):
                if free <= begin:
                    break
            else:
                lane = len(free_at)
                free_at.append(0)
            free_at[lane] = end
            lanes.append(lane)
        self._comm_lane_ends = list(free_at)
        if LANE_COMM0 + len(free_at) - 1 > 255:  # the lane column is one byte
            raise RuntimeError(f"{len(free_at)} collectives in flight at once: more than the trace's comm lanes")
        return lanes

    def _collective_rows(self, records, group_sizes) -> list:
        """Collective events (one per record, on comm lanes), their staging copies (same lane)
        and wait events (host lane), vectorized."""
        for r in records:  # GPU copies: the step has synchronized, their events can be read now
            if r.h2d is not None:
                r.h2d.resolve()
        cols = np.array([(r.issue_ns, r.complete_ns, r.nbytes, r.wait_ns, r.wait_start_ns, r.layer, r.phase,
                          OP_CODE[r.op], AXIS_CODE[r.axis], group_sizes[r.axis],
                          *(_copy_cols(r.d2h)), *(_copy_cols(r.h2d)), r.call_ns or r.issue_ns, 0)
                         for r in records], dtype=np.int64)
        # host time inside MPI calls during each in-flight window [return of the I* call, completion],
        # and host compute time (compute ops less the MPI polls inside them) in the same window
        call = np.maximum(cols[:, 16], cols[:, 0])
        window_end = np.maximum(cols[:, 1], call)
        cols[:, 17] = time_inside(self.mpi_spans, call, window_end)
        overlap = self._compute_inside(call, window_end)
        cols[:, (0, 1, 4, 16)] -= self.shift_ns  # issue, completion, wait start, call return: aligned clock
        for c in (10, 13):  # copy spans present (bytes > 0): to the aligned clock
            present = cols[:, c + 2] > 0
            cols[present, c] -= self.shift_ns
            cols[present, c + 1] -= self.shift_ns
        issue = cols[:, 0]
        complete = np.maximum(cols[:, 1], issue)  # never observed complete (0): a zero-length span
        has_d2h, has_h2d = cols[:, 12] > 0, cols[:, 15] > 0
        # a collective and its copies occupy one lane from the copy-out to the copy-in
        unit_start = np.where(has_d2h, np.minimum(cols[:, 10], issue), issue)
        h2d_start = np.maximum(cols[:, 13], complete)
        h2d_end = np.maximum(cols[:, 14], h2d_start)
        unit_end = np.where(has_h2d, h2d_end, complete)
        order = np.argsort(unit_start, kind="stable")
        cols, issue, complete = cols[order], issue[order], complete[order]
        has_d2h, has_h2d, h2d_start, h2d_end = has_d2h[order], has_h2d[order], h2d_start[order], h2d_end[order]
        lane_codes = LANE_COMM0 + np.array(self._comm_lanes(unit_start[order].tolist(), unit_end[order].tolist()))
        group = cols[:, 9]
        coll = np.zeros(len(cols), dtype=EVENT_DTYPE)
        coll["rank"] = self.rank
        coll["step"], coll["layer"], coll["phase"] = self.step, cols[:, 5], cols[:, 6]
        coll["op"], coll["axis"], coll["lane"] = cols[:, 7], cols[:, 8], lane_codes
        coll["start_ns"], coll["end_ns"], coll["bytes"] = issue, complete, cols[:, 2]
        for name, kind in COLLECTIVES.items():  # S*k*(p-1)//p in integers, per kind
            of_kind = cols[:, 7] == OP_CODE[name]
            coll["wire_bytes"][of_kind] = kind.wire_bytes(cols[of_kind, 2], group[of_kind])
        sends = cols[:, 7] == OP_CODE["send"]  # point to point: a send puts its bytes on the wire, a receive none
        coll["wire_bytes"][sends] = cols[sends, 2]
        coll["issue_ns"], coll["complete_ns"], coll["wait_ns"] = issue, complete, cols[:, 3]
        coll["call_ns"] = np.minimum(np.maximum(cols[:, 16], issue), complete)
        coll["mpi_ns"] = cols[:, 17]
        coll["overlap_ns"] = overlap[order]
        out = [coll]
        for name, has, start, end, nbytes in (
                ("d2h", has_d2h, cols[:, 10], np.minimum(cols[:, 11], issue), cols[:, 12]),
                ("h2d", has_h2d, h2d_start, h2d_end, cols[:, 15])):
            if has.any():
                copies = np.zeros(int(has.sum()), dtype=EVENT_DTYPE)
                copies["rank"] = self.rank
                copies["step"], copies["layer"], copies["phase"] = self.step, cols[has, 5], cols[has, 6]
                copies["op"], copies["axis"], copies["lane"] = OP_CODE[name], cols[has, 8], lane_codes[has]
                copies["start_ns"], copies["end_ns"], copies["bytes"] = start[has], end[has], nbytes[has]
                out.append(copies)
        blocked = cols[:, 3] > 0
        waits = np.zeros(int(blocked.sum()), dtype=EVENT_DTYPE)
        w = cols[blocked]
        waits["rank"] = self.rank
        waits["step"], waits["layer"], waits["phase"] = self.step, w[:, 5], w[:, 6]
        waits["op"], waits["axis"], waits["lane"] = OP_CODE["wait"], w[:, 8], LANE_HOST
        waits["start_ns"], waits["end_ns"], waits["bytes"] = w[:, 4], w[:, 4] + w[:, 3], w[:, 2]
        out.append(waits)
        return out


def time_inside(spans, start, end) -> np.ndarray:
    """Nanoseconds of the intervals ``spans`` (``[(t0, t1), ...]``) inside each window ``[start[i], end[i]]``.

    Overlapping spans are merged first, so no instant counts twice. With ``F(t)`` the span time
    before ``t`` (a piecewise-linear, non-decreasing function), the answer is ``F(end) - F(start)``.
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    if len(spans) == 0:
        return np.zeros(len(start), dtype=np.int64)
    arr = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    merged = [list(arr[0])]
    for t0, t1 in arr[1:].tolist():
        if t0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t1)
        else:
            merged.append([t0, t1])
    m = np.array(merged, dtype=np.int64)
    starts, lengths = m[:, 0], m[:, 1] - m[:, 0]
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    def covered(t):
        i = np.searchsorted(starts, t, side="right") - 1
        safe = np.maximum(i, 0)
        value = before[safe] + np.clip(t - starts[safe], 0, lengths[safe])
        return np.where(i >= 0, value, 0)

    return np.maximum(covered(end) - covered(start), 0)


def _copy_cols(span):
    """``(start_ns, end_ns, bytes)`` of a staging copy (zeros when there was none)."""
    if span is None:
        return 0, 0, 0
    return span.start_ns, span.end_ns, max(1, span.nbytes)
