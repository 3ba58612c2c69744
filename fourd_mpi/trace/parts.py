"""Part files of a hierarchical trace (schema version 5): the groups of ranks, the ``/events``
dataset and its buffered writer, one group's part file (:class:`PartWriter`), the parts staged under
a temporary directory (:class:`StagedParts`), the virtual ``/events`` of the top-level file that binds
them, and reading the parts back (:func:`read_parts`).

Why and how the world is cut into groups: :mod:`fourd_mpi.trace.merge`; the layout:
``docs/trace-format.md``.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from typing import List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, SCHEMA_VERSION
from fourd_mpi.trace.files import PARTS_SUFFIX, io_error_text, open_h5_read, parts_dir_of
from fourd_mpi.trace.guarded import GuardedFile
from fourd_mpi.util.signals import deferring

#: the root ``schema`` attribute of a part file (not a trace on its own)
PART_SCHEMA = "fourd_mpi.trace.part"


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

    @deferring
    def __init__(self, path: str, index: int, first_rank: int, rank_count: int, run_id: str,
                 compression: str = "gzip", checksum: bool = False):
        import h5py

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

    @deferring
    def append_events(self, rank: int, events: np.ndarray) -> None:
        events = np.ascontiguousarray(events)
        if self.digest is not None:
            self.digest.update(events.view(np.uint8))
        self.events.append(events)

    @deferring
    def append_ranks(self, first_rank: int, counts: np.ndarray, events: np.ndarray) -> None:
        """The events of ranks ``first_rank, first_rank + 1, ...`` (``counts`` each), in rank order."""
        events = np.ascontiguousarray(events)
        if self.digest is not None:
            self.digest.update(events.view(np.uint8))
        self.events.append(events)
        self._check()

    @deferring
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
            raise TraceError(f"writing {self.path} failed: {io_error_text(self._raw.error)}")

    @deferring
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
        """Move the staged directory to its final name (``--force``: an old one is set aside first; never a
        symbolic link, which fourd-mpi did not make)."""
        if os.path.islink(self.final_dir):
            raise TraceError(f"{self.final_dir} is a symbolic link, which fourd-mpi did not make; not replaced")
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


def read_parts(path: str, h5, run_id: str, expected_events: int, read: bool = True) -> Optional[np.ndarray]:
    """All events of an open multi-part trace, read part by part (one part file open at a time);
    ``read=False``: the checks below only (returns None).

    Checks every part before use: present next to the trace, a part file of this run with the rows
    ``/parts`` promises. Raises :class:`TraceError` naming the part and the reason (a missing part
    would otherwise read as fill values through the virtual dataset).
    """
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


def event_digest():
    """A streaming XXH3-64 hash (``xxhash``) of event bytes: ``update(bytes)``, ``hexdigest()``; the same
    digest however the bytes are split. About 30 GB/s on one core here against 4 GB/s for
    ``zlib.crc32``, which cost a sixth of a recovery's CPU time (writing plus reading back)."""
    import xxhash

    return xxhash.xxh3_64()
