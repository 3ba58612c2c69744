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

import datetime
import json
import os
import secrets
import time
from typing import Dict, Optional, Sequence

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
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    os.replace(tmp, path)


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
    except OSError as exc:
        raise TraceError(f"cannot create the results directory {results_dir}: {exc.strerror}") from None
    if not os.access(results_dir, os.W_OK | os.X_OK):
        raise TraceError(f"the results directory {results_dir} is not writable")
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
    _write_json_atomic(os.path.join(spool_dir, RUN_META), dict(run_meta, trace_path=trace_path))
    return spool_dir


class RankSpool:
    """One rank's append-only spool files: ``rankNNNNNN.events``, ``.steps``, ``.json``."""

    def __init__(self, spool_dir: str, rank: int, rank_meta: Dict):
        self.dir = spool_dir
        self.rank = rank
        stem = os.path.join(spool_dir, _rank_stem(rank))
        self.events_path, self.steps_path = stem + ".events", stem + ".steps"
        self.failed_path = stem + ".failed.json"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        self._events_fd = self._steps_fd = None
        try:
            _write_json_atomic(stem + ".json", rank_meta)
            self._events_fd = os.open(self.events_path, flags, 0o644)
            self._steps_fd = os.open(self.steps_path, flags, 0o644)
        except OSError as exc:
            self.close()
            raise TraceError(f"rank {rank} cannot write its trace files in {spool_dir}: {exc.strerror}") from None
        self.events_written = 0

    def append(self, events: np.ndarray, rank_step: np.ndarray) -> None:
        """One step: its events, then its step record (the record marks the step complete)."""
        _write_all(self._events_fd, np.ascontiguousarray(events, dtype=EVENT_DTYPE).tobytes())
        _write_all(self._steps_fd, np.ascontiguousarray(rank_step, dtype=RANK_STEP_DTYPE).tobytes())
        self.events_written += len(events)

    def close(self) -> None:
        for fd in (self._events_fd, self._steps_fd):
            if fd is not None:
                os.close(fd)
        self._events_fd = self._steps_fd = None

    def mark_failed(self, message: str) -> None:
        """Leave the reason this rank is going down (``trace recover`` reports it)."""
        _write_json_atomic(self.failed_path, {"rank": self.rank, "time": now_iso(), "error": message})

    def remove(self) -> None:
        self.close()
        stem = os.path.join(self.dir, _rank_stem(self.rank))
        for suffix in (".events", ".steps", ".json", ".failed.json"):
            try:
                os.remove(stem + suffix)
            except FileNotFoundError:
                pass


def read_records(path: str, dtype: np.dtype) -> np.ndarray:
    """Whole fixed-size records of an append-only file (a torn last record is dropped)."""
    try:
        with open(path, "rb") as fh:
            whole = os.fstat(fh.fileno()).st_size // dtype.itemsize
            return np.fromfile(fh, dtype=dtype, count=whole)  # one read, no copy
    except FileNotFoundError:
        return np.empty(0, dtype=dtype)


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

class TraceFileWriter:
    """Writes ``final_path`` under a temporary name; :meth:`publish` makes it appear atomically.

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
        self.h5 = None
        self._buffer = None
        try:
            self.h5 = h5py.File(self.tmp_path, "w")
            self.events = None if parts else create_events_dataset(self.h5, compression)
            self._buffer = None if parts else EventBuffer(self.events)
        except (OSError, TraceError) as exc:
            self.abort()
            raise TraceError(f"cannot write {final_path}: {exc}") from None
        self.rank_offsets: Dict[int, tuple] = {}
        self.parts = 0

    def append_events(self, rank: int, events: np.ndarray) -> None:
        """Append a piece of ``rank``'s events (ranks in order, each rank's pieces in order; buffered
        into whole chunks, written at the latest by :meth:`finish`)."""
        start = self._buffer.total
        self._buffer.append(events)
        first, count = self.rank_offsets.get(rank, (start, 0))
        self.rank_offsets[rank] = (first, count + len(events))

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
        h5 = self.h5
        if self.staged is None:
            self._buffer.flush()
        ranks = ranks.copy()
        for i, r in enumerate(ranks["rank"]):
            ranks["event_offset"][i], ranks["event_count"][i] = self.rank_offsets.get(int(r), (0, 0))
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
        h5.close()
        return self.publish()

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
        try:
            if self.h5 is not None:
                self.h5.close()
        except Exception:
            pass
        try:
            os.remove(self.tmp_path)
        except FileNotFoundError:
            pass
        if self.staged is not None:
            self.staged.abort()


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
    out = np.zeros(len(rank_metas), dtype=RANK_DTYPE)
    for i, m in enumerate(sorted(rank_metas, key=lambda m: m["rank"])):
        c = m.get("coords", {})
        out[i] = (m["rank"], str(m.get("hostname", "")).encode()[:64], m.get("node", 0), m.get("local_rank", 0),
                  c.get("data", 0), c.get("z", 0), c.get("y", 0), c.get("x", 0), m.get("clock_offset_ns", 0),
                  m.get("clock_uncertainty_ns", 0), m.get("pid", 0), 0, 0, m.get("clock_drift_ppm", float("nan")),
                  m.get("clock_residual_ns", m.get("clock_uncertainty_ns", 0)))
    return out


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

    spool.close()
    rank = comm.Get_rank()
    events = read_records(spool.events_path, EVENT_DTYPE)
    events = sort_events(correct(events) if correct is not None else events)
    mine = read_records(spool.steps_path, RANK_STEP_DTYPE)
    if correct is not None:
        mine = correct(mine)
    error, path = merge_collective(comm, events, mine, rank_meta, trace_path, metadata, layers, force,
                                   group_size=group_size, compression=compression)
    del events
    if error is not None:
        raise TraceError(f"{error}; the per-rank files are kept in {spool.dir} "
                         f"('fourd-mpi trace recover {spool.dir}' merges them)")
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


def recover(spool_dir: str, output: Optional[str] = None, force: bool = False, summarize=None,
            group_size: int = 0, jobs: int = 1, compression: str = "gzip") -> Dict:
    """Merge the spool of a crashed run into a ``partial`` (or ``failed``) trace.

    Keeps the steps that every rank finished (their step record is on disk).
    ``summarize``: ``rank_steps -> Summary`` for the kept steps (stored as
    ``metadata["summary"]``). Returns a dict with the path, status, steps kept,
    what was dropped, the number of part files and the largest peak RSS (KiB) of a
    process that wrote events.

    Events move group by group as in :func:`merge_run` (``group_size`` <= 0: the run's
    largest ``ranks_per_node``, at most :data:`~fourd_mpi.trace.merge.MAX_PARTS` parts), one
    rank's events in memory at a time per process; ``jobs`` > 1 writes the parts in that many
    worker processes.
    """
    meta_path = os.path.join(spool_dir, RUN_META)
    if not os.path.isdir(spool_dir):
        raise TraceError(f"{spool_dir} is not a directory")
    try:
        with open(meta_path) as fh:
            run_meta = json.load(fh)
    except FileNotFoundError:
        raise TraceError(f"{spool_dir} is not a fourd-mpi spool directory (no {RUN_META})") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{meta_path} is unreadable: {exc}") from None
    world = int(run_meta.get("world_size", 0))
    if world < 1:
        raise TraceError(f"{meta_path} has no world_size")
    from fourd_mpi.trace.merge import (GroupPool, concat_records, plan_groups, read_group_records, recover_group,
                                       recover_parts, resolve_group_size)

    # the run's largest node (run.json's ranks_per_node); unknown: the whole world, i.e. one file
    per_node = max([n for n in run_meta.get("ranks_per_node") or [] if isinstance(n, int)] or [world])
    groups = plan_groups(world, resolve_group_size(world, group_size, per_node))
    # next to the spool, wherever it is now (run.json's trace_path may be relative to the job's directory)
    path = output or spool_dir.rstrip("/").removesuffix(SPOOL_SUFFIX) + ".h5"
    run_id = str(run_meta.get("run_id", ""))
    with GroupPool(jobs, len(groups)) as pool:
        # pass 1, group by group: metadata and step records (small), to know the steps every rank finished
        rank_metas, rank_steps, failures, missing = [], [], [], []
        for metas, steps, fails, lost in pool.map(read_group_records, [(spool_dir, a, b) for a, b in groups]):
            rank_metas += metas
            rank_steps += steps
            failures += fails
            missing += lost
        done = set(rank_steps[0]["step"].tolist())
        for steps in rank_steps[1:]:
            done &= set(steps["step"].tolist())
        kept = np.array(sorted(done), dtype=np.int32)
        # pass 2: the events, one rank at a time per process
        writer = TraceFileWriter(path, force, compression=compression, parts=len(groups) > 1)
        try:
            if len(groups) > 1:
                counts, dropped, peak_kib = recover_parts(spool_dir, groups, kept, writer.staged, run_id,
                                                          compression, pool)
                writer.bind(groups, counts)
            else:
                counts, dropped, peak_kib = recover_group(spool_dir, 0, 0, world, kept, None, run_id, compression,
                                                          writer=writer)
        except BaseException:
            writer.abort()
            raise
    try:
        status = "failed" if failures else "partial"
        all_steps = concat_records(rank_steps, RANK_STEP_DTYPE)
        metadata = dict(run_meta, recovered=now_iso(), recovered_from=os.path.abspath(spool_dir),
                        failures=failures, ranks_without_metadata=missing, steps_kept=len(kept),
                        events_dropped=dropped)
        metadata.pop("trace_path", None)
        kept_steps = all_steps[np.isin(all_steps["step"], kept)]
        if len(kept_steps) and summarize is not None:
            metadata["summary"] = summarize(kept_steps).as_dict()
        path = writer.finish(metadata, ranks_table(rank_metas), kept_steps, run_meta.get("layers", []), status)
    except BaseException:
        writer.abort()
        raise
    return {"path": path, "status": status, "steps": kept.tolist(), "events_dropped": dropped,
            "failures": failures, "parts": writer.parts, "peak_rss_kib": peak_kib}
