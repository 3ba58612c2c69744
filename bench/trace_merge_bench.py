"""Merge rate, peak memory and analysis time of hierarchical traces, through the file-based path.

1. Builds the spool of a crashed run of ``--ranks`` ranks x ``--steps`` op-level steps (real
   ``RankSpool`` files: ``run.json``, per rank ``.json``, ``.events``, ``.steps``), every step the
   ~140-event GPT template of ``bench/analysis_bench.py`` stretched per rank, its events in
   recording order (spans after their contents), so the merge must sort them.
2. Measures the I/O floor on the same file system: reading the spool's ``.events`` files (4,096
   opens, page cache) and writing that many bytes to one new file (page cache, no fsync, as the
   trace writers do), in MB/s; ``floor s`` = events bytes / read rate + output bytes / write rate.
3. Recovers it (``fourd_mpi.trace.recover.recover``, what ``fourd-mpi trace recover`` runs) in a
   fresh process per configuration: one file (the single-writer path) or groups of
   ``--group-size`` ranks (part files bound by a virtual ``/events``), ``jobs`` worker processes,
   each compression. The configurations run in turn within each repeat (alternating, so a change
   of machine load hits them alike). Rate = events in the trace / wall time of ``recover``
   (reading every rank's files, sorting, writing, publishing, and the removability check:
   ``readback`` for parts, the whole-trace check for one file). ``M ev/CPU-s`` = events / (user +
   system time of the process and its workers): less sensitive to other jobs on a shared machine.
   Peak memory = ``ru_maxrss`` (``resource.getrusage``) of the recovering process and of its largest
   worker, next to the import baseline (a process that only imports the modules) and the bytes of
   one group's and of all events.
4. ``fourd-mpi analyze FILE`` (a subprocess, wall time) of the single-file and the multi-part
   trace of the same events, alternating, and ``load_trace`` alone; ratio parts / one file of the
   medians.

Seconds are the median and quartiles (q1-q3) of ``--repeats``. Prints tables.

``--against TREE [TREE ...]``: instead, before/after of the code: the grouped recovery (``--jobs``,
no compression) of the same spool by this checkout and by each other checkout ``TREE`` (e.g. a
``git worktree`` of an older commit; its own ``bench/trace_merge_bench.py --worker recover`` with
``PYTHONPATH=TREE``), alternating within every round; rate per tree and the per-round ratio of this
tree's rate to each other's (median and range).

    OMP_NUM_THREADS=1 python -m bench.trace_merge_bench [--ranks 4096] [--steps 10] [--group-size 128]
    OMP_NUM_THREADS=1 python -m bench.trace_merge_bench --dir D --no-single --against ../old --repeats 7
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

from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.spool import RankSpool
from fourd_mpi.util.files import RUN_META


def build_spool(spool_dir: str, ranks: int, steps: int, blocks: int, ranks_per_node: int) -> int:
    """The spool of a crashed run (every step finished on every rank); returns the number of events."""
    from bench.analysis_bench import grid_for, template_step

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
    from fourd_mpi.trace.recover import recover

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
    proc = subprocess.run([sys.executable, "-m", "bench.trace_merge_bench", *map(str, argv)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {argv} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trace_bytes(path: str) -> int:
    from fourd_mpi.trace.files import parts_dir_of

    total = os.path.getsize(path)
    parts = parts_dir_of(path)
    if os.path.isdir(parts):
        total += sum(os.path.getsize(os.path.join(parts, n)) for n in os.listdir(parts))
    return total


def remove_trace(path: str) -> None:
    from fourd_mpi.trace.files import parts_dir_of

    if os.path.exists(path):
        os.remove(path)
    shutil.rmtree(parts_dir_of(path), ignore_errors=True)


def med(values):
    return statistics.median(values)


def spread(values, fmt="{:.2f}"):
    """``median (q1-q3)``."""
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return (fmt + " ({}-{})").format(med(values), fmt.format(q1), fmt.format(q3))


def io_floor(spool: str, out_dir: str, nbytes: int, writers: int) -> dict:
    """Read rate of the spool's ``.events`` files, and write rate of ``nbytes`` into one new file of
    ``out_dir`` and into ``writers`` files by as many threads (``os.write`` releases the GIL: the
    kernel copies run in parallel, as the recovery's worker processes do); page cache, 4 MiB
    writes, no fsync (like the trace writers). MB/s."""
    import threading

    names = sorted(n for n in os.listdir(spool) if n.endswith(".events"))
    t = time.perf_counter()
    total = 0
    for name in names:
        with open(os.path.join(spool, name), "rb", buffering=0) as fh:
            total += len(fh.read())
    read_s = time.perf_counter() - t
    block = np.random.default_rng(1).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes()

    def write(path: str, n: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < n:
                done += os.write(fd, block[:min(len(block), n - done)])
        finally:
            os.close(fd)

    rates = {}
    for count in sorted({1, writers}):
        paths = [os.path.join(out_dir, f"io-floor-{i}.bin") for i in range(count)]
        threads = [threading.Thread(target=write, args=(path, nbytes // count)) for path in paths]
        t = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rates[count] = nbytes // count * count / (time.perf_counter() - t) / 1e6
        for path in paths:
            os.remove(path)
    return {"read_MBps": total / read_s / 1e6, "write_MBps": rates[1], "write_parallel_MBps": rates[writers]}


def against(args, spool: str, base: str, events: int, env) -> int:
    """Before/after (module doc): this checkout and each ``--against`` tree, alternating per round."""
    here = os.path.dirname(HERE)
    trees = {"this": here, **{os.path.basename(os.path.abspath(t)) or t: os.path.abspath(t) for t in args.against}}
    rates = {name: [] for name in trees}
    cpu = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            out = os.path.join(base, f"against-{name}.h5")
            remove_trace(out)
            tree_env = dict(env, PYTHONPATH=tree)
            proc = subprocess.run([sys.executable, "-m", "bench.trace_merge_bench", "--worker",
                                   "recover", "--spool", spool, "--path", out, "--group-size", str(args.group_size),
                                   "--jobs", str(args.jobs), "--compression", "none"],
                                  capture_output=True, text=True, env=tree_env, cwd=base)
            if proc.returncode != 0:
                raise SystemExit(f"recover by {tree} failed: {proc.stderr.strip()}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            assert result["events"] == events, result
            rates[name].append(events / result["seconds"] / 1e6)
            cpu[name].append(events / result["cpu_seconds"] / 1e6)
            remove_trace(out)
    print(f"before/after: recover, groups of {args.group_size}, {args.jobs} jobs, no compression, fresh process; "
          f"{args.repeats} rounds, the trees alternating within each round")
    print(f"{'tree':<12} {'M events/s, median (q1-q3)':>28} {'M ev/CPU-s':>11} {'this / tree per round':>26}  path")
    for name, tree in trees.items():
        ratios = [a / b for a, b in zip(rates["this"], rates[name])]
        versus = "-" if name == "this" else f"{med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{name:<12} {spread(rates[name]):>28} {med(cpu[name]):>11.2f} {versus:>26}  {tree}")
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=1, help="GPT blocks of the template step (1: ~140 events)")
    p.add_argument("--ranks-per-node", type=int, default=128, help="written to run.json (default 128)")
    p.add_argument("--group-size", type=int, default=128, help="ranks per part (default 128)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes of the grouped recoveries (default 2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--analyze-repeats", type=int, default=3)
    p.add_argument("--no-single", action="store_true", help="skip the single-file recoveries (slow)")
    p.add_argument("--dir", help="work directory (kept; a spool of the same shape there is reused); "
                                 "default: a temporary one, removed")
    p.add_argument("--against", nargs="+", metavar="TREE",
                   help="before/after: the grouped uncompressed recovery by this checkout and by each TREE, "
                        "alternating")
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
    spool = os.path.join(base, f"bench-{args.ranks}x{args.steps}x{args.blocks}.ranks")
    try:
        t = time.perf_counter()
        if os.path.isfile(os.path.join(spool, "events.count")):
            with open(os.path.join(spool, "events.count")) as fh:
                events = int(fh.read())
            how = "reused"
        else:
            shutil.rmtree(spool, ignore_errors=True)
            events = build_spool(spool, args.ranks, args.steps, args.blocks, args.ranks_per_node)
            with open(os.path.join(spool, "events.count"), "w") as fh:
                fh.write(str(events))
            how = "built"
        build_s = time.perf_counter() - t
        ev_bytes = EVENT_DTYPE.itemsize
        group_events = events // args.ranks * args.group_size
        print(f"# OMP_NUM_THREADS=1 python -m bench.trace_merge_bench {' '.join(argv or sys.argv[1:])}")
        print(f"spool: {args.ranks} ranks x {args.steps} steps x {events // args.ranks // args.steps} events = "
              f"{events:,} events ({events * ev_bytes / 2**20:.0f} MiB raw, {ev_bytes} B/event), {how} in "
              f"{build_s:.1f} s; machine: {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at start")
        if args.against:
            return against(args, spool, base, events, env)
        floor = io_floor(spool, base, events * ev_bytes, args.jobs)
        print(f"I/O floor on this file system: read the .events files {floor['read_MBps']:.0f} MB/s; write one file "
              f"{floor['write_MBps']:.0f} MB/s, {args.jobs} files by {args.jobs} threads "
              f"{floor['write_parallel_MBps']:.0f} MB/s (page cache, no fsync); 'floor s' = raw events / read rate "
              f"+ trace bytes / {args.jobs}-writer rate")
        baseline = run_json(["--worker", "baseline"], env)["rss_self_kib"]
        configs = []  # label, group size, jobs, compression
        if not args.no_single:
            configs += [("one file", args.ranks, 1, "gzip"), ("one file", args.ranks, 1, "none")]
        configs += [(f"groups of {args.group_size}", args.group_size, 1, "none")]
        configs += [(f"groups of {args.group_size}", args.group_size, args.jobs, c) for c in ("none", "lzf", "gzip")]
        samples = {c: [] for c in configs}
        outs = {c: os.path.join(base, f"g{c[1]}-j{c[2]}-{c[3]}.h5") for c in configs}
        for _ in range(args.repeats):  # alternating: every configuration once per round
            for config in configs:
                _, group, jobs, compression = config
                remove_trace(outs[config])
                samples[config].append(run_json(["--worker", "recover", "--spool", spool, "--path", outs[config],
                                                 "--group-size", group, "--jobs", jobs, "--compression",
                                                 compression], env))
        print()
        print(f"recover (fourd_mpi.trace.recover.recover in a fresh process, removability check included); "
              f"median (q1-q3) of {args.repeats}, alternating")
        print(f"peak RSS: ru_maxrss; import baseline {baseline / 1024:.0f} MiB (numpy, h5py, fourd_mpi.trace "
              f"imported); one group's events {group_events * ev_bytes / 2**20:.1f} MiB "
              f"({args.group_size} ranks), all events {events * ev_bytes / 2**20:.0f} MiB")
        header = (f"{'layout':<16} {'events':>10} {'ranks':>6} {'group':>6} {'parts':>5} {'codec':>5} {'jobs':>4} "
                  f"{'seconds':>18} {'M events/s':>18} {'M ev/CPU-s':>11} {'RSS main MiB':>12} "
                  f"{'RSS worker MiB':>14} {'size MiB':>9} {'floor s':>7}")
        print(header)
        print("-" * len(header))
        for config in configs:
            label, group, jobs, compression = config
            runs = samples[config]
            assert all(r["events"] == events for r in runs), runs
            secs = [r["seconds"] for r in runs]
            rates = [events / x / 1e6 for x in secs]
            cpu_rate = med([events / r["cpu_seconds"] / 1e6 for r in runs])
            rss_main = max(r["rss_self_kib"] for r in runs) / 1024
            rss_worker = f"{max(max(r['rss_writer_kib'], r['rss_children_kib']) for r in runs) / 1024:.0f}" \
                if jobs > 1 else "-"
            size = trace_bytes(outs[config])
            floor_s = events * ev_bytes / (floor["read_MBps"] * 1e6) + size / (floor["write_parallel_MBps"] * 1e6)
            print(f"{label:<16} {events:>10,} {args.ranks:>6} {group:>6} {runs[0]['parts']:>5} {compression:>5} "
                  f"{jobs:>4} {spread(secs):>18} {spread(rates):>18} {cpu_rate:>11.2f} {rss_main:>12.0f} "
                  f"{rss_worker:>14} {size / 2**20:>9.1f} {floor_s:>7.2f}")
        print(f"load average after the recoveries {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print()
        pairs = [(c, args.ranks, 1, c) for c in ("gzip", "none")] if not args.no_single else []
        if pairs:
            print(f"reading: wall time of `fourd-mpi analyze FILE` (subprocess) and of load_trace alone; one file and "
                  f"{args.ranks // args.group_size} parts of the same events alternating; median (q1-q3) of "
                  f"{args.analyze_repeats}")
            print(f"{'trace':<28} {'analyze s':>20} {'load_trace s':>20} {'analyze parts/one':>18}")
            for codec, *_ in pairs:
                one, parts = outs[("one file", args.ranks, 1, codec)], \
                    outs[(f"groups of {args.group_size}", args.group_size, args.jobs, codec)]
                times = {one: ([], []), parts: ([], [])}
                for _ in range(args.analyze_repeats):
                    for path in (one, parts):
                        t = time.perf_counter()
                        proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "analyze", path],
                                              capture_output=True, text=True, env=env)
                        times[path][0].append(time.perf_counter() - t)
                        if proc.returncode != 0:
                            raise SystemExit(f"analyze {path} failed: {proc.stderr.strip()}")
                        times[path][1].append(run_json(["--worker", "load", "--path", path], env)["seconds"])
                ratio = med(times[parts][0]) / med(times[one][0])
                print(f"{'one file, ' + codec:<28} {spread(times[one][0]):>20} {spread(times[one][1]):>20}")
                print(f"{f'{args.ranks // args.group_size} parts, ' + codec:<28} {spread(times[parts][0]):>20} "
                      f"{spread(times[parts][1]):>20} {ratio:>18.2f}")
        print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
