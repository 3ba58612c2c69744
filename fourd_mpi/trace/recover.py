"""``fourd-mpi trace recover``: a ``partial`` (or ``failed``) trace from the spool of a run that did
not finish, with the steps every rank completed, group by group (:func:`recover`); what a spool's
``run.json`` may hold (:func:`read_run_meta`); the temporaries a killed merge left
(:func:`remove_stale_temporaries`); whether a trace is a recovery of a run that was still live
(:func:`live_recovery_of`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from typing import Dict, List, Optional, Sequence

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import RANK_STEP_DTYPE
from fourd_mpi.trace.files import (
    SPOOL_SUFFIX,
    io_error_text,
    now_iso,
    parts_dir_of,
    rank_stem,
)
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.parts import concat_records, plan_groups, resolve_group_size
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.rebuild import SCRATCH, GroupPool, rank_step_keys, read_group_records, recover_group, recover_parts
from fourd_mpi.trace.spool import pid_alive
from fourd_mpi.trace.writer import TraceFileWriter, ranks_table
from fourd_mpi.util.files import RUN_META, remove_quietly
from fourd_mpi.util.signals import deferred
from fourd_mpi.util.yamlspec import schema_message


def live_recovery_of(trace_path: str, spool_dir: str) -> bool:
    """True if ``trace_path`` is a trace that :func:`recover` (``--force``) wrote from ``spool_dir`` while
    ranks of its run still held their spool files (metadata ``recovered_from`` is that directory,
    ``recovered_while_live`` not empty) and not ``complete``: the run's own final merge may replace it.
    False for anything else, an unreadable file included."""
    if not os.path.isfile(trace_path):
        return False
    import h5py

    try:
        with h5py.File(trace_path, "r") as h5:
            status, meta = h5.attrs.get("status"), h5["metadata"].attrs
            source, live = meta.get("recovered_from"), meta.get("recovered_while_live")
        live = json.loads(live) if isinstance(live, str) else None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return False
    return (status != "complete" and isinstance(source, str) and isinstance(live, list) and bool(live)
            and os.path.realpath(source) == os.path.realpath(spool_dir))


#: the temporary name of a trace file or staged parts directory being written (:class:`TraceFileWriter`,
#: :class:`~fourd_mpi.trace.parts.StagedParts`): ``.NAME.tmp-PID-HEX``; and of the parts of a trace being replaced
#: (``--force``), set aside until the new trace is published: ``.NAME.old-PID-HEX``
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>[0-9]+)-[0-9a-f]+\Z")


def merge_temporaries(trace_path: str) -> List[str]:
    """The names of the temporary files, staged parts directories and set-aside old parts of ``trace_path`` in its
    directory (``.NAME.h5.tmp-PID-*``, ``.NAME.parts.tmp-PID-*``, ``.NAME.parts.old-PID-*``), whoever left them."""
    path = os.path.abspath(trace_path)
    names = {os.path.basename(path), os.path.basename(parts_dir_of(path))}
    try:
        entries = os.listdir(os.path.dirname(path))
    except OSError:
        return []
    return sorted(e for e in entries if (m := _TEMP_NAME.match(e)) is not None and m["name"] in names)


def remove_stale_temporaries(trace_path: str, rank_metas: Sequence[Dict]):
    """Remove the temporary files and staged parts directories of ``trace_path`` (``.NAME.h5.tmp-PID-*``,
    ``.NAME.parts.tmp-PID-*``) that a merge of this run left behind when it was killed (SIGKILL, a node
    failure, ``MPI_Abort`` from another rank): PID is that of a rank of the run (``rank_metas``) that ran
    on this host, and no process has it now. Returns ``(removed, left)``: the names removed, and the names of
    :func:`merge_temporaries` left as they are (not provably this run's: another host's or process's, a live
    PID, or set-aside old parts, which may still belong to the trace they were moved from)."""
    import shutil

    host = socket.gethostname()
    pids = {m.get("pid") for m in rank_metas
            if isinstance(m, dict) and m.get("hostname") == host and isinstance(m.get("pid"), int)}
    directory = os.path.dirname(os.path.abspath(trace_path))
    removed, left = [], []
    for entry in merge_temporaries(trace_path):
        match = _TEMP_NAME.match(entry)
        pid = int(match["pid"])
        if match["kind"] != "tmp" or pid not in pids or pid_alive(pid):
            left.append(entry)
            continue
        full = os.path.join(directory, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            remove_quietly(full)
        (left if os.path.lexists(full) else removed).append(entry)
    return removed, left


def published_by_the_run(spool_dir: str, trace_path: str, run_meta: Dict) -> Optional[str]:
    """The complete trace that the run of ``spool_dir`` published itself, if there is one: the trace its final
    merge marked published (:func:`~fourd_mpi.trace.spool.published_trace`), or ``trace_path`` when it is a
    complete trace of this very run (the run id and start time of ``run_meta``, the spool's ``run.json``: an
    interruption can end the ranks between the publication and that mark). The spool is then left over (every
    step it holds is in that trace). Else None."""
    from fourd_mpi.trace.spool import published_trace

    marked = published_trace(spool_dir)
    for path in ([marked] if marked else []) + [trace_path]:
        if not os.path.isfile(path):
            continue
        try:
            trace = load_trace(path, events=False)
        except (OSError, TraceError):
            continue
        status, meta = trace.status, trace.metadata
        if status == "complete" and meta.get("run_id") == run_meta.get("run_id") and \
                meta.get("start_time") == run_meta.get("start_time") and run_meta.get("start_time"):
            return path
    return None


def _index_published(path: str):
    """``(added, error)``: the line of the published trace ``path`` added to the index next to it if it has none
    (the run was ended between its publication and its index line), as ``results reindex`` writes it."""
    from fourd_mpi.results.index import append_entry, index_file, read_index, trace_of
    from fourd_mpi.trace.indexing import entry_of_trace

    results_dir = os.path.dirname(os.path.abspath(path))
    index = index_file(results_dir)
    try:
        if any(os.path.realpath(trace_of(entry, index)) == os.path.realpath(path) for entry in read_index(index)):
            return False, None
        append_entry(index, entry_of_trace(load_trace(path, events=False), results_dir))
    except (OSError, ValueError) as exc:  # the trace stands
        return False, f"the run was not added to {index}: {exc}"
    return True, None


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
        raise TraceError(f"{meta_path}: {where}: {' '.join(schema_message(error).split())[:160]}")
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
        found = (f"the highest rank with files there is {highest} ({rank_stem(highest)}.*)" if highest >= 0
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
      validated, damage) and passes :func:`~fourd_mpi.trace.invariants.check_invariants`, in this process
      (``trace check``).

    A run whose ranks still hold their spool locks (:func:`live_ranks`) is refused unless
    ``force`` (which also replaces an existing output file). Raises :class:`TraceError` with one
    line; on an I/O error no temporary file is left.
    """
    if check not in RECOVER_CHECKS:
        raise TraceError(f"unknown recover check {check!r}: choose one of {', '.join(RECOVER_CHECKS)}")
    run_meta = read_run_meta(spool_dir)
    world = spool_world(spool_dir, run_meta["world_size"])
    default = spool_dir.rstrip("/").removesuffix(SPOOL_SUFFIX) + ".h5"
    if output is None or os.path.abspath(output) == os.path.abspath(default):
        published = published_by_the_run(spool_dir, default, run_meta)
        if published is not None:  # nothing to recover: the spool is what an interrupted clean-up left
            with deferred():
                indexed, index_error = _index_published(published)
            metas, *_ = read_group_records((spool_dir, 0, world))
            stale, stale_left = remove_stale_temporaries(published, metas)  # (a link of the trace, killed before
            # the temporary name was removed, among them)
            return {"path": published, "status": "complete", "left_over": True, "indexed": indexed, "steps": [],
                    "events_dropped": 0, "damaged": None, "failures": [], "live": [], "removable": None, "parts": 0,
                    "verified": None, "stale_removed": stale, "stale_left": stale_left, "index": index_error}
    try:
        return _recover(spool_dir, output, force, summarize, group_size, jobs, compression, check, run_meta, world)
    finally:
        SCRATCH.release()  # the batch arrays of an in-process recovery


def _recover(spool_dir: str, output: Optional[str], force: bool, summarize, group_size: int, jobs: int,
             compression: str, check: str, run_meta: Dict, world: int) -> Dict:
    # the run's largest node (run.json's ranks_per_node); unknown: the whole world, i.e. one file
    per_node = max([n for n in run_meta.get("ranks_per_node") or [] if isinstance(n, int)] or [world])
    groups = plan_groups(world, resolve_group_size(world, group_size, per_node))
    # next to the spool, wherever it is now (run.json's trace_path may be relative to the job's directory)
    path = output or spool_dir.rstrip("/").removesuffix(SPOOL_SUFFIX) + ".h5"
    _check_output(path, force, spool_dir, "-o" if output else "the trace")
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
            damage = _rank_step_mismatch(results, all_steps[np.isin(all_steps["step"], kept)])
            # validated before publication: a recovery never publishes what 'trace check' rejects
            if damage is not None:
                raise TraceError(f"the per-rank files in {spool_dir} are damaged: "
                                 f"{damage.replace('in the trace', 'in the .events file')} "
                                 "(a truncated or altered .events file): "
                                 "nothing was written, the per-rank files are kept")
            metadata = dict(run_meta, recovered=now_iso(), recovered_from=os.path.abspath(spool_dir),
                            failures=failures, ranks_without_metadata=missing, steps_kept=len(kept),
                            events_dropped=dropped, recovered_while_live=live)
            metadata.pop("trace_path", None)
            kept_steps = all_steps[np.isin(all_steps["step"], kept)]
            if len(kept_steps) and summarize is not None:
                metadata["summary"] = summarize(kept_steps).as_dict()
            with deferred():  # published and indexed, or neither (a signal waits for both)
                path = writer.finish(metadata, ranks_table(rank_metas), kept_steps, run_meta.get("layers", []),
                                     status)
                index_error = _index(metadata, status, path)
        stale, stale_left = remove_stale_temporaries(path, rank_metas)
        verified = "readback" if check == "readback" and writer.parts else "full"
        removable = _why_keep(path, live, missing, sorted(every - done), dropped, verified, results, kept_steps,
                              staged_dir)
    damaged = removable if removable is not None and removable.startswith("the written trace") else None
    return {"path": path, "status": status, "steps": kept.tolist(), "events_dropped": dropped, "damaged": damaged,
            "failures": failures, "live": live, "removable": removable, "parts": writer.parts,
            "peak_rss_kib": max(result.peak_rss_kib for result in results), "verified": verified,
            "stale_removed": stale, "stale_left": stale_left, "index": index_error}


def _index(metadata: Dict, status: str, path: str) -> Optional[str]:
    """Add the recovered run to the index next to its trace (``results/index.jsonl``, as ``run`` does for its
    own trace; :mod:`fourd_mpi.results.index`); returns why it could not, or None."""
    from fourd_mpi.results.index import index_file, index_run

    results_dir = os.path.dirname(os.path.abspath(path))
    try:
        index_run(metadata, status, path, results_dir)
    except (OSError, ValueError) as exc:  # the trace stands
        return f"the recovered run was not added to {index_file(results_dir)}: {exc}"
    return None

def _check_output(path: str, force: bool, spool_dir: str, option: str) -> None:
    """The output rule of :mod:`fourd_mpi.util.files`, before anything is read: not inside the spool (the
    trace would go with it), not a spool file, a directory or a device, in a writable directory with space."""
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.results.index import index_file, refuse_foreign_link
    from fourd_mpi.util.files import refuse_output

    try:
        refuse_output(path, force, inputs=[os.path.join(spool_dir, RUN_META)], option=option, writes_trace=True)
        # the recovered run's line goes into the index beside the trace: never through a link to another's
        refuse_foreign_link(index_file(os.path.dirname(os.path.abspath(path))), "trace recover")
    except TraceError:
        raise
    except ConfigError as exc:
        raise TraceError(str(exc)) from None


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
        return why.replace(staged_dir, parts_dir_of(os.path.abspath(path))) if staged_dir else why
    try:
        load_trace(path, events=False)
    except (OSError, TraceError) as exc:
        return f"the written trace does not read back: {exc}"
    return None


def _rank_step_mismatch(results, kept_steps: np.ndarray) -> Optional[str]:
    """None if the events written per (rank, step) (the groups' ``keys``/``held``) equal the ``events``
    of the kept step records, else the first difference."""
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
