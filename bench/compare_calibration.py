"""Calibration of ``fourd-mpi compare`` on this machine: false changes between identical runs, and the
detection of a planted slowdown, unpaired (runs as samples) and paired (neighbouring runs).

For each of ``--pairs`` pairs, ``--runs`` baseline runs (A) and ``--runs`` new runs (B) of one configuration
are made in the counterbalanced order A B B A A B B A ... (a drift of the machine's load, and any
advantage of running first or second, hits both sides alike), each a
separate ``mpiexec`` of ``fourd-mpi run`` writing a step-level trace. Then, with ``compare``'s statistics
(threshold 5 %, alpha 0.05; :mod:`fourd_mpi.analysis.compare`), on the samples ``compare`` itself reads
(``step_stats`` of each trace, the index entry of each trace, whose ``time`` is the run's start time):

- **identical**: B against A. Any verdict other than ``same`` is a false change;
- **planted**: B with every step time multiplied by ``1 + --slowdown`` against A. A verdict other than
  ``slower`` is a miss. The slowdown is planted on real runs (their noise scaled with them, which is
  harder to detect than a constant delay added to each step), because ``fourd-mpi run`` has no option to
  slow itself down by a known fraction;

each with two units: **runs** (``unit="run"``: the runs' medians, two independent samples, Mann-Whitney U)
and **paired** (``unit="paired"``: each B with the A next to it in start time, Wilcoxon signed-rank on the
log ratios; what ``unit="auto"`` picks for these interleaved runs from 6 runs a side); and, for contrast,
**identical, steps**: B against A with ``unit="step"`` (every step a sample, the former default).

Usage (from the repository root; runs ``.venv/bin/mpiexec`` and ``.venv/bin/fourd-mpi``)::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.compare_calibration [--pairs 20] [--runs 12] [--steps 42]
        [--slowdown 0.15] [--ranks 2] [--out FILE.txt] [--save FILE.json] [--from FILE.json]

**The calibration** (targets: at most 1 false change in 20 identical pairs, the planted 15 %
found in at least 19 of 20) needs a quiet machine: nothing else running (``uptime``'s load average below
1 on 2 cores before the start), a step of about 20 ms and one core left to the system (on this 2-core
machine: one rank; with both cores running ranks the detection stays at 15-20 of 20,
docs/guide/regressions.md), then::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.compare_calibration --pairs 20 --runs 12 --ranks 1 --steps 22 \\
        --run-args "--hidden 128 --seq 64 --batch 8" \\
        --save results/benchmarks/compare_calibration_runs.json.gz --out results/benchmarks/compare_calibration.txt

(581 s on 2026-11-26, load average 1.0-1.2.)

It makes 20 x 24 = 480 runs of 44 steps. Timed: one pair (``--pairs 1 --runs 12 --steps 42``) took 88 s at
load average 13-10 (2026-11-25 21:29 UTC, other jobs running: about 30 minutes for 20 pairs at that load);
the last full calibration took 646 s at load 2-10 (32 s a pair). With no other job and pinned ranks
(2026-11-26): 372 s at 12 runs a side, 679 s at 20.

The table names the command, the machine (``nproc``) and the load average before and after.
``--save FILE.json`` (or ``FILE.json.gz``, compressed) keeps every run's step times and start time (and
the load average around each pair); ``--from FILE.json`` analyses saved runs again without running
anything (the statistics are deterministic: the bootstrap has a fixed seed). Runs saved without start
times (before the paired design) get start times from the order they were made in (A B B A ..., 1 s
apart), which is all the pairing uses.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from fourd_mpi.analysis.compare import Settings, compare_runs, min_pairs, min_runs
from fourd_mpi.trace.indexing import entry_of_trace
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.summary import step_stats


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_command(args, results: str, run_id: str):
    bin_dir = REPO / ".venv" / "bin"
    bind = [] if args.bind == "none" else ["-bind-to", args.bind]
    return [str(bin_dir / "mpiexec"), "-n", str(args.ranks), *bind, str(bin_dir / "fourd-mpi"), "run", "--gx",
            str(args.ranks), "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--trace-level", "step", "--results-dir", results, "--run-id", run_id, "--display", "quiet",
            "--peak-tflops", "1", *shlex.split(args.run_args)]


def start_iso(position: int) -> str:
    """A start time for a run saved without one: its position in the order the runs were made, in seconds."""
    import datetime

    origin = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
    return (origin + datetime.timedelta(seconds=position)).isoformat(timespec="milliseconds")


def made_order(runs: int):
    """``(side, index)`` of the runs of a pair in the order they are made: A B B A A B B A ..."""
    for i in range(runs):
        for side in (("a", "b") if i % 2 == 0 else ("b", "a")):
            yield side, i


def one_run(args, results: str, run_id: str):
    """``(entry, per-step times, path)`` of a fresh run, as ``compare`` loads it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(run_command(args, results, run_id), env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"run {run_id} failed: {proc.stderr.strip()[-500:]}")
    path = os.path.join(results, f"{run_id}.h5")
    trace = load_trace(path)
    return entry_of_trace(trace, results), step_stats(trace).per_step_s, path


def read_saved(path: str) -> str:
    """A saved calibration's JSON text (``.gz``: gzip-compressed)."""
    return gzip.decompress(Path(path).read_bytes()).decode() if path.endswith(".gz") else Path(path).read_text()


def write_saved(path: str, record: dict) -> None:
    """Save ``record`` as JSON, step times to the nanosecond the traces hold (``.gz``: gzip-compressed)."""
    for pair in record["pairs"]:
        for side in ("a", "b"):
            pair[side] = [[round(t, 9) for t in run] for run in pair[side]]
    text = json.dumps(record)
    if path.endswith(".gz"):
        Path(path).write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        Path(path).write_text(text)


def scaled(runs, factor: float):
    return [(dict(e, run_id=e["run_id"] + "-planted"), s * factor, p) for e, s, p in runs]


VERDICT_UNITS = (("run", "identical"), ("paired", "identical"), ("run", "planted"), ("paired", "planted"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--runs", type=int, default=12, help="runs per side of a pair")
    p.add_argument("--steps", type=int, default=42)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--run-args", default="", help="more fourd-mpi run options, one string (e.g. \"--hidden 128 "
                   "--seq 64 --batch 8\": a 22 ms step instead of gpt-tiny's 4 ms)")
    p.add_argument("--slowdown", type=float, default=0.15)
    p.add_argument("--bind", default="core", help="Hydra's -bind-to for each run (core: one rank per core, as a "
                   "batch system pins them; none: the kernel may put both ranks on one core for a while)")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--save", default=None, help="keep every run's step times and start time in this JSON file")
    p.add_argument("--from", dest="source", default=None, help="analyse the runs saved in this JSON file")
    args = p.parse_args()
    saved = json.loads(read_saved(args.source)) if args.source else None
    if saved is not None:
        for key in ("pairs", "runs", "steps", "warmup", "ranks", "model"):
            setattr(args, key, saved["args"][key])
        args.run_args = saved["args"].get("run_args", "")
        args.bind = saved["args"].get("bind", "none")
    settings = {unit: Settings(resamples=args.resamples, unit=unit) for unit in ("run", "paired", "step", "auto")}
    work = tempfile.mkdtemp(prefix="compare-calibration-")
    command = (saved["command"] + f"  (analysed again: {' '.join(sys.argv[1:])})" if saved else
               "OMP_NUM_THREADS=1 python -m bench.compare_calibration " + shlex.join(sys.argv[1:]))
    record = {"command": command, "args": {k: getattr(args, k) for k in ("pairs", "runs", "steps", "warmup",
                                                                        "ranks", "model", "bind", "run_args")},
              "load_before": loadavg() if saved is None else saved["load_before"], "pairs": []}
    untimed = saved is not None and "a_times" not in saved["pairs"][0]
    lines = [f"# compare calibration: {command}",
             f"# each run: {' '.join(run_command(args, 'DIR', 'ID')[0:1])} ... "
             + " ".join(run_command(args, "DIR", "ID")[2:]),
             f"# {args.pairs} pairs x {args.runs} baseline (A) + {args.runs} new (B) runs, order A B B A A B B A; "
             f"{os.cpu_count()} cores (nproc --all); load average before {record['load_before']}",
             f"# runs: {settings['run'].statistics_text()}",
             f"# {settings['paired'].statistics_text()}",
             f"# identical = B vs A; planted = B x {1 + args.slowdown:g} vs A (every step time scaled); steps = B vs "
             f"A with unit step (every step a sample, the old default); the run-level test needs {min_runs(0.05)} runs "
             f"per side, the paired one {min_pairs(0.05)} pairs"]
    if untimed:
        lines.append("# these runs were saved without start times: each gets its position in the order A B B A ... "
                     "(1 s apart), which is all the pairing uses")
    lines.append("pair  A median ms  B median ms  identical: runs ratio p verdict; paired ratio p verdict | planted: "
                 "runs ratio p verdict; paired ratio p verdict | steps: ratio p verdict | load (1 min) around the pair")
    print("\n".join(lines), flush=True)
    wrong = {key: 0 for key in VERDICT_UNITS}
    step_false = 0
    auto_units = set()
    started = time.time()
    try:
        for pair in range(args.pairs):
            results = os.path.join(work, f"pair{pair:02d}")
            a, b = [], []
            if saved is not None:
                rec = saved["pairs"][pair]
                times = {"a": rec.get("a_times"), "b": rec.get("b_times")}
                if untimed:
                    times = {"a": [None] * args.runs, "b": [None] * args.runs}
                    for position, (side, i) in enumerate(made_order(args.runs)):
                        times[side][i] = start_iso(position)
                for side, out in (("a", a), ("b", b)):
                    for i, samples in enumerate(rec[side]):
                        out.append(({"config_key": "0" * 16, "run_id": f"p{pair:02d}-{side}{i}", "model": args.model,
                                     "grid": f"1x1x1x{args.ranks}", "world_size": args.ranks, "algorithm": "axonn4d",
                                     "time": times[side][i]}, np.asarray(samples), f"p{pair:02d}-{side}{i}.h5"))
                load = rec["load"]
            else:
                load = [loadavg()]
                made = {"a": {}, "b": {}}
                for side, i in made_order(args.runs):
                    made[side][i] = one_run(args, results, f"p{pair:02d}-{side}{i}")
                a = [made["a"][i] for i in range(args.runs)]
                b = [made["b"][i] for i in range(args.runs)]
                load.append(loadavg())
            record["pairs"].append({"a": [s.tolist() for _, s, _ in a], "b": [s.tolist() for _, s, _ in b],
                                    "a_times": [e["time"] for e, _, _ in a], "b_times": [e["time"] for e, _, _ in b],
                                    "load": load})
            sides = {"identical": b, "planted": scaled(b, 1 + args.slowdown)}
            got = {(unit, what): compare_runs(sides[what], a, settings[unit])[0] for unit, what in VERDICT_UNITS}
            auto_units.add(compare_runs(b, a, settings["auto"])[0].unit)
            steps = compare_runs(b, a, settings["step"])[0]
            for (unit, what), c in got.items():
                wrong[(unit, what)] += c.verdict != ("same" if what == "identical" else "slower")
            step_false += steps.verdict != "same"
            am = 1e3 * np.median([np.median(s) for _, s, _ in a])
            bm = 1e3 * np.median([np.median(s) for _, s, _ in b])

            def cell(c) -> str:
                return f"{c.ratio:6.3f} {c.p_value:<7.2g} {c.verdict:7s}"

            row = (f"{pair:4d}  {am:11.3f}  {bm:11.3f}  {cell(got[('run', 'identical')])}; "
                   f"{cell(got[('paired', 'identical')])} | {cell(got[('run', 'planted')])}; "
                   f"{cell(got[('paired', 'planted')])} | {cell(steps)} | "
                   f"load {load[0].split()[0]}-{load[1].split()[0]}")
            lines.append(row)
            print(row, flush=True)
            shutil.rmtree(results, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = args.pairs
    tail = [f"# identical runs called a change: runs {wrong[('run', 'identical')]} of {n}, paired "
            f"{wrong[('paired', 'identical')]} of {n} (target: at most 1)",
            f"# planted {100 * args.slowdown:g} % slowdown found (slower): runs {n - wrong[('run', 'planted')]} of "
            f"{n}, paired {n - wrong[('paired', 'planted')]} of {n} (target: at least 19)",
            f"# compare --unit auto (the default) chose for these runs: {', '.join(sorted(auto_units))}",
            f"# for contrast, identical runs called a change with steps as samples: {step_false} of {n}",
            f"# load average after {loadavg() if saved is None else saved['load_after']}; "
            f"{time.time() - started if saved is None else saved['seconds']:.0f} s of runs"]
    record.update(load_after=loadavg(), seconds=time.time() - started)
    if args.save and saved is None:
        write_saved(args.save, record)
    lines += tail
    print("\n".join(tail))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
