"""Command line: ``fourd-mpi run | verify | info | presets``.

The only module that touches ``COMM_WORLD``. Error policy, as in ``python -m
mpi4py``: a user error (:class:`ConfigError`, :class:`BackendError`) is raised on
every rank by validation that runs before any collective, and every rank prints
the same one-line message and exits with status 2; any other exception prints
its traceback and aborts the whole job, so no rank is left waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import replace
from typing import List, Optional

from fourd_mpi import __version__
from fourd_mpi.core.backend import BACKENDS, DEVICE_BUFFER_MODES, DTYPES
from fourd_mpi.step.presets import PRESETS, model_problems
from fourd_mpi.run.display import DISPLAYS
from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.step.optim import OPTIMIZERS
from fourd_mpi.core.progress import PROGRESS_STRATEGIES
from fourd_mpi.trace.events import LEVELS

PROG = "fourd-mpi"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is a one-line :class:`ConfigError` (same on every rank),
    and ``--help`` prints once (rank 0), not once per rank."""

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def _print_message(self, message, file=None):
        if "mpi4py.MPI" not in sys.modules or sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def int_at_least(minimum: int):
    """An argparse type: an integer ``>= minimum`` with a message that says so."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = "positive_int" if minimum == 1 else f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grid (G_data x G_z x G_y x G_x; omitted sizes are inferred)")
    for axis in ("gx", "gy", "gz", "gdata"):
        g.add_argument(f"--{axis}", type=positive_int, default=None, metavar="N")
    m = p.add_argument_group("model")
    m.add_argument("--model", default="gpt-tiny", help=f"preset: {', '.join(PRESETS)} (default gpt-tiny)")
    for name in ("layers", "hidden", "heads", "ffn-hidden", "seq", "batch"):
        m.add_argument(f"--{name}", type=positive_int, default=None, metavar="N",
                       help="global batch in sequences" if name == "batch" else None)
    r = p.add_argument_group("numerics")
    r.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="bfloat16: cupy backend only (CuPy >= 14 with ml_dtypes; NumPy has no bfloat16)")
    r.add_argument("--tf32", action="store_true",
                   help="cupy, float32: GEMMs in TF32 on tensor cores (Ampere and newer)")
    r.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto: cupy when every rank has a usable GPU, else numpy")
    r.add_argument("--device-buffers", default="auto", choices=DEVICE_BUFFER_MODES,
                   help="what MPI gets: direct = device buffers (needs CUDA-aware MPI); staged = copies through "
                        "pinned host buffers; auto (default) = direct only where detection and a smoke-test "
                        "all-reduce on a device buffer succeed. numpy backend: direct = host arrays; staged = "
                        "emulated staging (host copies, same code path and trace events; for testing)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    r.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 adam, 1e-2 sgd)")


def add_overlap_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    """The overlap and progress options of ``fourd-mpi run`` (``many``: repeatable, for verify)."""
    o = p.add_argument_group("overlap and MPI progress")
    action = "append" if many else "store"
    o.add_argument("--overlap", action=action, default=None, metavar="LIST",
                   help="none, all (= oag,ors,oar,dp,od) or a comma list of oag, ors, oar, dp, od, cache"
                        + (" (repeatable: each is checked)" if many else " (default none)"))
    o.add_argument("--progress", action=action, default=None, choices=PROGRESS_STRATEGIES,
                   help="who progresses nonblocking collectives during compute: poll (default), none, thread"
                        + (" (repeatable)" if many else ""))
    o.add_argument("--cache-weights", action="store_true",
                   help="keep weights gathered in forward for backward (memory for communication); "
                        "same as adding 'cache' to --overlap")
    o.add_argument("--prefetch-depth", type=positive_int, default=1, metavar="N",
                   help="oag: how many layers ahead weight all-gathers are issued (default 1)")
    o.add_argument("--chunks", type=positive_int, default=2, metavar="K",
                   help="od: token chunks of the forward all-reduce (default 2)")
    o.add_argument("--poll-flops", type=float, default=1e7, metavar="F",
                   help="poll: FLOPs of GEMM between two MPI progress polls (default 1e7)")
    o.add_argument("--check-buffers", action="store_true",
                   help="debug: verify that no send buffer is modified while its collective is in flight")


def overlap_kwargs(args) -> dict:
    """The :func:`fourd_mpi.run.build.resolve` keywords of :func:`add_overlap_args`'s options."""
    return dict(overlap=args.overlap if isinstance(args.overlap, str) else "none",
                progress=args.progress if isinstance(args.progress, str) else "poll",
                cache_weights=args.cache_weights, prefetch_depth=args.prefetch_depth, chunks=args.chunks,
                poll_flops=args.poll_flops, check_buffers=args.check_buffers)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="MPI benchmark of 4D hybrid parallel training "
                     "(data x 3D tensor parallelism). Launch under mpiexec/srun.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    run = sub.add_parser("run", help="run traced training steps; write results/<run-id>.h5 and a summary")
    run.add_argument("--config", metavar="FILE", help="options from a .toml or .yaml file (keys: long option "
                     "names); the command line wins")
    _add_model_args(run)
    add_overlap_args(run)
    run.add_argument("--steps", type=positive_int, default=10)
    run.add_argument("--warmup", type=nonnegative_int, default=1,
                     help="leading steps excluded from the summary statistics, kept in the trace (default 1)")
    t = run.add_argument_group("trace and output")
    t.add_argument("--trace-level", default="op", choices=LEVELS,
                   help="step: one event per step; layer: + per-layer spans; op: + every GEMM, collective "
                        "and wait (default)")
    t.add_argument("--results-dir", default="results", metavar="DIR", help="where the trace goes (default results)")
    t.add_argument("--label", metavar="TEXT", help="part of the run id: <time>-<label>-<random>")
    t.add_argument("--run-id", metavar="ID", help="the run id itself (the trace is DIR/ID.h5)")
    t.add_argument("--force", action="store_true", help="replace an existing trace of the same run id")
    t.add_argument("--display", default="auto", choices=DISPLAYS,
                   help="rank 0's per-step output: a progress bar, lines, or nothing (auto: bar on a terminal)")
    t.add_argument("--peak-tflops", type=positive_float, default=None, metavar="T",
                   help="peak TFLOP/s per rank for the %% of peak (default: measure the step's largest GEMM)")
    t.add_argument("--inject-fault", metavar="RANK:STEP[:MODE]",
                   help="testing: RANK dies at the start of STEP, once every rank has finished the steps "
                        "before (MODE kill = SIGKILL, default; raise = exception)")

    ver = sub.add_parser("verify", help="compare the distributed step with the serial reference")
    _add_model_args(ver)
    add_overlap_args(ver, many=True)
    ver.add_argument("--steps", type=positive_int, default=5, help="training steps whose losses are compared")
    ver.add_argument("--grid", action="append", default=[], metavar="DxZxYxX",
                     help="grid to check (repeatable), e.g. 1x2x2x2")
    ver.add_argument("--all-grids", action="store_true",
                     help="every factorization of the world size into (G_data, G_z, G_y, G_x)")
    ver.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0)")
    ver.add_argument("--reference-backend", default="same", choices=("same", "numpy"),
                     help="backend of the single-rank reference: same as the checked runs (default) or numpy "
                          "(checks the cupy step against the NumPy one)")

    info = sub.add_parser("info", help="describe the grid, backend and MPI library")
    _add_model_args(info)
    add_overlap_args(info)

    sub.add_parser("presets", help="list the model presets")

    an = sub.add_parser("analyze", help="tables from traces: per run, breakdown, communication, scaling, "
                        "comparison (one process, no mpiexec)")
    an.add_argument("paths", nargs="+", metavar="TRACE", help="trace files, directories of them, or globs")
    an.add_argument("--what", default="auto", metavar="LIST",
                    help=f"comma list of {', '.join(ANALYSES)}; auto (default): runs, breakdown and comm of each "
                         "run, and compare and weak/strong scaling when several runs qualify")
    an.add_argument("--scaling", choices=("weak", "strong"), action="append", default=None,
                    help="scaling mode(s) for the scaling table (default: both where they apply)")
    an.add_argument("--format", default="table", choices=("table", "csv", "json", "markdown"))
    an.add_argument("-o", "--output", metavar="FILE", help="write there instead of standard output")
    an.add_argument("--force", action="store_true", help="replace an existing output file")

    pl = sub.add_parser("plot", help="figures from traces: scaling, breakdown, timeline, overlap (PNG, SVG, PDF)")
    pl.add_argument("kind", choices=PLOTS)
    pl.add_argument("paths", nargs="+", metavar="TRACE", help="trace files, directories of them, or globs "
                    "(timeline: one trace)")
    pl.add_argument("-o", "--output", metavar="FILE", required=True, help="the figure: .png, .svg or .pdf")
    pl.add_argument("--mode", choices=("weak", "strong"), default="weak", help="scaling: weak (default) or strong")
    pl.add_argument("--step", type=nonnegative_int, default=None, help="timeline: the step (default: the first "
                    "measured one)")
    pl.add_argument("--ranks", type=_int_list, metavar="LIST", help="timeline: ranks to show (e.g. 0-3)")
    pl.add_argument("--normalize", action="store_true", help="breakdown: shares instead of seconds")
    pl.add_argument("--force", action="store_true", help="replace an existing output file")

    ex = sub.add_parser("export", help="convert a trace for Perfetto / chrome://tracing or for Hatchet / Thicket")
    ex.add_argument("format", choices=("perfetto", "thicket"),
                    help="perfetto: trace-event JSON (.json or .json.gz); thicket: Caliper JSON-split profile")
    ex.add_argument("trace", metavar="TRACE")
    ex.add_argument("-o", "--output", metavar="FILE", required=True)
    ex.add_argument("--steps", type=_int_list, metavar="LIST", help="perfetto: only these steps (e.g. 1,2)")
    ex.add_argument("--ranks", type=_int_list, metavar="LIST", help="perfetto: only these ranks (e.g. 0-3,8)")
    ex.add_argument("--include-warmup", action="store_true", help="thicket: also profile the warm-up steps")
    ex.add_argument("--force", action="store_true", help="replace an existing output file")

    from fourd_mpi.jobs.sweep import add_parser as add_sweep_parser

    add_sweep_parser(sub)
    from fourd_mpi.perf import collbench
    from fourd_mpi.perf import validate as modelcheck
    from fourd_mpi.perf import tune# the performance model (issue 7)
    for module in (collbench, tune, modelcheck):
        module.add_parser(sub)

    tr = sub.add_parser("trace", help="inspect, check or recover trace files (one process, no mpiexec)")
    tsub = tr.add_subparsers(dest="trace_command", required=True, parser_class=OneLineParser)
    show = tsub.add_parser("show", help="metadata and step summary of a trace")
    show.add_argument("file")
    check = tsub.add_parser("check", help="check a trace's invariants (exit 1 if any is violated)")
    check.add_argument("file")
    rec = tsub.add_parser("recover", help="merge the per-rank files of a crashed run into a partial trace")
    rec.add_argument("directory", help="the run's per-rank directory, <results>/<run-id>.ranks")
    rec.add_argument("-o", "--output", metavar="FILE", help="trace to write (default: the run's planned trace path)")
    rec.add_argument("--force", action="store_true", help="replace an existing output file")
    return parser


def _int_list(text: str) -> List[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    out: List[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 0-3,8, got {text!r}") from None
    return out


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _grid_sizes(args):
    return {"data": args.gdata, "z": args.gz, "y": args.gy, "x": args.gx}


def _model_overrides(args):
    return {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ffn_hidden": args.ffn_hidden, "seq": args.seq, "batch": args.batch}


def _run_options(args, world_size: int, **extra):
    from fourd_mpi.run.build import resolve

    return resolve(world_size, args.model, _grid_sizes(args), _model_overrides(args),
                   dtype=args.dtype, backend=args.backend, device_buffers=args.device_buffers, tf32=args.tf32,
                   seed=args.seed, optimizer=args.optimizer, lr=args.lr, **overlap_kwargs(args), **extra)


def _say(world, text: str = "") -> None:
    if world.Get_rank() == 0:
        print(text, flush=True)


def _header(world, run) -> None:
    from mpi4py import MPI

    cfg = run.options.model
    _say(world, f"fourd-mpi {__version__}  MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    _say(world, run.grid.describe())
    _say(world, f"model {cfg.name}: {cfg.kind}, {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}, "
                f"ffn {cfg.ffn_hidden}, seq {cfg.seq}, global batch {cfg.batch} "
                f"({cfg.parameter_count() / 1e6:.2f} M parameters)")
    overlap = run.trainer.overlap
    _say(world, f"backend {run.backend.describe()}, optimizer {run.options.optimizer}, "
                f"weights {'cached' if overlap.cache else 're-gathered'} for backward")
    if run.gpu_awareness is not None:
        _say(world, f"GPU-aware MPI: {run.gpu_awareness.library}: {run.gpu_awareness.reason}")
        smoke = run.gpu_awareness.smoke_test
        if smoke is not None:
            _say(world, f"device-buffer smoke test: {'passed' if smoke['ok'] else 'FAILED'} ({smoke['detail']})")
    if run.mpi_buffers is not None:
        _say(world, f"MPI buffers: {run.mpi_buffers.mode} ({run.mpi_buffers.reason})")
    _say(world, f"overlap {overlap}; progress {run.comm.progress.describe()}")
    for note in run.overlap_notes():
        _say(world, f"note: {note} on grid {run.options.grid}")
    _say(world, f"activations between blocks {run.model.activation_layout}")


def resolved_config(args, options, trace) -> dict:
    """The run's configuration after inference, keyed by option names (a valid ``--config`` file)."""
    cfg, grid = options.model, options.grid
    config = {"model": args.model, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
              "ffn-hidden": cfg.ffn_hidden, "seq": cfg.seq, "batch": cfg.batch,
              "gdata": grid.data, "gz": grid.z, "gy": grid.y, "gx": grid.x}
    for key in ("dtype", "tf32", "backend", "device_buffers", "seed", "optimizer", "lr", "overlap", "progress",
                "cache_weights", "prefetch_depth", "chunks", "poll_flops", "check_buffers", "steps", "warmup"):
        config[key.replace("_", "-")] = getattr(options, key)
    config.update({"trace-level": trace.level, "results-dir": trace.results_dir, "label": trace.label,
                   "display": args.display, "peak-tflops": args.peak_tflops})
    return config


def cmd_run(args, world) -> int:
    from fourd_mpi.run.configfile import dump_toml
    from fourd_mpi.run.session import Fault, TraceOptions, traced_run

    options = _run_options(args, world.Get_size(), steps=args.steps, warmup=args.warmup)
    trace = TraceOptions(args.trace_level, args.results_dir, args.run_id, args.label, args.force).validate()
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None
    if fault is not None and fault.rank >= world.Get_size():
        raise ConfigError(f"--inject-fault: rank {fault.rank} does not exist in a world of {world.Get_size()}")
    config = resolved_config(args, options, trace)

    def header(run):
        _say(world, "resolved configuration (reusable as --config FILE.toml):")
        _say(world, "\n".join("  " + line for line in dump_toml(config).splitlines()))
        _header(world, run)

    path, summary = traced_run(world, options, trace, config, lambda text: _say(world, text),
                               display=args.display, peak_tflops=args.peak_tflops, fault=fault, header=header)
    if world.Get_rank() == 0:
        for line in summary.lines():
            print(line)
        print(f"trace: {path}", flush=True)
    return 0


def cmd_verify(args, world) -> int:
    from fourd_mpi.run.verify import verify

    size = world.Get_size()
    options = _run_options(args, size, steps=args.steps)
    grids = [GridShape.parse(g) for g in args.grid]
    for g in grids:
        if g.size != size:
            raise ConfigError(f"grid {g} has {g.size} ranks but the world size is {size}")
    skipped = []
    if args.all_grids or not grids:
        candidates = list(grid_factorizations(size)) if args.all_grids else [options.grid]
        for g in candidates:
            problems = model_problems(options.model, g)
            (skipped.append((g, problems[0])) if problems else grids.append(g))
    for g in grids:
        problems = model_problems(options.model, g)
        if problems:
            raise ConfigError(f"model {options.model.name} on grid {g} (G_data x G_z x G_y x G_x): "
                              + "; ".join(problems))
    variants = [replace(options, overlap=o, progress=p)
                for o in (args.overlap or ["none"]) for p in (args.progress or ["poll"])]
    for v in variants:
        v.overlap_config()
    results = verify(variants, grids, args.steps, world,
                     None if args.reference_backend == "same" else args.reference_backend)
    if world.Get_rank() != 0:
        return 0
    reference = "" if args.reference_backend == "same" else f" ({args.reference_backend} reference)"
    print(f"verify {options.model.name} ({options.dtype}{', tf32' if options.tf32 else ''}) on {size} ranks "
          f"against one rank{reference}, "
          f"{args.steps} training steps; relative error ||a-b||/||b||, tolerance {results[0].tolerance:g}")
    print(f"{'grid (DxZxYxX)':>15} {'overlap':<22} {'progress':<8} {'output':>10} {'worst grad':>10} "
          f"{'(tensor)':<18} {'losses':>10}  result")
    for r in results:
        print(f"{r.grid:>15} {r.overlap:<22} {r.progress:<8} {r.output_error:>10.2e} {r.grad_error:>10.2e} "
              f"{r.worst_grad:<18} {r.loss_error:>10.2e}  {'ok' if r.ok else 'FAIL'}")
    for g, why in skipped:
        print(f"{str(g):>15} skipped: {why}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} passed, {failed} failed, {len(skipped)} skipped")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": options.model.as_dict(), "dtype": options.dtype, "world_size": size,
                       "results": [dict(r.__dict__, ok=r.ok) for r in results],
                       "skipped": [[str(g), why] for g, why in skipped]}, fh, indent=1)
    return 1 if failed else 0


def cmd_info(args, world) -> int:
    from fourd_mpi.run.build import Run

    options = _run_options(args, world.Get_size())
    run = Run.build(world, options)
    _header(world, run)
    for p in run.model.parameters()[:8]:
        _say(world, f"  {p.name:<18} global {str(p.global_shape):<14} layout {p.layout}")
    run.close()
    return 0


def cmd_presets(args, world) -> int:
    if world is None or world.Get_rank() == 0:
        print(f"{'preset':<10} {'kind':<4} {'layers':>6} {'hidden':>7} {'heads':>5} {'ffn':>7} {'seq':>5} "
              f"{'batch':>5} {'params':>9}")
        for cfg in PRESETS.values():
            print(f"{cfg.name:<10} {cfg.kind:<4} {cfg.layers:>6} {cfg.hidden:>7} {cfg.heads:>5} "
                  f"{cfg.ffn_hidden:>7} {cfg.seq:>5} {cfg.batch or '-':>5} {_human(cfg.parameter_count()):>9}")
    return 0


def _human(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))


def cmd_trace(args, world) -> int:
    from fourd_mpi.trace.read import check_invariants, load_trace
    from fourd_mpi.trace.store import recover

    if args.trace_command == "recover":
        result = recover(args.directory, args.output, args.force, summarize=_recovered_summary(args.directory))
        steps = result["steps"]
        kept = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        print(f"{result['path']}: status {result['status']}, {kept} completed by every rank "
              f"({len(steps)}), {result['events_dropped']} events of unfinished steps dropped")
        for failure in result["failures"]:
            print(f"  rank {failure.get('rank')} failed: {failure.get('error')}")
        print(f"the per-rank files in {args.directory} can now be removed")
        return 0
    trace = load_trace(args.file)
    if args.trace_command == "check":
        problems = check_invariants(trace)
        for problem in problems:
            print(f"violation: {problem}")
        print(f"{args.file}: {len(trace.events)} events, {trace.world_size} ranks, {len(trace.steps)} steps: "
              + ("ok" if not problems else f"{len(problems)} violation(s)"))
        return 1 if problems else 0
    meta = trace.metadata
    print(f"{args.file}: schema v{trace.schema_version}, status {trace.status}, run id {meta.get('run_id')}")
    print(f"  grid {meta.get('grid')} on {meta.get('world_size')} ranks, {meta.get('num_nodes')} node(s); "
          f"level {meta.get('level')}; started {meta.get('start_time')}")
    print(f"  {meta.get('mpi', {}).get('library_version', '?').splitlines()[0]}")
    print(f"  {len(trace.events)} events; {len(trace.steps)} steps")
    print(f"{'step':>6} {'loss':>14} {'time (s)':>10}")
    for row in trace.steps:
        print(f"{row['step']:>6} {row['loss']:>14.8g} {row['seconds']:>10.4f}" + ("  (warm-up)" if row["warmup"]
                                                                                 else ""))
    summary = meta.get("summary")
    if summary:
        print(f"median step {summary['median_s']:.4f} s; compute {100 * summary['compute_share']:.1f}%, exposed "
              f"communication {100 * summary['wait_share']:.1f}%; {summary['tokens_per_s']:,.0f} tokens/s")
    return 0


ANALYSES = ("runs", "breakdown", "comm", "compare", "scaling")
#: the runs table's columns on a terminal (csv/json keep all)
RUNS_SHOWN = ["run_id", "grid", "world_size", "overlap", "progress", "steps", "step_median_s", "step_q1_s",
              "step_q3_s", "compute_share", "wait_share", "other_share", "tflops_per_rank", "percent_of_peak",
              "tokens_per_s", "imbalance"]


def _load_traces(args):
    """The traces named by ``args.paths``; each unreadable one named on stderr. Refuses to
    overwrite ``args.output`` without ``--force``."""
    from fourd_mpi.analysis import tables as analysis

    if args.output and os.path.exists(args.output) and not args.force:
        raise ConfigError(f"{args.output} already exists (use --force to replace it)")
    traces, problems = analysis.collect(args.paths)
    for path, reason in problems:
        sys.stderr.write(f"{PROG}: skipped {path}: {reason}\n")
    if not traces:
        raise ConfigError(f"no readable trace among {len(args.paths)} argument(s)")
    return traces, problems


def cmd_analyze(args, world) -> int:
    """Exit 0: every file analysed; 1: some skipped (each named on stderr); 2: nothing to analyse."""
    from fourd_mpi.analysis import tables as analysis

    what = list(ANALYSES) if args.what == "auto" else [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = [w for w in what if w not in ANALYSES]
    if unknown:
        raise ConfigError(f"--what: unknown {', '.join(unknown)} (choose from {', '.join(ANALYSES)})")
    traces, problems = _load_traces(args)
    runs = analysis.runs_table(traces)
    sections = []  # (title, frame)
    if "runs" in what:
        sections.append(("runs", runs if args.format in ("csv", "json") else runs[RUNS_SHOWN]))
    for name, fn in (("breakdown", analysis.breakdown), ("comm", analysis.comm_table)):
        if name in what:
            frames = [fn(t) for t in traces]
            frames = [f for f in frames if len(f)]
            if frames:
                frame = pd_concat(frames)
                if name == "comm" and args.format not in ("csv", "json"):
                    frame = frame.drop(columns=["formula"])
                if name == "breakdown" and args.format not in ("csv", "json"):
                    frame = analysis.breakdown_wide(frame)  # long form in csv/json
                sections.append((name, frame))
    if "compare" in what and len(traces) > 1:
        table = analysis.compare(runs)
        sizes = table.groupby(["model", "world_size", "tokens_per_step"])["run_id"].transform("size")
        if (sizes > 1).any():  # only configurations with something to compare against
            sections.append(("compare", table[sizes > 1]))
    if "scaling" in what and runs["world_size"].nunique() > 1:
        for mode in args.scaling or ("weak", "strong"):
            table = analysis.scaling(runs, mode)
            for group, why in table.attrs.get("dropped", []):
                if not why.startswith("one rank count"):  # a single run is no line: not worth a word
                    sys.stderr.write(f"{PROG}: {mode} scaling: left out {group}: {why}\n")
            if len(table):
                sections.append((f"{mode} scaling", table))
    text = _render_sections(sections, args.format)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 1 if problems else 0


def pd_concat(frames):
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


def _render_sections(sections, fmt: str) -> str:
    from fourd_mpi.analysis.tables import COMM_FORMULAS, format_table

    if fmt == "json":
        return json.dumps({title: json.loads(format_table(frame, "json")) for title, frame in sections},
                          indent=1) + "\n"
    if fmt == "csv":
        if len(sections) != 1:
            raise ConfigError(f"--format csv writes one table: choose one with --what (got "
                              f"{', '.join(t for t, _ in sections) or 'none'})")
        return format_table(sections[0][1], "csv")
    heading = "## {}" if fmt == "markdown" else "== {} =="
    parts = []
    for title, frame in sections:
        parts.append(heading.format(title) + "\n\n" + format_table(frame, fmt))
        if title == "comm":
            parts.append("\n".join(f"  {k}: {v}" for k, v in COMM_FORMULAS.items()))
    return "\n\n".join(parts) + "\n"


PLOTS = ("scaling", "breakdown", "timeline", "overlap")


def cmd_plot(args, world) -> int:
    """Exit 0, or 1 when some input files were skipped (named on stderr)."""
    from fourd_mpi.analysis import tables as analysis
    from fourd_mpi.analysis import plots

    if os.path.splitext(args.output)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"{args.output}: the figure's format comes from its suffix: .png, .svg or .pdf")
    traces, problems = _load_traces(args)
    try:
        if args.kind == "timeline":
            if len(traces) != 1:
                raise ConfigError(f"timeline draws one trace; got {len(traces)}")
            plots.plot_timeline(traces[0], args.output, step=args.step, ranks=args.ranks)
        elif args.kind == "scaling":
            table = analysis.scaling(analysis.runs_table(traces), args.mode)
            if not len(table):
                why = "; ".join(f"{g}: {r}" for g, r in table.attrs.get("dropped", [])) or "no runs"
                raise ConfigError(f"no {args.mode}-scaling line in these traces ({why})")
            plots.plot_scaling(table, args.output, mode=args.mode)
        elif args.kind == "breakdown":
            frame = pd_concat([analysis.breakdown(t) for t in traces])
            plots.plot_breakdown(frame, analysis.runs_table(traces), args.output, normalize=args.normalize)
        else:
            frames = [f for f in (analysis.comm_table(t) for t in traces) if len(f)]
            if not frames:
                raise ConfigError("overlap needs op-level traces (--trace-level op)")
            plots.plot_overlap(pd_concat(frames), args.output, runs_df=analysis.runs_table(traces))
    except ValueError as exc:  # an unknown step or rank, an empty table
        raise ConfigError(str(exc)) from None
    print(f"{args.output}: {args.kind} of {len(traces)} trace(s)")
    return 1 if problems else 0


def cmd_sweep(args, world) -> int:
    from fourd_mpi.jobs.sweep import cmd_sweep as run_sweep

    return run_sweep(args, world)


def cmd_export(args, world) -> int:
    from fourd_mpi.analysis import export
    from fourd_mpi.trace.read import load_trace

    if os.path.exists(args.output) and not args.force:
        raise ConfigError(f"{args.output} already exists (use --force to replace it)")
    trace = load_trace(args.trace)
    try:
        if args.format == "perfetto":
            export.write_perfetto(trace, args.output, steps=args.steps, ranks=args.ranks)
        else:
            export.write_caliper_json(trace, args.output, include_warmup=args.include_warmup)
    except ValueError as exc:  # unknown step or rank, a trace without op events
        raise ConfigError(str(exc)) from None
    print(f"{args.output}: {args.format} export of {args.trace}")
    return 0


def _recovered_summary(spool_dir: str):
    """The summary of a recovered run, from the step records and run.json (the peak was never recorded)."""
    from fourd_mpi.run.session import summarize
    from fourd_mpi.trace.store import RUN_META

    try:
        with open(os.path.join(spool_dir, RUN_META)) as fh:
            meta = json.load(fh)
        flops, tokens, world = meta["model_flops_per_step"], meta["tokens_per_step"], meta["world_size"]
    except (OSError, ValueError, KeyError):
        return None  # recover() reports what is wrong with the directory
    return lambda rank_steps: summarize(rank_steps, world, flops, tokens, float("nan"), "not recorded")


def cmd_bench(args, world) -> int:
    from fourd_mpi.perf.collbench import cmd_bench as run_bench

    return run_bench(args, world)


def cmd_tune(args, world) -> int:
    from fourd_mpi.perf.tune import cmd_tune as run_tune

    return run_tune(args, world)


def cmd_model(args, world) -> int:
    from fourd_mpi.perf.validate import cmd_model as run_model

    return run_model(args, world)


COMMANDS = {"run": cmd_run, "verify": cmd_verify, "info": cmd_info, "presets": cmd_presets, "trace": cmd_trace,
            "analyze": cmd_analyze, "plot": cmd_plot, "export": cmd_export, "sweep": cmd_sweep,
            "bench": cmd_bench, "tune": cmd_tune, "model": cmd_model}
#: commands that run in one process, without mpiexec
SERIAL_COMMANDS = ("presets", "trace", "analyze", "plot", "export", "sweep", "tune", "model")


def _parse(argv: Optional[List[str]]):
    """Parse, with ``run --config FILE`` options inserted before the command line's own."""
    from fourd_mpi.run.configfile import config_tokens, load_config_file

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        run_parser = parser._subparsers._group_actions[0].choices["run"]
        tokens = config_tokens(load_config_file(args.config), run_parser, args.config)
        at = argv.index(args.command) + 1
        args = parser.parse_args(argv[:at] + tokens + argv[at:])
    return args


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parse(argv)
    except ConfigError as exc:
        _error_line(exc)
        return 2
    world = None
    try:
        if args.command in SERIAL_COMMANDS:
            return COMMANDS[args.command](args, None)
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        return COMMANDS[args.command](args, world)
    except (ConfigError, BackendError) as exc:
        _error_line(exc)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except KeyboardInterrupt:
        _abort(world, 130)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        _abort(world, 1)
    return 1


def _error_line(exc: Exception) -> None:
    """One line, one write: mpiexec interleaves the ranks' stderr at write granularity."""
    text = " ".join(str(exc).split())
    sys.stderr.flush()
    os.write(2, f"{PROG}: error: {text}\n".encode())


def _abort(world, code: int) -> None:
    """Take the whole job down: a rank that raised must not leave the others in a collective."""
    if world is not None and world.Get_size() > 1:
        world.Abort(code)
    sys.exit(code)
