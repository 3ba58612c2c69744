"""The merged HDF5 trace being written: :class:`TraceFileWriter` writes ``<name>.h5`` (and binds its
part files) under a temporary name and publishes it whole (``link``, or ``rename`` with ``--force``);
:func:`steps_table` and :func:`ranks_table` build its ``/steps`` and ``/ranks``."""

from __future__ import annotations

import json
import os
import secrets
import weakref
from typing import Dict, Sequence

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import AXES, LEVELS, OPS, PHASES, SCHEMA, SCHEMA_VERSION
from fourd_mpi.trace.files import RANK_DTYPE, STEP_DTYPE, io_error_text, now_iso, parts_dir_of
from fourd_mpi.trace.guarded import GuardedFile
from fourd_mpi.trace.parts import EventBuffer, StagedParts, bind_parts, create_events_dataset, parts_table
from fourd_mpi.util.files import remove_quietly
from fourd_mpi.util.signals import deferring


class TraceFileWriter:
    """Writes ``final_path`` under a temporary name; :meth:`publish` makes it appear atomically.

    An I/O error (disk full, ...) raises :class:`TraceError` with one line from :meth:`append_events`
    or :meth:`finish`; the temporary file is then removed (call :meth:`abort` after an error
    of :meth:`append_events`; :meth:`finish` does it itself).

    ``parts=False``: a self-contained file, events added with :meth:`append_events`.
    ``parts=True``: the events go to part files written elsewhere into :attr:`staged`
    (:class:`fourd_mpi.trace.parts.StagedParts`) and :meth:`bind` maps them into a virtual
    ``/events``; publication renames the parts directory into place first.
    ``compression``: a key of :data:`fourd_mpi.trace.parts.COMPRESSIONS` for ``/events``.
    """

    @deferring
    def __init__(self, final_path: str, force: bool = False, compression: str = "gzip", parts: bool = False):
        import h5py

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

    @deferring
    def append_events(self, rank: int, events: np.ndarray) -> None:
        """Append a piece of ``rank``'s events (ranks in order, each rank's pieces in order; buffered
        into whole chunks, written at the latest by :meth:`finish`)."""
        start = self._buffer.total
        self._buffer.append(events)
        first, count = self.rank_offsets.get(rank, (start, 0))
        self.rank_offsets[rank] = (first, count + len(events))
        self._check()

    @deferring
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

    @deferring
    def bind(self, groups, rank_counts) -> None:
        """Parts mode: ``/events`` becomes the virtual concatenation of the staged parts of ``groups``
        (consecutive rank ranges), ``rank_counts[r]`` events for rank ``r``."""
        table = parts_table(groups, rank_counts)
        bind_parts(self.h5, table, self.staged.dirname)
        self.events = self.h5["events"]
        offsets = np.concatenate([[0], np.cumsum(np.asarray(rank_counts, dtype=np.int64))])
        self.rank_offsets = {r: (int(offsets[r]), int(rank_counts[r])) for r in range(len(rank_counts))}
        self.parts = len(table)

    @deferring
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
        self.published = True
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
        if os.path.islink(self.final_path):  # appeared since the checks before the run: neither replaced nor followed
            from fourd_mpi.util.files import link_target

            self.abort()
            raise TraceError(f"{self.final_path} became a symbolic link to {link_target(self.final_path)} while the "
                             "trace was written; not replaced (the spool is kept: remove the link, then "
                             "'fourd-mpi trace recover')")
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

    #: set by :meth:`finish` once the trace is in place: :meth:`abort` then leaves it (and its parts) alone
    published = False

    @deferring
    def abort(self) -> None:
        """Close quietly and remove the temporary file (HDF5 sees no I/O error: see :class:`GuardedFile`)."""
        if self.published:
            return
        self._finalizer()
        if self.staged is not None:
            self.staged.abort()


@deferring
def _close_quietly(h5, raw, tmp_path: str) -> None:
    """Close the HDF5 file and its :class:`GuardedFile`, remove the temporary file (nothing raises)."""
    for closer in (h5, raw):
        if closer is not None:
            try:
                closer.close()
            except Exception:  # noqa: BLE001 - nothing to save: the file is removed next
                pass
    remove_quietly(tmp_path)


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
