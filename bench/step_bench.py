"""Step-time benchmark: how fast is the 4D training step, and how fast are its GEMMs?

For each grid ``G_data x G_z x G_y x G_x`` (all in one ``mpiexec`` run) this measures

1. **The step.** ``--warmup`` untimed steps, then ``--steps`` timed steps of
   ``run.trainer.step(i)`` with ``count_flops=True``, so the run's
   :class:`~fourd_mpi.step.kernels.ComputeCounter` times every local GEMM (kind
   ``"gemm"``: the layer GEMMs ``x @ W^T``, ``dy @ W``, ``dy^T @ x``; kind
   ``"attention"``: the batched attention matmuls) and records the GEMM shapes
   and operand layouts. Reported: step time (max over ranks per step, then the
   median / min / max over steps), the share of each rank's step time spent in
   layer GEMMs, attention matmuls and blocked in ``Wait`` on collectives, and
   the in-step GEMM rate ``flops / seconds`` of each rank. ``--overlap`` and
   ``--progress`` are passed to the run as in ``fourd-mpi run``; with the
   ``poll`` progress a GEMM issued while a collective is in flight runs in row
   chunks of about ``--poll-flops`` FLOPs with MPI polls in between (the
   counter times the chunks, not the polls). The counter records the whole
   GEMM's shape, so the standalone passes below run it unchunked and the
   ratio includes what chunking costs.
2. **The same GEMMs outside the step.** Every rank rebuilds operands with the
   recorded shapes, dtype and layout (a transposed view where the operand was
   not row-contiguous, as ``x @ w.T`` and ``dy.T @ x`` are in the step) and runs
   one step's worth of them (each shape as many times as the step calls it),
   timed exactly as in the step (``kernels.matmul`` with a fresh counter); the
   median over ``--repeats`` passes gives the standalone rate, two ways:

   * **concurrent**: all ranks run their own GEMMs at the same time, back to
     back (no barrier between passes, plus an untimed pass after the timed
     ones, so every timed pass runs on a fully busy node), as oversubscribed as
     during the step. ``in-step rate / concurrent rate`` per rank is the fair
     comparison; the target is >= 0.95. It can exceed 1: inside the step some
     ranks wait in MPI, and MPICH's wait loop calls ``sched_yield`` (thousands
     of times a second), so a GEMM in the step gets more of its core than in
     the concurrent pass, where every rank computes.
   * **alone**: one rank at a time (rank 0, or the first ``--alone-ranks``
     ranks in turn) runs rank 0's GEMMs while every other rank sleeps in
     :func:`~fourd_mpi.core.mpiutil.idle_barrier` (a barrier that sleeps, so it
     does not steal cores). This is the single-core GEMM rate; on an
     oversubscribed node (8 ranks on 2 cores: 4 ranks share a core inside the
     step) the in-step rate is only a fraction of it (about 1/4 when all ranks
     compute at once), so this ratio is *not* apples-to-apples: it shows the
     cost of oversubscription, not an inefficiency of the step.

Launch with ``OMP_NUM_THREADS=1`` (one BLAS thread per rank: the ranks already
fill or oversubscribe the cores, and a multithreaded BLAS in every rank would
oversubscribe them again; the script warns when it is unset)::

    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.step_bench
    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.step_bench --model gpt-small \\
        --grids 1x2x2x2,1x1x2x4 --steps 5 --warmup 2 --repeats 5 --json step.json

Default model: ``gpt-small`` with 2 layers and sequence length 128 (about
0.5-1.5 s a step with 8 ranks on 2 cores; the whole run takes about a
minute). With ``--model`` the preset is used as is (plus any size flags);
without it, size flags override these defaults. Nothing else should
run on the node meanwhile: the header prints the load average at start.

Grids that do not fit the model (``fourd_mpi.step.presets.model_problems``) or the
world size are skipped with the reason. Results are printed on rank 0;
``--json FILE`` also writes every number (per step, per rank, per shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

# Run from a checkout without installing the package.
import numpy as np
from mpi4py import MPI

from fourd_mpi import __version__
from fourd_mpi.cli.args import OneLineParser, add_option, add_options
from fourd_mpi.core.grid import GridShape
from fourd_mpi.core.mpiutil import idle_barrier
from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import options_in, resolve
from fourd_mpi.step.kernels import ComputeCounter, matmul
from fourd_mpi.step.presets import PRESETS, model_problems, resolve_model
from fourd_mpi.util.values import nonnegative_int, positive_int

#: Default model: gpt-small (hidden 512, 8 heads, ffn 2048, global batch 8) with 2 layers and a
#: shorter sequence, so a step takes roughly 0.2-2 s with 8 ranks on 2 cores.
DEFAULT_MODEL = "gpt-small"
DEFAULT_OVERRIDES = {"layers": 2, "seq": 128}

#: A GEMM as the counter records it: (m, n, k, a_row_contiguous, b_row_contiguous).
ShapeKey = Tuple[int, int, int, bool, bool]


# --------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="step_bench.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"preset: {', '.join(PRESETS)} (default {DEFAULT_MODEL} with "
                        + ", ".join(f"--{k} {v}" for k, v in DEFAULT_OVERRIDES.items())
                        + " unless given)")
    for option in options_in("model")[1:]:  # the sizes; --model above has its own default
        add_option(p, option)
    p.add_argument("--grids", default=None, metavar="DxZxYxX,...",
                   help="comma-separated grids G_data x G_z x G_y x G_x (default: a few "
                        "representative factorizations of the world size)")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per grid (default 8)")
    p.add_argument("--warmup", type=nonnegative_int, default=2,
                   help="untimed steps before them (default 2)")
    p.add_argument("--repeats", type=positive_int, default=7,
                   help="timed passes of the standalone GEMMs, median taken (default 7)")
    p.add_argument("--alone-ranks", type=positive_int, default=1, metavar="N",
                   help="ranks 0..N-1 take turns running rank 0's GEMMs alone (default 1)")
    add_options(p, ("overlap",), names=("dtype", "backend"))  # as in fourd-mpi run
    p.add_argument("--json", metavar="FILE", help="also write all numbers as JSON (rank 0)")
    return p


def model_overrides(args) -> Dict[str, Optional[int]]:
    given = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "ffn_hidden": args.ffn_hidden, "seq": args.seq, "batch": args.batch}
    if args.model is None:
        args.model = DEFAULT_MODEL
        for key, value in DEFAULT_OVERRIDES.items():
            if given[key] is None:
                given[key] = value
    return given


def default_grids(world_size: int) -> List[GridShape]:
    """Each axis alone, then the most balanced 3D tensor grid with data = 1 and data = 2."""
    n = world_size
    grids = [GridShape(n, 1, 1, 1), GridShape(1, n, 1, 1), GridShape(1, 1, n, 1), GridShape(1, 1, 1, n)]
    for data in (1, 2):
        if n % data == 0 and n // data > 1:
            rest = n // data
            triples = [(z, y, rest // (z * y)) for z in range(1, rest + 1) for y in range(1, rest + 1)
                       if rest % (z * y) == 0]
            # most balanced; ties: larger inner (x, then y) axes, which stay on a node longest
            z, y, x = min(triples, key=lambda t: (max(t) - min(t), -t[2], -t[1]))
            grids.append(GridShape(data, z, y, x))
    unique = []
    for g in grids:
        if g not in unique:
            unique.append(g)
    return unique


def choose_grids(text: Optional[str], world_size: int, cfg) -> Tuple[List[GridShape], List[Tuple[str, str]]]:
    """Grids to run and ``(grid, reason)`` for those skipped."""
    grids = ([GridShape.parse(t.strip()) for t in text.split(",") if t.strip()]
             if text else default_grids(world_size))
    run, skipped = [], []
    for g in grids:
        if g.size != world_size:
            skipped.append((str(g), f"has {g.size} ranks but the world size is {world_size}"))
            continue
        problems = model_problems(cfg, g)
        if problems:
            skipped.append((str(g), "; ".join(problems)))
        elif g not in run:
            run.append(g)
    return run, skipped


# --------------------------------------------------------------------------- measurement
def measure_step(run: Run, warmup: int, steps: int) -> Dict:
    """Warm-up steps, then timed steps with the GEMM counter. Collective; per-rank numbers."""
    trainer, counter = run.trainer, run.counter
    for i in range(warmup):
        trainer.step(i)
    counter.reset()
    polls_before = getattr(run.comm.progress, "polls", 0)
    slowest, local, wait_s = [], [], 0.0
    for i in range(warmup, warmup + steps):
        run.comm.records.clear()
        result = trainer.step(i)
        slowest.append(result.seconds)
        local.append(result.local_seconds)
        # time blocked in Wait on the grid's collectives (the whole collective when it is
        # waited at once; the loss's and the step time's scalar all-reduces are not recorded)
        wait_s += sum(rec.wait_ns for rec in run.comm.records) * 1e-9
    step_seconds = sum(local)
    gemm_s = counter.seconds.get("gemm", 0.0)
    gemm_flops = counter.flops.get("gemm", 0.0)
    attn_s = counter.seconds.get("attention", 0.0)
    per_step_shapes = {}
    for key, count in counter.shapes.items():
        if count % steps:
            raise RuntimeError(f"GEMM {key} called {count} times in {steps} steps: not the same every step")
        per_step_shapes[key] = count // steps
    return {
        "step_seconds": slowest,          # max over ranks, per step (same on every rank)
        "local_step_seconds": local,      # this rank, per step
        "gemm_seconds": gemm_s,
        "gemm_flops": gemm_flops,
        "attention_seconds": attn_s,
        "attention_flops": counter.flops.get("attention", 0.0),
        "wait_seconds": wait_s,
        "gemm_share": gemm_s / step_seconds,
        "attention_share": attn_s / step_seconds,
        "wait_share": wait_s / step_seconds,
        "gemm_rate": gemm_flops / gemm_s if gemm_s else float("nan"),
        "progress_polls_per_step": (getattr(run.comm.progress, "polls", 0) - polls_before) / steps,
        "shapes": per_step_shapes,
    }


def make_operands(backend, shapes: Dict[ShapeKey, int], seed: int) -> List[Tuple[object, object, int]]:
    """``(a, b, calls)`` per recorded shape, with the recorded layouts.

    A row-contiguous operand is a C-ordered array; one that was not is the
    transposed view of a C-ordered array (``w.T`` in ``x @ w.T``, ``dy.T`` in ``dy.T @ x``).
    """
    rng = np.random.default_rng(seed)

    def operand(rows, cols, row_contiguous):
        host = rng.uniform(-1.0, 1.0, size=(rows, cols) if row_contiguous else (cols, rows))
        array = backend.asarray(host)
        return array if row_contiguous else array.T

    return [(operand(m, k, a_rc), operand(k, n, b_rc), calls)
            for (m, n, k, a_rc, b_rc), calls in sorted(shapes.items())]


def gemm_pass(backend, operands) -> Tuple[float, float]:
    """One step's worth of GEMMs, timed exactly as in the step; returns ``(seconds, flops)``."""
    counter = ComputeCounter(backend=backend, enabled=True)
    for a, b, calls in operands:
        for _ in range(calls):
            matmul(a, b, counter)
    return counter.seconds.get("gemm", 0.0), counter.flops.get("gemm", 0.0)


def time_gemms(backend, operands, repeats: int, tail: bool = False) -> Dict:
    """One untimed pass, ``repeats`` timed passes (rate from the median), optionally an untimed tail pass.

    With ``tail`` a rank keeps computing after its timed passes, so a rank that
    drifted behind still has every timed pass contended by the others.
    """
    gemm_pass(backend, operands)
    passes = [gemm_pass(backend, operands) for _ in range(repeats)]
    if tail:
        gemm_pass(backend, operands)
    seconds = [s for s, _ in passes]
    flops = passes[0][1]
    med = statistics.median(seconds)
    return {"seconds": seconds, "flops": flops, "rate": flops / med if med else float("nan")}


def standalone_concurrent(world, backend, shapes, repeats: int) -> Dict:
    """Every rank times its own step GEMMs at the same time (as oversubscribed as the step).

    No barrier between passes: a rank that finished a pass early would sleep and
    hand the core to the stragglers, whose passes would then look faster than on
    a fully busy node (with a barrier before each pass the concurrent rate read
    5-10% high with 8 ranks on 2 cores). The sleeping barriers around keep
    waiting ranks off the cores.
    """
    operands = make_operands(backend, shapes, seed=world.Get_rank())
    idle_barrier(world)
    result = time_gemms(backend, operands, repeats, tail=True)
    idle_barrier(world)
    return result


def standalone_alone(world, backend, shapes_rank0, repeats: int, ranks: int) -> List[Dict]:
    """Ranks ``0..ranks-1`` in turn time rank 0's GEMMs while all others sleep; results on every rank."""
    operands = make_operands(backend, shapes_rank0, seed=0)
    results = []
    for turn in range(min(ranks, world.Get_size())):
        idle_barrier(world)
        result = time_gemms(backend, operands, repeats) if world.Get_rank() == turn else None
        idle_barrier(world)
        results.append(dict(world.bcast(result, root=turn), rank=turn))
    return results


def bench_grid(world, options, args) -> Dict:
    """All measurements of one grid. Collective; the summary is complete on rank 0."""
    run = Run.build(world, options, count_flops=True)
    try:
        step = measure_step(run, args.warmup, args.steps)
        concurrent = standalone_concurrent(world, run.backend, step["shapes"], args.repeats)
        shapes_rank0 = world.bcast(step["shapes"], root=0)
        alone = standalone_alone(world, run.backend, shapes_rank0, args.repeats, args.alone_ranks)
        notes = run.overlap_notes()
    finally:
        run.close()
    per_rank = world.gather({"step": step, "concurrent": concurrent}, root=0)
    del run
    gc.collect()
    if world.Get_rank() != 0:
        return {}
    return dict(summarize(str(options.grid), per_rank, alone), overlap_notes=notes)


def summarize(grid: str, per_rank: List[Dict], alone: List[Dict]) -> Dict:
    """Statistics over steps and ranks, plus every raw number for the JSON file."""
    steps = per_rank[0]["step"]["step_seconds"]
    in_step = [r["step"]["gemm_rate"] for r in per_rank]
    concurrent = [r["concurrent"]["rate"] for r in per_rank]
    ratio_concurrent = [a / b for a, b in zip(in_step, concurrent)]
    alone_rate = statistics.median(a["rate"] for a in alone)
    shape_sets = {tuple(sorted(r["step"]["shapes"].items())) for r in per_rank}
    return {
        "grid": grid,
        "step_median": statistics.median(steps),
        "step_min": min(steps),
        "step_max": max(steps),
        "gemm_share_median": statistics.median(r["step"]["gemm_share"] for r in per_rank),
        "gemm_share_max": max(r["step"]["gemm_share"] for r in per_rank),
        "attention_share_median": statistics.median(r["step"]["attention_share"] for r in per_rank),
        "wait_share_median": statistics.median(r["step"]["wait_share"] for r in per_rank),
        "in_step_rate_median": statistics.median(in_step),
        "concurrent_rate_median": statistics.median(concurrent),
        "ratio_concurrent_median": statistics.median(ratio_concurrent),
        "ratio_concurrent_min": min(ratio_concurrent),
        "alone_rate": alone_rate,
        "ratio_alone": statistics.median(in_step) / alone_rate,
        "same_shapes_on_all_ranks": len(shape_sets) == 1,
        "ranks": [{
            "rank": i,
            "local_step_seconds": r["step"]["local_step_seconds"],
            "gemm_seconds": r["step"]["gemm_seconds"],
            "gemm_flops": r["step"]["gemm_flops"],
            "attention_seconds": r["step"]["attention_seconds"],
            "attention_flops": r["step"]["attention_flops"],
            "wait_seconds": r["step"]["wait_seconds"],
            "progress_polls_per_step": r["step"]["progress_polls_per_step"],
            "gemm_share": r["step"]["gemm_share"],
            "in_step_rate": r["step"]["gemm_rate"],
            "concurrent_seconds": r["concurrent"]["seconds"],
            "concurrent_rate": r["concurrent"]["rate"],
            "ratio_concurrent": ratio_concurrent[i],
        } for i, r in enumerate(per_rank)],
        "alone": alone,
        "step_seconds": steps,
        "shapes_rank0": [{"m": m, "n": n, "k": k, "a_row_contiguous": a, "b_row_contiguous": b,
                          "calls_per_step": c}
                         for (m, n, k, a, b), c in sorted(per_rank[0]["step"]["shapes"].items())],
    }


# --------------------------------------------------------------------------- report
def environment(world, args, cfg, options) -> Dict:
    blas = "?"
    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{info.get('name', '?')} {info.get('version', '')}".strip()
    except Exception:
        pass
    try:
        cores = set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = set(range(os.cpu_count() or 1))
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_per_node = node.Get_size()
    node_cores = len(set().union(*node.allgather(cores)))  # cores the node's ranks may run on
    node.Free()
    return {
        "fourd_mpi": __version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__,
        "blas": blas,
        "python": platform.python_version(),
        "host": platform.node(),
        "world_size": world.Get_size(),
        "ranks_per_node": ranks_per_node,
        "node_cores": node_cores,
        "ranks_per_core": ranks_per_node / node_cores,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "model": cfg.as_dict(),
        "dtype": args.dtype,
        "backend": args.backend,
        "overlap": str(options.overlap),
        "progress": options.progress,
        "poll_flops": options.poll_flops,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "alone_ranks": args.alone_ranks,
    }


def print_header(env: Dict) -> None:
    m = env["model"]
    print(f"step_bench (fourd-mpi {env['fourd_mpi']})  MPI: {env['mpi_library']}  mpi4py {env['mpi4py']}")
    print(f"{env['world_size']} ranks, {env['ranks_per_node']} per node on {env['node_cores']} core(s) "
          f"({env['ranks_per_core']:.3g} ranks per core) on {env['host']}; numpy {env['numpy']} ({env['blas']}), "
          f"OMP_NUM_THREADS={env['omp_num_threads'] or 'unset'}")
    if env["load_average_at_start"] is not None:
        print(f"1-min load average at start {env['load_average_at_start']:.1f}: anything else running on "
              f"the node skews every number")
    print(f"model {m['name']}: {m['kind']}, {m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}, "
          f"ffn {m['ffn_hidden']}, seq {m['seq']}, global batch {m['batch']}; dtype {env['dtype']}, "
          f"backend {env['backend']}")
    chunk = env["poll_flops"]
    chunk = "sized by --poll-flops auto" if chunk == "auto" else f"of ~{chunk:.3g} FLOPs"
    poll = (f" (GEMMs in chunks {chunk} while a collective is in flight)"
            if env["progress"] == "poll" else "")
    print(f"overlap {env['overlap']}; progress {env['progress']}{poll}")
    print(f"per grid: {env['warmup']} warm-up + {env['steps']} timed steps; standalone GEMMs: 1 untimed + "
          f"{env['repeats']} timed passes of one step's GEMMs")
    print("statistics: step (s) = max over ranks per step, then median/min/max over the timed steps;")
    print("  GEMM %, attn %, wait % = a rank's time in layer GEMMs, in attention matmuls, blocked waiting")
    print("  on the grid's collectives, over its step time (sums over the timed steps), median over ranks;")
    print("  in-step GF/s = a rank's layer-GEMM flops / GEMM seconds in the step, median over ranks;")
    print("  conc GF/s = the same GEMMs, all ranks at once, median pass, median over ranks; its ratio =")
    print("  median over ranks of in-step / conc; alone GF/s = rank 0's GEMMs with the other ranks asleep,")
    print("  median pass (median over the alone ranks); its ratio = median in-step / alone")
    print()


COLUMNS = [("grid", 9, "{:>9}"), ("step med(s)", 11, "{:>11.3f}"), ("min", 7, "{:>7.3f}"),
           ("max", 7, "{:>7.3f}"), ("GEMM %", 6, "{:>6.1f}"), ("attn %", 6, "{:>6.1f}"), ("wait %", 6, "{:>6.1f}"),
           ("in-step GF/s", 12, "{:>12.2f}"), ("conc GF/s", 9, "{:>9.2f}"), ("ratio", 5, "{:>5.2f}"),
           ("alone GF/s", 10, "{:>10.2f}"), ("ratio", 5, "{:>5.2f}")]


def table_row(s: Dict) -> str:
    values = [s["grid"], s["step_median"], s["step_min"], s["step_max"], 100 * s["gemm_share_median"],
              100 * s["attention_share_median"], 100 * s["wait_share_median"], s["in_step_rate_median"] / 1e9,
              s["concurrent_rate_median"] / 1e9, s["ratio_concurrent_median"], s["alone_rate"] / 1e9,
              s["ratio_alone"]]
    return " ".join(fmt.format(v) for (_, _, fmt), v in zip(COLUMNS, values))


def table_header() -> str:
    return " ".join(f"{name:>{width}}" for name, width, _ in COLUMNS)


def print_footer(summaries: List[Dict], skipped: Sequence[Tuple[str, str]], env: Dict) -> None:
    for grid, why in skipped:
        print(f"{grid:>9} skipped: {why}")
    for s in summaries:
        if s["overlap_notes"]:
            print(f"note on {s['grid']}: " + "; ".join(s["overlap_notes"]))
    odd = [s["grid"] for s in summaries if not s["same_shapes_on_all_ranks"]]
    if odd:
        print(f"note: ranks do not all run the same GEMM shapes on {', '.join(odd)} (alone = rank 0's)")
    per_core = env["ranks_per_core"]
    if hasattr(os, "getloadavg"):
        env["load_average_at_end"] = os.getloadavg()[0]
        print(f"1-min load average at end {env['load_average_at_end']:.1f} (this job alone keeps it near "
              f"{env['ranks_per_node']}, its ranks per node; much more means other work shared the cores)")
    print()
    print("conc ratio = in-step GEMM rate / the same GEMMs run standalone by all ranks at once: the fair")
    print("  comparison (same oversubscription as in the step); target >= 0.95. Above 1 means the step's")
    print("  GEMMs got more of their core than in the concurrent pass: ranks waiting in MPI keep calling")
    print("  sched_yield (MPICH's wait loop), while in the concurrent pass every rank computes.")
    if per_core > 1:
        print("alone ratio = in-step rate / one rank running rank 0's GEMMs while the others sleep. NOT")
        print(f"  apples-to-apples here: {env['ranks_per_node']} ranks share {env['node_cores']} core(s) "
              f"(~{per_core:.3g} per core) in the step, so it measures")
        print(f"  oversubscription (~{1 / per_core:.2g} when every rank computes at once), not step overhead.")
    else:
        print("alone ratio = in-step rate / one rank running rank 0's GEMMs while the others sleep "
              "(no oversubscription here, so comparable to conc ratio).")


# --------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    world = MPI.COMM_WORLD
    rank0 = world.Get_rank() == 0
    try:
        args = build_parser().parse_args(argv)
        overrides = model_overrides(args)
        cfg = resolve_model(args.model, **overrides)
        grids, skipped = choose_grids(args.grids, world.Get_size(), cfg)
        if not grids:
            raise ConfigError("no grid to run: " + "; ".join(f"{g}: {why}" for g, why in skipped))
        options = [resolve(world.Get_size(), args.model,
                           {"data": g.data, "z": g.z, "y": g.y, "x": g.x}, overrides,
                           dtype=args.dtype, backend=args.backend, steps=args.steps, warmup=args.warmup,
                           **{o.dest: getattr(args, o.dest) for o in options_in("overlap")}) for g in grids]
    except ConfigError as exc:
        if rank0:
            print(f"step_bench.py: error: {exc}", file=sys.stderr, flush=True)
        return 2

    try:
        env = environment(world, args, cfg, options[0])
        if rank0:
            if not os.environ.get("OMP_NUM_THREADS"):
                print("warning: OMP_NUM_THREADS is unset; each rank's BLAS may start one thread per core "
                      "and oversubscribe the node further. Launch with OMP_NUM_THREADS=1.",
                      file=sys.stderr, flush=True)
            print_header(env)
            print(table_header(), flush=True)
        summaries = []
        for opts in options:
            t0 = time.perf_counter()
            summary = bench_grid(world, opts, args)
            if rank0:
                summary["wall_seconds"] = time.perf_counter() - t0
                summaries.append(summary)
                print(table_row(summary), flush=True)
        if rank0:
            print_footer(summaries, skipped, env)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"environment": env, "grids": summaries,
                               "skipped": [list(s) for s in skipped]}, fh, indent=1)
                print(f"\nwrote {args.json}")
        return 0
    except (ConfigError, BackendError) as exc:  # raised on every rank (runtime.Run.build agrees)
        if rank0:
            print(f"step_bench.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        world.Abort(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
