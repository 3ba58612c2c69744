"""What each collective did, and where it is when a rank waits for it: the records and the watchdog text.

The communication wrapper (:class:`~fourd_mpi.core.collectives.Collectives`) and the pipeline's messages
(:mod:`fourd_mpi.core.p2p`) write one :class:`CommRecord` per operation into the step's records, tagged
with the tracer's current layer and phase; the trace turns each into an event on a comm lane
(:mod:`fourd_mpi.trace.events`). A blocking wait runs under :func:`watch`, so a rank that waits too long
says which collective it waits for (:mod:`fourd_mpi.core.watchdog`). No MPI, no arrays: only times
(``time.perf_counter_ns``) and text. ``core`` sits below ``trace``: the tracer is passed in, never imported.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple


@dataclass
class CommRecord:
    """What one collective did (times from ``time.perf_counter_ns``).

    nbytes: the message size (nccl-tests convention: gathered buffer of an
    all-gather, full input of a reduce-scatter, buffer of an all-reduce).
    issue_ns: entry of the ``MPI_I*`` call; call_ns: its return (the in-flight window in
    which compute can overlap starts here); complete_ns: when its completion
    was first observed (by a progress poll, a test or a wait); wait_start_ns and
    wait_ns: when this rank started blocking in ``wait`` for it, and for how long
    (0: it had completed before the wait). layer, phase: trace codes of where it
    was issued (:mod:`fourd_mpi.trace.events`).
    """

    op: str
    axis: str
    nbytes: int
    issue_ns: int
    complete_ns: int = 0
    call_ns: int = 0
    wait_ns: int = 0
    wait_start_ns: int = 0
    layer: int = 0
    phase: int = 0
    #: staged mode: the device-to-host copy before the issue and the host-to-device copy after
    #: completion (:class:`~fourd_mpi.core.backend.CopySpan`; None on the direct path)
    d2h: Any = None
    h2d: Any = None
    #: position of this collective among the step's collectives (issue order), for diagnostics
    seq: int = 0


def new_record(records: List[CommRecord], tracer, op: str, axis: str, nbytes: int, tag=None) -> CommRecord:
    """Append and return the record of ``op`` over ``axis``, issued now.

    ``tag``: trace ``(layer, phase)`` codes; None: the tracer's current ones (``where_layer``, ``where_phase``).
    """
    layer, phase = tag if tag is not None else (tracer.where_layer, tracer.where_phase)
    record = CommRecord(op=op, axis=axis, nbytes=int(nbytes), issue_ns=time.perf_counter_ns(),
                        layer=layer, phase=phase, seq=len(records))
    records.append(record)
    return record


def note_wait(record: CommRecord, t0: int, t1: int) -> Tuple[int, int]:
    """Store a wait from ``t0`` to ``t1`` (ns) on ``record``; returns the span as counted.

    The wait ends when completion was observed (by this wait or by the progress thread, which may have
    seen it just before the wait began: then no wait).
    """
    if record.complete_ns:
        t1 = min(t1, record.complete_ns)
        t0 = min(t0, t1)
    record.wait_start_ns, record.wait_ns = t0, t1 - t0
    return t0, t1


def describe(tracer, record: Optional[CommRecord]) -> str:
    """Where a collective is: op, axis, step, layer and phase, and its sequence number in the step."""
    if record is None:
        return "a collective"
    layer = tracer.layer_names[record.layer] if 0 < record.layer < len(tracer.layer_names) else "no layer"
    phase = tracer.phase_name(record.phase)
    return (f"{record.op} over {record.axis} ({record.nbytes} bytes), step {tracer.step}, layer {layer} "
            f"({phase}), collective #{record.seq} of the step")


def watch(watchdog, tracer, what):
    """Context of a blocking wait for ``what`` (a :class:`CommRecord` or a text) under ``watchdog``
    (a :class:`~fourd_mpi.core.watchdog.Watchdog`, or None: no watch)."""
    if watchdog is None:
        return contextlib.nullcontext()
    return watchdog.watch(what if isinstance(what, str) else describe(tracer, what))
