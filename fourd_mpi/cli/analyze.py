"""``fourd-mpi analyze | plot | export``: tables, figures and timeline/profile exports of traces
(one process, no MPI; pandas and matplotlib from the ``analysis`` extra)."""

from __future__ import annotations

import json
import logging
import os

from fourd_mpi.analysis.export import COMMANDS as EXPORT_COMMANDS
from fourd_mpi.analysis.registry import ANALYSES, AUTO, NAMES, PER_TRACE
from fourd_mpi.cli.args import (
    FORMATS,
    add_allow_damaged,
    add_deprecated,
    add_format,
    add_output,
    add_selection,
    add_trace_paths,
    parse_list,
    write_output,
    wrote,
)
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import named_inputs, refuse_output, replacing

log = logging.getLogger(__name__)

PLOTS = ("scaling", "breakdown", "timeline", "overlap")


def register(sub) -> None:
    an = sub.add_parser("analyze", help="tables from traces: per run, breakdown, communication, scaling, "
                        "comparison, per step and rank (one process, no mpiexec); a run's step time is the median "
                        "over measured steps of the max over ranks, spread = its quartiles")
    add_trace_paths(an)
    an.add_argument("--what", default="auto", metavar="LIST",
                    help=f"comma list of {', '.join(NAMES)}; auto (default): runs, breakdown and comm of each "
                         "run, and compare and weak/strong scaling when several runs qualify; steps: one row per "
                         "(run, step, rank) with step, compute, wait and per-axis MPI time and loss")
    an.add_argument("--scaling", choices=("weak", "strong"), action="append", default=None,
                    help="scaling mode(s) for the scaling table (default: both where they apply)")
    add_format(an, FORMATS, help="table (default), csv (one table: choose it with --what), json (every table) or "
                                 "markdown")
    an.add_argument("--baseline", metavar="TRACE", help="comm: a run of the same model and grid without overlap; "
                    "adds hidden_pct, the share of its exposed communication time no longer exposed (OSU's overlap "
                    "with the baseline as t_pure)")
    add_output(an, help="write the tables to FILE instead of standard output")
    add_allow_damaged(an)
    an.set_defaults(handler=cmd_analyze, serial=True)

    pl = sub.add_parser("plot", help="figures from traces: scaling, breakdown, timeline, overlap (PNG, SVG, PDF)")
    pl.add_argument("kind", choices=PLOTS, help="the figure")
    add_trace_paths(pl, " (timeline: one trace)")
    add_output(pl, required=True, help="the figure: .png, .svg or .pdf")
    pl.add_argument("--scaling", choices=("weak", "strong"), default="weak",
                    help="scaling: weak (default) or strong (as analyze --scaling)")
    add_deprecated(pl, "--mode", "--scaling", dest="scaling", choices=("weak", "strong"))
    add_selection(pl, "steps", "timeline: the step to draw, one number (default: the first measured one)",
                  old=("--step",))
    add_selection(pl, "ranks", "timeline: ranks to show (e.g. 0-3; default all)", old=("--ranks",))
    pl.add_argument("--normalize", action="store_true", help="breakdown: shares instead of seconds")
    pl.add_argument("--baseline", metavar="TRACE", help="overlap: a run of the same model and grid without "
                    "overlap; plots hidden_pct (the exposed time that stopped being exposed) instead of overlap_pct, "
                    "an upper bound")
    add_allow_damaged(pl)
    pl.set_defaults(handler=cmd_plot, serial=True)

    ex = sub.add_parser("export", help="convert a trace for Perfetto / chrome://tracing or for Hatchet / Thicket")
    ex.add_argument("format", choices=EXPORT_COMMANDS,
                    help="perfetto: the timeline, its format from the suffix of -o: Chrome trace-event JSON "
                         "(.json or .json.gz) or Perfetto protobuf (.pftrace or .perfetto-trace, .gz: gzip; about "
                         "40 %% of the JSON's size; needs pip install 'fourd_mpi[perfetto]'); thicket: Caliper "
                         "JSON-split profile")
    ex.add_argument("trace", metavar="TRACE", help="the trace (.h5)")
    add_output(ex, required=True, help="the exported file")
    add_selection(ex, "steps", "perfetto: only these steps (e.g. 1,2; default all)", old=("--steps",))
    add_selection(ex, "ranks", "perfetto: only these ranks (e.g. 0-3,8; default all)", old=("--ranks",))
    ex.add_argument("--include-warmup", action="store_true", help="thicket: also profile the warm-up steps")
    add_allow_damaged(ex)
    ex.set_defaults(handler=cmd_export, serial=True)


def _load_traces(args):
    """The traces named by ``args.paths`` (each unreadable one named on stderr), after refusing to
    overwrite ``args.output`` without ``--force``."""
    from fourd_mpi.analysis.tables import collect_or_fail

    refuse_output(args.output, args.force, inputs=named_inputs(args.paths + [getattr(args, "baseline", None) or ""]))
    return collect_or_fail(args.paths, allow_damaged=args.allow_damaged)


def _concat(frames):
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


def cmd_analyze(args, world=None) -> int:
    """Exit 0: every file analysed; 1: some skipped (each named on stderr); 2: nothing to analyse.

    Iterates the analyses of :data:`~fourd_mpi.analysis.registry.ANALYSES` that ``--what`` names."""
    from fourd_mpi.analysis.tables import runs_table

    what = list(AUTO) if args.what == "auto" else parse_list(args.what, NAMES, "--what")
    chosen = [a for a in ANALYSES if a.name in what]
    traces, problems = _load_traces(args)
    runs = runs_table(traces)
    for entry in chosen:  # asked for by name: too few runs is one line, not an empty answer
        why = entry.need and entry.get("need")(runs)
        if why and args.what != "auto":
            raise ConfigError(why)
    full = args.format in ("csv", "json")  # csv and json: the full frames; table and markdown: the wide views
    sections = []  # (title, frame, formulas)
    for entry in chosen:
        if entry.need and entry.get("need")(runs):
            continue
        table = entry.get("table")
        if entry.scope == PER_TRACE:
            frames = [f for f in (table(t) for t in traces) if len(f)]
            if not frames:
                continue
            if entry.against and args.baseline:
                reference = _baseline_table(args, traces, table)
                frames = [entry.get("against")(f, reference) for f in frames]
            tables = [(entry.name, _concat(frames))]
        else:
            tables = [(title, frame) for title, frame in table(runs, args.scaling or ("weak", "strong")) if len(frame)]
        for title, frame in tables:
            shown = frame if full or not entry.wide else entry.get("wide")(frame)
            sections.append((title, shown, entry.get("formulas")))
            if entry.companion and args.format != "csv":  # csv: one table, this one
                name, companion, formulas = entry.get("companion")
                sections.append((name, companion(frame), formulas))
    write_output(args.output, _render_sections(sections, args.format), f"{args.format}: {len(sections)} table(s)")
    return 1 if problems else 0


def _baseline_table(args, traces, table):
    """``table`` of the ``--baseline`` run, after a note for each trace unlike it."""
    from fourd_mpi.trace.read import load_trace

    base = load_trace(args.baseline, allow_damaged=args.allow_damaged)
    _note_unlike_baseline(traces, base, args.baseline)
    reference = table(base)
    if not len(reference):
        raise ConfigError(f"--baseline {args.baseline}: no collectives (an op-level trace is needed)")
    return reference


def _note_unlike_baseline(traces, base, path: str) -> None:
    """One note per trace whose model or grid differs from the ``--baseline``'s: its hidden_pct is '-' (the
    collectives of another grid or model are not the same operations), and now the note says why."""
    def shape(trace):
        meta = trace.metadata
        return (meta.get("config") or {}).get("model"), meta.get("grid")

    want = shape(base)
    for trace in traces:
        have = shape(trace)
        if have != want:
            log.info(f"note: {trace.path} is model {have[0]} on grid {have[1]}, the --baseline {path} is model "
                     f"{want[0]} on grid {want[1]}: its hidden_pct is '-' "
                     "(the baseline must be a run of the same model and grid without overlap)")


def _render_sections(sections, fmt: str) -> str:
    """``sections`` ``[(title, frame, formulas)]`` as one document: json (title -> records), csv (one table
    only) or text and markdown (each table under its title, then its formulas)."""
    from fourd_mpi.analysis.tables import format_table

    if fmt == "json":
        return json.dumps({title: json.loads(format_table(frame, "json")) for title, frame, _ in sections},
                          indent=1) + "\n"
    if fmt == "csv":
        if len(sections) != 1:
            raise ConfigError(f"--format csv writes one table: choose one with --what (got "
                              f"{', '.join(t for t, _, _ in sections) or 'none'})")
        return format_table(sections[0][1], "csv")
    heading = "## {}" if fmt == "markdown" else "== {} =="
    parts = []
    for title, frame, formulas in sections:
        parts.append(heading.format(title) + "\n\n" + format_table(frame, fmt))
        if formulas:
            parts.append("\n".join(f"  {k}: {v}" for k, v in formulas.items()))
    return "\n\n".join(parts) + "\n"


def cmd_plot(args, world=None) -> int:
    """Exit 0, or 1 when some input files were skipped (named on stderr)."""
    from fourd_mpi.analysis import plots
    from fourd_mpi.analysis import tables as analysis

    if os.path.splitext(args.output)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"{args.output}: the figure's format comes from its suffix: .png, .svg or .pdf")
    traces, problems = _load_traces(args)
    try:
        with replacing(args.output) as tmp:  # the figure under a temporary name, renamed when complete
            _draw(args, traces, tmp, plots, analysis)
    except ValueError as exc:  # an unknown step or rank, an empty table
        raise ConfigError(str(exc)) from None
    wrote(args.output, f"{args.kind} of {len(traces)} trace(s)")
    return 1 if problems else 0


def _draw(args, traces, output: str, plots, analysis) -> None:
    """The figure ``args.kind`` of ``traces`` into ``output``."""
    if args.kind == "timeline":
        if len(traces) != 1:
            raise ConfigError(f"timeline draws one trace; got {len(traces)}")
        steps = args.select_steps or []
        if len(steps) > 1:
            raise ConfigError(f"timeline draws one step: give --select-steps N, not {len(steps)} steps")
        plots.plot_timeline(traces[0], output, step=steps[0] if steps else None, ranks=args.select_ranks)
    elif args.kind == "scaling":
        table = analysis.scaling(analysis.runs_table(traces), args.scaling)
        if not len(table):
            why = "; ".join(f"{g}: {r}" for g, r in table.attrs.get("dropped", [])) or "no runs"
            raise ConfigError(f"no {args.scaling}-scaling line in these traces ({why})")
        plots.plot_scaling(table, output, mode=args.scaling)
    elif args.kind == "breakdown":
        frame = _concat([analysis.breakdown(t) for t in traces])
        plots.plot_breakdown(frame, analysis.runs_table(traces), output, normalize=args.normalize)
    else:
        frames = [f for f in (analysis.comm_table(t) for t in traces) if len(f)]
        if not frames:
            raise ConfigError("overlap needs op-level traces (--trace-level op)")
        if args.baseline:
            reference = _baseline_table(args, traces, analysis.comm_table)
            frames = [analysis.hidden_vs_baseline(f, reference) for f in frames]
        plots.plot_overlap(_concat(frames), output, runs_df=analysis.runs_table(traces))


def cmd_export(args, world=None) -> int:
    from fourd_mpi.analysis.export import format_for
    from fourd_mpi.trace.read import load_trace

    try:
        chosen = format_for(args.format, args.output)  # perfetto: JSON or protobuf, by the suffix of -o
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    chosen.require(args.output)
    refuse_output(args.output, args.force, inputs=[args.trace])
    trace = load_trace(args.trace, allow_damaged=args.allow_damaged)
    try:
        with replacing(args.output) as tmp:  # written under a temporary name, renamed when complete
            chosen.export(trace, tmp, steps=args.select_steps, ranks=args.select_ranks,
                          include_warmup=args.include_warmup)
    except ValueError as exc:  # unknown step or rank, a trace without op events
        raise ConfigError(str(exc)) from None
    wrote(args.output, f"{args.format} export of {args.trace}")
    return 0
