"""``fourd-mpi run | verify | info | presets``: the commands that run the step (under mpiexec).

Every option of the step comes from :data:`fourd_mpi.run.options.RUN_OPTIONS`; every rank
resolves them (:func:`fourd_mpi.run.options.resolve_values`) before any collective.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from fourd_mpi import __version__
from fourd_mpi.algorithms.registry import display_name
from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.cli.args import FORMATS, OneLineParser, add_format, add_options, say
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json, json_text
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.core.watchdog import check_timeout
from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import RunOptions, defaults, overlap_of, resolve_values, resolved_config
from fourd_mpi.step.presets import PRESETS
from fourd_mpi.util.log import verbosity_of
from fourd_mpi.util.values import text

log = logging.getLogger(__name__)

#: what each command takes from the option table
STEP_GROUPS = ("grid", "model", "numerics", "overlap")


def add_run_arguments(parser) -> None:
    """The arguments of ``fourd-mpi run``: ``--config`` and every option of the table."""
    parser.add_argument("--config", metavar="FILE", type=text,
                        help="options from a .toml or .yaml file (keys: long option names); the command line wins")
    add_options(parser, STEP_GROUPS + ("steps", "trace"))
    add_json_format(parser, RUN_JSON, help="what standard output shows (rank 0): table (default: a short header, "
                    "the steps as --display says, the summary) or json (only the document at the end; the trace "
                    "records the same either way)")
    parser.add_argument("--show-config", action="store_true",
                        help="print the full configuration before the steps (the resolved options, reusable as "
                             "--config FILE.toml, and the grid, placement, backend, MPI buffers and overlap in detail; "
                             "also with -v) instead of the short header; the trace stores it either way "
                             "(fourd-mpi results show RUN_ID)")


#: ``run --format json``
RUN_JSON = JsonDoc("run", {
    "trace": "the trace written", "run_id": "its run id", "status": "complete",
    "summary": "the measured steps: steps, median_s, min_s, max_s, q1_s, q3_s, compute_share, wait_share, "
               "other_share, model_tflops_per_rank, mfu_pct, hfu_pct, gemm_pct, tokens_per_s and the rest of the "
               "summary lines",
    "config": "the resolved configuration (reusable as --config)"})


def run_parser() -> OneLineParser:
    """A parser of ``fourd-mpi run``'s arguments alone (tests, and scripts that build a command line)."""
    parser = OneLineParser(prog="fourd-mpi run")
    add_run_arguments(parser)
    return parser


def register(sub) -> None:
    run = sub.add_parser("run", help="run traced training steps; write results/<run-id>.h5 and a summary")
    add_run_arguments(run)
    run.set_defaults(handler=cmd_run, serial=False)

    ver = sub.add_parser("verify", help="compare the distributed step with the serial reference")
    add_options(ver, STEP_GROUPS, names=("steps", "step-timeout"), many=("overlap", "progress", "recompute"),
                overlap={"help": f"as in run; repeatable: each is checked (default {defaults()['overlap']})"},
                progress={"help": f"as in run; repeatable: each is checked (default {defaults()['progress']})"},
                recompute={"help": "as in run; repeatable: each is checked against the reference without "
                                   f"recompute (default {defaults()['recompute']})"},
                steps={"default": 5, "help": "training steps whose losses are compared (default 5)"})
    ver.add_argument("--grid", action="append", default=[], metavar="DxZxYxX",
                     help="grid to check (repeatable), e.g. 1x2x2x2")
    ver.add_argument("--all-grids", action="store_true",
                     help="every factorization of the world size into (G_data, G_z, G_y, G_x)")
    ver.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0; the document of "
                     "--format json)")
    add_json_format(ver, VERIFY_JSON, help="the report on standard output (rank 0): table (default) or json")
    ver.add_argument("--reference-backend", default="same", choices=("same", "numpy"),
                     help="backend of the single-rank reference: same as the checked runs (default) or numpy "
                          "(checks the cupy step against the NumPy one)")
    ver.set_defaults(handler=cmd_verify, serial=False)

    info = sub.add_parser("info", help="describe the grid, backend and MPI library")
    add_options(info, STEP_GROUPS)
    add_json_format(info, INFO_JSON, help="on standard output (rank 0): table (default: lines of text) or json")
    info.set_defaults(handler=cmd_info, serial=False)

    presets = sub.add_parser("presets", help="list the model presets")
    add_format(presets, FORMATS, help="table (default), csv, json or markdown (json and csv: exact parameter counts)")
    presets.set_defaults(handler=cmd_presets, serial=True)


#: ``verify --format json`` (and ``--json FILE``)
VERIFY_JSON = JsonDoc("verify", {
    "model": "the model's sizes", "dtype": "the run dtype", "world_size": "ranks", "algorithm": "the algorithm",
    "steps": "training steps compared", "tolerance": "the relative error allowed",
    "results": "per grid and variant: grid, overlap, progress, recompute, output_error, grad_error, worst_grad, "
               "loss_error, tolerance, across_nodes, nodes, attention, ok",
    "skipped": "[grid, why] of the grids not checked", "passed": "how many passed", "failed": "how many failed"})
#: ``info --format json``
INFO_JSON = JsonDoc("info", {
    "version": "fourd-mpi's", "mpi": "the MPI library's version line", "world_size": "ranks",
    "grid": "G_data x G_z x G_y x G_x",
    "placement": "nodes, ranks_per_node (per node), binding (one sentence), axes: per axis size, stride and "
                 "placement (intra-node, inter-node or -)",
    "algorithm": "the algorithm and how it uses the grid (one sentence)",
    "model": "name, kind, layers, hidden, heads, ffn_hidden, seq, batch, parameters",
    "backend": "the array library and device", "optimizer": "the optimizer", "overlap": "the overlap",
    "progress": "the progress strategy", "recompute": "activation recompute",
    "parameters": "the first 8 parameters: name, global_shape, layout"})


def run_options(args, world_size: int) -> RunOptions:
    """The resolved options of a parsed command line (verify: the first overlap and progress)."""
    values = dict(vars(args))
    values.setdefault("warmup", 0)  # verify has no --warmup: it compares every step
    for key in ("overlap", "progress", "recompute"):  # verify's repeatable options: each variant is checked later
        if isinstance(values.get(key), list):
            values[key] = values[key][0]
        elif values.get(key) is None:  # not given: the table's default
            values.pop(key, None)
    return resolve_values(values, world_size)


def _mpi_library() -> str:
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def _short_header(world, run, run_id: str, trace_path: str, level: str) -> None:
    """What ``fourd-mpi run`` prints before the steps by default: four lines (five for a pipeline)."""
    o, cfg, placement = run.options, run.options.model, run.placement
    per_node = placement.ranks_per_node
    per_node = str(per_node[0]) if per_node[0] == per_node[-1] else f"{per_node[0]}-{per_node[-1]}"
    say(world, f"fourd-mpi {__version__}: {o.algorithm} ({display_name(o.algorithm)}) on grid {o.grid} (DxZxYxX), "
               f"{run.grid.world_size} ranks on {placement.num_nodes} node(s), {per_node} per node; axes across "
               f"nodes: {', '.join(placement.inter_node_axes) or 'none'}")
    if hasattr(run.trainer, "describe"):  # e.g. the pipeline's stages and schedule
        say(world, run.trainer.describe())
    say(world, f"model {cfg.name}: {cfg.kind}, {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}, "
               f"ffn {cfg.ffn_hidden}, seq {cfg.seq}, global batch {cfg.batch} "
               f"({cfg.parameter_count() / 1e6:.2f} M parameters); {o.steps} steps, {o.warmup} warm-up")
    say(world, f"backend {run.backend.describe()}; MPI: {_mpi_library()}; overlap {run.trainer.overlap}, progress "
               f"{run.comm.progress.name}{' (auto)' if o.progress == 'auto' else ''}, recompute {o.recompute}")
    say(world, f"output: {trace_path} (trace level {level}); the full configuration: --show-config or fourd-mpi "
               f"results show {run_id}")


def _header_notes(world, run) -> None:
    """The notes of the full header, as log lines on rank 0 (stderr; ``-q`` leaves them out), a failed
    device-buffer check as a warning: what the short header leaves out but a user must hear."""
    if world.Get_rank() != 0:
        return
    o, placement = run.options, run.placement
    binding = placement.binding
    if binding is not None and binding.advice():
        log.info("note: %s", binding.advice())
    smoke = run.gpu_awareness.smoke_test if run.gpu_awareness is not None else None
    if smoke is not None and not smoke["ok"]:
        log.warning("device-buffer smoke test: FAILED (%s)", smoke["detail"])
    for note in run.overlap_notes():
        log.info("note: %s on grid %s", note, o.grid)


def _header(world, run) -> None:
    cfg = run.options.model
    say(world, f"fourd-mpi {__version__}  MPI: {_mpi_library()}")
    say(world, run.grid.describe(run.placement))
    say(world, get_algorithm(run.options.algorithm).describe(run.options.grid))
    if hasattr(run.trainer, "describe"):  # e.g. the pipeline's stages and schedule
        say(world, run.trainer.describe())
    say(world, f"model {cfg.name}: {cfg.kind}, {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}, "
               f"ffn {cfg.ffn_hidden}, seq {cfg.seq}, global batch {cfg.batch} "
               f"({cfg.parameter_count() / 1e6:.2f} M parameters)")
    overlap = run.trainer.overlap
    say(world, f"backend {run.backend.describe()}, optimizer {run.options.optimizer}, "
               f"weights {'cached' if overlap.cache else 're-gathered'} for backward, "
               f"activation recompute {run.options.recompute}")
    if run.gpu_awareness is not None:
        from fourd_mpi.core.gpuaware import describe_routes

        chosen = run.mpi_buffers.routes if run.mpi_buffers is not None and run.backend.name == "cupy" else None
        for line in describe_routes(run.gpu_awareness, chosen):
            say(world, line)
        smoke = run.gpu_awareness.smoke_test
        if smoke is not None:
            say(world, f"device-buffer smoke test: {'passed' if smoke['ok'] else 'FAILED'} ({smoke['detail']})")
    if run.mpi_buffers is not None:
        say(world, f"MPI buffers: {run.mpi_buffers.mode} ({run.mpi_buffers.reason})")
    if run.options.model.kind == "gpt":
        say(world, f"attention: {run.backend.attention} ({run.backend.attention_reason})")
    say(world, f"overlap {overlap}; progress {run.comm.progress.describe()}")
    for note in run.overlap_notes():
        say(world, f"note: {note} on grid {run.options.grid}")
    say(world, f"activations between blocks {run.model.activation_layout}")


def cmd_run(args, world) -> int:
    from fourd_mpi.run.configfile import dump_toml
    from fourd_mpi.run.faults import Fault
    from fourd_mpi.run.session import TraceOptions, traced_run

    options = run_options(args, world.Get_size())
    trace = TraceOptions(args.trace_level, args.results_dir, args.run_id, args.label, args.force,
                         args.trace_group_size, args.nvtx).validate()
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None
    check_timeout(args.step_timeout)
    if fault is not None and fault.rank >= world.Get_size():
        raise ConfigError(f"--inject-fault: rank {fault.rank} does not exist in a world of {world.Get_size()}")
    if fault is not None and fault.step > options.steps:  # it would never fire
        raise ConfigError(f"--inject-fault {args.inject_fault}: step {fault.step} is beyond the run: STEP must be <= "
                          f"--steps {options.steps} (STEP = --steps: after the last step, before the merge)")
    verbosity = verbosity_of(args)
    display = "quiet" if verbosity < 0 else args.display  # -q: the results only
    config = resolved_config(args.model, options, {"trace_level": trace.level, "results_dir": trace.results_dir,
                                                   "label": trace.label, "display": display,
                                                   "trace_group_size": trace.group_size,
                                                   "peak_tflops": args.peak_tflops})

    quiet = args.format == "json"  # standard output holds the document alone

    def header(run, run_id, trace_path, spool_dir):
        if quiet:
            _header_notes(world, run)  # on stderr
            return
        if args.show_config or verbosity > 0:
            say(world, "resolved configuration (reusable as --config FILE.toml):")
            say(world, "\n".join("  " + line for line in dump_toml(config).splitlines()))
            _header(world, run)
            say(world, f"output: {trace_path} (trace level {trace.level}, run id {run_id}; per-rank files in "
                       f"{spool_dir} until the merge)")
            return
        if display != "quiet":
            _short_header(world, run, run_id, trace_path, trace.level)
        _header_notes(world, run)

    path, summary = traced_run(world, options, trace, config, (lambda text: None) if quiet else
                               (lambda text: say(world, text)), display=display, peak_tflops=args.peak_tflops,
                               fault=fault, header=header, step_timeout=args.step_timeout)
    if quiet:
        if world.Get_rank() == 0:
            import os

            emit_json(RUN_JSON, {"trace": path, "run_id": os.path.splitext(os.path.basename(path))[0],
                                 "status": "complete", "summary": summary.as_dict(), "config": config})
        return 0
    if world.Get_rank() == 0:
        for line in summary.lines():
            print(line)
        print(f"trace: {path}", flush=True)
    return 0


def cmd_verify(args, world) -> int:
    from fourd_mpi.run.verify import verify

    world_size = world.Get_size()
    options = run_options(args, world_size)
    size = options.grid.size  # ranks of one 4D grid: the world, or world / G_inter for pipeline stages
    check_timeout(args.step_timeout)
    if args.json:  # rank 0 writes it: checked there, before anything runs; every rank hears
        from fourd_mpi.core.mpiutil import on_root
        from fourd_mpi.util.files import refuse_output

        on_root(world, lambda: refuse_output(args.json, True, option="--json"))
    grids = [GridShape.parse(g) for g in args.grid]
    for g in grids:
        if g.size != size:
            stages = f" / G_inter {options.ginter} = {size}" if size != world_size else ""
            raise ConfigError(f"grid {g} has {g.size} ranks but the world size is {world_size}{stages}")
    skipped = []
    algorithm = get_algorithm(options.algorithm)

    def problems_of(g):  # a fixed axis of another size, the algorithm's own checks, its model rules
        return [p for p in (algorithm.grid_problem(options, g),) if p] or algorithm.model_problems(options.model, g)

    if args.all_grids or not grids:
        candidates = list(grid_factorizations(size)) if args.all_grids else [options.grid]
        for g in candidates:
            problems = problems_of(g)
            (skipped.append((g, problems[0])) if problems else grids.append(g))
    for g in grids:
        problems = problems_of(g)
        if problems:
            raise ConfigError(f"model {options.model.name} on grid {g} (G_data x G_z x G_y x G_x): "
                              + "; ".join(problems))
        get_algorithm(options.algorithm).check(replace(options, grid=g))  # e.g. micro-batches of this grid's shard
    table = defaults()
    overlaps = [overlap_of({**{k: getattr(args, k) for k in ("cache_weights", "prefetch_depth", "chunks")},
                            "overlap": text}) for text in (args.overlap or [table["overlap"]])]
    variants = [replace(options, overlap=o, progress=p, recompute=r)
                for r in (args.recompute or [table["recompute"]])
                for o in overlaps for p in (args.progress or [table["progress"]])]
    results = verify(variants, grids, args.steps, world,
                     None if args.reference_backend == "same" else args.reference_backend,
                     step_timeout=args.step_timeout)
    if world.Get_rank() != 0:
        return 0
    failed = sum(not r.ok for r in results)
    doc = {"model": options.model.as_dict(), "dtype": options.dtype, "world_size": world_size,
           "algorithm": options.algorithm, "steps": args.steps,
           "tolerance": results[0].tolerance if results else None,
           "results": [dict(r.__dict__, ok=r.ok) for r in results], "skipped": [[str(g), why] for g, why in skipped],
           "passed": len(results) - failed, "failed": failed}
    if args.json:
        from fourd_mpi.util.files import write_text

        VERIFY_JSON.check(doc)
        write_text(args.json, json_text(doc), "--json")
    if args.format == "json":
        emit_json(VERIFY_JSON, doc)
        return 1 if failed else 0
    reference = "" if args.reference_backend == "same" else f" ({args.reference_backend} reference)"
    print(f"verify {options.model.name} ({options.dtype}{', tf32' if options.tf32 else ''}) on {world_size} ranks "
          f"with {options.algorithm} against the serial 4D model on one rank{reference}, "
          f"{args.steps} training steps; relative error ||a-b||/||b||, tolerance {results[0].tolerance:g}")
    nodes = results[0].nodes if results else 1
    kernels = sorted({r.attention for r in results}) or ["unfused"]
    print(f"attention: {', '.join(kernels)} in the checked runs; the reference's is unfused")
    print(f"ranks on {nodes} node(s) (MPI_COMM_TYPE_SHARED); 'across nodes': the axes with a communicator that "
          f"spans more than one node")
    from fourd_mpi.util.table import render

    rows = [[r.grid, r.overlap, r.progress, r.recompute, f"{r.output_error:.2e}", f"{r.grad_error:.2e}", r.worst_grad,
             f"{r.loss_error:.2e}", r.across_nodes, "ok" if r.ok else "FAIL"] for r in results]
    print(render(rows, ["grid (DxZxYxX)", "overlap", "progress", "recompute", "output", "worst grad", "(tensor)",
                        "losses", "across nodes", "result"],
                 align=["right", "left", "left", "left", "right", "right", "left", "right", "left", "left"]))
    for g, why in skipped:
        print(f"{str(g):>15} skipped: {why}")
    print(f"{len(results) - failed} passed, {failed} failed, {len(skipped)} skipped")
    return 1 if failed else 0


def cmd_info(args, world) -> int:
    from fourd_mpi.run.build import Run

    options = run_options(args, world.Get_size())
    run = Run.build(world, options)
    if args.format == "json":
        if world.Get_rank() == 0:
            from mpi4py import MPI

            cfg = run.options.model
            emit_json(INFO_JSON, {
                "version": __version__, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "world_size": world.Get_size(), "grid": str(run.options.grid),
                "placement": _placement_json(run),
                "algorithm": get_algorithm(run.options.algorithm).describe(run.options.grid),
                "model": {"name": cfg.name, "kind": cfg.kind, "layers": cfg.layers, "hidden": cfg.hidden,
                          "heads": cfg.heads, "ffn_hidden": cfg.ffn_hidden, "seq": cfg.seq, "batch": cfg.batch,
                          "parameters": cfg.parameter_count()},
                "backend": run.backend.describe(), "optimizer": run.options.optimizer,
                "overlap": str(run.trainer.overlap), "progress": run.comm.progress.describe(),
                "recompute": run.options.recompute,
                "parameters": [{"name": p.name, "global_shape": list(p.global_shape), "layout": str(p.layout)}
                               for p in run.model.parameters()[:8]]})
        run.close()
        return 0
    _header(world, run)
    for p in run.model.parameters()[:8]:
        say(world, f"  {p.name:<18} global {str(p.global_shape):<14} layout {p.layout}")
    run.close()
    return 0


def _placement_json(run) -> dict:
    """``info --format json``'s placement: what the grid's description says, as data."""
    from fourd_mpi.core.grid import AXES

    placement, shape = run.placement, run.grid.shape
    binding = placement.binding
    return {"nodes": placement.num_nodes, "ranks_per_node": list(placement.ranks_per_node),
            "binding": binding.describe() if binding is not None else None,
            "axes": {axis: {"size": shape[axis], "stride": run.grid.stride(axis),
                            "placement": "-" if shape[axis] == 1 else
                            "inter-node" if placement.crosses(axis) else "intra-node"} for axis in reversed(AXES)}}


def cmd_presets(args, world) -> int:
    from fourd_mpi.util.text import format_rows

    exact = args.format in ("csv", "json")  # exact parameter counts; the tables: 1.23M
    rows = [{"preset": c.name, "kind": c.kind, "layers": c.layers, "hidden": c.hidden, "heads": c.heads,
             "ffn": c.ffn_hidden, "seq": c.seq, "batch": c.batch if exact else c.batch or "-",
             "params": c.parameter_count() if exact else _human(c.parameter_count())}
            for c in PRESETS.values()]
    say(world, format_rows(rows, args.format).rstrip("\n"))
    return 0


def _human(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))
