"""Timeline formats for many ranks: Chrome JSON (plain, gzip) vs Perfetto protobuf, size and write rate.

A synthetic op-level trace of ``--ranks`` ranks x ``--steps`` steps is built from a real one (gpt-tiny,
8 ranks on a 2x2x2 grid, every overlap option on, ``--trace-level op``; run here with ``mpiexec`` unless
``--trace`` names one): the events of one measured step of the real trace, tiled to ``--ranks`` ranks
(copy ``c`` of rank ``r`` is rank ``8c + r``, on host ``node<c>``; the grid becomes ``(ranks/8)x2x2x2``, so
collective instances and their flows are real) and repeated ``--steps`` times (step ``k`` shifted by ``k``
step spans). The events per rank and step are the real trace's; nothing else is invented.

Each format is written by the exporter ``fourd-mpi export perfetto`` calls (``write_perfetto`` for
``.json`` / ``.json.gz``, ``write_perfetto_proto`` for ``.pftrace`` / ``.pftrace.gz``; gzip at Python's
default level 9, as ``gzip.open``), one process, ``--repeats`` times in
alternating order. Printed per format: events (the trace's events, E = ranks x steps x events per rank
and step; every format writes the same E slices plus the derived phase spans, flows and track names),
bytes (the file), bytes/event = bytes / E, write seconds (wall, median of the repeats) and CPU seconds
(user + system of this process, median), events/s = E / wall seconds, events per CPU-s = E / CPU seconds,
peak RSS (ru_maxrss after the format's first write: a high-water mark, so it only grows down the table).
The load average (``os.getloadavg``) at the start and the end, and the command line, are printed with it.

    OMP_NUM_THREADS=1 python -m bench.timeline_formats            # 1,024 ranks x 10 steps
    OMP_NUM_THREADS=1 python -m bench.timeline_formats --ranks 64 --steps 2 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import numpy as np

from fourd_mpi.analysis.export import write_perfetto, write_perfetto_proto
from fourd_mpi.trace.read import load_trace

SOURCE_RANKS = 8
SOURCE_RUN = ["run", "--gx", "2", "--gy", "2", "--gz", "2", "--steps", "3", "--overlap", "all", "--trace-level", "op",
              "--display", "lines", "--peak-tflops", "1"]
FORMATS = (("Chrome JSON", "t.json", write_perfetto), ("Chrome JSON, gzip", "t.json.gz", write_perfetto),
           ("Perfetto protobuf", "t.pftrace", write_perfetto_proto),
           ("Perfetto protobuf, gzip", "t.pftrace.gz", write_perfetto_proto))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", help="a real op-level trace of 8 ranks (2x2x2) to tile (default: run one with mpiexec)")
    p.add_argument("--ranks", type=int, default=1024,
                   help="ranks of the synthetic trace, a multiple of 8 (default 1024)")
    p.add_argument("--steps", type=int, default=10, help="steps of the synthetic trace (default 10)")
    p.add_argument("--repeats", type=int, default=2, help="writes per format, alternating (default 2)")
    p.add_argument("--dir", help="where to write the files (default: a temporary directory, removed)")
    return p.parse_args(argv)


def source_trace(args, work: str):
    if args.trace:
        return load_trace(args.trace)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    results = os.path.join(work, "source")
    cmd = [mpiexec, "-n", str(SOURCE_RANKS), sys.executable, "-m", "fourd_mpi", *SOURCE_RUN, "--results-dir", results]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    if proc.returncode:
        sys.exit(f"the source run failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    print("source run: " + " ".join(["mpiexec", "-n", str(SOURCE_RANKS), "fourd-mpi", *SOURCE_RUN]))
    return load_trace(next(str(p) for p in Path(results).glob("*.h5")))


def tile(trace, ranks: int, steps: int):
    """The trace's first measured step on ``ranks`` ranks (copies of its 8) and ``steps`` steps (shifted copies)."""
    world = trace.world_size
    if world != SOURCE_RANKS or ranks % world:
        sys.exit(f"--ranks must be a multiple of the source trace's {world} ranks (and the source 8 ranks, 2x2x2)")
    step = int(trace.steps["step"][trace.steps["warmup"] == 0][0])
    one = trace.events[trace.events["step"] == step]
    t0 = int(one["start_ns"].min())
    span = int(one["end_ns"].max()) - t0 + 1000
    copies = ranks // world
    parts = []
    for k in range(steps):
        for c in range(copies):
            part = one.copy()
            part["rank"] += c * world
            part["step"] = k
            shift = k * span - t0 + 1_000_000
            for column in ("start_ns", "end_ns", "issue_ns", "complete_ns"):
                moved = part[column] != 0
                part[column][moved] += shift
            parts.append(part)
    events = np.concatenate(parts)
    events = events[np.lexsort((events["start_ns"], events["rank"]))]
    rows = np.concatenate([trace.ranks] * copies)
    rows["rank"] = np.arange(ranks)
    rows["hostname"] = [f"node{r // world}".encode() for r in range(ranks)]
    grid = {"data": copies, "z": 2, "y": 2, "x": 2}
    options = {**(trace.metadata.get("run_options") or {}), "grid": grid}
    meta = {**trace.metadata, "grid": f"{copies}x2x2x2", "world_size": ranks, "run_options": options}
    step_rows = np.zeros(steps, dtype=trace.steps.dtype)
    step_rows["step"] = np.arange(steps)
    rank_steps = np.zeros(steps * ranks, dtype=trace.rank_steps.dtype)
    rank_steps["step"] = np.repeat(np.arange(steps), ranks)
    rank_steps["rank"] = np.tile(np.arange(ranks), steps)
    return dataclasses.replace(trace, events=events, ranks=rows, metadata=meta, steps=step_rows,
                               rank_steps=rank_steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    load0 = os.getloadavg()
    work = args.dir or tempfile.mkdtemp(prefix="timeline-formats-")
    os.makedirs(work, exist_ok=True)
    try:
        source = source_trace(args, work)
        t = time.perf_counter()
        trace = tile(source, args.ranks, args.steps)
        built = time.perf_counter() - t
        n = len(trace.events)
        print(f"synthetic trace: {args.ranks} ranks x {args.steps} steps x {n / (args.ranks * args.steps):.1f} "
              "events per rank and step (one measured step of the source, gpt-tiny 2x2x2 overlap all) = "
              f"{n:,} events, built in {built:.1f} s")
        walls = {name: [] for name, _, _ in FORMATS}
        cpus = {name: [] for name, _, _ in FORMATS}
        sizes, rss = {}, {}
        for repeat in range(args.repeats):
            order = FORMATS if repeat % 2 == 0 else FORMATS[::-1]
            for name, file, writer in order:
                path = os.path.join(work, file)
                if os.path.exists(path):
                    os.remove(path)
                c0, w0 = os.times(), time.perf_counter()
                writer(trace, path)
                wall, c1 = time.perf_counter() - w0, os.times()
                walls[name].append(wall)
                cpus[name].append((c1.user - c0.user) + (c1.system - c0.system))
                sizes[name] = os.path.getsize(path)
                rss.setdefault(name, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        load1 = os.getloadavg()
        print(f"machine: {os.cpu_count()} CPUs; load average {' '.join(f'{v:.2f}' for v in load0)} at start, "
              f"{' '.join(f'{v:.2f}' for v in load1)} at end; Python {sys.version.split()[0]}; "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        print(f"command: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python -m bench.timeline_formats "
              + " ".join(sys.argv[1:] if argv is None else argv))
        print("bytes/event = file bytes / events; events/s = events / wall s; events/CPU-s = events / "
              f"(user + system s); seconds: median of {args.repeats} writes, alternating order; "
              "RSS: peak of the process after the first write")
        header = (f"{'format':<25}{'events':>12}{'bytes':>15}{'bytes/event':>13}{'write s':>10}{'CPU s':>9}"
                  f"{'events/s':>12}{'events/CPU-s':>14}{'peak RSS MiB':>14}")
        print(header)
        print("-" * len(header))
        for name, _, _ in FORMATS:
            wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
            print(f"{name:<25}{n:>12,}{sizes[name]:>15,}{sizes[name] / n:>13.1f}{wall:>10.1f}{cpu:>9.1f}"
                  f"{n / wall:>12,.0f}{n / cpu:>14,.0f}{rss[name]:>14,.0f}")
        json_size = sizes["Chrome JSON"]
        print("size / JSON size: " + ", ".join(f"{name} {sizes[name] / json_size:.3f}" for name, _, _ in FORMATS[1:]))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
