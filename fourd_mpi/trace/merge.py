"""Hierarchical trace merge: groups of ranks write part files, a top-level file binds them.

Why: a single writer moves every event of the run through one process (about 0.4 M
events/s measured with gzip; 90 M events at 32,768 ranks x 10 op-level steps). Here the
world is cut into **groups** of consecutive ranks, ``[g * G, (g + 1) * G)`` for group
size ``G`` (``--trace-group-size``; default: the ranks of the largest node, raised so that
there are at most :data:`MAX_PARTS` groups). Each group's lowest rank receives its
members' events (one rank at a time, pieces of :data:`~fourd_mpi.trace.store.MERGE_CHUNK`
events) and writes them into its own **part file**; the groups write in parallel. Rank 0
then writes the top-level trace, whose ``/events`` is an HDF5 *virtual dataset* that
concatenates the parts' ``/events`` in group order, i.e. in rank order. A writer holds
its own events and one received piece at a time, never another group's events.

Layout of a trace with ``P > 1`` parts (schema version 5, ``docs/trace-format.md``)::

    <name>.h5                  top level: attributes, /metadata, /vocab, /ranks, /steps,
                               /rank_steps, /parts (one row per part), /events (virtual)
    <name>.parts/part000000.h5 /events of ranks [0, G), root attributes below
    <name>.parts/part000001.h5 ...

The virtual dataset names its sources by *relative* paths (``<name>.parts/partNNNNNN.h5``),
which HDF5 resolves against the directory of the top-level file: the pair can be moved or
copied anywhere together. A run whose world is a single group writes one self-contained
file as before (``parts = 0``).

One process (``trace recover``) uses the same layout: each group's part is written from
the spool files of its ranks, one rank in memory at a time, by a pool of ``jobs`` worker
processes. Nothing here initializes MPI at import time.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE, SCHEMA_VERSION

#: the root ``schema`` attribute of a part file (not a trace on its own)
PART_SCHEMA = "fourd_mpi.trace.part"
PARTS_SUFFIX = ".parts"
#: the default group size is raised until there are at most this many part files: HDF5 keeps every
#: source file of a virtual dataset open while reading it (one descriptor each)
MAX_PARTS = 256
#: ``/parts`` of a multi-part trace: one row per part, in rank order
PART_DTYPE = np.dtype([("first_rank", "<u4"), ("rank_count", "<u4"), ("event_offset", "<i8"),
                       ("event_count", "<i8"), ("file", "S32")])
#: HDF5 dataset options per ``compression`` name (gzip: the single-file default since version 1)
COMPRESSIONS = {
    "gzip": dict(compression="gzip", compression_opts=1, shuffle=True),
    "lzf": dict(compression="lzf", shuffle=True),
    "none": {},
}
EVENT_CHUNK_ROWS = 4096


def concat_records(arrays: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """``np.concatenate`` of many arrays of one structured ``dtype``, as raw records (NumPy's
    concatenate promotes structured dtypes pair by pair: slow for thousands of ranks)."""
    raw = np.dtype((np.void, dtype.itemsize))
    return np.concatenate([np.ascontiguousarray(a, dtype=dtype).view(raw) for a in arrays]
                          or [np.empty(0, raw)]).view(dtype)


def missing_part_fill() -> np.ndarray:
    """The virtual dataset's fill value: what plain h5py reads where a part file cannot be opened
    (``rank = 2**32 - 1``, ``step = -1``; :func:`read_parts` refuses such a trace instead)."""
    fill = np.zeros(1, dtype=EVENT_DTYPE)
    fill["rank"], fill["step"] = np.iinfo(np.uint32).max, -1
    return fill[0]


def parts_dir_of(trace_path: str) -> str:
    """``run.h5`` -> ``run.parts`` (the part files' directory, next to the trace)."""
    stem = trace_path[:-3] if trace_path.endswith(".h5") else trace_path
    return stem + PARTS_SUFFIX


def part_name(index: int) -> str:
    return f"part{index:06d}.h5"


def plan_groups(world_size: int, group_size: int) -> List[Tuple[int, int]]:
    """Consecutive rank ranges ``[(first, stop), ...]`` of at most ``group_size`` ranks (the last may be
    smaller): ``plan_groups(8, 3) == [(0, 3), (3, 6), (6, 8)]``."""
    if world_size < 1 or group_size < 1:
        raise ValueError(f"world size {world_size} and group size {group_size} must be >= 1")
    return [(first, min(first + group_size, world_size)) for first in range(0, world_size, group_size)]


def auto_group_size(world_size: int, ranks_per_node: int, max_parts: int = MAX_PARTS) -> int:
    """Default group size: ``max(ranks_per_node, ceil(world_size / max_parts))`` (one writer per node,
    at most ``max_parts`` part files)."""
    return max(1, int(ranks_per_node), math.ceil(world_size / max_parts))


def resolve_group_size(world_size: int, group_size: int, ranks_per_node: int) -> int:
    """``group_size`` if positive, else :func:`auto_group_size`; never more than the world."""
    size = group_size if group_size > 0 else auto_group_size(world_size, ranks_per_node)
    return min(size, world_size)


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------

def create_events_dataset(h5, compression: str = "gzip"):
    """An empty, growable ``/events`` (chunks of 4096 rows, ``compression`` from :data:`COMPRESSIONS`)."""
    if compression not in COMPRESSIONS:
        raise TraceError(f"unknown trace compression {compression!r}: choose one of {', '.join(COMPRESSIONS)}")
    return h5.create_dataset("events", shape=(0,), maxshape=(None,), dtype=EVENT_DTYPE, chunks=(EVENT_CHUNK_ROWS,),
                             **COMPRESSIONS[compression])


def append_rows(dataset, rows: np.ndarray) -> None:
    start = dataset.shape[0]
    dataset.resize((start + len(rows),))
    dataset[start:] = rows


class EventBuffer:
    """Appends to ``/events`` in writes of ``rows`` events (a multiple of the chunk), so that no
    compressed chunk is written twice (appending each rank's few hundred events directly would
    decompress and recompress the partial last chunk every time). Holds at most ``rows`` events."""

    def __init__(self, dataset, rows: int = 1 << 18):
        self.dataset = dataset
        self.buffer = np.empty(rows - rows % EVENT_CHUNK_ROWS or EVENT_CHUNK_ROWS, dtype=EVENT_DTYPE)
        self._raw = np.dtype((np.void, EVENT_DTYPE.itemsize))
        self.used = 0
        self.total = dataset.shape[0]  #: events appended so far, written or buffered

    def append(self, events: np.ndarray) -> None:
        """Buffer ``events``; whole buffers are written, and a run of whole chunks that meets an empty
        buffer goes to the file directly (no copy)."""
        done, n = 0, len(events)
        while done < n:
            if self.used == 0 and n - done >= EVENT_CHUNK_ROWS:  # the file ends on a chunk boundary here
                take = (n - done) // EVENT_CHUNK_ROWS * EVENT_CHUNK_ROWS
                append_rows(self.dataset, np.ascontiguousarray(events[done:done + take]))
                done += take
                continue
            take = min(n - done, len(self.buffer) - self.used)
            # as raw records: a plain copy (a structured assignment checks field by field)
            self.buffer.view(self._raw)[self.used:self.used + take] = \
                np.ascontiguousarray(events[done:done + take]).view(self._raw)
            self.used += take
            done += take
            if self.used == len(self.buffer):
                self.flush()
        self.total += n

    def flush(self) -> None:
        if self.used:
            append_rows(self.dataset, self.buffer[:self.used])
            self.used = 0


class PartWriter:
    """Writes the ``/events`` of one group of ranks into ``path`` (a part file, see the module doc)."""

    def __init__(self, path: str, index: int, first_rank: int, rank_count: int, run_id: str,
                 compression: str = "gzip", checksum: bool = False):
        import h5py

        from fourd_mpi.trace.store import GuardedFile

        self.path = path
        self.h5 = self._raw = None
        #: ``checksum``: the XXH3-64 digest (:func:`event_digest`) of the bytes of every event appended, in
        #: order (what :func:`verify_part` reads back); None without
        self.digest = event_digest() if checksum else None
        try:
            self._raw = GuardedFile(path)  # HDF5 never sees an I/O error (store.GuardedFile: no segfault)
            self.h5 = h5py.File(self._raw, "w")
            self.h5.attrs.update({"schema": PART_SCHEMA, "schema_version": SCHEMA_VERSION, "run_id": run_id,
                                  "part": index, "first_rank": first_rank, "rank_count": rank_count})
            self.events = EventBuffer(create_events_dataset(self.h5, compression))
        except OSError as exc:
            self.abort()
            raise TraceError(f"cannot write the trace part {path}: {exc}") from None

    @property
    def count(self) -> int:
        return self.events.total

    def append_events(self, rank: int, events: np.ndarray) -> None:
        events = np.ascontiguousarray(events)
        if self.digest is not None:
            self.digest.update(events.view(np.uint8))
        self.events.append(events)

    def append_ranks(self, first_rank: int, counts: np.ndarray, events: np.ndarray) -> None:
        """The events of ranks ``first_rank, first_rank + 1, ...`` (``counts`` each), in rank order."""
        events = np.ascontiguousarray(events)
        if self.digest is not None:
            self.digest.update(events.view(np.uint8))
        self.events.append(events)
        self._check()

    def close(self) -> int:
        """Write the buffered events and the event count, close; returns it."""
        self.events.flush()
        self.h5.attrs["events"] = self.count
        self.h5.close()
        self.h5 = None
        self._check()
        self._raw.close()
        self._raw = None
        return self.count

    def _check(self) -> None:
        if self._raw is not None and self._raw.error is not None:
            from fourd_mpi.trace.store import io_error_text

            raise TraceError(f"writing {self.path} failed: {io_error_text(self._raw.error)}")

    def abort(self) -> None:
        for closer in (self.h5, self._raw):
            if closer is not None:
                try:
                    closer.close()
                except Exception:  # noqa: BLE001 - the staged parts are removed by the caller
                    pass
        self.h5 = self._raw = None


def parts_table(groups: Sequence[Tuple[int, int]], rank_counts: Sequence[int]) -> np.ndarray:
    """``/parts``: per group its first rank, rank count, and its events' offset and count in ``/events``."""
    counts = np.asarray(rank_counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    out = np.zeros(len(groups), dtype=PART_DTYPE)
    for i, (first, stop) in enumerate(groups):
        out[i] = (first, stop - first, offsets[first], offsets[stop] - offsets[first], part_name(i).encode())
    return out


def bind_parts(h5, parts: np.ndarray, parts_dirname: str) -> None:
    """Create ``/parts`` and the virtual ``/events`` of an open top-level file.

    ``parts_dirname``: the parts directory's name relative to the top-level file's directory
    (HDF5 resolves relative source paths against it, so the pair can be moved together).
    """
    import h5py

    total = int(parts["event_count"].sum())
    layout = h5py.VirtualLayout(shape=(total,), maxshape=(total,), dtype=EVENT_DTYPE)
    for row in parts:
        count = int(row["event_count"])
        if count:
            offset = int(row["event_offset"])
            source = h5py.VirtualSource(f"{parts_dirname}/{row['file'].decode()}", "events", shape=(count,))
            layout[offset:offset + count] = source
    h5.create_virtual_dataset("events", layout, fillvalue=missing_part_fill())
    h5.create_dataset("parts", data=parts)


class StagedParts:
    """The part files of one trace while they are written: a hidden directory next to the trace,
    renamed to ``<name>.parts`` by :meth:`publish` just before the top-level file is published."""

    def __init__(self, trace_path: str, force: bool):
        self.final_dir = parts_dir_of(os.path.abspath(trace_path))
        if os.path.exists(self.final_dir) and not force:
            raise TraceError(f"{self.final_dir} already exists (use --force to replace it)")
        parent, name = os.path.split(self.final_dir)
        self.dir = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            os.mkdir(self.dir)
        except OSError as exc:
            raise TraceError(f"cannot create {self.dir}: {exc.strerror}") from None
        self.force = force
        self._old = None

    @property
    def dirname(self) -> str:
        """The final directory's name (the relative path the virtual dataset uses)."""
        return os.path.basename(self.final_dir)

    def path(self, index: int) -> str:
        return os.path.join(self.dir, part_name(index))

    def publish(self) -> None:
        """Move the staged directory to its final name (``--force``: an old one is set aside first)."""
        if os.path.exists(self.final_dir):
            if not self.force:
                raise TraceError(f"{self.final_dir} appeared while the trace was written; not overwritten")
            parent, name = os.path.split(self.final_dir)
            self._old = os.path.join(parent, f".{name}.old-{os.getpid()}-{secrets.token_hex(3)}")
            os.rename(self.final_dir, self._old)
        os.rename(self.dir, self.final_dir)
        self.dir = self.final_dir

    def committed(self) -> None:
        """The top-level file is published: drop the set-aside old parts."""
        if self._old is not None:
            shutil.rmtree(self._old, ignore_errors=True)
            self._old = None

    def abort(self) -> None:
        """Remove what was staged (or published, if the top-level file then failed); restore old parts."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._old is not None:
            try:
                os.rename(self._old, self.final_dir)
            except OSError:
                pass
            self._old = None


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------

def read_parts(path: str, h5, run_id: str, expected_events: int, read: bool = True) -> Optional[np.ndarray]:
    """All events of an open multi-part trace, read part by part (one part file open at a time);
    ``read=False``: the checks below only (returns None).

    Checks every part before use: present next to the trace, a part file of this run with the rows
    ``/parts`` promises. Raises :class:`TraceError` naming the part and the reason (a missing part
    would otherwise read as fill values through the virtual dataset).
    """
    from fourd_mpi.trace.store import open_h5_read

    parts = h5["parts"][()]
    if parts.dtype.names is None or not set(PART_DTYPE.names) <= set(parts.dtype.names):
        raise TraceError(f"{path}: /parts lacks the columns of a part table")
    counts = parts["event_count"].astype(np.int64)
    offsets = parts["event_offset"].astype(np.int64)
    if (counts < 0).any() or int(counts.sum()) != expected_events or \
            not np.array_equal(offsets, np.concatenate([[0], np.cumsum(counts)[:-1]])):
        raise TraceError(f"{path}: /parts does not add up to the {expected_events} events of its header")
    directory = os.path.join(os.path.dirname(os.path.abspath(path)), parts_dir_of(os.path.basename(path)))
    out = np.empty(expected_events, dtype=EVENT_DTYPE) if read else None
    for row in parts:
        name = row["file"].decode(errors="replace")
        if os.path.basename(name) != name or not name:
            raise TraceError(f"{path}: part name {name!r} is not a plain file name")
        part_path = os.path.join(directory, name)
        try:
            part = open_h5_read(part_path)
        except FileNotFoundError:
            raise TraceError(f"{path}: its part {part_path} is missing (a multi-part trace is the .h5 file and its "
                             f"{PARTS_SUFFIX} directory: copy or move both)") from None
        except OSError as exc:
            raise TraceError(f"{part_path} is not a readable HDF5 file: {' '.join(str(exc).split())[:200]}") from None
        with part:
            attrs = part.attrs
            if attrs.get("schema") != PART_SCHEMA or str(attrs.get("run_id")) != run_id:
                raise TraceError(f"{part_path} is not a part of the trace {path} (schema {attrs.get('schema')!r}, "
                                 f"run id {attrs.get('run_id')!r})")
            count, offset = int(row["event_count"]), int(row["event_offset"])
            events = part["events"] if "events" in part else None
            if events is None or events.shape != (count,) or int(attrs.get("events", -1)) != count:
                raise TraceError(f"{part_path} holds {None if events is None else events.shape[0]} events, "
                                 f"{path} expects {count} (truncated part?)")
            if count and read:
                events.read_direct(out, dest_sel=np.s_[offset:offset + count])
    return out


# ---------------------------------------------------------------------------
# end of a run: the collective merge
# ---------------------------------------------------------------------------

def ranks_per_node(comm) -> int:
    """Collective: the number of ranks on the most populated node (``MPI_COMM_TYPE_SHARED``)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return comm.allreduce(node.Get_size(), op=MPI.MAX)
    finally:
        node.Free()


def merge_collective(comm, events: np.ndarray, rank_steps: np.ndarray, rank_meta: Dict, trace_path: str,
                     metadata: Optional[Dict], layers: Sequence[str], force: bool, group_size: int = 0,
                     compression: str = "gzip") -> Tuple[Optional[str], Optional[str]]:
    """Collective over ``comm``: write the trace of every rank's ``events`` (this rank's, sorted);
    returns ``(error, path)``, the same on every rank (error: one line, or None).

    ``group_size`` <= 0: :func:`auto_group_size` from the ranks per node. One group: rank 0 writes
    one self-contained file. Several: each group's lowest rank writes its part, rank 0 the top level.
    ``rank_steps`` (this rank's step records) and ``rank_meta`` are gathered to rank 0.
    """
    from mpi4py import MPI

    from fourd_mpi.trace.store import MERGE_CHUNK, TraceFileWriter, ranks_table

    rank, size = comm.Get_rank(), comm.Get_size()
    group_size = resolve_group_size(size, group_size, ranks_per_node(comm) if group_size <= 0 else 1)
    groups = plan_groups(size, group_size)
    multi = len(groups) > 1
    run_id = str((metadata or {}).get("run_id", ""))  # metadata: rank 0's (None elsewhere)
    top = staged = None
    error = None
    if rank == 0:
        try:
            top = TraceFileWriter(trace_path, force, compression=compression, parts=multi)
            staged = top.staged
        except TraceError as exc:
            error = str(exc)
    error, staged_dir, run_id = comm.bcast((error, staged.dir if staged is not None else None, run_id), root=0)
    index = rank // group_size
    group = comm.Split(index, rank) if multi else comm
    writer = None
    local_error = None
    if error is None:
        if group.Get_rank() == 0:
            if multi:
                first, stop = groups[index]
                try:
                    writer = PartWriter(os.path.join(staged_dir, part_name(index)), index, first, stop - first,
                                        run_id, compression)
                except TraceError as exc:
                    local_error = str(exc)
            else:
                writer = top
        for source in range(group.Get_size()):  # one rank at a time: the writer holds one piece
            if group.Get_rank() == source:
                pieces = [events[i:i + MERGE_CHUNK] for i in range(0, len(events), MERGE_CHUNK)]
                if source == 0:
                    for piece in pieces:
                        local_error = local_error or _append(writer, rank, piece)
                else:
                    group.send(len(pieces), dest=0, tag=81)
                    for piece in pieces:
                        group.send(len(piece), dest=0, tag=82)
                        group.Send([piece.view(np.uint8), MPI.BYTE], dest=0, tag=83)
            elif group.Get_rank() == 0:
                sender = comm.Get_rank() + source  # groups are consecutive ranks
                for _ in range(group.recv(source=source, tag=81)):
                    piece = np.empty(group.recv(source=source, tag=82), dtype=EVENT_DTYPE)
                    group.Recv([piece.view(np.uint8), MPI.BYTE], source=source, tag=83)
                    local_error = local_error or _append(writer, sender, piece)
        if multi and writer is not None:
            try:
                if local_error is None:
                    writer.close()
            except TraceError as exc:
                local_error = str(exc)
            except OSError as exc:
                local_error = f"writing {writer.path} failed: {_io_error_text(exc)}"
            finally:
                writer.abort()
    if multi:
        group.Free()
    errors = comm.gather(local_error, root=0)
    counts = comm.gather(len(events), root=0)
    all_steps = comm.gather(rank_steps, root=0)
    rank_metas = comm.gather(rank_meta, root=0)
    path = None
    if rank == 0:
        error = error or next((e for e in errors if e is not None), None)
        if error is None:
            try:
                if multi:
                    top.bind(groups, counts)
                path = top.finish(dict(metadata or {}, end_time=_now()), ranks_table(rank_metas),
                                  concat_records(all_steps, RANK_STEP_DTYPE), layers, "complete")
            except (OSError, TraceError) as exc:
                top.abort()
                error = str(exc)
        elif top is not None:
            top.abort()
        if error is not None and staged_dir:  # name the part where it belongs, not the removed staging directory
            error = error.replace(staged_dir, parts_dir_of(os.path.abspath(trace_path)))
    return comm.bcast((error, path), root=0)


def _now() -> str:
    from fourd_mpi.trace.store import now_iso

    return now_iso()


def _append(writer, rank: int, piece: np.ndarray) -> Optional[str]:
    """A writer appends, an I/O error becomes a message (the other ranks keep sending)."""
    try:
        writer.append_events(rank, piece)
        return None
    except TraceError as exc:
        return str(exc)
    except OSError as exc:
        return f"writing {getattr(writer, 'path', None) or writer.final_path} failed: {_io_error_text(exc)}"


def _io_error_text(exc: OSError) -> str:
    from fourd_mpi.trace.store import io_error_text

    return io_error_text(exc)


# ---------------------------------------------------------------------------
# recovery: the same layout from the spool files, one process (and a pool of workers)
# ---------------------------------------------------------------------------

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
    from fourd_mpi.trace.store import rank_events_path

    counts = np.zeros(len(ranks), dtype=np.int64)
    for i, rank in enumerate(ranks):
        try:
            counts[i] = os.stat(rank_events_path(spool_dir, rank)).st_size // EVENT_DTYPE.itemsize
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TraceError(f"reading {rank_events_path(spool_dir, rank)} failed: {_io_error_text(exc)}") from None
    return counts


def read_rank_files(spool_dir: str, ranks: Sequence[int], counts: np.ndarray,
                    out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The first ``counts[i]`` records of the ``.events`` spool file of each of ``ranks``, read straight
    into one array (``out``, of at least ``sum(counts)`` events, or a new one; no per-rank arrays, no
    concatenation; one file open at a time); returns ``(events, per-rank counts read)``: a file that
    is missing or shorter now gives its whole records."""
    from fourd_mpi.trace.store import rank_events_path

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
                raise TraceError(f"reading {rank_events_path(spool_dir, rank)} failed: {_io_error_text(exc)}") \
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


def recover_group(spool_dir: str, index: int, first: int, stop: int, kept: np.ndarray, path: Optional[str],
                  run_id: str, compression: str, writer=None) -> Tuple[List[int], int, int]:
    """Write the events of ranks ``[first, stop)`` from their spool files (:func:`rank_batches`: read
    into one array per batch, sorted with one sort, written with one append), keeping the steps in
    ``kept``: into the part file ``path``, or into ``writer`` (a single-file
    :class:`~fourd_mpi.trace.store.TraceFileWriter`, left open). Returns ``(per-rank counts, events
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
        raise TraceError(f"writing {path or writer.final_path} failed: {_io_error_text(exc)}") from None
    finally:
        if part:
            writer.abort()
    # read the closed part back now, while its pages are warm and the other groups still write
    readback = verify_part((path, index, sum(counts), writer.digest.hexdigest(), run_id)) if part else None
    return GroupResult(counts, dropped, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, readback,
                       np.concatenate(keys or [np.zeros(0, np.int64)]), np.concatenate(held or [np.zeros(0, np.int64)]))


class GroupResult(NamedTuple):
    """What writing one group returns to :func:`~fourd_mpi.trace.store.recover`."""

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


def event_digest():
    """A streaming XXH3-64 hash (``xxhash``) of event bytes: ``update(bytes)``, ``hexdigest()``; the same
    digest however the bytes are split. About 30 GB/s on one core here against 4 GB/s for
    ``zlib.crc32``, which cost a sixth of a recovery's CPU time (writing plus reading back)."""
    import xxhash

    return xxhash.xxh3_64()


def verify_part(task) -> Optional[str]:
    """``(path, index, events, digest, run_id)``: read a closed part file back (a fresh open, the bytes
    from the file system) and compare its attributes, row count and the XXH3-64 digest of its event
    bytes (:func:`event_digest`, hex) with what was written. None if it matches, else the reason
    (one line)."""
    from fourd_mpi.trace.store import open_h5_read

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
                                            mp_context=multiprocessing.get_context(self.start_method))
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
    without metadata and live ranks (:func:`~fourd_mpi.trace.store.live_rank`) of ranks ``[first,
    stop)`` (``recover``'s first pass, group by group)."""
    import json
    import socket

    from fourd_mpi.trace.events import RANK_STEP_DTYPE
    from fourd_mpi.trace.store import live_rank, rank_stem_path, read_failure, read_records

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
