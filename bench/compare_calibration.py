"""Calibration of ``fourd-mpi compare`` on this machine: false changes between identical runs, and the
detection of a planted slowdown.

For each of ``--pairs`` pairs, ``--runs`` baseline runs (A) and ``--runs`` new runs (B) of one configuration
are made in the counterbalanced order A B B A A B B A ... (a drift of the machine's load, and any
advantage of running first or second, hits both sides alike), each a
separate ``mpiexec`` of ``fourd-mpi run`` writing a step-level trace. Then, with ``compare``'s statistics at
their defaults (threshold 5 %, alpha 0.05, unit ``auto``: the runs' medians when both sides have enough
runs; :mod:`fourd_mpi.analysis.compare`), on the samples ``compare`` itself reads (``step_stats`` of each
trace, the index entry of each trace):

- **identical**: B against A. Any verdict other than ``same`` is a false change;
- **planted**: B with every step time multiplied by ``1 + --slowdown`` against A. A verdict other than
  ``slower`` is a miss. The slowdown is planted on real runs (their noise scaled with them, which is
  harder to detect than a constant delay added to each step), because ``fourd-mpi run`` has no option to
  slow itself down by a known fraction;
- for contrast, **identical, steps**: B against A with ``unit="step"`` (every step a sample, the
  default before issue 32).

Usage (from the repository root; runs ``.venv/bin/mpiexec`` and ``.venv/bin/fourd-mpi``)::

    OMP_NUM_THREADS=1 python bench/compare_calibration.py [--pairs 20] [--runs 5] [--steps 42]
        [--slowdown 0.15] [--ranks 2] [--out results/benchmarks/compare_calibration.txt]

The table names the command, the machine (``nproc``) and the load average before and after.
``--save FILE.json`` keeps every run's step times (and the load average around each pair);
``--from FILE.json`` analyses saved runs again without running anything (the statistics are
deterministic: the bootstrap has a fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fourd_mpi.analysis.compare import Settings, compare_runs, min_runs  # noqa: E402
from fourd_mpi.results.index import entry_of_trace  # noqa: E402
from fourd_mpi.trace.read import load_trace  # noqa: E402
from fourd_mpi.trace.summary import step_stats  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run_command(args, results: str, run_id: str):
    bin_dir = REPO / ".venv" / "bin"
    return [str(bin_dir / "mpiexec"), "-n", str(args.ranks), str(bin_dir / "fourd-mpi"), "run", "--gx",
            str(args.ranks), "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--trace-level", "step", "--results-dir", results, "--run-id", run_id, "--display", "quiet",
            "--peak-tflops", "1"]


def one_run(args, results: str, run_id: str):
    """``(entry, per-step times, path)`` of a fresh run, as ``compare`` loads it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(run_command(args, results, run_id), env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"run {run_id} failed: {proc.stderr.strip()[-500:]}")
    path = os.path.join(results, f"{run_id}.h5")
    trace = load_trace(path)
    return entry_of_trace(trace, results), step_stats(trace).per_step_s, path


def scaled(runs, factor: float):
    return [(dict(e, run_id=e["run_id"] + "-planted"), s * factor, p) for e, s, p in runs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--runs", type=int, default=12, help="runs per side of a pair")
    p.add_argument("--steps", type=int, default=42)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--slowdown", type=float, default=0.15)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--save", default=None, help="keep every run's step times in this JSON file")
    p.add_argument("--from", dest="source", default=None, help="analyse the runs saved in this JSON file")
    args = p.parse_args()
    saved = json.loads(Path(args.source).read_text()) if args.source else None
    if saved is not None:
        for key in ("pairs", "runs", "steps", "warmup", "ranks", "model"):
            setattr(args, key, saved["args"][key])
    settings = Settings(resamples=args.resamples)
    steps_settings = Settings(resamples=args.resamples, unit="step")
    work = tempfile.mkdtemp(prefix="compare-calibration-")
    command = (saved["command"] + f"  (analysed again: {' '.join(sys.argv[1:])})" if saved else
               " ".join(["OMP_NUM_THREADS=1", "python", "bench/compare_calibration.py"] + sys.argv[1:]))
    record = {"command": command, "args": {k: getattr(args, k) for k in ("pairs", "runs", "steps", "warmup",
                                                                        "ranks", "model")},
              "load_before": loadavg() if saved is None else saved["load_before"], "pairs": []}
    lines = [f"# compare calibration: {command}",
             f"# each run: {' '.join(run_command(args, 'DIR', 'ID')[0:1])} ... "
             + " ".join(run_command(args, "DIR", "ID")[2:]),
             f"# {args.pairs} pairs x {args.runs} baseline (A) + {args.runs} new (B) runs, order A B B A A B B A; "
             f"{os.cpu_count()} cores (nproc --all); load average before {record['load_before']}",
             f"# statistics: compare's defaults: {settings.statistics_text()}",
             f"# identical = B vs A; planted = B x {1 + args.slowdown:g} vs A (every step time scaled); steps = B vs "
             f"A with unit step (every step a sample, the old default); run-level test needs {min_runs(0.05)} runs "
             f"per side",
             "pair  A median ms  B median ms  identical: ratio  p       verdict  | planted: ratio  p       verdict  "
             "| steps: ratio  p        verdict  load (1 min) around the pair"]
    print("\n".join(lines), flush=True)
    false_changes = misses = step_false = 0
    started = time.time()
    try:
        for pair in range(args.pairs):
            results = os.path.join(work, f"pair{pair:02d}")
            a, b = [], []
            if saved is not None:
                for side, out in (("a", a), ("b", b)):
                    for i, samples in enumerate(saved["pairs"][pair][side]):
                        out.append(({"config_key": "0" * 16, "run_id": f"p{pair:02d}-{side}{i}", "model": args.model,
                                     "grid": f"1x1x1x{args.ranks}", "world_size": args.ranks, "algorithm": "axonn4d"},
                                    np.asarray(samples), f"p{pair:02d}-{side}{i}.h5"))
                load = saved["pairs"][pair]["load"]
            else:
                load = [loadavg()]
                for i in range(args.runs):
                    order = ("a", "b") if i % 2 == 0 else ("b", "a")  # A B B A A B B A ...
                    for side in order:
                        (a if side == "a" else b).append(one_run(args, results, f"p{pair:02d}-{side}{i}"))
                load.append(loadavg())
            record["pairs"].append({"a": [s.tolist() for _, s, _ in a], "b": [s.tolist() for _, s, _ in b],
                                    "load": load})
            same = compare_runs(b, a, settings)[0]
            planted = compare_runs(scaled(b, 1 + args.slowdown), a, settings)[0]
            steps = compare_runs(b, a, steps_settings)[0]
            false_changes += same.verdict != "same"
            misses += planted.verdict != "slower"
            step_false += steps.verdict != "same"
            am = 1e3 * np.median([np.median(s) for _, s, _ in a])
            bm = 1e3 * np.median([np.median(s) for _, s, _ in b])
            row = (f"{pair:4d}  {am:11.3f}  {bm:11.3f}  {same.ratio:16.3f}  {same.p_value:<6.3g}  {same.verdict:7s}  | "
                   f"{planted.ratio:14.3f}  {planted.p_value:<6.3g}  {planted.verdict:7s}  | {steps.ratio:12.3f}  "
                   f"{steps.p_value:<7.2g}  {steps.verdict:7s}  load {load[0].split()[0]}-{load[1].split()[0]}")
            lines.append(row)
            print(row, flush=True)
            shutil.rmtree(results, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tail = [f"# identical runs called a change: {false_changes} of {args.pairs} (target: at most 1)",
            f"# planted {100 * args.slowdown:g} % slowdown found (slower): {args.pairs - misses} of {args.pairs} "
            f"(target: at least 19)",
            f"# for contrast, identical runs called a change with steps as samples: {step_false} of {args.pairs}",
            f"# load average after {loadavg() if saved is None else saved['load_after']}; "
            f"{time.time() - started if saved is None else saved['seconds']:.0f} s of runs"]
    record.update(load_after=loadavg(), seconds=time.time() - started)
    if args.save and saved is None:
        Path(args.save).write_text(json.dumps(record))
    lines += tail
    print("\n".join(tail))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
