"""Hierarchical trace merge: groups of ranks write part files, a top-level file binds them.

Why: a single writer moves every event of the run through one process (about 0.4 M
events/s measured with gzip; 90 M events at 32,768 ranks x 10 op-level steps). Here the
world is cut into **groups** of consecutive ranks, ``[g * G, (g + 1) * G)`` for group
size ``G`` (``--trace-group-size``; default: the ranks of the largest node, raised so that
there are at most :data:`MAX_PARTS` groups). Each group's lowest rank receives its
members' events (one rank at a time, pieces of :data:`~fourd_mpi.trace.files.MERGE_CHUNK`
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

import contextlib
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.files import MERGE_CHUNK, PUBLISHED, io_error_text, now_iso, parts_dir_of, sort_events
from fourd_mpi.trace.parts import PartWriter, concat_records, part_name, plan_groups, resolve_group_size
from fourd_mpi.trace.spool import RankSpool, mark_published
from fourd_mpi.trace.writer import TraceFileWriter, ranks_table
from fourd_mpi.util.files import RUN_META
from fourd_mpi.util.signals import deferred


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
                     compression: str = "gzip", after_open=None,
                     on_published: Optional[Callable[[str], None]] = None,
                     on_temporaries: Optional[Callable[[Optional[str], Optional[str]], None]] = None
                     ) -> Tuple[Optional[str], Optional[str]]:
    """Collective over ``comm``: write the trace of every rank's ``events`` (this rank's, sorted);
    returns ``(error, path)``, the same on every rank (error: one line, or None).

    ``group_size`` <= 0: :func:`auto_group_size` from the ranks per node. One group: rank 0 writes
    one self-contained file. Several: each group's lowest rank writes its part, rank 0 the top level.
    ``rank_steps`` (this rank's step records) and ``rank_meta`` are gathered to rank 0.

    Any exception on rank 0 (Ctrl-C, SIGTERM as :class:`~fourd_mpi.errors.Terminated`, an error)
    removes the temporary file and the staged parts before it propagates; so does one on another rank before it
    joins the final gather (rank 0 cannot publish without it, and the abort that follows may end rank 0 before it
    cleans up). The final gather, the publication and the broadcast of the outcome run with signals held back on
    every rank: an interruption then comes after, on a trace published or not, never in between. ``after_open``: testing
    (``--inject-fault R:S:sigterm-merge``), called on every rank after a barrier, once rank 0 has
    created the temporary files. ``on_published(path)``: rank 0, right after the trace is published, with
    signals held back from the publication to its end (what must follow a publication: the index line), so that
    no interruption comes between the two. ``on_temporaries(tmp_path, staged_dir)``: every rank, once rank 0 has
    created them, the names of this merge's temporary file and staged parts directory (None: none).

    Long: one try block: the clean-up on any failure must see every temporary this merge made so far.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    group_size = resolve_group_size(size, group_size, ranks_per_node(comm) if group_size <= 0 else 1)
    groups = plan_groups(size, group_size)
    multi = len(groups) > 1
    run_id = str((metadata or {}).get("run_id", ""))  # metadata: rank 0's (None elsewhere)
    top = staged = None
    error = tmp_path = staged_dir = None
    contributed = False  # this rank has given its part to the final gather: rank 0 may publish from then on
    try:
        if rank == 0:
            with deferred():  # created and known (so removed on any exception below), or not created
                try:
                    top = TraceFileWriter(trace_path, force, compression=compression, parts=multi)
                    staged = top.staged
                except TraceError as exc:
                    error = str(exc)
        error, staged_dir, tmp_path, run_id = comm.bcast(
            (error, staged.dir if staged is not None else None, top.tmp_path if top is not None else None, run_id),
            root=0)
        if on_temporaries is not None and error is None:
            on_temporaries(tmp_path, staged_dir)
        if after_open is not None:
            comm.Barrier()
            after_open()
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
                    local_error = f"writing {writer.path} failed: {io_error_text(exc)}"
                finally:
                    writer.abort()
        if multi:
            group.Free()
        # the end of the merge is one stretch with signals held on every rank (it is short: the parts are written):
        # no rank ends the job while rank 0 publishes, and every rank knows whether it did before it stops
        with deferred():
            contributed = True
            return _merge_end(comm, top, local_error, events, rank_steps, rank_meta, metadata, trace_path, groups,
                              layers, error, staged_dir, multi, on_published)
    except BaseException:
        if top is not None:
            top.abort()  # a no-op once the trace is published
        elif not contributed:  # rank 0 cannot publish without this rank's part of the final gather
            remove_merge_temporaries(tmp_path, staged_dir)
        raise


def remove_merge_temporaries(tmp_path: Optional[str], staged_dir: Optional[str]) -> None:
    """A rank other than 0 leaving the merge before the final gather (interrupted): remove the temporary trace
    file and the staged parts directory that rank 0 created for this merge (their names came from it), as rank 0
    does when it leaves: the job is about to be aborted, and rank 0 may be ended before it can. Other writers
    may still be adding parts to the directory: removed again while something is left (three tries)."""
    import shutil

    if tmp_path:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
    for _ in range(3):
        if not staged_dir or not os.path.lexists(staged_dir):
            return
        shutil.rmtree(staged_dir, ignore_errors=True)


def _merge_end(comm, top, local_error, events, rank_steps, rank_meta, metadata, trace_path, groups, layers, error,
               staged_dir, multi, on_published) -> Tuple[Optional[str], Optional[str]]:
    """The final gather, rank 0's top-level file and publication, and the outcome to every rank."""
    rank = comm.Get_rank()
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
                path = top.finish(dict(metadata or {}, end_time=now_iso()), ranks_table(rank_metas),
                                  concat_records(all_steps, RANK_STEP_DTYPE), layers, "complete")
                if on_published is not None:
                    on_published(path)
            except (OSError, TraceError) as exc:
                top.abort()
                error = str(exc)
        elif top is not None:
            top.abort()
        if error is not None and staged_dir:  # name the part where it belongs, not the removed staging directory
            error = error.replace(staged_dir, parts_dir_of(os.path.abspath(trace_path)))
    return comm.bcast((error, path), root=0)


def _append(writer, rank: int, piece: np.ndarray) -> Optional[str]:
    """A writer appends, an I/O error becomes a message (the other ranks keep sending)."""
    try:
        writer.append_events(rank, piece)
        return None
    except TraceError as exc:
        return str(exc)
    except OSError as exc:
        return f"writing {getattr(writer, 'path', None) or writer.final_path} failed: {io_error_text(exc)}"


def merge_run(comm, spool: RankSpool, rank_meta: Dict, trace_path: str, metadata: Optional[Dict],
              layers: Sequence[str], force: bool, correct=None, group_size: int = 0,
              compression: str = "gzip", after_open=None, on_published=None, on_temporaries=None) -> str:
    """Collective: write the merged trace from every rank's spool; returns its path.

    ``correct``: this rank's clock correction (records -> records with their time columns moved,
    :meth:`fourd_mpi.trace.clocks.DriftModel.correct_records`), applied to its events and step
    records before they are sent; None keeps the start-aligned times.

    ``group_size``: ranks per writer (``--trace-group-size``; <= 0: ranks per node, at most
    :data:`fourd_mpi.trace.parts.MAX_PARTS` parts). The data movement is
    :func:`fourd_mpi.trace.merge.merge_collective`: one group writes one file, several write part
    files bound by a top-level file.

    The spool is removed only after the trace is published. On a write error
    every rank raises the same :class:`TraceError` and the spool is kept. ``after_open``: testing
    (``--inject-fault``), ``on_published`` and ``on_temporaries``: see
    :func:`~fourd_mpi.trace.merge.merge_collective`. Rank 0
    marks the spool published (:func:`~fourd_mpi.trace.spool.mark_published`) before ``on_published``: a
    rank interrupted from then on knows the spool is left over.
    """
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
    def published(path: str) -> None:
        mark_published(spool.dir, path)
        if on_published is not None:
            on_published(path)

    error, path = merge_collective(comm, events, mine, rank_meta, trace_path, metadata, layers, force,
                                   group_size=group_size, compression=compression, after_open=after_open,
                                   on_published=published, on_temporaries=on_temporaries)
    del events
    if error is not None:
        raise merge_failed(spool, error)
    spool.remove()
    comm.Barrier()
    if rank == 0:
        for leftover in (RUN_META, PUBLISHED):
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
