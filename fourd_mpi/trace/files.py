"""The files of a run and the small I/O under them: names and paths (run id, trace, spool, parts
directory), the rank and step record types of a trace, atomic JSON, one-line I/O errors, and opening a
trace for reading where the file system refuses locks.

The file layout is documented in ``docs/trace-format.md``; :mod:`fourd_mpi.trace` says which module
writes, merges, recovers and reads it.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import secrets
import time
from typing import Optional

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.util.files import NO_LOCK_ERRNOS, SPOOL_SUFFIX, remove_quietly

RANK_DTYPE = np.dtype([
    ("rank", "<u4"), ("hostname", "S64"), ("node", "<u4"), ("local_rank", "<u4"),
    ("coord_data", "<u4"), ("coord_z", "<u4"), ("coord_y", "<u4"), ("coord_x", "<u4"),
    ("clock_offset_ns", "<i8"), ("clock_uncertainty_ns", "<i8"), ("pid", "<u4"),
    ("event_offset", "<i8"), ("event_count", "<i8"),
    # schema 4: the drift model of fourd_mpi.trace.clocks (NaN: no end alignment, e.g. a recovered run)
    ("clock_drift_ppm", "<f8"), ("clock_residual_ns", "<i8"),
])
STEP_DTYPE = np.dtype([
    ("step", "<i4"), ("warmup", "u1"), ("loss", "<f8"), ("seconds", "<f8"),
    ("start_ns", "<i8"), ("end_ns", "<i8"), ("compute_ns_max", "<i8"), ("wait_ns_max", "<i8"),
])
#: events per MPI message and per HDF5 write during the merge
MERGE_CHUNK = 1 << 18


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def new_run_id(label: Optional[str] = None) -> str:
    """``YYYYmmdd-HHMMSS[-label]-xxxxxx``: sortable by time, a random suffix against collisions."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return "-".join([stamp] + ([label] if label else []) + [secrets.token_hex(3)])


def check_name(kind: str, name: str) -> str:
    """Run ids and labels become file names: letters, digits, ``._-`` only."""
    if not name or not all(c.isalnum() or c in "._-" for c in name) or name.startswith((".", "-")):
        raise TraceError(f"invalid {kind} {name!r}: use letters, digits, '.', '_' and '-' "
                         "(not starting with '.' or '-')")
    return name


#: characters that file names derived from a run id add to it, at most: ``.RUN.parts.tmp-PID-HEX``
#: (a staged parts directory) with a 10-digit PID and 6 hex digits
RUN_ID_OVERHEAD = len(".") + len(".parts.tmp-") + 10 + len("-") + 6
#: characters a generated run id adds to its label: ``YYYYmmdd-HHMMSS-LABEL-xxxxxx``
LABEL_OVERHEAD = len("20261125-181139--") + 6


def check_name_fits(results_dir: str, kind: str, name: str, overhead: int = RUN_ID_OVERHEAD) -> str:
    """``name`` (a run id or label) short enough for the file names made of it on the file system of
    ``results_dir`` (``NAME_MAX``, from ``os.pathconf`` of its nearest existing directory; 255 if unknown):
    checked before the first step, so that a long id does not fail only at the merge."""
    from fourd_mpi.util.files import nearest_directory

    try:
        limit = os.pathconf(nearest_directory(results_dir or "."), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(name.encode()) + overhead > limit:
        raise TraceError(f"{kind} of {len(name.encode())} characters is too long: the file names made of it "
                         f"must fit the file system's limit of {limit} (NAME_MAX): "
                         f"give at most {limit - overhead} characters")
    return name


def trace_paths(results_dir: str, run_id: str):
    """``(trace file, spool directory)`` of a run."""
    return (os.path.join(results_dir, run_id + ".h5"), os.path.join(results_dir, run_id + SPOOL_SUFFIX))


def rank_stem(rank: int) -> str:
    """``rankNNNNNN``: the stem of a rank's spool files."""
    return f"rank{rank:06d}"


def rank_stem_path(spool_dir: str, rank: int) -> str:
    """``<spool>/rankNNNNNN`` (add ``.json``, ``.events``, ``.steps``, ``.failed.json``)."""
    return os.path.join(spool_dir, rank_stem(rank))


def rank_events_path(spool_dir: str, rank: int) -> str:
    """``<spool>/rankNNNNNN.events``."""
    return os.path.join(spool_dir, rank_stem(rank)) + ".events"


def write_json_atomic(path: str, payload) -> None:
    """Write ``path`` as ``<path>.tmp-<pid>`` renamed into place; on any error the temporary file is
    removed (a full disk leaves no 0-byte ``.tmp-`` file) and the error is raised."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def io_error_text(exc: OSError) -> str:
    """One line for an I/O error: ``No space left on device (ENOSPC)``, without HDF5's multi-line detail."""
    code = errno.errorcode.get(exc.errno or 0)
    text = os.strerror(exc.errno) if exc.errno else " ".join(str(exc).split())
    return f"{text} ({code})" if code else text


def open_h5_read(path: str):
    """``h5py.File(path, "r")``; where the file system refuses locks (HDF5 takes a ``flock`` on every
    open and fails with ENOLCK there; its ``HDF5_USE_FILE_LOCKING=BEST_EFFORT`` forgives only ENOSYS),
    opened again without the lock: our traces are published whole (``link``/``rename``), so a reader
    never meets one being written, which is all that lock is for. Anything but a regular file (a
    directory, a FIFO whose open would wait for a writer forever) is refused first with one line
    (:class:`TraceError`)."""
    import h5py

    from fourd_mpi.util.files import check_regular_file

    check_regular_file(path, "trace file", TraceError)
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if exc.errno not in NO_LOCK_ERRNOS:
            raise
    return h5py.File(path, "r", locking=False)


def sort_events(events: np.ndarray) -> np.ndarray:
    """Events of one rank in time order (stable: a step span precedes what starts with it)."""
    start = events["start_ns"]
    if len(start) < 2 or (start[1:] >= start[:-1]).all():  # already in order: no copy
        return events
    order = np.argsort(start, kind="stable")
    raw = np.dtype((np.void, events.dtype.itemsize))  # gather whole records as bytes: no per-field work
    return np.ascontiguousarray(events).view(raw)[order].view(events.dtype)


#: the file rank 0 writes into the spool the moment the run's final merge has published its trace (in the same
#: signal-deferred stretch as the publication): from then on the spool is left over, whatever interrupts the
#: ranks before they remove it (:func:`fourd_mpi.trace.spool.published_trace`)
PUBLISHED = "published.json"

PARTS_SUFFIX = ".parts"


def parts_dir_of(trace_path: str) -> str:
    """``run.h5`` -> ``run.parts`` (the part files' directory, next to the trace)."""
    stem = trace_path[:-3] if trace_path.endswith(".h5") else trace_path
    return stem + PARTS_SUFFIX
