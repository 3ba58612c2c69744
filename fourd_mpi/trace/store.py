"""Trace files: per-rank spool files during a run, the merged HDF5 trace, recovery.

pip's h5py has no parallel HDF5 (docs/design.md section 4), so:

1. During the run each rank appends its events and one step record per step to
   its own files in the *spool directory* ``<results>/<run-id>.ranks/`` with
   plain ``os.write`` on ``O_APPEND`` descriptors: the events of a step first, then
   its step record, so a step record on disk means the step's events are all
   there. A rank killed at any point loses at most the step in flight (the
   records are fixed-size; a torn last record is cut off when read).
2. At the end, the ranks send their events over MPI to the lowest rank of their
   group of ``--trace-group-size`` consecutive ranks (nobody reads another rank's
   files); with one group rank 0 writes ``<results>/<run-id>.h5`` itself, with several
   each group writes a part file and rank 0 a top-level file that binds them
   (:mod:`fourd_mpi.trace.merge`). The trace is written under a temporary name, then
   published with ``link`` (never overwrites; ``--force``: rename over it). Only then
   is the spool removed.
3. After a crash, :func:`recover` builds a ``partial`` (or ``failed``) trace from
   the spool: the steps every rank completed, group by group.

The spool directory is created by rank 0 and written by every rank, so the
results directory must be on a file system all ranks see (as on clusters).

The file layout is documented in ``docs/trace-format.md``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import json
import os
import secrets
import socket
import time
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import AXES, EVENT_DTYPE, LEVELS, OPS, PHASES, RANK_STEP_DTYPE, SCHEMA, SCHEMA_VERSION

SPOOL_SUFFIX = ".ranks"
RUN_META = "run.json"
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


def trace_paths(results_dir: str, run_id: str):
    """``(trace file, spool directory)`` of a run."""
    return (os.path.join(results_dir, run_id + ".h5"), os.path.join(results_dir, run_id + SPOOL_SUFFIX))


def _rank_stem(rank: int) -> str:
    return f"rank{rank:06d}"


def rank_stem_path(spool_dir: str, rank: int) -> str:
    """``<spool>/rankNNNNNN`` (add ``.json``, ``.events``, ``.steps``, ``.failed.json``)."""
    return os.path.join(spool_dir, _rank_stem(rank))


def rank_events_path(spool_dir: str, rank: int) -> str:
    """``<spool>/rankNNNNNN.events``."""
    return os.path.join(spool_dir, _rank_stem(rank)) + ".events"


def _write_json_atomic(path: str, payload) -> None:
    """Write ``path`` as ``<path>.tmp-<pid>`` renamed into place; on any error the temporary file is
    removed (a full disk leaves no 0-byte ``.tmp-`` file) and the error is raised."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def io_error_text(exc: OSError) -> str:
    """One line for an I/O error: ``No space left on device (ENOSPC)``, without HDF5's multi-line detail."""
    code = errno.errorcode.get(exc.errno or 0)
    text = os.strerror(exc.errno) if exc.errno else " ".join(str(exc).split())
    return f"{text} ({code})" if code else text


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def prepare_spool(results_dir: str, run_id: str, force: bool, run_meta: Dict) -> str:
    """Rank 0: check the destination and create the spool directory with ``run.json``.

    Raises :class:`TraceError` for an unwritable results directory, an existing
    trace (without ``force``) or a run id in use by another job.
    """
    trace_path, spool_dir = trace_paths(results_dir, run_id)
    try:
        os.makedirs(results_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the directory, or a parent of it, is a file
        blocker = results_dir
        while os.path.dirname(blocker) not in ("", blocker) and not os.path.exists(blocker):
            blocker = os.path.dirname(blocker)
        raise TraceError(f"cannot create the results directory {results_dir}: {blocker} is a file, not a "
                         "directory (give --results-dir a directory)") from None
    except OSError as exc:
        raise TraceError(f"cannot create the results directory {results_dir}: {exc.strerror}") from None
    if not os.access(results_dir, os.W_OK | os.X_OK):
        raise TraceError(f"the results directory {results_dir} is not writable")
    if os.path.isdir(trace_path):  # --force replaces a file: found only at publish, after every step
        raise TraceError(f"{trace_path} is a directory, not a trace file: remove it or choose another --run-id")
    if os.path.exists(trace_path) and not force:
        raise TraceError(f"{trace_path} already exists: choose another --run-id, or --force to replace it")
    from fourd_mpi.trace.merge import parts_dir_of

    if os.path.exists(parts_dir_of(trace_path)) and not force:  # the parts of a trace of that name
        raise TraceError(f"{parts_dir_of(trace_path)} already exists: choose another --run-id, or --force to "
                         "replace it")
    try:
        os.mkdir(spool_dir)  # atomic: two jobs with one run id cannot both get here
    except FileExistsError:
        raise TraceError(f"run id {run_id} is in use: {spool_dir} exists (another job, or a crashed run: "
                         f"'fourd-mpi trace recover {spool_dir}')") from None
    except OSError as exc:
        raise TraceError(f"cannot create {spool_dir}: {exc.strerror}") from None
    try:
        _write_json_atomic(os.path.join(spool_dir, RUN_META), dict(run_meta, trace_path=trace_path))
    except OSError as exc:
        try:
            os.rmdir(spool_dir)
        except OSError:
            pass
        raise TraceError(f"cannot write {os.path.join(spool_dir, RUN_META)}: {io_error_text(exc)}") from None
    return spool_dir


#: bytes reserved per rank for its failure report (``rankNNNNNN.reserve``), so that a rank can still
#: record why it stops when the disk is full
RESERVE_BYTES = 4096
#: bytes per read when the spool files are copied or read back through their descriptors
_COPY_BLOCK = 1 << 24


class RankSpool:
    """One rank's append-only spool files: ``rankNNNNNN.events``, ``.steps``, ``.json``, ``.reserve``.

    Liveness: the rank holds an exclusive ``fcntl`` (POSIX) lock on its ``.events`` file for as long as
    the spool is open; :func:`recover` refuses a spool whose lock is held (a live run). The lock goes
    away with the process (kill -9 included). On file systems without POSIX locks ``locked`` is False
    and :func:`recover` falls back to the pid on the same host.

    The record files stay open read-write for the whole run and are read back through their
    descriptors (:meth:`read_events`, :meth:`read_steps`): the data survives the deletion of the spool
    directory, which :meth:`append` notices (link count 0) and repairs by re-creating the files from
    the descriptors (:attr:`recreated` says when). A failed write (disk full, I/O error) is cut back
    to the last whole step (``ftruncate``: no torn record stays behind), kept in :attr:`error`, and
    ends the spooling; the caller decides, with the other ranks, to stop.
    """

    def __init__(self, spool_dir: str, rank: int, rank_meta: Dict):
        self.dir = spool_dir
        self.rank = rank
        stem = os.path.join(spool_dir, _rank_stem(rank))
        self.events_path, self.steps_path = stem + ".events", stem + ".steps"
        self.meta_path, self.failed_path, self.reserve_path = stem + ".json", stem + ".failed.json", stem + ".reserve"
        self.rank_meta = dict(rank_meta)
        self._run_meta = None  # rank 0: the bytes of run.json, to re-create it
        self._events_fd = self._steps_fd = None
        self.events_written = 0
        self._sizes = [0, 0]  # bytes of whole steps in .events and .steps
        self.steps_written = 0
        #: the first write error (one line), None while the spool is healthy
        self.error: Optional[str] = None
        #: notes of re-creations after the spool files were deleted
        self.recreated: List[str] = []
        self.locked = False
        if rank == 0:
            try:
                with open(os.path.join(spool_dir, RUN_META), "rb") as fh:
                    self._run_meta = fh.read()
            except OSError:
                pass
        try:
            self._open_files()
        except OSError as exc:
            self.close()
            if not isinstance(exc, FileExistsError):  # the files are this rank's own: leave none behind
                for path in (self.events_path, self.steps_path, self.meta_path, self.reserve_path):
                    _remove_quietly(path)
            raise TraceError(f"rank {rank} cannot write its trace files in {spool_dir}: {io_error_text(exc)}") from None

    def _open_files(self) -> None:
        """Create this rank's files (never reusing existing ones) and take the liveness lock."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND
        meta = dict(self.rank_meta)
        self._events_fd = os.open(self.events_path, flags, 0o644)
        self._steps_fd = os.open(self.steps_path, flags, 0o644)
        try:
            fcntl.lockf(self._events_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked = True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise
            self.locked = False  # ENOLCK, EOPNOTSUPP...: no POSIX locks on this file system
            meta["lock"] = False
        _write_json_atomic(self.meta_path, meta)
        fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, b" " * RESERVE_BYTES)
        finally:
            os.close(fd)

    def append(self, events: np.ndarray, rank_step: np.ndarray) -> None:
        """One step: its events, then its step record (the record marks the step complete).

        Never raises for I/O: a failure is cut back to the last whole step and kept in :attr:`error`;
        later calls do nothing.
        """
        if self.error is not None:
            return
        try:
            self._ensure_linked()
            _write_all(self._events_fd, np.ascontiguousarray(events, dtype=EVENT_DTYPE).tobytes())
            _write_all(self._steps_fd, np.ascontiguousarray(rank_step, dtype=RANK_STEP_DTYPE).tobytes())
        except OSError as exc:
            self._cut_back()
            self.error = f"rank {self.rank} cannot write its trace files in {self.dir}: {io_error_text(exc)}"
            return
        self.events_written += len(events)
        self.steps_written += len(rank_step)
        self._sizes = [self._sizes[0] + len(events) * EVENT_DTYPE.itemsize,
                       self._sizes[1] + len(rank_step) * RANK_STEP_DTYPE.itemsize]

    def _cut_back(self) -> None:
        """Truncate both record files to their whole steps (frees what a failed write left behind)."""
        for fd, size in zip((self._events_fd, self._steps_fd), self._sizes):
            if fd is not None:
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass

    def lost(self) -> bool:
        """True if this rank's spool files were deleted (or the spool is closed)."""
        if self._events_fd is None:
            return False
        return any(os.fstat(fd).st_nlink == 0 for fd in (self._events_fd, self._steps_fd))

    def _ensure_linked(self) -> None:
        """If the spool files were deleted (the directory removed mid-run), re-create them from the open
        descriptors, with ``rankNNNNNN.json`` (and ``run.json`` on rank 0). Raises OSError if it cannot."""
        if not self.lost():
            return
        old = (self._events_fd, self._steps_fd)
        os.makedirs(self.dir, exist_ok=True)
        if self._run_meta is not None and not os.path.exists(os.path.join(self.dir, RUN_META)):
            tmp = os.path.join(self.dir, f"{RUN_META}.tmp-{os.getpid()}")
            try:
                with open(tmp, "wb") as fh:
                    fh.write(self._run_meta)
                os.replace(tmp, os.path.join(self.dir, RUN_META))
            except BaseException:
                _remove_quietly(tmp)
                raise
        for path in (self.events_path, self.steps_path):
            _remove_quietly(path)  # a half-made copy of an earlier attempt
        try:
            self._open_files()
            for src, dst, size in zip(old, (self._events_fd, self._steps_fd), self._sizes):
                offset = 0
                while offset < size:
                    block = os.pread(src, min(_COPY_BLOCK, size - offset), offset)
                    if not block:
                        break
                    _write_all(dst, block)
                    offset += len(block)
        except BaseException:
            for fd in (self._events_fd, self._steps_fd):
                if fd is not None and fd not in old:
                    os.close(fd)
            self._events_fd, self._steps_fd = old
            raise
        for fd in old:
            os.close(fd)
        self.recreated.append(f"rank {self.rank}: spool files deleted, re-created after {self.steps_written} "
                              f"step record(s) from the open files")

    def ensure_present(self) -> None:
        """Re-create the files if they were deleted (see :meth:`append`); an error goes to :attr:`error`."""
        if self.error is None and self._events_fd is not None:
            try:
                self._ensure_linked()
            except OSError as exc:
                self.error = (f"rank {self.rank} cannot re-create its deleted trace files in {self.dir}: "
                              f"{io_error_text(exc)}")

    def _read_fd(self, fd: Optional[int], path: str, size: int, dtype: np.dtype) -> np.ndarray:
        if fd is None:
            return read_records(path, dtype)
        out = np.empty(size, dtype=np.uint8)
        offset = 0
        while offset < size:
            try:
                block = os.pread(fd, min(_COPY_BLOCK, size - offset), offset)
            except OSError as exc:  # EIO: the error names the file
                raise OSError(exc.errno, exc.strerror, path) from None
            if not block:
                break
            out[offset:offset + len(block)] = np.frombuffer(block, dtype=np.uint8)
            offset += len(block)
        whole = offset - offset % dtype.itemsize
        return out[:whole].view(dtype).copy()

    def read_events(self) -> np.ndarray:
        """This rank's events of its whole steps, through the open descriptor (the lock stays held;
        a deleted file still reads). After :meth:`close`: from the file."""
        return self._read_fd(self._events_fd, self.events_path, self._sizes[0], EVENT_DTYPE)

    def read_steps(self) -> np.ndarray:
        """This rank's step records (:data:`RANK_STEP_DTYPE`), as :meth:`read_events`."""
        return self._read_fd(self._steps_fd, self.steps_path, self._sizes[1], RANK_STEP_DTYPE)

    def close(self) -> None:
        """Close the files (releases the liveness lock). Idempotent."""
        for fd in (self._events_fd, self._steps_fd):
            if fd is not None:
                os.close(fd)
        self._events_fd = self._steps_fd = None

    def mark_failed(self, message: str) -> bool:
        """Leave the reason this rank is going down (``trace recover`` reports it); False if it could not.

        Written into the space reserved at the start (``.reserve``, then renamed ``.failed.json``), so
        that a full disk does not stop it; else as a new file. Where no data can be written at all (EIO
        on every write: a failing disk, a Lustre OST gone) the reserve is still renamed: a blank
        ``.failed.json`` that :func:`read_failure` reads as a failure whose reason was lost (a rename
        needs no data block). Never raises.
        """
        payload = {"rank": self.rank, "time": now_iso(), "error": message}
        data = json.dumps(payload).encode()
        if len(data) > RESERVE_BYTES:
            payload["error"] = message[:RESERVE_BYTES // 2] + " [...]"
            data = json.dumps(payload).encode()
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY)
        except OSError:
            fd = None
        if fd is not None:
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
                os.close(fd)
                fd = None
                os.replace(self.reserve_path, self.failed_path)
                return True
            except OSError:
                if fd is not None:
                    os.close(fd)
                with contextlib.suppress(OSError):  # at least the name says that this rank failed
                    os.replace(self.reserve_path, self.failed_path)
        try:
            _write_json_atomic(self.failed_path, payload)
            return True
        except OSError:
            return False

    def remove(self) -> None:
        self.close()
        stem = os.path.join(self.dir, _rank_stem(self.rank))
        for suffix in (".events", ".steps", ".json", ".failed.json", ".reserve"):
            try:
                os.remove(stem + suffix)
            except FileNotFoundError:
                pass


def read_records(path: str, dtype: np.dtype) -> np.ndarray:
    """Whole fixed-size records of an append-only file (a torn last record is dropped; a missing file
    has none). An I/O error (EIO: a failing disk) raises :class:`TraceError` naming the file."""
    try:
        with open(path, "rb", buffering=0) as fh:
            out = np.empty(os.fstat(fh.fileno()).st_size // dtype.itemsize, dtype=dtype)
            raw, got = memoryview(out.view(np.uint8)), 0
            while got < len(raw):  # one read, no copy (np.fromfile would return a short array on EIO)
                n = fh.readinto(raw[got:])
                if not n:
                    break
                got += n
            return out[:got // dtype.itemsize]
    except FileNotFoundError:
        return np.empty(0, dtype=dtype)
    except OSError as exc:
        raise TraceError(f"reading {path} failed: {io_error_text(exc)}") from None


#: errors of file systems that refuse locks (NFS mounted ``nolock``, some FUSE and Lustre mounts)
NO_LOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)


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


# ---------------------------------------------------------------------------
# the merged HDF5 file
# ---------------------------------------------------------------------------

class GuardedFile(io.RawIOBase):
    """The file under the HDF5 writer (h5py's file-object driver): HDF5 never sees an I/O error.

    HDF5 2.0 / h5py 3.16 crash (SIGSEGV, at the latest when the interpreter exits) after a write of
    the default ``sec2`` driver fails and the file is closed: the failed dataset or file close leaves
    half-closed objects behind (reproduced without MPI by filling a small tmpfs). So the first
    failing write is kept in :attr:`error`, and it and every later write go to an in-memory overlay
    that reads see as well: HDF5 sees a consistent file, closes it cleanly, and the writer discards
    the temporary file and reports :attr:`error`. The overlay holds at most what HDF5 writes after
    the failure (its caches at close and the rest of one append).
    """

    def __init__(self, path: str):
        super().__init__()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.pos = 0
        self.error: Optional[OSError] = None
        self._overlay: List[tuple] = []
        self._end = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self._size() + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _size(self) -> int:
        return max(self._end, os.fstat(self.fd).st_size)

    def readinto(self, buffer) -> int:
        n = min(len(buffer), max(0, self._size() - self.pos))
        data = bytearray(os.pread(self.fd, n, self.pos))
        data.extend(bytes(n - len(data)))
        for offset, blob in self._overlay:
            lo, hi = max(offset, self.pos), min(offset + len(blob), self.pos + n)
            if lo < hi:
                data[lo - self.pos:hi - self.pos] = blob[lo - offset:hi - offset]
        buffer[:n] = data
        self.pos += n
        return n

    def write(self, data) -> int:
        view = memoryview(data).cast("B")  # no copy: HDF5's buffer goes to pwrite as it is
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None:  # reads apply the pieces in write order: the newest last
            self._overlay.append((self.pos, bytes(view)))
        self.pos += len(view)
        self._end = max(self._end, self.pos)
        return len(view)

    def truncate(self, size: Optional[int] = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        self._end = size
        return size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._overlay = []
        super().close()


class TraceFileWriter:
    """Writes ``final_path`` under a temporary name; :meth:`publish` makes it appear atomically.

    An I/O error (disk full, ...) raises :class:`TraceError` with one line from :meth:`append_events`
    or :meth:`finish`; the temporary file is then removed (call :meth:`abort` after an error
    of :meth:`append_events`; :meth:`finish` does it itself).

    ``parts=False``: a self-contained file, events added with :meth:`append_events`.
    ``parts=True``: the events go to part files written elsewhere into :attr:`staged`
    (:class:`fourd_mpi.trace.merge.StagedParts`) and :meth:`bind` maps them into a virtual
    ``/events``; publication renames the parts directory into place first.
    ``compression``: a key of :data:`fourd_mpi.trace.merge.COMPRESSIONS` for ``/events``.
    """

    def __init__(self, final_path: str, force: bool = False, compression: str = "gzip", parts: bool = False):
        import h5py

        from fourd_mpi.trace.merge import EventBuffer, StagedParts, create_events_dataset

        self.final_path = final_path
        self.force = force
        if os.path.exists(final_path) and not force:
            raise TraceError(f"{final_path} already exists (use --force to replace it)")
        directory, name = os.path.split(os.path.abspath(final_path))
        self.tmp_path = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
        self.staged = StagedParts(final_path, force) if parts else None
        self.h5 = self._raw = None
        self._buffer = None
        try:
            self._raw = GuardedFile(self.tmp_path)
            self.h5 = h5py.File(self._raw, "w")
            self.events = None if parts else create_events_dataset(self.h5, compression)
            self._buffer = None if parts else EventBuffer(self.events)
            self._check()
            # an exit with the file open would let HDF5 call into a half torn-down interpreter
            self._finalizer = weakref.finalize(self, _close_quietly, self.h5, self._raw, self.tmp_path)
        except (OSError, TraceError) as exc:
            _close_quietly(self.h5, self._raw, self.tmp_path)
            if self.staged is not None:
                self.staged.abort()
            raise TraceError(f"cannot write {final_path}: "
                             f"{io_error_text(exc) if isinstance(exc, OSError) else exc}") from None
        self.rank_offsets: Dict[int, tuple] = {}
        self.parts = 0

    def _check(self) -> None:
        if self._raw is not None and self._raw.error is not None:
            raise TraceError(f"writing {self.final_path} failed: {io_error_text(self._raw.error)}")

    def append_events(self, rank: int, events: np.ndarray) -> None:
        """Append a piece of ``rank``'s events (ranks in order, each rank's pieces in order; buffered
        into whole chunks, written at the latest by :meth:`finish`)."""
        start = self._buffer.total
        self._buffer.append(events)
        first, count = self.rank_offsets.get(rank, (start, 0))
        self.rank_offsets[rank] = (first, count + len(events))
        self._check()

    def append_ranks(self, first_rank: int, counts: np.ndarray, events: np.ndarray) -> None:
        """The events of ranks ``first_rank, first_rank + 1, ...`` (``counts`` each, in rank order), in
        one append."""
        start = self._buffer.total
        self._buffer.append(events)
        offsets = start + np.concatenate([[0], np.cumsum(counts)])
        for i, count in enumerate(counts.tolist()):
            if count:
                self.rank_offsets[first_rank + i] = (int(offsets[i]), count)
        self._check()

    def bind(self, groups, rank_counts) -> None:
        """Parts mode: ``/events`` becomes the virtual concatenation of the staged parts of ``groups``
        (consecutive rank ranges), ``rank_counts[r]`` events for rank ``r``."""
        from fourd_mpi.trace.merge import bind_parts, parts_table

        table = parts_table(groups, rank_counts)
        bind_parts(self.h5, table, self.staged.dirname)
        self.events = self.h5["events"]
        offsets = np.concatenate([[0], np.cumsum(np.asarray(rank_counts, dtype=np.int64))])
        self.rank_offsets = {r: (int(offsets[r]), int(rank_counts[r])) for r in range(len(rank_counts))}
        self.parts = len(table)

    def finish(self, metadata: Dict, ranks: np.ndarray, rank_steps: np.ndarray, layers: Sequence[str],
               status: str) -> str:
        """Write everything but the events, close, publish; returns the trace path."""
        try:
            self._write_tables(metadata, ranks, rank_steps, layers, status)
            self.h5.close()
            self._check()
            self._raw.close()
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise TraceError(f"writing {self.final_path} failed: {io_error_text(exc)}") from None
            raise
        path = self.publish()
        self._finalizer.detach()
        return path

    def _write_tables(self, metadata: Dict, ranks: np.ndarray, rank_steps: np.ndarray, layers: Sequence[str],
                      status: str) -> None:
        h5 = self.h5
        if self.staged is None:
            self._buffer.flush()
        ranks = ranks.copy()
        where = [self.rank_offsets.get(r, (0, 0)) for r in ranks["rank"].tolist()]
        ranks["event_offset"] = [w[0] for w in where]
        ranks["event_count"] = [w[1] for w in where]
        h5.attrs.update({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "status": status,
                         "run_id": metadata.get("run_id", ""), "events": self.events.shape[0],
                         "world_size": len(ranks), "written": now_iso(), "parts": self.parts})
        meta = h5.create_group("metadata")
        json_keys = []
        for key, value in metadata.items():
            if isinstance(value, (dict, list, tuple)) or value is None:
                value, _ = json.dumps(value, default=str), json_keys.append(key)
            meta.attrs[key] = value
        meta.attrs["json_keys"] = json.dumps(json_keys)
        vocab = h5.create_group("vocab")
        for name, words in (("layers", layers), ("phases", PHASES), ("ops", OPS), ("axes", AXES),
                            ("levels", LEVELS)):
            vocab.attrs[name] = json.dumps(list(words))
        h5.create_dataset("ranks", data=ranks)
        rank_steps = rank_steps[np.lexsort((rank_steps["rank"], rank_steps["step"]))]
        h5.create_dataset("rank_steps", data=rank_steps)
        h5.create_dataset("steps", data=steps_table(rank_steps))
        self._check()

    def publish(self) -> str:
        """Parts directory first (when there is one), then the file: the file never names missing parts."""
        from fourd_mpi.trace.merge import parts_dir_of

        if self.staged is not None:
            try:
                self.staged.publish()
            except (OSError, TraceError) as exc:
                self.abort()
                raise TraceError(str(exc) if isinstance(exc, TraceError) else
                                 f"cannot publish {self.staged.final_dir}: {exc}") from None
        try:
            self._publish_file()
        except OSError as exc:
            self.abort()
            raise TraceError(f"cannot publish {self.final_path}: {exc}") from None
        if self.staged is not None:
            self.staged.committed()
        elif self.force:  # a replaced multi-part trace leaves no orphan parts
            import shutil

            shutil.rmtree(parts_dir_of(os.path.abspath(self.final_path)), ignore_errors=True)
        return self.final_path

    def _publish_file(self) -> None:
        if self.force:
            os.replace(self.tmp_path, self.final_path)
            return
        try:
            os.link(self.tmp_path, self.final_path)  # fails if the name exists: never overwrites
        except FileExistsError:
            self.abort()
            raise TraceError(f"{self.final_path} appeared while the trace was written; not overwritten") from None
        except OSError:  # file systems without hard links
            if os.path.exists(self.final_path):
                self.abort()
                raise TraceError(f"{self.final_path} already exists; not overwritten") from None
            os.rename(self.tmp_path, self.final_path)
            return
        os.remove(self.tmp_path)

    def abort(self) -> None:
        """Close quietly and remove the temporary file (HDF5 sees no I/O error: see :class:`GuardedFile`)."""
        self._finalizer()
        if self.staged is not None:
            self.staged.abort()


def _close_quietly(h5, raw, tmp_path: str) -> None:
    """Close the HDF5 file and its :class:`GuardedFile`, remove the temporary file (nothing raises)."""
    for closer in (h5, raw):
        if closer is not None:
            try:
                closer.close()
            except Exception:  # noqa: BLE001 - nothing to save: the file is removed next
                pass
    _remove_quietly(tmp_path)


def steps_table(rank_steps: np.ndarray) -> np.ndarray:
    """Per step: loss, wall time (max over ranks of the step span), min start, max end."""
    steps = np.unique(rank_steps["step"])
    out = np.zeros(len(steps), dtype=STEP_DTYPE)
    for i, step in enumerate(steps):
        rows = rank_steps[rank_steps["step"] == step]
        out[i] = (step, rows["warmup"].max(), rows["loss"][0], ((rows["end_ns"] - rows["start_ns"]).max()) * 1e-9,
                  rows["start_ns"].min(), rows["end_ns"].max(), rows["compute_ns"].max(), rows["wait_ns"].max())
    return out


def ranks_table(rank_metas: Sequence[Dict]) -> np.ndarray:
    """``/ranks`` from the ranks' metadata dicts (event ranges zero: the writer fills them)."""
    rows = []
    for m in sorted(rank_metas, key=lambda m: m["rank"]):
        c = m.get("coords", {})
        rows.append((m["rank"], str(m.get("hostname", "")).encode()[:64], m.get("node", 0), m.get("local_rank", 0),
                     c.get("data", 0), c.get("z", 0), c.get("y", 0), c.get("x", 0), m.get("clock_offset_ns", 0),
                     m.get("clock_uncertainty_ns", 0), m.get("pid", 0), 0, 0, m.get("clock_drift_ppm", float("nan")),
                     m.get("clock_residual_ns", m.get("clock_uncertainty_ns", 0))))
    return np.array(rows, dtype=RANK_DTYPE) if rows else np.zeros(0, dtype=RANK_DTYPE)


# ---------------------------------------------------------------------------
# end of a run (collective) and recovery (one process)
# ---------------------------------------------------------------------------

def merge_run(comm, spool: RankSpool, rank_meta: Dict, trace_path: str, metadata: Optional[Dict],
              layers: Sequence[str], force: bool, correct=None, group_size: int = 0,
              compression: str = "gzip") -> str:
    """Collective: write the merged trace from every rank's spool; returns its path.

    ``correct``: this rank's clock correction (records -> records with their time columns moved,
    :meth:`fourd_mpi.trace.clocks.DriftModel.correct_records`), applied to its events and step
    records before they are sent; None keeps the start-aligned times.

    ``group_size``: ranks per writer (``--trace-group-size``; <= 0: ranks per node, at most
    :data:`fourd_mpi.trace.merge.MAX_PARTS` parts). The data movement is
    :func:`fourd_mpi.trace.merge.merge_collective`: one group writes one file, several write part
    files bound by a top-level file.

    The spool is removed only after the trace is published. On a write error
    every rank raises the same :class:`TraceError` and the spool is kept.
    """
    from fourd_mpi.trace.merge import merge_collective

    from mpi4py import MPI

    rank = comm.Get_rank()
    read_error = None
    try:
        events = spool.read_events()  # through the open descriptor: the liveness lock stays held
        events = sort_events(correct(events) if correct is not None else events)
        mine = spool.read_steps()
        if correct is not None:
            mine = correct(mine)
    except OSError as exc:  # EIO reading back: agreed on below, so no rank waits in the merge for this one
        read_error = (f"rank {rank} cannot read its trace files back: reading {exc.filename} failed: "
                      f"{io_error_text(exc)}")
    if comm.allreduce(int(read_error is not None), op=MPI.MAX):
        errors = comm.allgather(read_error)
        failed = [r for r, e in enumerate(errors) if e is not None]
        others = f" (ranks {', '.join(map(str, failed))} failed)" if len(failed) > 1 else ""
        raise merge_failed(spool, errors[failed[0]] + others)
    error, path = merge_collective(comm, events, mine, rank_meta, trace_path, metadata, layers, force,
                                   group_size=group_size, compression=compression)
    del events
    if error is not None:
        raise merge_failed(spool, error)
    spool.remove()
    comm.Barrier()
    if rank == 0:
        for leftover in (RUN_META,):
            try:
                os.remove(os.path.join(spool.dir, leftover))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(spool.dir)
        except OSError:
            pass  # something else lives there: leave it
    return path


def merge_failed(spool: RankSpool, error: str) -> TraceError:
    """Every rank, after a failed merge (``error``: the same one line on all): rank 0 records the failure in
    the spool (``trace recover`` then reports status ``failed`` with it), every rank closes its files
    (the lock goes) and gets the error to raise, which names the spool kept for ``trace recover``."""
    if spool.rank == 0:
        spool.mark_failed(f"merge: {error}")
    spool.close()
    return TraceError(f"{error}; the per-rank files are kept in {spool.dir} "
                      f"('fourd-mpi trace recover {spool.dir}' merges them)")


def live_ranks(spool_dir: str, world: int) -> List[str]:
    """Ranks of the spool that a running process still holds, as ``"rank R (pid P on HOST)"``.

    A rank is live if the ``fcntl`` lock of its ``.events`` file is held (:class:`RankSpool`), or, where
    the run's file system had no POSIX locks (``"lock": false`` in its ``rankNNNNNN.json``), if its pid
    is alive on this host. A process killed by any signal holds no lock.
    """
    host = socket.gethostname()
    live = []
    for rank in range(world):
        stem = os.path.join(spool_dir, _rank_stem(rank))
        try:
            with open(stem + ".json") as fh:
                meta = json.load(fh)
        except (OSError, ValueError):
            meta = {}
        where = live_rank(stem, rank, meta if isinstance(meta, dict) else {}, host)
        if where is not None:
            live.append(where)
    return live


def live_rank(stem: str, rank: int, meta: Dict, host: str) -> Optional[str]:
    """``"rank R (pid P on HOST)"`` if a running process holds the spool files ``stem.*`` of ``rank``
    (``meta``: its ``.json``, ``{}`` if unreadable), else None (:func:`live_ranks`)."""
    where = f"rank {rank} (pid {meta.get('pid', '?')} on {meta.get('hostname', '?')})"
    if meta.get("lock", True) is False:
        pid = meta.get("pid")
        if meta.get("hostname") == host and isinstance(pid, int) and _pid_alive(pid):
            return where
        return None
    try:
        fd = os.open(stem + ".events", os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return where
    finally:
        os.close(fd)  # releases the probe's own lock
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def read_failure(path: str, rank: int) -> Dict:
    """A rank's failure report (``rankNNNNNN.failed.json``, see :meth:`RankSpool.mark_failed`)."""
    try:
        with open(path) as fh:
            text = fh.read(1 << 20)
        if not text.strip():  # the renamed reserve: the rank failed, writing its reason failed too
            return {"rank": rank, "error": "failed; its reason could not be written (an I/O error on every write)"}
        report = json.loads(text)
        if isinstance(report, dict):
            return report
    except (OSError, ValueError) as exc:
        return {"rank": rank, "error": f"unreadable failure report {os.path.basename(path)}: {exc}"}
    return {"rank": rank, "error": f"unreadable failure report {os.path.basename(path)}"}


def recovered_status(failures: Sequence[Dict]) -> str:
    """``partial`` without error reports, ``interrupted`` when every report says so (Ctrl-C), else ``failed``."""
    if not failures:
        return "partial"
    if all(str(f.get("error", "")).startswith("interrupted: ") for f in failures):
        return "interrupted"
    return "failed"


#: how ``recover`` verifies the trace before it calls the spool removable (``check=``)
RECOVER_CHECKS = ("readback", "full")


#: what ``recover`` trusts in a spool's ``run.json`` (written by :meth:`RunSpool` on rank 0): checked once
#: where it is read, so that a damaged or hostile file is one line, not a ``TypeError`` later
RUN_META_SCHEMA = {
    "type": "object",
    "required": ["world_size"],
    "properties": {
        "world_size": {"type": "integer", "minimum": 1},
        "ranks_per_node": {"type": ["array", "null"]},
        "run_id": {"type": ["string", "null"]},
        "model_flops_per_step": {"type": "number"},
        "tokens_per_step": {"type": "number"},
        "hardware_flops_per_step": {"type": ["number", "null"]},
    },
}
#: largest ``run.json`` read (bytes): a few kB in practice
MAX_RUN_META_BYTES = 16 << 20
#: how many ranks above the highest one with files in the spool ``run.json``'s ``world_size`` may name
#: (every rank creates its files right after ``MPI_Init``, so only deleted files are missing; a larger
#: gap is a damaged ``run.json``, and trusting it would make ``recover`` walk ranks that never existed)
MAX_MISSING_TAIL = 1024


def read_run_meta(spool_dir: str) -> Dict:
    """The spool's ``run.json`` as a dict, validated against :data:`RUN_META_SCHEMA`; anything else
    (no directory, no file, not a regular file, not JSON, not an object, a bad ``world_size``)
    raises :class:`TraceError` with one line."""
    import jsonschema

    from fourd_mpi.util.files import read_regular_file

    if not os.path.isdir(spool_dir):
        raise TraceError(f"{spool_dir} is not a directory")
    meta_path = os.path.join(spool_dir, RUN_META)
    try:
        raw = read_regular_file(meta_path, MAX_RUN_META_BYTES + 1, "run.json", TraceError)
    except FileNotFoundError:
        raise TraceError(f"{spool_dir} is not a fourd-mpi spool directory (no {RUN_META})") from None
    except OSError as exc:
        raise TraceError(f"{meta_path} is unreadable: {io_error_text(exc)}") from None
    if len(raw) > MAX_RUN_META_BYTES:
        raise TraceError(f"{meta_path} is larger than {MAX_RUN_META_BYTES:,} bytes: not a run.json of fourd-mpi")
    try:
        run_meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{meta_path} is unreadable: not valid JSON ({' '.join(str(exc).split())[:160]})") from None
    if not isinstance(run_meta, dict):
        raise TraceError(f"{meta_path} is not a JSON object (it holds a {type(run_meta).__name__})")
    if "world_size" not in run_meta:
        raise TraceError(f"{meta_path} has no world_size")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(RUN_META_SCHEMA).iter_errors(run_meta))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise TraceError(f"{meta_path}: {where}: {' '.join(error.message.split())[:160]}")
    run_meta["world_size"] = int(run_meta["world_size"])  # JSON Schema's integer admits 8.0
    return run_meta


def spool_world(spool_dir: str, declared: int) -> int:
    """``declared`` (run.json's ``world_size``) once checked against the per-rank files present: it may
    exceed the highest rank with files (``rankNNNNNN.*``) by at most :data:`MAX_MISSING_TAIL`, else
    :class:`TraceError` naming both numbers."""
    import re

    pattern = re.compile(r"rank(\d{6,})\.(?:json|events|steps|reserve|failed\.json)$")
    highest = -1
    try:
        with os.scandir(spool_dir) as entries:
            for entry in entries:
                match = pattern.match(entry.name)
                if match:
                    highest = max(highest, int(match.group(1)))
    except OSError as exc:
        raise TraceError(f"cannot list {spool_dir}: {io_error_text(exc)}") from None
    if declared > highest + 1 + MAX_MISSING_TAIL:
        found = (f"the highest rank with files there is {highest} ({_rank_stem(highest)}.*)" if highest >= 0
                 else "the spool holds no per-rank files")
        raise TraceError(f"{os.path.join(spool_dir, RUN_META)} says world_size {declared:,} but {found}: a damaged "
                         f"run.json (at most {MAX_MISSING_TAIL:,} ranks beyond the highest may be missing)")
    return declared


def recover(spool_dir: str, output: Optional[str] = None, force: bool = False, summarize=None,
            group_size: int = 0, jobs: int = 1, compression: str = "none", check: str = "readback") -> Dict:
    """Merge the spool of a crashed run into a ``partial`` (or ``failed``) trace.

    Keeps the steps that every rank finished (their step record is on disk).
    ``summarize``: ``rank_steps -> Summary`` for the kept steps (stored as
    ``metadata["summary"]``). Returns a dict with the path, status, steps kept
    and what was dropped, ``live`` (ranks still running when forced), and ``removable``: None
    if the spool may be deleted (the trace holds every whole step of every rank, nothing was
    dropped, the run was not live, and the written trace is verified), else the reason to keep it;
    ``verified``: how (``check``). ``compression``: of the events (default ``none``: a recovery runs on
    the CPUs of one machine, where deflate costs about 2.5 times the rest of the merge; ``gzip`` as
    in runs, about 10 times smaller).

    - ``"readback"`` (default) for a multi-part trace: every part file, once closed, is opened again by
      the worker that wrote it and its event bytes compared with those written (XXH3-64 digest), the
      top-level file is read back with every
      check but the events' (``load_trace(events=False)``: header, tables, part identities and row
      counts), and every kept (rank, step) holds exactly the events its step record counts. The
      workers check the parts in parallel; no process reads more than one group's events.
    - ``"full"``, and any single-file trace: the whole trace is loaded (``load_trace``: every column
      validated, damage) and passes :func:`~fourd_mpi.trace.read.check_invariants`, in this process
      (``trace check``).

    A run whose ranks still hold their spool locks (:func:`live_ranks`) is refused unless
    ``force`` (which also replaces an existing output file). Raises :class:`TraceError` with one
    line; on an I/O error no temporary file is left.
    """
    if check not in RECOVER_CHECKS:
        raise TraceError(f"unknown recover check {check!r}: choose one of {', '.join(RECOVER_CHECKS)}")
    run_meta = read_run_meta(spool_dir)
    world = spool_world(spool_dir, run_meta["world_size"])
    from fourd_mpi.trace.merge import SCRATCH

    try:
        return _recover(spool_dir, output, force, summarize, group_size, jobs, compression, check, run_meta, world)
    finally:
        SCRATCH.release()  # the batch arrays of an in-process recovery


def _recover(spool_dir: str, output: Optional[str], force: bool, summarize, group_size: int, jobs: int,
             compression: str, check: str, run_meta: Dict, world: int) -> Dict:
    from fourd_mpi.trace.merge import (GroupPool, concat_records, plan_groups, read_group_records, recover_group,
                                       recover_parts, resolve_group_size)

    # the run's largest node (run.json's ranks_per_node); unknown: the whole world, i.e. one file
    per_node = max([n for n in run_meta.get("ranks_per_node") or [] if isinstance(n, int)] or [world])
    groups = plan_groups(world, resolve_group_size(world, group_size, per_node))
    # next to the spool, wherever it is now (run.json's trace_path may be relative to the job's directory)
    path = output or spool_dir.rstrip("/").removesuffix(SPOOL_SUFFIX) + ".h5"
    run_id = str(run_meta.get("run_id", ""))
    with GroupPool(jobs, len(groups)) as pool:
        # pass 1, group by group: metadata, step records (small) and spool locks, to know the steps every
        # rank finished and whether the run still lives
        rank_metas, rank_steps, failures, missing, live = [], [], [], [], []
        for metas, steps, fails, lost, held in pool.map(read_group_records, [(spool_dir, a, b) for a, b in groups]):
            rank_metas += metas
            rank_steps += steps
            failures += fails
            missing += lost
            live += held
        if live and not force:
            shown = ", ".join(live[:3]) + (f" and {len(live) - 3} more" if len(live) > 3 else "")
            raise TraceError(f"the run of {spool_dir} is still running: {shown} hold their spool files; recover it "
                             "after it ends (it merges its own trace), or --force for a partial trace of the steps "
                             "so far (the spool is kept)")
        done = set(rank_steps[0]["step"].tolist())
        for steps in rank_steps[1:]:
            done &= set(steps["step"].tolist())
        every = set().union(*(set(steps["step"].tolist()) for steps in rank_steps))
        kept = np.array(sorted(done), dtype=np.int32)
        # pass 2: the events, a batch of whole ranks at a time per process
        writer = TraceFileWriter(path, force, compression=compression, parts=len(groups) > 1)
        with _aborting_on_error(writer, path):
            if len(groups) > 1:
                results = recover_parts(spool_dir, groups, kept, writer.staged, run_id, compression, pool)
                writer.bind(groups, [c for result in results for c in result.counts])
            else:
                results = [recover_group(spool_dir, 0, 0, world, kept, None, run_id, compression, writer=writer)]
        dropped = sum(result.dropped for result in results)
        staged_dir = writer.staged.dir if writer.staged is not None else None  # renamed by publication
        with _aborting_on_error(writer, path):
            status = recovered_status(failures)
            all_steps = concat_records(rank_steps, RANK_STEP_DTYPE)
            metadata = dict(run_meta, recovered=now_iso(), recovered_from=os.path.abspath(spool_dir),
                            failures=failures, ranks_without_metadata=missing, steps_kept=len(kept),
                            events_dropped=dropped, recovered_while_live=live)
            metadata.pop("trace_path", None)
            kept_steps = all_steps[np.isin(all_steps["step"], kept)]
            if len(kept_steps) and summarize is not None:
                metadata["summary"] = summarize(kept_steps).as_dict()
            path = writer.finish(metadata, ranks_table(rank_metas), kept_steps, run_meta.get("layers", []), status)
        verified = "readback" if check == "readback" and writer.parts else "full"
        removable = _why_keep(path, live, missing, sorted(every - done), dropped, verified, results, kept_steps,
                              staged_dir)
    return {"path": path, "status": status, "steps": kept.tolist(), "events_dropped": dropped,
            "failures": failures, "live": live, "removable": removable, "parts": writer.parts,
            "peak_rss_kib": max(result.peak_rss_kib for result in results), "verified": verified}

@contextlib.contextmanager
def _aborting_on_error(writer: TraceFileWriter, path: str):
    """Any exception inside aborts ``writer`` (no temporary file left); an I/O error becomes one line."""
    try:
        yield
    except OSError as exc:
        writer.abort()
        raise TraceError(f"writing {path} failed: {io_error_text(exc)}") from None
    except TraceError as exc:
        writer.abort()
        if writer.staged is None:
            raise
        from fourd_mpi.trace.merge import parts_dir_of

        # a part's error names the staging directory just removed: name the part where it belongs
        raise TraceError(str(exc).replace(writer.staged.dir, parts_dir_of(os.path.abspath(path)))) from None
    except BaseException:
        writer.abort()
        raise


def _why_keep(path: str, live: List[str], missing: List[int], unfinished: List[int], dropped: int, verified: str,
              results, kept_steps: np.ndarray, staged_dir: Optional[str]) -> Optional[str]:
    """None if the spool of a recovered trace may be deleted, else the reason to keep it (``verified``:
    how the trace is checked, see :func:`recover`)."""
    if live:
        return f"the run was still running ({len(live)} rank(s) held their files)"
    if missing:
        return f"rank(s) {', '.join(map(str, missing))} had no metadata file"
    if unfinished or dropped:
        return (f"{len(unfinished)} step(s) not finished by every rank and {dropped} of their events are not "
                "in the trace")
    from fourd_mpi.trace.read import check_invariants, load_trace

    if verified == "full":
        try:
            problems = check_invariants(load_trace(path))
        except (OSError, TraceError) as exc:
            return f"the written trace does not read back: {exc}"
        if problems:
            return f"the written trace violates {len(problems)} invariant(s) ('fourd-mpi trace check {path}')"
        return None
    why = _rank_step_mismatch(results, kept_steps)
    if why is not None:
        return why
    why = next((result.readback for result in results if result.readback is not None), None)
    if why is not None:  # read back under the staged name: the directory was renamed into place since
        from fourd_mpi.trace.merge import parts_dir_of

        return why.replace(staged_dir, parts_dir_of(os.path.abspath(path))) if staged_dir else why
    try:
        load_trace(path, events=False)
    except (OSError, TraceError) as exc:
        return f"the written trace does not read back: {exc}"
    return None


def _rank_step_mismatch(results, kept_steps: np.ndarray) -> Optional[str]:
    """None if the events written per (rank, step) (the groups' ``keys``/``held``) equal the ``events``
    of the kept step records, else the first difference."""
    from fourd_mpi.trace.merge import rank_step_keys

    keys = np.concatenate([result.keys for result in results])
    held = np.concatenate([result.held for result in results])
    order = np.argsort(keys, kind="stable")
    keys, held = keys[order], held[order]
    records = rank_step_keys(kept_steps["rank"], kept_steps["step"])
    order = np.argsort(records, kind="stable")
    records, expected = records[order], kept_steps["events"][order]
    if len(records) != len(np.unique(records)):
        return "the kept step records hold a duplicate (rank, step)"
    if np.array_equal(keys, records) and np.array_equal(held, expected):
        return None
    both = np.union1d(keys, records)
    have = np.zeros(len(both), dtype=np.int64)
    want = np.zeros(len(both), dtype=np.int64)
    have[np.searchsorted(both, keys)] = held
    want[np.searchsorted(both, records)] = expected
    bad = np.nonzero(have != want)[0]
    if not len(bad):  # differ only by rank-steps without events whose records say 0
        return None
    key = int(both[bad[0]])
    step = key & 0xFFFFFFFF
    step -= (1 << 32) if step & 0x80000000 else 0
    return (f"rank {key >> 32} step {step}: {have[bad[0]]} events in the trace, its record says {want[bad[0]]} "
            f"({len(bad)} such rank-steps)")
