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
import statistics
import sys
import traceback
from dataclasses import replace
from typing import List, Optional

from . import __version__
from .backend import BACKENDS, DEVICE_BUFFER_MODES, DTYPES
from .config import PRESETS, model_problems
from .errors import BackendError, ConfigError
from .grid import GridShape, grid_factorizations
from .optim import OPTIMIZERS
from .progress import PROGRESS_STRATEGIES

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
    r.add_argument("--dtype", default="float32", choices=list(DTYPES))
    r.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto: cupy when a GPU is usable, else numpy")
    r.add_argument("--device-buffers", default="auto", choices=DEVICE_BUFFER_MODES,
                   help="cupy only: hand device buffers to MPI (direct) or stage through host memory")
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
    """The :func:`fourd_mpi.runtime.resolve` keywords of :func:`add_overlap_args`'s options."""
    return dict(overlap=args.overlap if isinstance(args.overlap, str) else "none",
                progress=args.progress if isinstance(args.progress, str) else "poll",
                cache_weights=args.cache_weights, prefetch_depth=args.prefetch_depth, chunks=args.chunks,
                poll_flops=args.poll_flops, check_buffers=args.check_buffers)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="MPI benchmark of 4D hybrid parallel training "
                     "(data x 3D tensor parallelism). Launch under mpiexec/srun.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    run = sub.add_parser("run", help="run training steps and print loss and step time")
    _add_model_args(run)
    add_overlap_args(run)
    run.add_argument("--steps", type=positive_int, default=10)
    run.add_argument("--warmup", type=nonnegative_int, default=1,
                     help="leading steps excluded from the summary statistics (default 1)")

    ver = sub.add_parser("verify", help="compare the distributed step with the serial reference")
    _add_model_args(ver)
    add_overlap_args(ver, many=True)
    ver.add_argument("--steps", type=positive_int, default=5, help="training steps whose losses are compared")
    ver.add_argument("--grid", action="append", default=[], metavar="DxZxYxX",
                     help="grid to check (repeatable), e.g. 1x2x2x2")
    ver.add_argument("--all-grids", action="store_true",
                     help="every factorization of the world size into (G_data, G_z, G_y, G_x)")
    ver.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0)")

    info = sub.add_parser("info", help="describe the grid, backend and MPI library")
    _add_model_args(info)
    add_overlap_args(info)

    sub.add_parser("presets", help="list the model presets")
    return parser


def _grid_sizes(args):
    return {"data": args.gdata, "z": args.gz, "y": args.gy, "x": args.gx}


def _model_overrides(args):
    return {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ffn_hidden": args.ffn_hidden, "seq": args.seq, "batch": args.batch}


def _run_options(args, world_size: int, **extra):
    from .runtime import resolve

    return resolve(world_size, args.model, _grid_sizes(args), _model_overrides(args),
                   dtype=args.dtype, backend=args.backend, device_buffers=args.device_buffers,
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
    _say(world, f"overlap {overlap}; progress {run.comm.progress.describe()}")
    for note in run.overlap_notes():
        _say(world, f"note: {note} on grid {run.options.grid}")
    _say(world, f"activations between blocks {run.model.activation_layout}")


def cmd_run(args, world) -> int:
    from .runtime import Run

    options = _run_options(args, world.Get_size(), steps=args.steps, warmup=args.warmup)
    run = Run.build(world, options)
    _header(world, run)
    _say(world, f"{'step':>6} {'loss':>14} {'time (s)':>10}")
    times = []
    for i in range(options.steps):
        result = run.trainer.step(i)
        if i >= options.warmup:
            times.append(result.seconds)
        tag = "  (warm-up)" if i < options.warmup else ""
        _say(world, f"{i:>6} {result.loss:>14.8g} {result.seconds:>10.4f}{tag}")
    if times:
        med = statistics.median(times)
        tokens = options.model.tokens
        _say(world, f"median step time {med:.4f} s over {len(times)} steps "
                    f"(min {min(times):.4f}, max {max(times):.4f}), {tokens / med:,.0f} tokens/s")
    run.close()
    return 0


def cmd_verify(args, world) -> int:
    from .verify import verify

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
    results = verify(variants, grids, args.steps, world)
    if world.Get_rank() != 0:
        return 0
    print(f"verify {options.model.name} ({options.dtype}) on {size} ranks against one rank, "
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
    from .runtime import Run

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


COMMANDS = {"run": cmd_run, "verify": cmd_verify, "info": cmd_info, "presets": cmd_presets}


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ConfigError as exc:
        _error_line(exc)
        return 2
    world = None
    try:
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
