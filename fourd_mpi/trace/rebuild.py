"""Rebuilding part files from a spool (``trace recover``, one process): each group's part is
written from the spool files of its ranks, one rank in memory at a time (:func:`recover_group`), by a
pool of worker processes (:class:`GroupPool`); a written part is read back and its digest compared
(:func:`verify_part`). Orchestrated by :func:`fourd_mpi.trace.recover.recover`."""

from __future__ import annotations

import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.files import io_error_text, open_h5_read, rank_events_path, rank_stem_path
from fourd_mpi.trace.parts import PART_SCHEMA, PartWriter, StagedParts, event_digest
from fourd_mpi.trace.spool import live_rank, read_failure, read_records

#: events read into memory at once by a recovering process (about 50 MiB): a group's ranks are read,
#: sorted and written in batches of whole ranks up to this size (one rank may exceed it)
RECOVER_BATCH_EVENTS = 1 << 19


class Scratch:
    """Event arrays reused from batch to batch (and group to group) by one process: a new array of
    tens of MiB per batch costs page faults and the kernel's zeroing of every page, about as much
    as reading the batch. ``get(name, n)``: an array of at least ``n`` events (contents undefined),
    grown as needed; :meth:`release` frees them."""

    def __init__(self):
        self._arrays: Dict[str, np.ndarray] = {}

    def get(self, name: str, n: int) -> np.ndarray:
        array = self._arrays.get(name)
        if array is None or len(array) < n:
            array = self._arrays[name] = np.empty(n, dtype=EVENT_DTYPE)
        return array[:n]

    def release(self) -> None:
        self._arrays.clear()


#: this process's scratch arrays (a forked worker starts with its own, empty)
SCRATCH = Scratch()


def spool_event_counts(spool_dir: str, ranks: Sequence[int]) -> np.ndarray:
    """Whole records in the ``.events`` spool file of each of ``ranks`` (0 for a missing file)."""
    counts = np.zeros(len(ranks), dtype=np.int64)
    for i, rank in enumerate(ranks):
        try:
            counts[i] = os.stat(rank_events_path(spool_dir, rank)).st_size // EVENT_DTYPE.itemsize
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TraceError(f"reading {rank_events_path(spool_dir, rank)} failed: {io_error_text(exc)}") from None
    return counts


def read_rank_files(spool_dir: str, ranks: Sequence[int], counts: np.ndarray,
                    out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The first ``counts[i]`` records of the ``.events`` spool file of each of ``ranks``, read straight
    into one array (``out``, of at least ``sum(counts)`` events, or a new one; no per-rank arrays, no
    concatenation; one file open at a time); returns ``(events, per-rank counts read)``: a file that
    is missing or shorter now gives its whole records."""
    size = EVENT_DTYPE.itemsize
    counts = np.array(counts, dtype=np.int64)
    out = np.empty(int(counts.sum()), dtype=EVENT_DTYPE) if out is None else out[:int(counts.sum())]
    raw = memoryview(out.view(np.uint8))
    at = 0
    for i, rank in enumerate(ranks):
        want, got = int(counts[i]) * size, 0
        if want:
            try:
                with open(rank_events_path(spool_dir, rank), "rb", buffering=0) as fh:
                    while got < want:
                        n = fh.readinto(raw[at + got:at + want])
                        if not n:
                            break
                        got += n
            except FileNotFoundError:
                pass
            except OSError as exc:  # EIO: a failing disk; the recovery stops with the file named
                raise TraceError(f"reading {rank_events_path(spool_dir, rank)} failed: {io_error_text(exc)}") \
                    from None
        if got < want:  # later files are read after this one: they simply start earlier
            counts[i] = got // size
            want = int(counts[i]) * size
        at += want
    return out[:int(counts.sum())], counts


def sort_by_rank_and_start(events: np.ndarray, counts: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Events of consecutive ranks (``counts[i]`` each, in that order) sorted by start within each
    rank, stably (a step span precedes what starts with it); ``events`` itself when already in
    order, else a copy (into ``out`` if given: at least as long). One stable sort of an int64 key
    (rank index, start) for the whole batch; two keys if it would overflow."""
    start = events["start_ns"]
    if len(start) < 2:
        return events
    block = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if not ((start[1:] < start[:-1]) & (block[1:] == block[:-1])).any():
        return events
    lo, span = int(start.min()), int(start.max()) - int(start.min()) + 1
    if span * len(counts) < (1 << 62):
        order = np.argsort(block * span + (start - lo), kind="stable")
    else:
        order = np.lexsort((start, block))
    # gather whole records as rows of bytes (no per-field work); mode "clip": no bounds-check copy
    rows = np.ascontiguousarray(events).view(np.uint8).reshape(len(events), events.dtype.itemsize)
    target = np.empty(len(events), dtype=events.dtype) if out is None else out[:len(events)]
    np.take(rows, order, axis=0, out=target.view(np.uint8).reshape(rows.shape), mode="clip")
    return target


def rank_batches(spool_dir: str, first: int, stop: int, kept: np.ndarray, max_events: int = RECOVER_BATCH_EVENTS):
    """Batches of consecutive ranks of ``[first, stop)``: yields ``(first rank, per-rank counts, events
    in rank order and sorted by start within each rank, events dropped)``, the events of steps
    outside ``kept`` dropped. A batch holds whole ranks, about ``max_events`` at most."""
    sizes = spool_event_counts(spool_dir, range(first, stop))
    lo = 0
    while lo < len(sizes):
        hi = lo + 1
        total = int(sizes[lo])
        while hi < len(sizes) and total < max_events:
            total += int(sizes[hi])
            hi += 1
        ranks = list(range(first + lo, first + hi))
        events, counts = read_rank_files(spool_dir, ranks, sizes[lo:hi], SCRATCH.get("read", total))
        check_event_ranks(spool_dir, ranks, counts, events)
        lo = hi
        dropped = 0
        keep = kept_mask(events["step"], kept)
        if keep is not None:
            held = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
            ends = np.cumsum(counts)
            new_counts = held[ends] - held[ends - counts]
            dropped = int(len(events) - held[-1])
            events, counts = events[keep], new_counts
        yield ranks[0], counts, sort_by_rank_and_start(events, counts, SCRATCH.get("sorted", len(events))), dropped


def check_event_ranks(spool_dir: str, ranks: Sequence[int], counts: np.ndarray, events: np.ndarray) -> None:
    """Every event read from rank r's ``.events`` file says rank r, else :class:`TraceError` naming the file
    and the record (flipped bytes, a file of another run copied in): a recovery never merges such events."""
    expected = np.repeat(np.asarray(ranks, dtype=np.int64), counts)
    bad = np.nonzero(events["rank"].astype(np.int64) != expected)[0]
    if not len(bad):
        return
    i = int(bad[0])
    rank = int(expected[i])
    record = i - int(np.sum(counts[:list(ranks).index(rank)]))
    raise TraceError(f"{rank_events_path(spool_dir, rank)} is damaged: record {record} says rank "
                     f"{int(events['rank'][i])}, not {rank} "
                     f"({len(bad)} such record(s) in ranks {ranks[0]}-{ranks[-1]}; "
                     "flipped bytes or another run's file): nothing was written, the per-rank files are kept")


def recover_group(spool_dir: str, index: int, first: int, stop: int, kept: np.ndarray, path: Optional[str],
                  run_id: str, compression: str, writer=None) -> Tuple[List[int], int, int]:
    """Write the events of ranks ``[first, stop)`` from their spool files (:func:`rank_batches`: read
    into one array per batch, sorted with one sort, written with one append), keeping the steps in
    ``kept``: into the part file ``path``, or into ``writer`` (a single-file
    :class:`~fourd_mpi.trace.writer.TraceFileWriter`, left open). Returns ``(per-rank counts, events
    dropped, peak RSS of this process in KiB)``."""
    import resource

    part = writer is None
    if part:
        writer = PartWriter(path, index, first, stop - first, run_id, compression, checksum=True)
    counts, dropped, keys, held = [], 0, [], []
    try:
        for batch_first, batch_counts, events, batch_dropped in rank_batches(spool_dir, first, stop, kept):
            writer.append_ranks(batch_first, batch_counts, events)
            counts += batch_counts.tolist()
            dropped += batch_dropped
            batch_keys, batch_held = count_keys(rank_step_keys(events["rank"], events["step"]))
            keys.append(batch_keys)
            held.append(batch_held)
            del events
        if part:
            writer.close()
    except OSError as exc:  # reading the spool raises TraceError itself (read_rank_files)
        raise TraceError(f"writing {path or writer.final_path} failed: {io_error_text(exc)}") from None
    finally:
        if part:
            writer.abort()
    # read the closed part back now, while its pages are warm and the other groups still write
    readback = verify_part((path, index, sum(counts), writer.digest.hexdigest(), run_id)) if part else None
    return GroupResult(counts, dropped, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, readback,
                       np.concatenate(keys or [np.zeros(0, np.int64)]), np.concatenate(held or [np.zeros(0, np.int64)]))


class GroupResult(NamedTuple):
    """What writing one group returns to :func:`~fourd_mpi.trace.recover.recover`."""

    counts: List[int]  #: events per rank, in rank order
    dropped: int  #: events of steps not kept
    peak_rss_kib: int  #: ``ru_maxrss`` of the process that wrote the group
    readback: Optional[str]  #: a part: why it does not read back as written (:func:`verify_part`), None if it does
    keys: np.ndarray  #: :func:`rank_step_keys` of the (rank, step) pairs written, sorted
    held: np.ndarray  #: events written per key


def count_keys(keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)``, without a sort when ``keys`` are already in order (a
    batch's (rank, step) keys are: events sorted by rank, then time)."""
    if len(keys) and not (keys[1:] < keys[:-1]).any():
        begin = np.concatenate([[0], np.nonzero(keys[1:] != keys[:-1])[0] + 1])
        return keys[begin], np.diff(np.append(begin, len(keys)))
    return np.unique(keys, return_counts=True)


def rank_step_keys(ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One int64 per (rank, step): ``rank * 2**32 + (step mod 2**32)`` (sorts by rank, then step >= 0)."""
    return (ranks.astype(np.int64) << 32) | (steps.astype(np.int64) & 0xFFFFFFFF)


def verify_part(task) -> Optional[str]:
    """``(path, index, events, digest, run_id)``: read a closed part file back (a fresh open, the bytes
    from the file system) and compare its attributes, row count and the XXH3-64 digest of its event
    bytes (:func:`event_digest`, hex) with what was written. None if it matches, else the reason
    (one line)."""
    path, index, count, digest, run_id = task
    try:
        with open_h5_read(path) as part:
            attrs = part.attrs
            if attrs.get("schema") != PART_SCHEMA or str(attrs.get("run_id")) != run_id or \
                    int(attrs.get("part", -1)) != index or int(attrs.get("events", -1)) != count:
                return f"{path} does not carry the attributes written (part {index}, {count} events)"
            events = part["events"] if "events" in part else None
            if events is None or events.shape != (count,) or events.dtype != EVENT_DTYPE:
                return f"{path} does not hold the {count} events written"
            buffer = SCRATCH.get("read", min(count, RECOVER_BATCH_EVENTS))
            hasher = event_digest()
            for lo in range(0, count, len(buffer) or 1):
                n = min(len(buffer), count - lo)
                events.read_direct(buffer, source_sel=np.s_[lo:lo + n], dest_sel=np.s_[0:n])
                hasher.update(buffer[:n].view(np.uint8))
            got = hasher.hexdigest()
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        return f"{path} does not read back: {' '.join(str(exc).split())[:200]}"
    if got != digest:
        return f"{path}: the events read back differ from those written (XXH3-64 {got} != {digest})"
    return None


def kept_mask(steps: np.ndarray, kept: np.ndarray) -> Optional[np.ndarray]:
    """Which of ``steps`` are in ``kept`` (sorted); None when all are (nothing to drop)."""
    if not len(steps):
        return None
    if len(kept) and kept[-1] - kept[0] + 1 == len(kept):  # a range: two comparisons
        lo, hi = int(steps.min()), int(steps.max())
        if kept[0] <= lo and hi <= kept[-1]:
            return None
        return (steps >= kept[0]) & (steps <= kept[-1])
    return np.isin(steps, kept)


def _recover_group_task(task):
    return recover_group(*task)


class GroupPool:
    """Runs one function over the groups: in ``jobs`` worker processes, or here when ``jobs`` <= 1 or
    one group. The workers are forked at once (about 0.2-0.4 CPU-s cheaper each than a fresh
    interpreter importing NumPy and h5py) when that is safe: a POSIX system, this process has one
    thread, and no HDF5 object is open (a child then inherits no HDF5 file state; h5py's lock is
    free). Otherwise they are spawned (a clean interpreter each)."""

    def __init__(self, jobs: int, groups: int):
        self.pool = None
        self.start_method = None
        if jobs > 1 and groups > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.start_method = "fork" if _fork_is_safe() else "spawn"
            if self.start_method == "fork":
                import h5py  # noqa: F401 - imported once here, inherited by every worker (no file open yet)
            self.pool = ProcessPoolExecutor(max_workers=min(jobs, groups),
                                            mp_context=multiprocessing.get_context(self.start_method),
                                            initializer=die_with_parent, initargs=(os.getpid(),))
            self.pool.submit(int).result()  # starts every worker now, before this process opens a file

    def map(self, function, tasks) -> list:
        if self.pool is None:
            return [function(task) for task in tasks]
        return list(self.pool.map(function, tasks))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


#: ``prctl`` option: the signal a process receives when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a pool worker: be killed (SIGKILL) when the process that started it dies, even by SIGKILL (Linux:
    ``prctl(PR_SET_PDEATHSIG)``), so a killed ``trace recover`` leaves no worker blocked forever; and exit
    now if that parent is already gone (it died before the call)."""
    import signal

    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent-pid check below only
        pass
    if os.getppid() != parent:
        os._exit(1)


def _fork_is_safe() -> bool:
    import multiprocessing
    import sys
    import threading

    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() != 1:
        return False
    h5py = sys.modules.get("h5py")
    try:
        if h5py is None:
            return True
        from h5py import h5f

        return h5f.get_obj_count(h5f.OBJ_ALL, h5f.OBJ_FILE | h5f.OBJ_DATASET | h5f.OBJ_GROUP | h5f.OBJ_ATTR) == 0
    except Exception:  # noqa: BLE001 - unknown h5py state: spawn
        return False


def read_group_records(task) -> Tuple[List[Dict], List[np.ndarray], List[Dict], List[int], List[str]]:
    """``(spool_dir, first, stop)`` -> the rank metadata, step records, failure reports, ranks
    without metadata and live ranks (:func:`~fourd_mpi.trace.spool.live_rank`) of ranks ``[first,
    stop)`` (``recover``'s first pass, group by group)."""
    import json
    import socket

    spool_dir, first, stop = task
    host = socket.gethostname()
    metas, steps, failures, missing, live = [], [], [], [], []
    for rank in range(first, stop):
        stem = rank_stem_path(spool_dir, rank)
        try:
            with open(stem + ".json", "rb") as fh:  # bytes: no text decoder per file
                meta = json.loads(fh.read())
            metas.append(meta)
        except (OSError, ValueError):
            meta = None
            metas.append({"rank": rank})
            missing.append(rank)
        where = live_rank(stem, rank, meta if isinstance(meta, dict) else {}, host)
        if where is not None:
            live.append(where)
        steps.append(read_records(stem + ".steps", RANK_STEP_DTYPE))
        if os.path.exists(stem + ".failed.json"):
            failures.append(read_failure(stem + ".failed.json", rank))
    return metas, steps, failures, missing, live


def recover_parts(spool_dir: str, groups: Sequence[Tuple[int, int]], kept: np.ndarray, staged: StagedParts,
                  run_id: str, compression: str, pool: GroupPool) -> List[GroupResult]:
    """Every group's part, through ``pool``; one :class:`GroupResult` per group, in group order."""
    tasks = [(spool_dir, i, first, stop, kept, staged.path(i), run_id, compression)
             for i, (first, stop) in enumerate(groups)]
    return pool.map(_recover_group_task, tasks)
