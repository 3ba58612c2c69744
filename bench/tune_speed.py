"""How long ``fourd-mpi tune`` and ``model predict`` take at 32,768 ranks (target: under 2 s), against the
interpreter's and the command line's own start-up (``fourd-mpi --version``).

Each command is a fresh process, run in alternating rounds (every command once per round), and timed by
wall clock and by CPU (user + sys of the child, from ``getrusage``). The table gives the median with the
range over rounds, the machine's core count and the 1-minute load average before and after.

Usage (from the repository root, ``OMP_NUM_THREADS=1``, on a machine with nothing else running)::

    OMP_NUM_THREADS=1 python -m bench.tune_speed [--rounds 5] [--out results/benchmarks/tune_speed.txt]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: label -> the command's arguments after ``fourd-mpi``
COMMANDS = {
    "tune pipeline": ["tune", "--ranks", "32768", "--model", "gpt-80b", "--batch", "2048", "--profile", "perlmutter",
                      "--algorithm", "pipeline"],
    "tune all": ["tune", "--ranks", "32768", "--model", "gpt-80b", "--batch", "2048", "--profile", "perlmutter",
                 "--algorithm", "all"],
    "model predict": ["model", "predict", "--grid", "64x8x8x8", "--model", "gpt-80b", "--batch", "2048", "--profile",
                      "perlmutter"],
    "--version": ["--version"],
}


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def timed(argv) -> tuple:
    """``(wall s, CPU s)`` of one run of ``argv`` (CPU: the child's user + sys)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    exe = shutil.which("fourd-mpi", path=os.path.dirname(sys.executable)) or shutil.which("fourd-mpi")
    if exe is None:
        print("tune_speed.py: no fourd-mpi beside this interpreter or on PATH", file=sys.stderr)
        return 2
    lines = [f"# bench/tune_speed.py --rounds {args.rounds}: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
             f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
             f"load average before {loadavg()}"]
    lines += [f"#   {label}: fourd-mpi {' '.join(argv)}" for label, argv in COMMANDS.items()]
    got = {label: [] for label in COMMANDS}
    for _ in range(args.rounds):
        for label, argv in COMMANDS.items():
            got[label].append(timed([exe, *argv]))
    lines.append(f"{'command':<15} {'wall s median (range)':>24} {'CPU s median (range)':>24}")
    for label, rows in got.items():
        cells = []
        for i in (0, 1):
            values = [r[i] for r in rows]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"{label:<15} {cells[0]:>24} {cells[1]:>24}")
    lines.append(f"# load average after {loadavg()}; target: tune and model under 2 s at 32,768 ranks")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
