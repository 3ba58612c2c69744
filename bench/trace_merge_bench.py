"""Merge rate, peak memory and analysis time of hierarchical traces, through the file-based path.

1. Builds the spool of a crashed run of ``--ranks`` ranks x ``--steps`` op-level steps (real
   ``RankSpool`` files: ``run.json``, per rank ``.json``, ``.events``, ``.steps``), every step the
   ~200-event GPT template of ``bench/analysis_bench.py`` stretched per rank, its events in
   recording order (spans after their contents), so the merge must sort them.
2. Recovers it (``fourd_mpi.trace.store.recover``, what ``fourd-mpi trace recover`` runs) in a
   fresh process per configuration: one file (the single-writer path of schema 4) or groups of
   ``--group-size`` ranks (part files bound by a virtual ``/events``), ``jobs`` worker processes,
   each compression. Rate = events in the trace / wall time of ``recover`` (reading every
   rank's files, sorting, writing, publishing); on a shared machine also per CPU-second (user +
   system time of the process and its workers, less sensitive to other jobs). Peak memory =
   ``ru_maxrss`` of the recovering process and of its workers (largest), compared with the
   import baseline (a process that only imports the modules) and with the bytes of one
   group's and of all events.
3. ``fourd-mpi analyze FILE`` (a subprocess, wall time) of the single-file and the multi-part
   trace of the same events, and ``load_trace`` alone.

Each configuration runs ``--repeats`` times (the machine may be shared: medians, and the
spread as min-max). Prints a table.

    OMP_NUM_THREADS=1 python bench/trace_merge_bench.py [--ranks 4096] [--steps 4] [--group-size 128]
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE  # noqa: E402
from fourd_mpi.trace.store import RUN_META, RankSpool  # noqa: E402


def build_spool(spool_dir: str, ranks: int, steps: int, blocks: int, ranks_per_node: int) -> int:
    """The spool of a crashed run (every step finished on every rank); returns the number of events."""
    from analysis_bench import grid_for, template_step

    grid = grid_for(ranks)
    rows, layers = template_step(blocks, grid)  # recording order (spans after their contents)
    names = ("op", "phase", "layer", "axis", "lane", "start_ns", "end_ns", "bytes", "wire_bytes", "flops",
             "issue_ns", "complete_ns", "wait_ns")
    tmpl = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, name in enumerate(names):
        tmpl[name] = [row[i] for row in rows]
    span = int(tmpl["end_ns"][tmpl["op"] == 0][0])
    os.makedirs(spool_dir)
    with open(os.path.join(spool_dir, RUN_META), "w") as fh:
        json.dump({"run_id": "merge-bench", "world_size": ranks, "layers": layers, "level": "op",
                   "ranks_per_node": [ranks_per_node] * (ranks // ranks_per_node)
                   + ([ranks % ranks_per_node] if ranks % ranks_per_node else [])}, fh)
    rng = np.random.default_rng(0)
    record = np.zeros(1, dtype=RANK_STEP_DTYPE)
    for rank in range(ranks):
        spool = RankSpool(spool_dir, rank, {"rank": rank, "hostname": f"node{rank // ranks_per_node}",
                                            "node": rank // ranks_per_node, "local_rank": rank % ranks_per_node})
        for step in range(steps):
            f = 1.0 + 0.15 * rng.random()
            t0 = 10**9 + step * 4 * span + rank * 37
            ev = tmpl.copy()
            ev["rank"], ev["step"] = rank, step
            for column in ("start_ns", "end_ns", "issue_ns", "complete_ns"):
                ev[column] = np.where(tmpl[column] > 0, t0 + (tmpl[column] * f).astype(np.int64), 0)
            ev["start_ns"] = t0 + (tmpl["start_ns"] * f).astype(np.int64)
            ev["wait_ns"] = (tmpl["wait_ns"] * f).astype(np.int64)
            record[0] = (rank, step, step == 0, t0, t0 + int(span * f), 1.0, span * f * 1e-9, 0, 0, len(ev), 0)
            spool.append(ev, record)
        spool.close()
    return ranks * steps * len(tmpl)


def worker(args) -> int:
    """One measurement in this (fresh) process; prints one JSON line."""
    if args.worker == "baseline":
        import h5py  # noqa: F401

        import fourd_mpi.trace.merge  # noqa: F401
        import fourd_mpi.trace.read  # noqa: F401
        print(json.dumps({"rss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
        return 0
    if args.worker == "load":
        from fourd_mpi.trace.read import load_trace

        t = time.perf_counter()
        trace = load_trace(args.path)
        print(json.dumps({"seconds": time.perf_counter() - t, "events": len(trace.events)}))
        return 0
    from fourd_mpi.trace.store import recover

    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    t = time.perf_counter()
    result = recover(args.spool, output=args.path, group_size=args.group_size, jobs=args.jobs,
                     compression=args.compression)
    seconds = time.perf_counter() - t
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))
    import h5py

    with h5py.File(result["path"], "r") as f:
        events = int(f.attrs["events"])
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "events": events, "parts": result["parts"],
                      "rss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "rss_children_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                      "rss_writer_kib": result["peak_rss_kib"]}))
    return 0


def run_json(argv, env) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *map(str, argv)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {argv} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trace_bytes(path: str) -> int:
    from fourd_mpi.trace.merge import parts_dir_of

    total = os.path.getsize(path)
    parts = parts_dir_of(path)
    if os.path.isdir(parts):
        total += sum(os.path.getsize(os.path.join(parts, n)) for n in os.listdir(parts))
    return total


def remove_trace(path: str) -> None:
    from fourd_mpi.trace.merge import parts_dir_of

    if os.path.exists(path):
        os.remove(path)
    shutil.rmtree(parts_dir_of(path), ignore_errors=True)


def med(values):
    return statistics.median(values)


def spread(values, scale=1.0, fmt="{:.2f}"):
    return (fmt + " ({}-{})").format(med(values) * scale, fmt.format(min(values) * scale),
                                     fmt.format(max(values) * scale))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--blocks", type=int, default=1, help="GPT blocks of the template step (1: ~130 events)")
    p.add_argument("--ranks-per-node", type=int, default=128, help="written to run.json (default 128)")
    p.add_argument("--group-size", type=int, default=128, help="ranks per part (default 128)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes of the grouped recoveries (default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--analyze-repeats", type=int, default=3)
    p.add_argument("--dir", help="work directory (kept); default: a temporary one, removed")
    p.add_argument("--worker", choices=("recover", "load", "baseline"), help=argparse.SUPPRESS)
    p.add_argument("--spool", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--compression", default="gzip", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.path.join(HERE, "..") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = args.dir or tempfile.mkdtemp(prefix="fourd-merge-bench-")
    os.makedirs(base, exist_ok=True)
    spool = os.path.join(base, "bench.ranks")
    try:
        if os.path.exists(spool):
            shutil.rmtree(spool)
        t = time.perf_counter()
        events = build_spool(spool, args.ranks, args.steps, args.blocks, args.ranks_per_node)
        build_s = time.perf_counter() - t
        ev_bytes = EVENT_DTYPE.itemsize
        group_events = events // args.ranks * args.group_size
        print(f"spool: {args.ranks} ranks x {args.steps} steps x {events // args.ranks // args.steps} events = "
              f"{events:,} events ({events * ev_bytes / 2**20:.0f} MiB raw, {ev_bytes} B/event), built in "
              f"{build_s:.1f} s; machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
        baseline = run_json(["--worker", "baseline"], env)["rss_self_kib"]
        configs = [  # label, group size, jobs, compression
            ("one file (schema-4 path)", args.ranks, 1, "gzip"),
            (f"groups of {args.group_size}", args.group_size, 1, "gzip"),
            (f"groups of {args.group_size}", args.group_size, args.jobs, "gzip"),
            ("one file (schema-4 path)", args.ranks, 1, "none"),
            (f"groups of {args.group_size}", args.group_size, args.jobs, "lzf"),
            (f"groups of {args.group_size}", args.group_size, args.jobs, "none"),
        ]
        rows, keep = [], {}
        for label, group, jobs, compression in configs:
            out = os.path.join(base, f"g{group}-j{jobs}-{compression}.h5")
            samples = []
            for _ in range(args.repeats):
                remove_trace(out)
                samples.append(run_json(["--worker", "recover", "--spool", spool, "--path", out, "--group-size",
                                         group, "--jobs", jobs, "--compression", compression], env))
            assert all(s["events"] == events for s in samples), samples
            rows.append((label, samples[0]["parts"], jobs, compression, samples, trace_bytes(out)))
            keep[(group, jobs, compression)] = out
        print()
        print("recover (fourd_mpi.trace.store.recover in a fresh process); rate = events / wall time; "
              f"median (min-max) of {args.repeats}")
        print(f"peak RSS: ru_maxrss; import baseline {baseline / 1024:.0f} MiB (numpy, h5py, fourd_mpi.trace "
              f"imported); one group's events {group_events * ev_bytes / 2**20:.1f} MiB "
              f"({args.group_size} ranks), all events {events * ev_bytes / 2**20:.0f} MiB")
        header = (f"{'layout':<26} {'parts':>5} {'jobs':>4} {'compr.':>6} {'wall s':>18} {'M events/s':>18} "
                  f"{'M ev/CPU-s':>18} "
                  f"{'RSS main MiB':>13} {'RSS writer MiB':>15} {'size MiB':>9}")
        print(header)
        print("-" * len(header))
        for label, parts, jobs, compression, samples, size in rows:
            secs = [s["seconds"] for s in samples]
            rates = [events / s / 1e6 for s in secs]
            cpu_rates = [events / s["cpu_seconds"] / 1e6 for s in samples]
            rss_main = max(s["rss_self_kib"] for s in samples) / 1024
            rss_writer = max(max(s["rss_writer_kib"], s["rss_children_kib"]) for s in samples) / 1024
            print(f"{label:<26} {parts:>5} {jobs:>4} {compression:>6} {spread(secs):>18} {spread(rates):>18} "
                  f"{spread(cpu_rates):>18} "
                  f"{rss_main:>13.0f} {rss_writer:>15.0f} {size / 2**20:>9.1f}")
        print()
        print(f"reading: wall time of `fourd-mpi analyze FILE` (subprocess) and of load_trace alone, median (min-max) "
              f"of {args.analyze_repeats}")
        print(f"{'trace':<40} {'analyze s':>20} {'load_trace s':>20}")
        for key, label in (((args.ranks, 1, "gzip"), "one file, gzip"),
                           ((args.group_size, args.jobs, "gzip"), f"{args.ranks // args.group_size} parts, gzip"),
                           ((args.ranks, 1, "none"), "one file, none"),
                           ((args.group_size, args.jobs, "none"), f"{args.ranks // args.group_size} parts, none")):
            path = keep[key]
            analyze, load = [], []
            for _ in range(args.analyze_repeats):
                t = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "analyze", path], capture_output=True,
                                      text=True, env=env)
                analyze.append(time.perf_counter() - t)
                if proc.returncode != 0:
                    raise SystemExit(f"analyze {path} failed: {proc.stderr.strip()}")
                load.append(run_json(["--worker", "load", "--path", path], env)["seconds"])
            print(f"{label:<40} {spread(analyze):>20} {spread(load):>20}")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
