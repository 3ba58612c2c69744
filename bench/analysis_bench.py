"""Benchmark of fourd_mpi.analysis.tables on a large synthetic op-level trace (no MPI).

Writes a trace of ``--ranks`` ranks x ``--steps`` steps with about 200 events per rank and
step (a realistic mix: step and layer spans, GEMMs and other compute ops, all-gathers,
reduce-scatters, all-reduces on every axis, waits) into a temporary directory with
``TraceFileWriter``, then times ``load_trace``, ``runs_table``, ``breakdown`` and
``comm_table``.

    python -m bench.analysis_bench [--ranks 1024] [--steps 10] [--keep DIR]

A/B mode: ``--trace FILE --against TREE`` times this checkout's code against another checkout
``TREE`` (e.g. ``git worktree add --detach /tmp/old <commit>``) on the same trace, in fresh
processes, alternating (old, new, new, old, ... so that a drift of the machine's load hits both
alike): ``fourd-mpi analyze FILE`` (wall time of the subprocess, imports included) and
``load_trace`` alone (inside a subprocess). Prints every round with the ratio new / old and the
load average, then the medians; checks that both trees print the same analysis (every
``--format``).

    OMP_NUM_THREADS=1 python -m bench.analysis_bench --trace FILE --against TREE [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from fourd_mpi.analysis import tables as analysis
from fourd_mpi.core.colltable import wire_factor
from fourd_mpi.trace.events import (
    AXES,
    COMPUTE_OPS,
    EVENT_DTYPE,
    LANE_COMM0,
    LANE_HOST,
    LANE_LAYER,
    LANE_STEP,
    OPS,
    PHASES,
    RANK_STEP_DTYPE,
)
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.summary import summarize
from fourd_mpi.trace.writer import TraceFileWriter, ranks_table

OP = {name: i for i, name in enumerate(OPS)}
PHASE = {name: i for i, name in enumerate(PHASES)}
AXIS = {name: i for i, name in enumerate(AXES)}


def grid_for(ranks: int):
    """A 4D grid of ``ranks`` (powers of two): x and y up to 8, then z up to 4, then data."""
    sizes = {"x": 1, "y": 1, "z": 1, "data": 1}
    left = ranks
    for axis, cap in (("x", 8), ("y", 8), ("z", 4), ("data", 1 << 30)):
        while left > 1 and sizes[axis] < cap and left % 2 == 0:
            sizes[axis] *= 2
            left //= 2
    if left != 1:
        raise SystemExit(f"--ranks {ranks}: use a power of two")
    return {"data": sizes["data"], "z": sizes["z"], "y": sizes["y"], "x": sizes["x"]}


def template_step(blocks: int, grid):
    """One rank's step as ``(rows, layer_names)``: events with times relative to the step start.

    Built once (a Python loop over ~200 template events, not over the trace)."""
    layers = [""]
    for b in range(blocks):
        layers += [f"block{b}.{n}" for n in ("ln1", "qkv", "attn", "proj", "ln2", "fc1", "gelu", "fc2")]
    layers.append("loss")
    code = {name: i for i, name in enumerate(layers)}
    rows = []
    t = 1000
    lane_free = []

    def comm(op, axis, layer, phase, issue, flight, wait, nbytes):
        if grid[axis] <= 1:
            return
        lane = next((i for i, free in enumerate(lane_free) if free <= issue), len(lane_free))
        if lane == len(lane_free):
            lane_free.append(0)
        lane_free[lane] = issue + flight
        wire = int(nbytes * wire_factor(op, grid[axis]))
        rows.append((OP[op], PHASE[phase], code[layer], AXIS[axis], LANE_COMM0 + lane, issue, issue + flight,
                     nbytes, wire, 0.0, issue, issue + flight, wait))
        if wait:
            rows.append((OP["wait"], PHASE[phase], code[layer], AXIS[axis], LANE_HOST, issue + flight - wait,
                         issue + flight, nbytes, 0, 0.0, 0, 0, 0))

    def compute(op, layer, phase, dur, flops=0.0):
        nonlocal t
        rows.append((OP[op], PHASE[phase], code[layer], 0, LANE_HOST, t, t + dur, 0, 0, flops, 0, 0, 0))
        t += dur + 20

    def blocked_comm(op, axis, layer, phase, flight, nbytes, hidden=0.0):
        """issue now, compute ``hidden`` of the flight, wait for the rest."""
        nonlocal t
        issue = t
        if hidden:
            compute("gemm", layer, phase, int(flight * hidden), 2e9)
        if grid[axis] > 1:
            exposed = max(0, issue + flight - t)
            comm(op, axis, layer, phase, issue, flight, exposed, nbytes)
            t = max(t, issue + flight) + 10

    compute("data", "", "none", 30_000)
    for phase, order in (("forward", range(blocks)), ("backward", reversed(range(blocks)))):
        for b in order:
            names = [f"block{b}.{n}" for n in ("ln1", "qkv", "attn", "proj", "ln2", "fc1", "gelu", "fc2")]
            if phase == "backward":
                names = names[::-1]
            for name in names:
                start = t
                kind = name.split(".")[1]
                if kind in ("qkv", "proj", "fc1", "fc2"):
                    blocked_comm("allgather", "z", name, phase, 40_000, 4 << 20, hidden=0.5)
                    compute("gemm", name, phase, 120_000, 4e9)
                    if phase == "backward":
                        compute("gemm", name, phase, 110_000, 4e9)
                        blocked_comm("reduce_scatter", "z", name, phase, 50_000, 4 << 20, hidden=0.3)
                        comm("allreduce", "data", name, phase, t, 200_000, 0, 2 << 20)
                    blocked_comm("allreduce", "x" if phase == "forward" else "y", name, phase, 30_000, 1 << 20,
                                 hidden=0.2)
                elif kind in ("ln1", "ln2"):
                    for _ in range(3 if phase == "forward" else 2):
                        compute("layernorm", name, phase, 8_000)
                        blocked_comm("allreduce", "x", name, phase, 6_000, 4096)
                    if phase == "backward":
                        blocked_comm("allreduce", "z", name, phase, 8_000, 1024, hidden=0.5)
                elif kind == "attn":
                    compute("attention", name, phase, 150_000, 3e9)
                else:
                    compute("gelu", name, phase, 20_000)
                rows.append((OP["layer"], PHASE[phase], code[name], 0, LANE_LAYER, start, t, 0, 0, 0.0, 0, 0, 0))
                t += 10
            if phase == "forward" and b == blocks - 1:
                compute("loss", "loss", "forward", 5_000)
                for axis in ("data", "z", "x"):
                    blocked_comm("allreduce", axis, "loss", "forward", 3_000, 8)
                compute("loss", "loss", "forward", 4_000)
    t = max([t] + lane_free) + 100
    compute("optimizer", "", "optimizer", 60_000)
    rows.append((OP["step"], 0, 0, 0, LANE_STEP, 0, t + 500, 0, 0, 0.0, 0, 0, 0))
    return rows, layers


def build_trace(path: str, ranks: int, steps: int, blocks: int, seed: int = 0) -> int:
    grid = grid_for(ranks)
    rows, layers = template_step(blocks, grid)
    tmpl = np.array(rows, dtype=[("op", "u1"), ("phase", "u1"), ("layer", "<i2"), ("axis", "u1"), ("lane", "u1"),
                                 ("start", "<i8"), ("end", "<i8"), ("bytes", "<i8"), ("wire", "<i8"),
                                 ("flops", "<f8"), ("issue", "<i8"), ("complete", "<i8"), ("wait", "<i8")])
    tmpl = tmpl[np.argsort(tmpl["start"], kind="stable")]
    n = len(tmpl)
    span = int(tmpl["end"][tmpl["op"] == OP["step"]][0])
    rng = np.random.default_rng(seed)
    # every (rank, step) is the template stretched by its own factor (keeps the lanes disjoint)
    scale = 1.0 + 0.15 * rng.random((steps, ranks))
    scale[0] *= 3.0  # warm-up
    step_start = np.arange(steps, dtype=np.int64) * int(span * 4) + 10**9
    compute_codes = np.array([OP[o] for o in COMPUTE_OPS])
    is_compute = np.isin(tmpl["op"], compute_codes)
    is_wait = tmpl["op"] == OP["wait"]
    writer = TraceFileWriter(path)
    rank_steps = np.zeros(ranks * steps, dtype=RANK_STEP_DTYPE)
    try:
        for rank in range(ranks):
            f = scale[:, rank][:, None]                       # steps x 1
            t0 = (step_start + rank * 37)[:, None]
            ev = np.zeros((steps, n), dtype=EVENT_DTYPE)
            ev["rank"] = rank
            ev["step"] = np.arange(steps, dtype=np.int32)[:, None]
            for src, dst in (("op", "op"), ("phase", "phase"), ("layer", "layer"), ("axis", "axis"),
                             ("lane", "lane"), ("bytes", "bytes"), ("wire", "wire_bytes"), ("flops", "flops")):
                ev[dst] = tmpl[src][None, :]
            start = t0 + (tmpl["start"][None, :] * f).astype(np.int64)
            end = t0 + (tmpl["end"][None, :] * f).astype(np.int64)
            ev["start_ns"], ev["end_ns"] = start, end
            coll = tmpl["issue"] > 0
            ev["issue_ns"] = np.where(coll, start, 0)
            ev["complete_ns"] = np.where(coll, end, 0)
            waits = (tmpl["wait"][None, :] * f).astype(np.int64)
            ev["wait_ns"] = np.where(coll, waits, 0)
            dur = end - start
            rs = rank_steps[rank::ranks]  # rows of this rank, one per step (view)
            rs["rank"], rs["step"] = rank, np.arange(steps)
            rs["warmup"] = np.arange(steps) == 0
            rs["start_ns"], rs["end_ns"] = t0[:, 0], t0[:, 0] + (span * f[:, 0]).astype(np.int64)
            rs["loss"] = 1.0
            rs["compute_ns"] = dur[:, is_compute].sum(axis=1)
            rs["wait_ns"] = dur[:, is_wait].sum(axis=1)
            rs["events"] = n
            flat = ev.reshape(-1)
            writer.append_events(rank, flat[np.argsort(flat["start_ns"], kind="stable")])
        spans = (rank_steps["end_ns"] - rank_steps["start_ns"]).reshape(steps, ranks)
        rank_steps["seconds"] = np.repeat(spans.max(axis=1) * 1e-9, ranks)
        model = {"name": "gpt-5b", "kind": "gpt", "layers": blocks, "hidden": 4096, "heads": 32,
                 "ffn_hidden": 16384, "seq": 2048, "batch": 64}
        flops = 6.0 * 64 * 2048 * blocks * 12 * 4096 ** 2
        tokens = 64 * 2048
        meta = {"run_id": os.path.basename(path)[:-3], "level": "op",
                "config": {"model": "gpt-5b", "label": "bench", "overlap": "all", "progress": "poll"},
                "run_options": {"model": model, "grid": grid}, "grid": "{data}x{z}x{y}x{x}".format(**grid),
                "world_size": ranks, "overlap": "oag,ors,oar,dp,od (prefetch depth 1, 2 token chunks)",
                "progress": "poll (Testsome between GEMM chunks of 1e+07 FLOPs)", "layers": layers,
                "warmup_steps": 1, "model_flops_per_step": flops, "tokens_per_step": tokens,
                "summary": summarize(rank_steps, ranks, flops, tokens, 100.0, "--peak-tflops").as_dict()}
        metas = [{"rank": r, "hostname": f"node{r // 4}", "node": r // 4, "local_rank": r % 4} for r in range(ranks)]
        writer.finish(meta, ranks_table(metas), rank_steps, layers, "complete")
    except BaseException:
        writer.abort()
        raise
    return n


#: times load_trace, then (on the loaded trace) its checks of the events as load_trace runs them: the
#: range checks and damage (given the range checks' scan where this tree's damage takes one)
_LOAD_WORKER = """
import inspect, json, sys, time
from fourd_mpi.trace import read
t, c = time.perf_counter(), time.process_time()
trace = read.load_trace(sys.argv[1])
seconds, cpu = time.perf_counter() - t, time.process_time() - c
t = time.perf_counter()
scan = read._check_ranges(trace.events, trace.rank_steps, trace.ranks, trace.vocab, trace.world_size)
read.damage(trace, scan) if "scan" in inspect.signature(read.damage).parameters else read.damage(trace)
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "checks_seconds": time.perf_counter() - t,
                  "events": len(trace.events)}))
"""


def ab(trace: str, against: str, rounds: int) -> int:
    """The A/B comparison of the module docstring; exit 1 when the two trees' outputs differ."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    trees = {"old": os.path.abspath(against), "new": os.path.abspath(here)}
    env = {name: dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=tree)
           for name, tree in trees.items()}

    def children_cpu():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def analyze(name, *extra):
        t, cpu = time.perf_counter(), children_cpu()
        proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "analyze", trace, *extra], capture_output=True,
                              text=True, env=env[name], cwd=trees[name])
        if proc.returncode != 0:
            raise SystemExit(f"{name}: analyze failed: {proc.stderr.strip()}")
        return time.perf_counter() - t, proc.stdout, children_cpu() - cpu

    def load(name):
        proc = subprocess.run([sys.executable, "-c", _LOAD_WORKER, trace], capture_output=True, text=True,
                              env=env[name], cwd=trees[name])
        if proc.returncode != 0:
            raise SystemExit(f"{name}: load_trace failed: {proc.stderr.strip()}")
        return json.loads(proc.stdout)

    same = all(analyze("old", *f)[1] == analyze("new", *f)[1]
               for f in ([], ["--format", "json"], ["--format", "markdown"], ["--what", "steps", "--format", "csv"]))
    events = load("new")["events"]
    print(f"# OMP_NUM_THREADS=1 python -m bench.analysis_bench --trace {trace} --against {against} --rounds {rounds}")
    print(f"trace {trace}: {events:,} events; old = {trees['old']}, new = {trees['new']}; {os.cpu_count()} CPUs; "
          f"outputs of `fourd-mpi analyze` (table, json, markdown, steps csv) identical: {'yes' if same else 'NO'}")
    print("seconds: wall time (CPU time: user + system of the process); new/old: wall-time ratio of the round")
    print("checks: load_trace's checks of the events alone (range checks and damage), on the loaded trace")
    print(f"{'round':>5} {'analyze old':>13} {'new':>13} {'new/old':>7} "
          f"{'load_trace old':>15} {'new':>13} {'new/old':>7} "
          f"{'checks old':>10} {'new':>5} {'new/old':>7} {'load avg':>8}")
    kinds = ("a_old", "a_new", "l_old", "l_new", "c_old", "c_new")
    times = {k: [] for k in kinds}
    cpus = {k: [] for k in kinds}

    def cell(k, i=-1):
        return f"{times[k][i]:.2f} ({cpus[k][i]:.2f})"

    for r in range(rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for name in order:
            wall, _, cpu = analyze(name)
            times[f"a_{name}"].append(wall)
            cpus[f"a_{name}"].append(cpu)
            loaded = load(name)
            times[f"l_{name}"].append(loaded["seconds"])
            cpus[f"l_{name}"].append(loaded["cpu_seconds"])
            times[f"c_{name}"].append(loaded["checks_seconds"])
            cpus[f"c_{name}"].append(float("nan"))
        print(f"{r + 1:>5} {cell('a_old'):>13} {cell('a_new'):>13} {times['a_new'][-1] / times['a_old'][-1]:>7.2f} "
              f"{cell('l_old'):>15} {cell('l_new'):>13} {times['l_new'][-1] / times['l_old'][-1]:>7.2f} "
              f"{times['c_old'][-1]:>10.2f} {times['c_new'][-1]:>5.2f} {times['c_new'][-1] / times['c_old'][-1]:>7.2f} "
              f"{os.getloadavg()[0]:>8.1f}")
    ratio = {k: statistics.median(n / o for n, o in zip(times[f"{k}_new"], times[f"{k}_old"])) for k in "alc"}
    for k in kinds:
        times[k], cpus[k] = [statistics.median(times[k])], [statistics.median(cpus[k])]
    print(f"{'med':>5} {cell('a_old'):>13} {cell('a_new'):>13} {ratio['a']:>7.2f} {cell('l_old'):>15} "
          f"{cell('l_new'):>13} {ratio['l']:>7.2f} {times['c_old'][0]:>10.2f} {times['c_new'][0]:>5.2f} "
          f"{ratio['c']:>7.2f}   (medians; new/old: median of the per-round ratios)")
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=2,
                        help="GPT blocks (2: ~275 events per rank and step on 1024 ranks)")
    parser.add_argument("--keep", metavar="DIR", help="write the trace into DIR and keep it")
    parser.add_argument("--trace", metavar="FILE", help="A/B mode: an existing trace to analyse (with --against)")
    parser.add_argument("--against", metavar="TREE", help="A/B mode: the other checkout (its fourd_mpi is imported "
                                                          "from TREE)")
    parser.add_argument("--rounds", type=int, default=5, help="A/B mode: alternating rounds (default 5)")
    args = parser.parse_args(argv)
    if args.trace or args.against:
        if not (args.trace and args.against):
            parser.error("--trace and --against go together")
        return ab(args.trace, args.against, args.rounds)
    directory = args.keep or tempfile.mkdtemp(prefix="fourd-analysis-bench-")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"bench-{args.ranks}x{args.steps}.h5")
    if os.path.exists(path):
        os.remove(path)
    try:
        t = time.perf_counter()
        per_step = build_trace(path, args.ranks, args.steps, args.blocks)
        build = time.perf_counter() - t
        size = os.path.getsize(path)
        print(f"trace: {args.ranks} ranks x {args.steps} steps x {per_step} events = "
              f"{args.ranks * args.steps * per_step:,} events, {size / 2**20:.1f} MiB, written in {build:.1f} s")
        times = {}
        t = time.perf_counter()
        trace = load_trace(path)
        times["load_trace"] = time.perf_counter() - t
        t = time.perf_counter()
        runs = analysis.runs_table([trace])
        times["runs_table"] = time.perf_counter() - t
        t = time.perf_counter()
        parts = analysis.breakdown(trace)
        times["breakdown"] = time.perf_counter() - t
        t = time.perf_counter()
        comm = analysis.comm_table(trace)
        times["comm_table"] = time.perf_counter() - t
        total = sum(times.values())
        for name, seconds in times.items():
            print(f"{name:12s} {seconds:8.3f} s")
        print(f"{'total':12s} {total:8.3f} s  (target < 60 s)")
        print(f"step median {runs.step_median_s[0]:.4f} s, breakdown shares sum {parts.share.sum():.6f}, "
              f"{len(comm)} (op, axis) rows")
        print(analysis.format_table(comm[["op", "axis", "group_size", "messages_per_step", "bytes_per_step",
                                          "busbw_gbps", "overlap_pct"]], "table"))
        return 0 if total < 60 else 1
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
