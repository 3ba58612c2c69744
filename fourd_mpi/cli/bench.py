"""``fourd-mpi bench collectives``: the collective micro-benchmark (OSU / nccl-tests style) under
mpiexec that measures a machine profile for the performance model."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from fourd_mpi.cli.args import add_deprecated, add_option, add_options
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format
from fourd_mpi.run.options import OPTIONS, options_in
from fourd_mpi.util.files import refuse_output, write_text
from fourd_mpi.util.values import byte_size, float_in, int_in

#: the largest message of bench collectives (bytes): it holds a few buffers of this size per rank
MAX_BENCH_BYTES = 1 << 30
#: the most iterations of one measurement of bench collectives
MAX_BENCH_ITERS = 1 << 20
#: the largest n of bench collectives' n x n GEMM (three float64 matrices of 2 GiB each)
MAX_GEMM_SIZE = 1 << 14


#: ``bench collectives --format json`` (written by :func:`fourd_mpi.run.collbench.format_result`)
BENCH_JSON = JsonDoc("bench collectives", {
    "world_size": "ranks", "num_nodes": "nodes", "grids": "the grids benchmarked", "formulas": "of the columns",
    "units": "of the values", "communicators": "comm, axes, level, p, per_node",
    "rows": "per communicator, op, size and placement: the csv columns", "overlap": "the overlap measurements",
    "sync": "the synchronization cost per communicator", "compute": "GEMM and element-wise rates",
    "wrong": "wrong result elements in all", "avg_busbw_gbps": "mean busbw of the rows",
    "iterations": "the iteration rule", "step_model": "model and dtype of the step's messages",
    "step_messages": "the step's messages and whether the sizes cover them", "bound": "the --time-limit rule",
    "sweep": "time_limit_s, elapsed_s, planned, measured, skipped (what the bound left out)",
    "profile": "path of the profile written (null: none, with reason), missing_ops"}, optional=("profile",))


def _size(text: str) -> int:
    """Bytes of ``--min-size``/``--max-size``: :func:`byte_size` with bare numbers as bytes and ``KB`` = 1024
    (``8``, ``64K``, ``64KB``, ``4MiB``), from 1 to :data:`MAX_BENCH_BYTES`."""
    value = byte_size(text, decimal=False, bare=True, what="message size")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    if value > MAX_BENCH_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is larger than the largest message, 1G ({MAX_BENCH_BYTES:,} "
                                         "bytes): the benchmark holds a few buffers of that size on every rank")
    return value


def _add_output_options(p) -> None:
    """The ``output`` group of ``bench collectives``: the profile written, its fit gate, the report's file and
    format."""
    from fourd_mpi.perf.calibration import MAX_FIT_RMS

    o = p.add_argument_group("output")
    o.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="machine profile to write (default results/profiles/<host>.yaml); the report stays on "
                        "standard output")
    o.add_argument("--name", default=None, help="profile name (default local-<host>)")
    o.add_argument("--fallback", default=None, metavar="PROFILE",
                   help="built-in profile named in the file for levels not measured (e.g. perlmutter)")
    o.add_argument("--force", action="store_true", help="replace an existing profile file (or --report file)")
    o.add_argument("--max-fit-error", type=float_in(0.0, 1000.0, "a percentage"), default=100 * MAX_FIT_RMS,
                   metavar="PERCENT", help=f"the profile is written only when every alpha-beta fit (per level, "
                   f"collective and group size) misses its measurements by less than this relative rms error "
                   f"(default {100 * MAX_FIT_RMS:.0f}); else one line names the worst fit and every rank exits 1")
    o.add_argument("--accept-poor-fit", action="store_true",
                   help="write the profile even when a fit reaches --max-fit-error; the model then uses the stored "
                        "measured points first. A flag of its own, not --force: replacing a file and accepting a "
                        "poor fit are different decisions")
    o.add_argument("--report", dest="table", metavar="FILE",
                   help="also write the printed report (in --format) there")
    add_deprecated(o, "--table", "--report", dest="table", metavar="FILE")
    add_json_format(o, BENCH_JSON, ("table", "csv", "json"),
                    help="report on stdout: table (nccl-tests / OSU-like text, default) or csv (a row per "
                         "communicator, op, size and placement), each row printed when it is measured; or json (one "
                         "document at the end: everything)")


def register(sub) -> None:
    """``fourd-mpi bench collectives ...``"""
    from fourd_mpi.perf.calibration import OPS
    from fourd_mpi.run.collbench import DEFAULT_TIME_LIMIT_S, PROGRESS_EVERY_S

    bench = sub.add_parser("bench", help="micro-benchmarks under mpiexec: collectives (OSU / nccl-tests "
                           "style) and the machine profile for the performance model")
    bsub = bench.add_subparsers(dest="bench_command", required=True, parser_class=sub._parser_class)
    p = bsub.add_parser("collectives", help="latency, algbw/busbw and overlap %% of the grid's collectives, "
                        "each size's row printed as it is measured; writes a machine profile; bounded by --time-limit")
    g = p.add_argument_group("communicators (each axis of size > 1, and the world)")
    for option in options_in("grid"):
        add_option(g, option)
    g.add_argument("--grid", action="append", default=[], metavar="DxZxYxX",
                   help="grid to benchmark (repeatable); default: the grid flags, or when none is given one "
                        "grid per divisor p of the world with G_x = p (every group size once)")
    g.add_argument("--no-world", action="store_true", help="skip the world communicator")
    add_option(g, OPTIONS["step-timeout"], help="watchdog: a rank that waits longer than this in one measurement "
               "(one collective, size and placement) prints where it waits and aborts the job (MPI_Abort); 0 "
               "disables (default 600)")
    s = p.add_argument_group("sweep")
    s.add_argument("--ops", default=",".join(OPS), metavar="LIST", help=f"comma list of {', '.join(OPS)}")
    s.add_argument("--min-size", type=_size, default=8, metavar="BYTES", help="smallest message (default 8)")
    s.add_argument("--max-size", type=_size, default=64 * 1024 ** 2, metavar="BYTES",
                   help="largest message, measured even when the --factor steps miss it (default 64M: "
                        "8, 64, ..., 16M, 64M; measured here: 310 MB peak resident memory per rank at 64M, 82 MB "
                        "at 4M)")
    s.add_argument("--factor", type=int_in(2, 1 << 20, "the size multiplier"), default=8,
                   help="size step (default 8: 8, 64, 512, ...)")
    s.add_argument("--iters", type=int_in(1, MAX_BENCH_ITERS, "timed iterations"), default=20,
                   help="at least this many timed iterations per size and placement (default 20, as nccl-tests' -n)")
    s.add_argument("--min-time", type=float_in(0.0, 86400.0, "seconds"), default=0.2, metavar="SECONDS",
                   help="and at least this many seconds of timed iterations (default 0.2; 0: --iters alone); "
                        "the ranks agree on the count, so collectives stay matched")
    s.add_argument("--max-time", type=float_in(1e-3, 86400.0, "seconds"), default=10.0, metavar="SECONDS",
                   help="bound: stop the timed iterations of one size and placement after this much wall time, "
                        "even below --iters or --min-time (default 10; at least one iteration)")
    s.add_argument("--time-limit", type=float_in(0.0, 7 * 86400.0, "seconds"), default=DEFAULT_TIME_LIMIT_S,
                   metavar="SECONDS", help=f"bound on the whole sweep, the compute calibration before it included "
                   f"(default {DEFAULT_TIME_LIMIT_S:g}; 0: none): each communicator and collective gets its share of "
                   "the time left, and a measurement runs only when its least predicted time (warm-up, --min-time or "
                   "one timed iteration, the check; extrapolated from the sizes measured before it) fits into what is "
                   "left of that share, its timed iterations stopping there: the largest sizes are left out first, "
                   "named in one line (JSON: sweep.skipped)")
    s.add_argument("--progress-every", type=float_in(0.0, 86400.0, "seconds"), default=PROGRESS_EVERY_S,
                   metavar="SECONDS", help=f"a progress line on standard error (which collective, size i of n, time "
                   f"elapsed and about how much is left) at each new communicator and collective, before a "
                   f"measurement predicted to take this long, and otherwise at most every SECONDS (default "
                   f"{PROGRESS_EVERY_S:g}; 0: none)")
    s.add_argument("--warmup", type=int_in(0, MAX_BENCH_ITERS, "untimed iterations"), default=3,
                   help="untimed iterations first (default 3)")
    s.add_argument("--overlap-sizes", type=int_in(0, 64, "sizes"), default=2, metavar="K",
                   help="measure overlap at the K largest sizes up to 4M (default 2; 0 skips it)")
    add_options(p, ("model",), names=("dtype",))  # the step whose messages the report sets beside the table
    c = p.add_argument_group("compute calibration")
    c.add_argument("--dtypes", default="float32,float64", help="GEMM dtypes to measure (default float32,float64)")
    c.add_argument("--gemm-size", type=int_in(1, MAX_GEMM_SIZE, "n of an n x n GEMM"), default=256,
                   help="n of the n x n x n GEMM (default 256)")
    c.add_argument("--backend", default="numpy", choices=("numpy", "cupy"), help="array library of the GEMM "
                   "(collective buffers are host memory)")
    _add_output_options(p)
    s.add_argument("--no-in-place", dest="in_place", action="store_false",
                   help="measure out-of-place only (default: out-of-place and MPI_IN_PLACE)")
    bench.set_defaults(handler=cmd_bench, serial=False)


def cmd_bench(args, world) -> int:
    """``fourd-mpi bench collectives``: run, write the profile (rank 0), print the report (rank 0).

    Errors are printed once, by rank 0, and every rank exits with the same status (rank 0's,
    broadcast): 2 for bad options or a profile/report that cannot be written, 1 when the result
    check found wrong elements (``#wrong`` > 0), else 0.
    """
    from fourd_mpi.cli.args import error_line
    from fourd_mpi.core.mpiutil import on_root
    from fourd_mpi.core.watchdog import Watchdog, check_timeout
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.run.collbench import StreamReport, run_bench

    hostname = socket.gethostname()
    out = args.output or os.path.join("results", "profiles", f"{hostname}.yaml")
    rank = world.Get_rank()
    try:
        # rank 0 writes them; every rank hears, before anything is measured
        on_root(world, lambda: refuse_output(out, args.force, inputs=[args.fallback or ""], makes_dirs=True))
        if args.table:
            on_root(world, lambda: refuse_output(args.table, args.force, option="--report",
                                                   inputs=[out, args.fallback or ""]))
        if args.name is not None:
            on_root(world, lambda: _check_profile_name(args.name))
        if args.fallback:
            from fourd_mpi.perf.machine import load_profile

            load_profile(args.fallback)  # fail early on an unknown name, on every rank
        check_timeout(args.step_timeout)
        watchdog = Watchdog(args.step_timeout, rank)
        report = StreamReport(args.format, every=args.progress_every) if rank == 0 else None
        result = run_bench(args, world, watchdog, report)
        watchdog.close()
    except ConfigError as exc:  # the same on every rank (checked before any collective): said once
        if rank == 0:
            error_line(exc)
        return 2
    status = 0
    if rank == 0:
        try:
            status = _report_bench(result, args, hostname, out, report)
        except (ConfigError, OSError) as exc:
            error_line(exc)
            status = 2
    return world.bcast(status, root=0)


def _check_profile_name(name: str) -> None:
    """``--name`` as the machine profile schema wants it, checked before anything is measured."""
    import re

    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf.machine import PROFILE_SCHEMA

    rule = PROFILE_SCHEMA["properties"]["name"]
    if not re.match(rule["pattern"], name):
        raise ConfigError(f"--name {name!r}: {rule['description']} (at most 64 characters, starting with a letter "
                          f"or digit)")


def _report_bench(result, args, hostname, out, report) -> int:
    """Rank 0: write the machine profile (from what was measured), print the rest of the report in ``--format``
    (``report``: the :class:`~fourd_mpi.run.collbench.StreamReport` that printed the rows as they were
    measured) and the profile summary; the exit status."""
    import yaml

    from fourd_mpi.perf.calibration import build_profile, missing_kinds, profile_problem
    from fourd_mpi.run.collbench import format_result, total_wrong

    problem = profile_problem(result)
    missing = missing_kinds(result)
    refused = None
    if problem:
        summary = [f"# {problem}"]
        result["profile"] = {"path": None, "reason": problem}
    else:
        summary, refused = _write_profile(result, args, hostname, out, build_profile, yaml)
        result["profile"] = {"path": None if refused else out, "missing_ops": missing}
        if refused:
            result["profile"]["reason"] = refused
        if missing:
            summary.append(f"  no fit of {', '.join(m[1:] for m in missing)}: --ops lacks {', '.join(missing)}; the "
                           f"model takes them from the profile's fallback (--fallback) or refuses")
    text = format_result(result, args.format)
    if args.format == "json":
        import json

        BENCH_JSON.check(json.loads(text))
    report.end(result)
    if result.get("skipped_line"):
        print(f"fourd-mpi: note: {result['skipped_line']}", file=sys.stderr, flush=True)
    if args.format == "table":
        print("\n".join(summary), flush=True)
    else:  # stdout stays machine-readable
        print("\n".join(line.lstrip("# ") if line.startswith("#") else line for line in summary if line),
              file=sys.stderr, flush=True)
    if args.table:
        write_text(args.table, text + "\n" + ("\n".join(summary) + "\n" if args.format == "table" else ""), "--report")
    wrong = total_wrong(result)
    if wrong:
        print(f"fourd-mpi: error: the result check found {wrong} wrong element(s) (#wrong)", file=sys.stderr,
              flush=True)
        return 1
    if refused:
        print(f"fourd-mpi: error: {refused}", file=sys.stderr, flush=True)
        return 1
    return 0


def _per_size_errors(entry, kind) -> str:
    """``; per group size (what the model uses): p=2 12%, p=4 8%`` from a level's ``by_size`` fits, or ``""``."""
    per_p = (entry.get("by_size") or {}).get(kind) or {}
    if not per_p:
        return ""
    return "; per group size (what the model uses): " + ", ".join(
        f"p={p} {100 * f['rms_rel_error']:.0f}%" for p, f in per_p.items())


def _write_profile(result, args, hostname, out, build_profile, yaml):
    """Validate and write the machine profile (rank 0); ``(the lines that describe its fits, why it was
    not written or None)``: a fit whose relative rms error reaches
    ``--max-fit-error`` (default :data:`~fourd_mpi.perf.calibration.MAX_FIT_RMS`) keeps it from being written
    unless ``--accept-poor-fit``."""
    from fourd_mpi.perf.calibration import fit_window, poor_fit_line, poor_fits
    from fourd_mpi.run.collbench import mpi_library

    name = args.name or f"local-{hostname}"
    profile = build_profile(result, name, hostname, args.fallback, args.backend, mpi_library=mpi_library())
    import jsonschema

    from fourd_mpi.perf.machine import PROFILE_SCHEMA

    jsonschema.validate(profile, PROFILE_SCHEMA)
    limit = args.max_fit_error / 100
    bad = poor_fits(profile, limit)
    refused = (poor_fit_line(bad, limit, fit_window(result["rows"], limit), searched=True)
               if bad and not args.accept_poor_fit else None)
    if bad and args.accept_poor_fit:
        profile["calibration"]["poor_fits"] = (f"{len(bad)} fit(s) at or over {100 * limit:g}% rms, written "
                                               f"by --accept-poor-fit: " + ", ".join(
                                                   f"{lv} {kind} p={p} {100 * rms:.0f}%" for lv, kind, p, rms in bad))
        jsonschema.validate(profile, PROFILE_SCHEMA)
    if not refused:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_text(out, f"# machine profile written by fourd-mpi bench collectives ({len(result['rows'])} "
                        f"measurements)\n" + yaml.safe_dump(profile, sort_keys=False))
    fits = []
    for level, entry in profile["levels"].items():
        for kind in ("allgather", "reduce_scatter", "allreduce"):
            f = entry.get(kind)
            if f is None:
                fits.append(f"  {level:<5} {kind:<15} not measured")
                continue
            beta = f["beta_s_per_byte"]
            fits.append(f"  {level:<5} {kind:<15} alpha {f['alpha_s'] * 1e6:8.2f} us  beta {beta * 1e9:8.4f} "
                        f"ns/B ({1 / beta / 1e9 if beta > 0 else float('inf'):.3f} GB/s)"
                        f"  rms rel. error {100 * f['rms_rel_error']:.0f}% over {f['points']} points"
                        + _per_size_errors(entry, kind))
    summary = ["", f"machine profile {out}{' NOT written (see the error line)' if refused else ''}:"] + fits + [
        f"  oversubscription x{profile['compute']['oversubscription']:.2f}, overlap efficiency with polling "
        f"{profile['progress']['overlap_efficiency']:.2f}"]
    if "inter" not in profile["levels"]:
        summary.append("  no inter-node level (one node): grids that cross nodes need --fallback or a multi-node run")
    if bad and args.accept_poor_fit:
        summary.append(f"  written with {len(bad)} fit(s) at or over {100 * limit:g}% rms (--accept-poor-fit): "
                       f"the model uses the stored measured points where it has them")
    return summary, refused
