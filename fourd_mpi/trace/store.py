"""Trace files: per-rank spool files during a run, the merged HDF5 trace, recovery.

pip's h5py has no parallel HDF5 (docs/design.md section 4), so:

1. During the run each rank appends its events and one step record per step to
   its own files in the *spool directory* ``<results>/<run-id>.ranks/`` with
   plain ``os.write`` on ``O_APPEND`` descriptors: the events of a step first, then
   its step record, so a step record on disk means the step's events are all
   there. A rank killed at any point loses at most the step in flight (the
   records are fixed-size; a torn last record is cut off when read).
2. At the end, the ranks send their events to rank 0 over MPI (rank 0 reads
   nobody else's files) and rank 0 writes ``<results>/<run-id>.h5`` under a temporary
   name, then publishes it with ``link`` (never overwrites; ``--force``: rename
   over it). Only then is the spool removed.
3. After a crash, :func:`recover` builds a ``partial`` (or ``failed``) trace from
   the spool: the steps every rank completed.

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
    if os.path.exists(trace_path) and not force:
        raise TraceError(f"{trace_path} already exists: choose another --run-id, or --force to replace it")
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
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        return np.empty(0, dtype=dtype)
    whole = len(raw) - len(raw) % dtype.itemsize
    return raw[:whole].view(dtype).copy()


def sort_events(events: np.ndarray) -> np.ndarray:
    """Events of one rank in time order (stable: a step span precedes what starts with it)."""
    return events[np.argsort(events["start_ns"], kind="stable")]


# ---------------------------------------------------------------------------
# the merged HDF5 file
# ---------------------------------------------------------------------------

class TraceFileWriter:
    """Writes ``final_path`` under a temporary name; :meth:`publish` makes it appear atomically."""

    def __init__(self, final_path: str, force: bool = False):
        import h5py

        self.final_path = final_path
        self.force = force
        if os.path.exists(final_path) and not force:
            raise TraceError(f"{final_path} already exists (use --force to replace it)")
        directory, name = os.path.split(os.path.abspath(final_path))
        self.tmp_path = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            self.h5 = h5py.File(self.tmp_path, "w")
        except OSError as exc:
            raise TraceError(f"cannot write {final_path}: {exc}") from None
        self.events = self.h5.create_dataset("events", shape=(0,), maxshape=(None,), dtype=EVENT_DTYPE,
                                             chunks=(4096,), compression="gzip", compression_opts=1, shuffle=True)
        self.rank_offsets: Dict[int, tuple] = {}

    def append_events(self, rank: int, events: np.ndarray) -> None:
        """Append a piece of ``rank``'s events (ranks in order, each rank's pieces in order)."""
        start = self.events.shape[0]
        self.events.resize((start + len(events),))
        self.events[start:] = events
        first, count = self.rank_offsets.get(rank, (start, 0))
        self.rank_offsets[rank] = (first, count + len(events))

    def finish(self, metadata: Dict, ranks: np.ndarray, rank_steps: np.ndarray, layers: Sequence[str],
               status: str) -> str:
        """Write everything but the events, close, publish; returns the trace path."""
        h5 = self.h5
        ranks = ranks.copy()
        for i, r in enumerate(ranks["rank"]):
            ranks["event_offset"][i], ranks["event_count"][i] = self.rank_offsets.get(int(r), (0, 0))
        h5.attrs.update({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "status": status,
                         "run_id": metadata.get("run_id", ""), "events": self.events.shape[0],
                         "world_size": len(ranks), "written": now_iso()})
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
        if self.force:
            os.replace(self.tmp_path, self.final_path)
            return self.final_path
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
            return self.final_path
        os.remove(self.tmp_path)
        return self.final_path

    def abort(self) -> None:
        try:
            self.h5.close()
        except Exception:
            pass
        try:
            os.remove(self.tmp_path)
        except FileNotFoundError:
            pass


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
              layers: Sequence[str], force: bool, correct=None) -> str:
    """Collective: rank 0 writes the merged trace from every rank's spool; returns its path.

    ``correct``: this rank's clock correction (records -> records with their time columns moved,
    :meth:`fourd_mpi.trace.clocks.DriftModel.correct_records`), applied to its events and step
    records before they are sent; None keeps the start-aligned times.

    The spool is removed only after the trace is published. On a write error
    every rank raises the same :class:`TraceError` and the spool is kept.
    """
    from mpi4py import MPI

    spool.close()
    rank, size = comm.Get_rank(), comm.Get_size()
    error = None
    writer = None
    if rank == 0:
        try:
            writer = TraceFileWriter(trace_path, force)
        except TraceError as exc:
            error = str(exc)
    for source in range(size):  # one rank at a time: rank 0 holds one chunk in memory
        if rank == source:
            events = read_records(spool.events_path, EVENT_DTYPE)
            events = sort_events(correct(events) if correct is not None else events)
            pieces = [events[i:i + MERGE_CHUNK] for i in range(0, len(events), MERGE_CHUNK)]
            if rank == 0:
                for piece in pieces:
                    error = error or _append(writer, 0, piece)
            else:
                comm.send(len(pieces), dest=0, tag=81)
                for piece in pieces:
                    comm.send(len(piece), dest=0, tag=82)
                    comm.Send([piece.view(np.uint8), MPI.BYTE], dest=0, tag=83)
        elif rank == 0:
            for _ in range(comm.recv(source=source, tag=81)):
                piece = np.empty(comm.recv(source=source, tag=82), dtype=EVENT_DTYPE)
                comm.Recv([piece.view(np.uint8), MPI.BYTE], source=source, tag=83)
                error = error or _append(writer, source, piece)
    mine = read_records(spool.steps_path, RANK_STEP_DTYPE)
    if correct is not None:
        mine = correct(mine)
    rank_steps = comm.gather(mine, root=0)
    rank_metas = comm.gather(rank_meta, root=0)
    path = None
    if rank == 0 and error is None:
        try:
            path = writer.finish(dict(metadata, end_time=now_iso()), ranks_table(rank_metas),
                                 np.concatenate(rank_steps), layers, "complete")
        except (OSError, TraceError) as exc:
            writer.abort()
            error = str(exc)
    elif rank == 0 and writer is not None:
        writer.abort()
    error, path = comm.bcast((error, path), root=0)
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


def _append(writer: TraceFileWriter, rank: int, piece: np.ndarray) -> Optional[str]:
    """Rank 0: append, turning an I/O error into a message (the other ranks keep sending)."""
    try:
        writer.append_events(rank, piece)
        return None
    except OSError as exc:
        return f"writing {writer.final_path} failed: {exc}"


def recovered_status(failures: Sequence[Dict]) -> str:
    """``partial`` without error reports, ``interrupted`` when every report says so (Ctrl-C), else ``failed``."""
    if not failures:
        return "partial"
    if all(str(f.get("error", "")).startswith("interrupted: ") for f in failures):
        return "interrupted"
    return "failed"


def recover(spool_dir: str, output: Optional[str] = None, force: bool = False, summarize=None) -> Dict:
    """Merge the spool of a crashed run into a ``partial`` (or ``failed``) trace.

    Keeps the steps that every rank finished (their step record is on disk).
    ``summarize``: ``rank_steps -> Summary`` for the kept steps (stored as
    ``metadata["summary"]``). Returns a dict with the path, status, steps kept
    and what was dropped.
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
    rank_metas, rank_steps, failures, missing = [], [], [], []
    for rank in range(world):
        stem = os.path.join(spool_dir, _rank_stem(rank))
        try:
            with open(stem + ".json") as fh:
                rank_metas.append(json.load(fh))
        except (OSError, ValueError):
            rank_metas.append({"rank": rank})
            missing.append(rank)
        rank_steps.append(read_records(stem + ".steps", RANK_STEP_DTYPE))
        if os.path.exists(stem + ".failed.json"):
            with open(stem + ".failed.json") as fh:
                failures.append(json.load(fh))
    done = set(rank_steps[0]["step"].tolist())
    for steps in rank_steps[1:]:
        done &= set(steps["step"].tolist())
    kept = np.array(sorted(done), dtype=np.int32)
    # next to the spool, wherever it is now (run.json's trace_path may be relative to the job's directory)
    path = output or spool_dir.rstrip("/").removesuffix(SPOOL_SUFFIX) + ".h5"
    writer = TraceFileWriter(path, force)
    dropped = 0
    try:
        for rank in range(world):
            events = read_records(os.path.join(spool_dir, _rank_stem(rank)) + ".events", EVENT_DTYPE)
            keep = np.isin(events["step"], kept)
            dropped += int((~keep).sum())
            events = sort_events(events[keep])
            for i in range(0, len(events), MERGE_CHUNK):
                writer.append_events(rank, events[i:i + MERGE_CHUNK])
        status = recovered_status(failures)
        all_steps = np.concatenate(rank_steps)
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
            "failures": failures}
