"""``fourd-mpi trace show | check | recover``: one trace file at a time (one process, no mpiexec)."""

from __future__ import annotations

import logging
import os

import numpy as np

from fourd_mpi.cli.args import add_allow_damaged, add_output, error_line
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.util.values import group_size, int_in

log = logging.getLogger(__name__)


def register(sub) -> None:
    tr = sub.add_parser("trace", help="inspect, check or recover trace files (one process, no mpiexec)")
    tsub = tr.add_subparsers(dest="trace_command", required=True, parser_class=type(tr))
    show = tsub.add_parser("show", help="metadata and step summary of a trace")
    show.add_argument("file", help="the trace (.h5)")
    add_allow_damaged(show)
    add_json_format(show, SHOW_JSON)
    check = tsub.add_parser("check", help="check a trace's invariants and whether it is damaged (NaN or negative "
                            "times, events missing for its level): exit 1 if any is violated")
    check.add_argument("file", help="the trace (.h5)")
    add_json_format(check, CHECK_JSON)
    rec = tsub.add_parser("recover", help="merge the per-rank files of a crashed run into a partial trace")
    rec.add_argument("directory", help="the run's per-rank directory, <results>/<run-id>.ranks")
    add_output(rec, announce=False, help="trace to write (default: the run's planned trace path); the report on "
                                         "standard output names it",
               force_help="replace an existing output file, and recover a run that still holds its spool "
                          "files (still running: a partial trace of the steps so far; the spool is kept)")
    rec.add_argument("--group-size", type=group_size, default=0, metavar="N",
                     help="ranks per part file (0, default: the run's ranks per node, raised to keep at most 256 "
                          "parts; one group: a single file)")
    rec.add_argument("--jobs", type=int_in(1, 1 << 12, "worker processes"), default=None, metavar="N",
                     help="worker processes writing parts (default: the CPUs this process may use)")
    rec.add_argument("--compression", choices=("gzip", "lzf", "none"), default="none",
                     help="compression of the events (default none: recovery is bound by the CPUs of one node, "
                          "and deflate costs 2.5x the rest of the merge; the trace is 102 bytes per event, about 10x "
                          "its gzip size; gzip: level 1 with shuffle, as fourd-mpi run)")
    rec.add_argument("--check", choices=("readback", "full"), default="readback",
                     help="how the written trace is verified before the per-rank files are called removable: "
                          "readback (default; a multi-part trace: every part read back by the workers and compared "
                          "byte for byte, XXH3-64 digest, the top level validated without its events, every kept "
                          "rank-step holding the events its record counts) or full (the whole trace loaded in one "
                          "process and checked as 'trace check' does; always for a single-file trace)")
    add_json_format(rec, RECOVER_JSON, help="the report on standard output: table (default: lines of text) or json")
    tr.set_defaults(handler=cmd_trace, serial=True)


#: ``trace show --format json``
SHOW_JSON = JsonDoc("trace show", {
    "file": "the trace", "schema_version": "of the file", "status": "complete, partial, failed or interrupted",
    "damage": "why the trace is damaged (empty: it is not)", "metadata": "the trace's metadata, as stored",
    "nodes": "the ranks' nodes (one sentence)", "binding": "the ranks' CPU binding (one sentence, or null)",
    "events": "how many", "parts": "part files holding the events (0: in the file)",
    "clocks": "per rank: rank, offset_ns, drift_ppm (null: no end alignment), residual_ns",
    "steps": "per step: step, loss, seconds (max over ranks of the step span), warmup, stored_seconds",
    "summary": "median_s, compute_share, wait_share, tokens_per_s (or null)"})
#: ``trace check --format json``
CHECK_JSON = JsonDoc("trace check", {
    "file": "the trace", "events": "how many", "world_size": "ranks", "steps": "how many",
    "violations": "each violated invariant or damage (empty: ok)", "ok": "no violation"})
#: ``trace recover --format json``
RECOVER_JSON = JsonDoc("trace recover", {
    "path": "the trace written", "status": "its status", "steps": "the steps kept (completed by every rank)",
    "events_dropped": "events of unfinished steps", "parts": "part files (0: one file)",
    "failures": "ranks that failed: rank, error", "stale_removed": "temporary files of an interrupted merge removed",
    "verified": "readback or full", "removable": "null when the per-rank files can go, else why to keep them",
    "damaged": "why the written trace fails trace check (or null)", "index": "a warning about the run index (or null)"})


def cmd_trace(args, world=None) -> int:
    """``fourd-mpi trace recover|check|show``: one function per subcommand."""
    if args.trace_command == "recover":
        return _cmd_recover(args)
    if args.trace_command == "check":  # a damaged trace is read, and its damage reported as violations
        return _cmd_check(args)
    return _cmd_show(args)


def _cmd_recover(args) -> int:
    """``trace recover DIR``: merge the per-rank files of an interrupted run into its trace."""
    from fourd_mpi.trace.files import parts_dir_of
    from fourd_mpi.trace.recover import recover

    jobs = args.jobs or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    result = recover(args.directory, args.output, args.force, summarize=_recovered_summary(args.directory),
                     group_size=args.group_size, jobs=jobs, compression=args.compression, check=args.check)
    if args.format == "json":
        emit_json(RECOVER_JSON, {k: result.get(k) for k in RECOVER_JSON.keys})
        if result["damaged"]:
            error_line(f"the recovered trace {result['path']} does not pass 'trace check': {result['damaged']}")
        return 1 if result["damaged"] else 0
    if result.get("left_over"):
        print(f"{result['path']}: status complete: the run's final merge published it; the per-rank files in "
              f"{args.directory} are left over from its interrupted clean-up (every step is in the trace) and can "
              "now be removed" + ("; the run's line was missing from the index: added" if result["indexed"] else ""))
        _say_stale(result)
        if result["index"] is not None:
            log.warning("%s", result["index"])
        return 0
    steps = result["steps"]
    kept = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
    print(f"{result['path']}: status {result['status']}, {kept} completed by every rank "
          f"({len(steps)}), {result['events_dropped']} events of unfinished steps dropped"
          + (f"; events in {result['parts']} part files in {parts_dir_of(result['path'])}" if result["parts"]
             else ""))
    for failure in result["failures"]:
        print(f"  rank {failure.get('rank')} failed: {failure.get('error')}")
    _say_stale(result)
    if result["index"] is not None:
        log.warning("%s", result["index"])
    if result["removable"] is None:
        how = ("passes 'trace check'" if result["verified"] == "full" else
               "reads back byte for byte (every part's XXH3-64 digest; 'trace check' runs the full checks)")
        print(f"the trace holds every step of the per-rank files and {how}: {args.directory} can now be removed")
    else:
        print(f"keep the per-rank files in {args.directory}: {result['removable']}")
    if result["damaged"]:
        error_line(f"the recovered trace {result['path']} does not pass 'trace check': {result['damaged']}")
        return 1
    return 0


def _cmd_check(args) -> int:
    """``trace check FILE``: the damage and the invariant violations of a trace, one line each."""
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    trace = load_trace(args.file, allow_damaged=True)
    problems = [f"damaged: {why}" for why in trace.damage] + check_invariants(trace)
    if args.format == "json":
        emit_json(CHECK_JSON, {"file": args.file, "events": len(trace.events), "world_size": trace.world_size,
                               "steps": len(trace.steps), "violations": problems, "ok": not problems})
        return 1 if problems else 0
    for problem in problems:
        print(f"violation: {problem}")
    print(f"{args.file}: {len(trace.events)} events, {trace.world_size} ranks, {len(trace.steps)} steps: "
          + ("ok" if not problems else f"{len(problems)} violation(s)"))
    return 1 if problems else 0


def _cmd_show(args) -> int:
    """``trace show FILE``: the trace's metadata, placement, clocks and step times (or JSON)."""
    from fourd_mpi.algorithms.registry import of_metadata
    from fourd_mpi.trace.files import parts_dir_of
    from fourd_mpi.trace.read import load_trace

    trace = load_trace(args.file, allow_damaged=args.allow_damaged)
    if args.format == "json":
        return _show_json(args.file, trace)
    for why in trace.damage:
        print(f"damaged: {why}")
    meta = trace.metadata
    print(f"{args.file}: schema v{trace.schema_version}, status {trace.status}, run id {meta.get('run_id')}")
    print(f"  algorithm {of_metadata(meta)}, grid {meta.get('grid')} on {meta.get('world_size')} ranks, "
          f"{meta.get('num_nodes')} node(s); level {meta.get('level')}; started {meta.get('start_time')}")
    print(f"  {((meta.get('mpi') or {}).get('library_version') or '?').splitlines()[0]}")
    placement = trace.placement()
    print(f"  nodes{'' if 'placement' in meta else ' (derived from /ranks: the trace predates metadata placement)'}: "
          f"{placement.describe()}")
    binding = meta.get("binding")
    print(f"  binding: {binding.get('summary') if isinstance(binding, dict) else 'unknown (not recorded)'}")
    parts = int(trace.attrs.get("parts", 0) or 0)
    print(f"  {len(trace.events)} events; {len(trace.steps)} steps"
          + (f"; events in {parts} part files ({parts_dir_of(args.file)})" if parts else ""))
    _show_clocks(trace.ranks)
    from fourd_mpi.trace.invariants import STEP_TIME_SLACK_S, rank_max_seconds

    print(f"{'step':>6} {'loss':>14} {'time (s)':>10}")
    derived = rank_max_seconds(trace.steps, trace.rank_steps)  # the definition: max over ranks of the step span
    for row, seconds in zip(trace.steps, derived):
        stored = float(row["seconds"])
        shown = stored if np.isnan(seconds) else seconds
        note = ("" if np.isnan(seconds) or abs(stored - seconds) <= STEP_TIME_SLACK_S + 1e-9 * abs(seconds)
                else f"  (/steps says {stored:.4f}: damaged, see trace check)")
        print(f"{row['step']:>6} {row['loss']:>14.8g} {shown:>10.4f}" + ("  (warm-up)" if row["warmup"] else "")
              + note)
    summary = meta.get("summary") or {}
    if all(isinstance(summary.get(k), (int, float)) for k in ("median_s", "compute_share", "wait_share",
                                                               "tokens_per_s")):
        from fourd_mpi.util.text import format_number

        print(f"median step {format_number(summary['median_s'])} s (max over ranks); "
              f"compute {100 * summary['compute_share']:.1f}%, exposed communication "
              f"{100 * summary['wait_share']:.1f}%; {summary['tokens_per_s']:,.0f} tokens/s")
    return 0


def _show_json(path: str, trace) -> int:
    """``trace show --format json``: what the text shows, as data (:data:`SHOW_JSON`)."""
    from fourd_mpi.trace.invariants import rank_max_seconds

    meta = trace.metadata
    binding = meta.get("binding")
    derived = rank_max_seconds(trace.steps, trace.rank_steps)
    steps = [{"step": int(row["step"]), "loss": float(row["loss"]),
              "seconds": float(row["seconds"]) if np.isnan(seconds) else float(seconds),
              "warmup": bool(row["warmup"]), "stored_seconds": float(row["seconds"])}
             for row, seconds in zip(trace.steps, derived)]
    clocks = [{"rank": int(r["rank"]), "offset_ns": int(r["clock_offset_ns"]), "drift_ppm": float(r["clock_drift_ppm"]),
               "residual_ns": int(r["clock_residual_ns"])} for r in trace.ranks]
    summary = meta.get("summary") or {}
    keys = ("median_s", "compute_share", "wait_share", "tokens_per_s")
    emit_json(SHOW_JSON, {
        "file": path, "schema_version": trace.schema_version, "status": trace.status, "damage": list(trace.damage),
        "metadata": meta, "nodes": trace.placement().describe(),
        "binding": binding.get("summary") if isinstance(binding, dict) else None, "events": len(trace.events),
        "parts": int(trace.attrs.get("parts", 0) or 0), "clocks": clocks, "steps": steps,
        "summary": {k: summary[k] for k in keys} if all(isinstance(summary.get(k), (int, float)) for k in keys)
        else None})
    return 0


def _say_stale(result) -> None:
    """One line for the temporaries of a killed merge of this run that recover removed, one for those of this
    trace's name that it left (not provably this run's)."""
    if result["stale_removed"]:
        print(f"removed {len(result['stale_removed'])} temporary file(s) that an interrupted merge of this run "
              f"left next to the trace (their processes are gone): {', '.join(result['stale_removed'])}")
    left = result.get("stale_left") or []
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        print(f"note: left {len(left)} temporary file(s) of another merge of this trace next to it, not provably "
              f"this run's (another host's or a live process's, or parts set aside by --force): {shown}")


def _show_clocks(ranks, shown: int = 16) -> None:
    """Per-rank clock alignment: start offset to rank 0, linear drift, residual uncertainty."""
    if not len(ranks):
        return
    drift = ranks["clock_drift_ppm"]
    print(f"  clocks: aligned to rank 0 at start and end (Cristian), linear drift removed; residual "
          f"uncertainty max {int(ranks['clock_residual_ns'].max())} ns"
          + ("" if np.isfinite(drift).all() else " (no end alignment on some ranks: start offsets only)"))
    from fourd_mpi.util.table import render

    rows = [[row["rank"], row["clock_offset_ns"],
             f"{row['clock_drift_ppm']:.3f}" if np.isfinite(row["clock_drift_ppm"]) else "n/a",
             row["clock_residual_ns"]] for row in ranks[:shown]]
    print(render(rows, ["rank", "offset (ns)", "drift (ppm)", "residual (ns)"], align=["right"] * 4, indent="  "))
    if len(ranks) > shown:
        print(f"  ... {len(ranks) - shown} more ranks")


def _recovered_summary(spool_dir: str):
    """The summary of a recovered run, from the step records and run.json (the peak was never recorded)."""
    from fourd_mpi.errors import TraceError
    from fourd_mpi.trace.recover import read_run_meta
    from fourd_mpi.trace.summary import summarize

    try:
        meta = read_run_meta(spool_dir)  # validated: a JSON object, numbers where numbers belong
        flops, tokens, world = meta["model_flops_per_step"], meta["tokens_per_step"], meta["world_size"]
    except (TraceError, KeyError):
        return None  # recover() reports what is wrong with the directory
    hardware = meta.get("hardware_flops_per_step")  # schema >= 5
    return lambda rank_steps: summarize(rank_steps, world, flops, tokens, None, "not recorded",
                                        hardware_flops_per_step=hardware, recompute=meta.get("recompute"))
