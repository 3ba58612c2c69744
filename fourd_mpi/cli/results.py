"""``fourd-mpi results list | show | reindex`` and ``fourd-mpi compare``: the run index and the
regression check (one process, no MPI; ``compare`` needs scipy from the ``analysis`` extra).

``compare`` exits 1 when a configuration is significantly slower than its baseline beyond the
threshold (:mod:`fourd_mpi.analysis.compare`), 0 otherwise, 2 on a usage error (nothing to compare,
an argument that names no run, a bad option).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os

from fourd_mpi.cli.args import add_allow_damaged, add_format, add_output, write_output
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import check_regular_file, check_writable, named_inputs, refuse_output
from fourd_mpi.util.values import int_in, seed_value

LIST_FORMATS = ("table", "json", "csv")
#: columns of ``results list`` (table and csv), in order
LIST_COLUMNS = ("run_id", "time", "model", "grid", "world_size", "algorithm", "median_s", "q1_s", "q3_s",
                "model_tflops_per_rank", "mfu_pct", "gemm_pct", "status", "config_key", "git_commit", "trace")
log = logging.getLogger(__name__)

#: the columns of ``results list`` that hold numbers (aligned right)
LIST_NUMBERS = ("world_size", "median_s", "q1_s", "q3_s", "model_tflops_per_rank", "mfu_pct", "gemm_pct")
INDEX_HELP = ("the index: a results directory (its index.jsonl and those below it, e.g. a sweep's "
              "results/SWEEP/SITE) or a .jsonl file (default: results)")


def register(sub) -> None:
    res = sub.add_parser("results", help="the run index <results-dir>/index.jsonl: list, show, reindex "
                         "(one process, no mpiexec)")
    rsub = res.add_subparsers(dest="results_command", required=True, parser_class=type(res))
    ls = rsub.add_parser("list", help="runs in the index, filtered; one line each")
    ls.add_argument("filters", nargs="*", metavar="KEY=VALUE",
                    help="more filters: any field of the index or option of the resolved configuration "
                         "(e.g. dtype=float64 overlap=none steps=10); config_key and git_commit match by prefix")
    _add_index(ls)
    for name, what in (("model", "only runs of this model preset"),
                       ("grid", "only runs on this grid DxZxYxX, e.g. 1x1x1x2"),
                       ("status", "only runs whose trace has this status: complete, partial, failed or interrupted"),
                       ("since", "only runs started at or after this ISO date or time (UTC unless a zone is given)"),
                       ("until", "only runs started at or before this ISO date or time"),
                       ("algorithm", "only runs of this algorithm (runs that recorded none ran axonn4d)")):
        ls.add_argument(f"--{name}", metavar=name.upper(), help=what)
    add_format(ls, LIST_FORMATS)
    add_output(ls, help="write the list to FILE instead of standard output")
    ls.set_defaults(handler=cmd_results, serial=True)

    show = rsub.add_parser("show", help="every field of one run's index entry")
    show.add_argument("run_id", metavar="RUN_ID", help="the run id")
    _add_index(show)
    add_format(show, ("table", "json"))
    show.set_defaults(handler=cmd_results, serial=True)

    rei = rsub.add_parser("reindex", help="rebuild a directory's index.jsonl from its traces (*.h5), read by the "
                         "validating reader; unreadable traces are named and left out")
    rei.add_argument("directory", metavar="DIR", help="the results directory")
    add_output(rei, help="the index to write (default DIR/index.jsonl, replaced: that is the command's purpose)",
               force_help="replace an existing -o FILE", announce=False)
    add_allow_damaged(rei)
    add_json_format(rei, REINDEX_JSON, help="the report on standard output: table (default: one line) or json")
    rei.set_defaults(handler=cmd_results, serial=True)

    cmp = sub.add_parser("compare", help="regression check: new runs against baseline runs of the same "
                         "configuration (median step-time ratio, bootstrap CI, Mann-Whitney U; runs made alternately: "
                         "paired by start time, Wilcoxon signed-rank); exit 1 on a significant slowdown beyond "
                         "--threshold (one process, no mpiexec; needs scipy)")
    cmp.add_argument("new", nargs="+", metavar="NEW",
                     help="the new runs: trace files, directories or globs of traces, run ids in the index, or "
                          "index queries KEY=VALUE[,KEY=VALUE...] (as in results list)")
    cmp.add_argument("--baseline", nargs="+", required=True, metavar="OLD",
                     help="the baseline runs, in the same forms as NEW")
    _add_index(cmp, "; run ids and queries are looked up there")
    cmp.add_argument("--threshold", default="5%",
                     help="slowdown tolerated: a percentage (5%%, default) or a fraction (0.05)")
    cmp.add_argument("--alpha", type=_fraction, default=0.05,
                     help="significance level of the Mann-Whitney U test (default 0.05)")
    cmp.add_argument("--confidence", type=_fraction, default=0.95,
                     help="confidence level of the bootstrap interval (default 0.95)")
    cmp.add_argument("--resamples", type=int_in(1, 10 ** 6, "bootstrap resamples"), default=9999, metavar="N",
                     help="bootstrap resamples (default 9999)")
    cmp.add_argument("--seed", type=seed_value, default=0, help="seed of the bootstrap (default 0: reproducible)")
    cmp.add_argument("--ignore", metavar="OPTIONS", default=None,
                     help="comma list of configuration options left out of the matching key (e.g. steps,warmup: "
                          "compare runs that differ only in them)")
    cmp.add_argument("--unit", choices=("auto", "paired", "run", "step"), default="auto",
                     help="the samples: auto (default): paired runs when the two sides' runs alternate in time "
                          "(ordered by start time, at most 2 of a side in a row) and give at least 6 pairs (at --alpha "
                          "0.05: n pairs give an exact signed-rank p >= 2/2^n), else each run's median step time when "
                          "both sides have at least 4 runs (at --alpha 0.05: the fewest for which the exact two-sided "
                          "Mann-Whitney p can fall below alpha; n against n runs give p >= 2/C(2n,n)), else "
                          "inconclusive (exit 0: the steps' figures for information, one line saying how many runs "
                          "each side needs); paired: each new run with the baseline run next to it in start "
                          "time, Wilcoxon signed-rank test of the log ratios of their median step times (cancels a "
                          "drift of the machine's load that moves both sides; make the runs alternately, A B B A ...); "
                          "run: always the runs (sees the variation between runs, which steps of one run do not; "
                          "inconclusive with fewer than 4 a side, paired with fewer than 6 pairs, at --alpha 0.05); "
                          "step: always every measured step, pooled (a verdict from one run a side, uncalibrated)")
    add_format(cmp, ("table", "markdown", "json", "junit"),
               help="table (default), markdown, json, or junit (JUnit XML: a test case per configuration, a failure "
                    "per regression)")
    add_output(cmp, help="write the report to FILE instead of standard output (the exit status still tells)")
    add_allow_damaged(cmp)
    cmp.set_defaults(handler=cmd_compare, serial=True)


#: ``results reindex --format json``
REINDEX_JSON = JsonDoc("results reindex", {
    "index": "the index written", "runs": "how many runs it holds",
    "skipped": "traces left out: path, why"})


def _add_index(parser, what: str = "") -> None:
    parser.add_argument("--index", default="results", metavar="PATH", help=INDEX_HELP + what)


def _fraction(text: str) -> float:
    """A number strictly between 0 and 1 (``--alpha``, ``--confidence``); argparse names the option."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (both excluded), e.g. 0.05, got {text!r}")
    return value


def warn(text: str) -> None:
    log.warning("%s", text)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_entries(entries, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(entries, indent=1) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(LIST_COLUMNS)
        for e in entries:
            writer.writerow(["" if e.get(c) is None else e.get(c) for c in LIST_COLUMNS])
        return buf.getvalue()
    from fourd_mpi.util.table import render

    shown = [c for c in LIST_COLUMNS if c not in ("git_commit", "trace")]
    body = [[_cell(e.get(c)) if c != "config_key" else e[c][:8] for c in shown] for e in entries]
    align = ["right" if c in LIST_NUMBERS else "left" for c in shown]
    return (render(body, shown, align=align) + f"\n{len(entries)} run(s); median_s, q1_s, q3_s: step time (median and "
            "quartiles over measured steps of the max over ranks)\n")


def cmd_results(args, world=None) -> int:
    from fourd_mpi.results.index import index_file, nested_indexes, read_index_tree, refuse_foreign_link
    from fourd_mpi.results.query import parse_terms, select
    from fourd_mpi.trace.indexing import reindex

    if args.results_command == "reindex":
        if not os.path.isdir(args.directory):
            raise ConfigError(f"{args.directory}: not a directory")
        refuse_output(args.output, args.force, inputs=named_inputs([args.directory]))
        target = args.output or index_file(args.directory)
        check_regular_file(target, "index file")  # before the traces are read: a FIFO, a directory
        refuse_foreign_link(target)  # a link to another directory's (shared) index is never rewritten
        check_writable(os.path.dirname(os.path.abspath(target)), f"the index {target}")
        entries, problems = reindex(args.directory, args.output, allow_damaged=args.allow_damaged)
        for path, why in problems:
            log.warning("skipped %s: %s", path, why)
        if args.format == "json":
            emit_json(REINDEX_JSON, {"index": target, "runs": len(entries),
                                     "skipped": [{"path": path, "why": why} for path, why in problems]})
            return 1 if problems else 0
        print(f"{args.output or index_file(args.directory)}: {len(entries)} run(s) indexed"
              + (f", {len(problems)} trace(s) skipped" if problems else ""))
        return 1 if problems else 0  # as analyze: 1 when some trace was skipped
    path = index_file(args.index)
    if not os.path.exists(path) and not (os.path.isdir(args.index) and nested_indexes(args.index)):
        raise ConfigError(f"no index at {path} (runs append to <results-dir>/index.jsonl; "
                          f"'fourd-mpi results reindex DIR' builds one from traces)")
    entries = read_index_tree(path, warn)  # with the indexes below it: a sweep's results/SWEEP/SITE
    if args.results_command == "show":
        found = [e for e in entries if e["run_id"] == args.run_id]
        if not found:
            raise ConfigError(f"no run {args.run_id!r} in {path}")
        entry = found[-1]
        if args.format == "json":
            print(json.dumps(entry, indent=1))
        else:
            for key, value in entry.items():
                if key == "config":
                    print("config:")
                    for k, v in value.items():
                        print(f"  {k} = {json.dumps(v)}")
                else:
                    print(f"{key}: {_cell(value) if not isinstance(value, float) else repr(value)}")
        return 0
    refuse_output(args.output, args.force, inputs=[path])
    terms = [(name, getattr(args, name)) for name in ("model", "grid", "status", "since", "until", "algorithm")
             if getattr(args, name) is not None]
    chosen = select(entries, terms + parse_terms(args.filters))
    write_output(args.output, format_entries(chosen, args.format), f"{args.format}: {len(chosen)} run(s)")
    return 0


def _load_side(args, specs, index_path, what: str):
    """``(entry, per-step times, trace path)`` of every run the arguments name (unreadable traces skipped
    with a warning; none at all is a usage error)."""
    from fourd_mpi.errors import TraceError
    from fourd_mpi.results.query import resolve
    from fourd_mpi.trace.indexing import entry_of_trace
    from fourd_mpi.trace.read import load_trace
    from fourd_mpi.trace.summary import step_stats

    runs, seen = [], set()
    for spec in specs:
        for _, path in resolve(spec, index_path, warn):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            try:
                trace = load_trace(path, allow_damaged=args.allow_damaged)
            except TraceError as exc:
                log.warning("skipped %s: %s", path, exc)
                continue
            times = usable_step_times(step_stats(trace).per_step_s, path)
            if times is not None:
                runs.append((entry_of_trace(trace, os.path.dirname(path) or "."), times, path))
    if not runs:
        raise ConfigError(f"no readable trace with a usable step time among the {what} runs ({' '.join(specs)})")
    return runs


def usable_step_times(times, path: str):
    """The step times of a run that a comparison may use: positive and finite. A damaged trace read with
    ``--allow-damaged`` may hold negative or zero spans (clocks that ran backwards, a corrupted record): they are
    left out with a warning (statistics over impossible times gave verdicts, "faster" at p = 1e-08), and a run
    with none left is skipped with one (None)."""
    import numpy as np

    times = np.asarray(times, dtype=float)
    good = np.isfinite(times) & (times > 0)
    if good.all():
        return times
    if not good.any():
        warn(f"skipped {path}: none of its {len(times)} step time(s) is a positive time (a damaged trace: "
             "--allow-damaged reads it, but impossible times are not compared)")
        return None
    warn(f"{path}: left out {int((~good).sum())} of its {len(times)} step time(s) that are not positive times (a "
         "damaged trace: --allow-damaged reads it, but impossible times are not compared)")
    return times[good]


def cmd_compare(args, world=None) -> int:
    try:
        import scipy  # noqa: F401
    except ImportError:
        raise ConfigError("compare needs scipy (bootstrap, Mann-Whitney U, Wilcoxon signed-rank): pip install "
                          "'fourd_mpi[analysis]' (or pip install scipy)") from None
    from fourd_mpi.analysis.compare import (
        Settings,
        compare_runs,
        config_differences,
        drop_new_from_baseline,
        exit_status,
        parse_threshold,
    )
    from fourd_mpi.analysis.compare_report import render
    from fourd_mpi.results.index import index_file, rekeyed

    settings = Settings(threshold=parse_threshold(args.threshold), alpha=args.alpha, confidence=args.confidence,
                        resamples=args.resamples, seed=args.seed, unit=args.unit)
    index_path = index_file(args.index)
    refuse_output(args.output, args.force, inputs=named_inputs(args.new + args.baseline) + [index_path])
    new = _load_side(args, args.new, index_path, "new")
    old = _load_side(args, args.baseline, index_path, "baseline")
    old, dropped = drop_new_from_baseline(new, old)
    if dropped:
        warn(f"left out of the baseline {len(dropped)} run(s) that are also new runs: {', '.join(dropped)}")
    if not old:
        raise ConfigError(f"--baseline: every baseline run is also a new run ({', '.join(dropped)}); name other "
                          f"baseline runs")
    ignore = [name.strip() for name in (args.ignore or "").split(",") if name.strip()]
    if ignore:
        known = {k for entry, _, _ in new + old for k in entry["config"]}
        unknown = [name for name in ignore if name not in known]
        if unknown:
            raise ConfigError(f"--ignore {unknown[0]}: no such configuration option in these runs (options: "
                              f"{', '.join(sorted(known))})")
        new = [(rekeyed(e, ignore), s, p) for e, s, p in new]
        old = [(rekeyed(e, ignore), s, p) for e, s, p in old]
    comparisons = compare_runs(new, old, settings)
    if not any(c.verdict != "unmatched" for c in comparisons):
        differ = config_differences(new[0][0].get("config") or {}, old[0][0].get("config") or {})
        raise ConfigError(f"no configuration is in both the new and the baseline runs: {new[0][0]['run_id']} and "
                          f"{old[0][0]['run_id']} differ in {differ or 'options outside the config'} (new->baseline); "
                          f"--ignore NAME,... matches runs that differ only in those")
    write_output(args.output, render(comparisons, settings, args.format),
                 f"{args.format}: {sum(c.regression for c in comparisons)} regression(s)")
    return exit_status(comparisons)
