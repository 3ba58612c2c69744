"""The spool: each rank's append-only files in ``<results>/<run-id>.ranks/`` during a run.

Rank 0 creates the directory and its ``run.json`` (:func:`prepare_spool`); each rank appends its
events and one step record per step with plain ``os.write`` on ``O_APPEND`` descriptors
(:class:`RankSpool`): the events of a step first, then its step record, so a step record on disk means
the step's events are all there. A rank killed at any point loses at most the step in flight (the
records are fixed-size; a torn last record is cut off when read, :func:`read_records`). A rank holds an
``fcntl`` lock on its ``.events`` file while it lives (:func:`live_ranks`, :func:`live_rank`), and
records why it stops in ``rankNNNNNN.failed.json`` (:func:`read_failure`).

The spool directory is created by rank 0 and written by every rank, so the results directory must be
on a file system all ranks see (as on clusters).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from typing import Dict, List, Optional

import numpy as np

from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.files import (
    PUBLISHED,
    io_error_text,
    now_iso,
    parts_dir_of,
    rank_stem,
    trace_paths,
    write_json_atomic,
)
from fourd_mpi.util.files import RUN_META, remove_quietly, write_all


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
        while os.path.dirname(blocker) not in ("", blocker) and not os.path.lexists(blocker):
            blocker = os.path.dirname(blocker)
        from fourd_mpi.util.files import missing_reason

        what = missing_reason(blocker) if os.path.islink(blocker) and not os.path.exists(blocker) else "a file"
        raise TraceError(f"cannot create the results directory {results_dir}: {blocker} is {what}, not a "
                         "directory (give --results-dir a directory)") from None
    except OSError as exc:
        raise TraceError(f"cannot create the results directory {results_dir}: {exc.strerror}") from None
    if not os.access(results_dir, os.W_OK | os.X_OK):
        raise TraceError(f"the results directory {results_dir} is not writable")
    from fourd_mpi.results.index import refuse_foreign_link
    from fourd_mpi.util.files import refuse_link

    try:  # what the run will write: its trace, its parts, its line in the index (before any step runs)
        refuse_link(trace_path, what=f"the trace {trace_path}")
        refuse_link(parts_dir_of(trace_path), what=f"the trace's parts {parts_dir_of(trace_path)}")
        refuse_foreign_link(os.path.join(results_dir, "index.jsonl"), "run")
    except ConfigError as exc:
        raise TraceError(str(exc)) from None
    if os.path.isdir(trace_path):  # --force replaces a file: found only at publish, after every step
        raise TraceError(f"{trace_path} is a directory, not a trace file: remove it or choose another --run-id")
    if os.path.exists(trace_path) and not force:
        raise TraceError(f"{trace_path} already exists: choose another --run-id, or --force to replace it")
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
        write_json_atomic(os.path.join(spool_dir, RUN_META), dict(run_meta, trace_path=trace_path))
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
        stem = os.path.join(spool_dir, rank_stem(rank))
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
                    remove_quietly(path)
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
        write_json_atomic(self.meta_path, meta)
        fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, b" " * RESERVE_BYTES)
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
            write_all(self._events_fd, np.ascontiguousarray(events, dtype=EVENT_DTYPE).tobytes())
            write_all(self._steps_fd, np.ascontiguousarray(rank_step, dtype=RANK_STEP_DTYPE).tobytes())
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
                remove_quietly(tmp)
                raise
        for path in (self.events_path, self.steps_path):
            remove_quietly(path)  # a half-made copy of an earlier attempt
        try:
            self._open_files()
            for src, dst, size in zip(old, (self._events_fd, self._steps_fd), self._sizes):
                offset = 0
                while offset < size:
                    block = os.pread(src, min(_COPY_BLOCK, size - offset), offset)
                    if not block:
                        break
                    write_all(dst, block)
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
        """Leave the reason this rank is going down (``trace recover`` reports it); False if it could not
        (:func:`write_failure`). Never raises."""
        return write_failure(os.path.join(self.dir, rank_stem(self.rank)), self.rank, message)

    def remove(self) -> None:
        self.close()
        stem = os.path.join(self.dir, rank_stem(self.rank))
        for suffix in (".events", ".steps", ".json", ".failed.json", ".reserve"):
            try:
                os.remove(stem + suffix)
            except FileNotFoundError:
                pass


def write_failure(stem: str, rank: int, message: str) -> bool:
    """Write ``stem.failed.json`` (``stem``: ``<spool>/rankNNNNNN``), the reason ``rank`` is going down, which
    ``trace recover`` reports; False if it could not. Never raises.

    Written into the space reserved at the start (``stem.reserve``, then renamed ``.failed.json``), so
    that a full disk does not stop it; else as a new file. Where no data can be written at all (EIO
    on every write: a failing disk, a Lustre OST gone) the reserve is still renamed: a blank
    ``.failed.json`` that :func:`read_failure` reads as a failure whose reason was lost (a rename
    needs no data block).
    """
    reserve_path, failed_path = stem + ".reserve", stem + ".failed.json"
    payload = {"rank": rank, "time": now_iso(), "error": message}
    data = json.dumps(payload).encode()
    if len(data) > RESERVE_BYTES:
        payload["error"] = message[:RESERVE_BYTES // 2] + " [...]"
        data = json.dumps(payload).encode()
    try:
        fd = os.open(reserve_path, os.O_WRONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.close(fd)
            fd = None
            os.replace(reserve_path, failed_path)
            return True
        except OSError:
            if fd is not None:
                os.close(fd)
            with contextlib.suppress(OSError):  # at least the name says that this rank failed
                os.replace(reserve_path, failed_path)
    try:
        write_json_atomic(failed_path, payload)
        return True
    except OSError:
        return False


def mark_published(spool_dir: str, trace_path: str) -> None:
    """Rank 0, as the final merge publishes ``trace_path``: write :data:`~fourd_mpi.trace.files.PUBLISHED` into
    the spool (best effort: without it a left-over spool is recognised by its trace, :func:`published_trace`)."""
    with contextlib.suppress(OSError):
        write_json_atomic(os.path.join(spool_dir, PUBLISHED), {"trace": os.path.abspath(trace_path),
                                                                "time": now_iso()})


def published_trace(spool_dir: str) -> Optional[str]:
    """The trace the run of ``spool_dir`` published (its final merge ended: the spool is left over), from
    :data:`~fourd_mpi.trace.files.PUBLISHED`, if that trace is there; else None."""
    try:
        with open(os.path.join(spool_dir, PUBLISHED)) as fh:
            trace = json.load(fh).get("trace")
    except (OSError, ValueError, AttributeError):
        return None
    return trace if isinstance(trace, str) and os.path.isfile(trace) else None


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


def live_ranks(spool_dir: str, world: int) -> List[str]:
    """Ranks of the spool that a running process still holds, as ``"rank R (pid P on HOST)"``.

    A rank is live if the ``fcntl`` lock of its ``.events`` file is held (:class:`RankSpool`), or, where
    the run's file system had no POSIX locks (``"lock": false`` in its ``rankNNNNNN.json``), if its pid
    is alive on this host. A process killed by any signal holds no lock.
    """
    host = socket.gethostname()
    live = []
    for rank in range(world):
        stem = os.path.join(spool_dir, rank_stem(rank))
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
        if meta.get("hostname") == host and isinstance(pid, int) and pid_alive(pid):
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts)."""
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
