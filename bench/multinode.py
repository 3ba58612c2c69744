"""Across node boundaries on the test bed (docs/multinode.md): placement, overlap and the Slurm launch.

Brings up its own test bed (``bm<pid>``, 2 nodes, ``--rate`` links, Slurm) and always takes it down.
Two parts, each measured **side by side, alternating** (round r runs every case once, then round r+1),
with the 1-minute load average before and after and the exact command of every case:

1. ``placement``: the same grid and model with X inside nodes (``--order block``: consecutive ranks on
   one node, so X is intra-node and Z inter-node) and with X across nodes (``--order cyclic``), and the
   block placement with ``--overlap all``. Per case: the median step time (from the run's summary line:
   median over measured steps of the max over ranks) of each round, the ratio to ``block`` of the same
   round, and the bytes each run put on node 1's link (``testbed status`` counters, both directions).
2. ``launch``: ``--launch-repeats`` two-node Slurm batch jobs of a 4-rank ``fourd-mpi run``, alternating
   ``srun --mpi=pmi2`` and hydra ``mpiexec -iface eth0`` inside the allocation; a job not done in
   ``--launch-timeout`` seconds is cancelled and counted as hung, with the pmi2 plugin's errors counted.

Run as root with ``OMP_NUM_THREADS=1``::

    python bench/multinode.py --output results/benchmarks/multinode.txt
    python bench/multinode.py --repeats 5 --rate 100mbit --hidden 256 --launch-repeats 0
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fourd_mpi.testbed import bed as tb  # noqa: E402

PY = sys.executable


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def fourd(*args, env=None, timeout=900, cwd=None):
    return subprocess.run([PY, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="200mbit", help="each node's link rate (default 200mbit)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of the placement cases (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of gpt-tiny (default 256)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    ap.add_argument("--launch-repeats", type=int, default=4, help="Slurm jobs per launcher (default 4; 0: skip)")
    ap.add_argument("--launch-timeout", type=float, default=90, help="seconds before a job counts as hung")
    ap.add_argument("--rank-repeats", type=int, default=0,
                    help="3. ranking: alternating rounds over every grid of 8 ranks on 2 nodes x 4 (default 0: skip)")
    ap.add_argument("--skip-placement", action="store_true", help="skip part 1")
    ap.add_argument("--output", help="also write the report here")
    args = ap.parse_args()
    why = tb.why_unavailable()
    if why:
        print(f"multinode.py: {why}", file=sys.stderr)
        return 2
    name = f"bm{os.getpid() % 10 ** 7}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "FOURD_TESTBED": name}
    out = []

    def say(line=""):
        print(line, flush=True)
        out.append(line)

    up = fourd("testbed", "up", "--name", name, "--nodes", 2, "--rate", args.rate,
               *(["--slurm"] if args.launch_repeats else []), env=env)
    if up.returncode:
        print(up.stderr, file=sys.stderr)
        return 1
    try:
        say(f"# bench/multinode.py: test bed {name}, 2 nodes, links {args.rate} each way (tbf), "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        say(f"# command: {' '.join(shlex.quote(a) for a in sys.argv)}")
        say(f"# machine: {os.cpu_count()} cores; load average (1 min) at start {load()}")
        if not args.skip_placement:
            placement(args, name, env, say)
        if args.rank_repeats:
            ranking(args, name, env, say)
        if args.launch_repeats:
            launch(args, name, env, say)
        say(f"# load average (1 min) at end {load()}")
    finally:
        fourd("testbed", "down", "--name", name, env=env)
    if args.output:
        Path(args.output).write_text("\n".join(out) + "\n")
    return 0


def placement(args, name, env, say) -> None:
    model = ["--model", "gpt-tiny", "--hidden", args.hidden, "--seq", args.seq, "--batch", args.batch,
             "--steps", args.steps, "--warmup", 1, "--trace-level", "step"]
    cases = {
        "block": (["--order", "block"], []),
        "cyclic": (["--order", "cyclic"], []),
        "block+overlap": (["--order", "block"], ["--overlap", "all"]),
    }
    say()
    say("## 1. placement and overlap: grid 1x2x1x2 (G_z = 2, G_x = 2), 4 ranks, 2 per node, "
        f"gpt-tiny h={args.hidden} seq={args.seq} batch={args.batch}, {args.steps} measured steps")
    results = {c: [] for c in cases}
    node1 = f"{name}-n1"
    with tempfile.TemporaryDirectory() as tmp:
        for case, (order, extra) in cases.items():
            argv = ["testbed", "mpiexec", "-n", 4, "--ppn", 2, *order, "--", PY, "-m", "fourd_mpi", "run",
                    "--gz", 2, "--gx", 2, *model, *extra, "--results-dir", tmp]
            say(f"#   {case}: fourd-mpi {' '.join(map(str, argv[:8]))} -- fourd-mpi run --gz 2 --gx 2 "
                f"{' '.join(map(str, model + extra))}")
        for r in range(args.repeats):
            for case, (order, extra) in cases.items():
                before = tb.link_counters(tb.load_state(name))[node1]
                done = fourd("testbed", "mpiexec", "-n", 4, "--ppn", 2, *order, "--", PY, "-m", "fourd_mpi", "run",
                             "--gz", 2, "--gx", 2, *model, *extra, "--results-dir", tmp, env=env)
                after = tb.link_counters(tb.load_state(name))[node1]
                match = re.search(r"step time: median ([0-9.]+) s", done.stdout)
                axes = dict(re.findall(r"^\s+([xz])\s+2\s+\S+\s+(\S+-node)", done.stdout, re.M))
                if done.returncode or not match:
                    say(f"# {case} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
                    continue
                link = (after["sent"] - before["sent"] + after["received"] - before["received"]) / 1e6
                results[case].append((r, float(match.group(1)), link, axes))
    model = predicted(args)
    say(f"#   model: fourd_mpi.perf.predict with the laptop profile's intra-node level and a nominal inter-node "
        f"level (alpha 100 us, beta = 8/rate s/B, shared by the node's 2 ranks); cyclic = X inter, Z intra")
    say(f"{'case':<15} {'X':<11} {'Z':<11} {'step s per round':<28} {'median s':>9} {'vs block (same round)':>24} "
        f"{'node-1 link MB/run':>19} {'model s':>8} {'model vs block':>15}")
    base = {r: s for r, s, _, _ in results["block"]}
    for case, rows in results.items():
        if not rows:
            continue
        steps = [s for _, s, _, _ in rows]
        ratios = [s / base[r] for r, s, _, _ in rows if r in base]
        axes = rows[0][3]
        ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        say(f"{case:<15} {axes.get('x', '?'):<11} {axes.get('z', '?'):<11} "
            f"{' '.join(f'{s:.3f}' for s in steps):<28} {statistics.median(steps):>9.3f} {ratio:>24} "
            f"{statistics.median(l for _, _, l, _ in rows):>19.1f} {model[case]:>8.3f} "
            f"{model[case] / model['block']:>15.2f}")


def nominal_profile(args, ranks_per_node: int):
    """The laptop profile with the bed's link as its inter-node level (alpha 100 us, beta = 8 / rate)."""
    import yaml

    from fourd_mpi.perf.machine import PROFILES_DIR, load_profile

    data = yaml.safe_load(open(os.path.join(PROFILES_DIR, "laptop.yaml")))
    beta = 8.0 / tb.parse_rate(args.rate)
    data["name"], data["node"]["ranks_per_node"] = "bed-nominal", ranks_per_node
    data["levels"]["inter"] = {"description": f"nominal {args.rate} tbf link", "shared_by": ranks_per_node,
                               **{op: {"alpha_s": 1e-4, "beta_s_per_byte": beta}
                                  for op in ("allgather", "reduce_scatter", "allreduce")}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(data, fh)
    try:
        return load_profile(fh.name)
    finally:
        os.unlink(fh.name)


def ranking(args, name, env, say) -> None:
    """Every grid of 8 ranks (2 nodes x 4, block order): measured median step against the model's."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf import predict as pr
    from fourd_mpi.step.presets import resolve_model

    profile = nominal_profile(args, 4)
    cfg = resolve_model("gpt-tiny", hidden=args.hidden, seq=args.seq, batch=args.batch)
    grids = {}
    for d in (1, 2, 4, 8):
        for z in (1, 2, 4, 8):
            for y in (1, 2, 4, 8):
                x = 8 // (d * z * y) if 8 % (d * z * y) == 0 else 0
                if x:
                    try:
                        grids[f"{d}x{z}x{y}x{x}"] = pr.predict(cfg, GridShape(data=d, z=z, y=y, x=x), profile,
                                                               ranks_per_node=4).step_s
                    except ConfigError:
                        continue
    say()
    say(f"## 3. ranking: every grid of 8 ranks, 2 nodes x 4 (block), gpt-tiny h={args.hidden} seq={args.seq} "
        f"batch={args.batch}, {args.steps} measured steps, {args.rank_repeats} alternating rounds; model: the "
        f"laptop profile with the link's nominal rate as its inter level, ranks_per_node 4")
    say(f"#   each: fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run --gdata D --gz Z --gy Y --gx X --model gpt-tiny "
        f"--hidden {args.hidden} --seq {args.seq} --batch {args.batch} --steps {args.steps} --warmup 1 --trace-level step")
    measured = {g: [] for g in grids}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rank_repeats):
            for g in grids:
                d, z, y, x = g.split("x")
                done = fourd("testbed", "mpiexec", "-n", 8, "--ppn", 4, "--", PY, "-m", "fourd_mpi", "run",
                             "--gdata", d, "--gz", z, "--gy", y, "--gx", x, "--model", "gpt-tiny", "--hidden",
                             args.hidden, "--seq", args.seq, "--batch", args.batch, "--steps", args.steps,
                             "--warmup", 1, "--trace-level", "step", "--results-dir", tmp, env=env)
                match = re.search(r"step time: median ([0-9.]+) s", done.stdout)
                if done.returncode == 0 and match:
                    measured[g].append(float(match.group(1)))
                else:
                    say(f"# {g} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-200:]}")
    rows = [(g, statistics.median(m), grids[g]) for g, m in measured.items() if m]
    rows.sort(key=lambda row: row[1])
    say(f"{'grid':<9} {'measured s':>10} {'rank':>5} {'model s':>8} {'model rank':>10}")
    model_order = sorted(rows, key=lambda row: row[2])
    model_rank = {row[0]: i + 1 for i, row in enumerate(model_order)}
    for i, (g, m, p) in enumerate(rows):
        say(f"{g:<9} {m:>10.3f} {i + 1:>5} {p:>8.3f} {model_rank[g]:>10}")
    if len(rows) > 2:
        from scipy.stats import spearmanr

        rho = spearmanr([m for _, m, _ in rows], [p for _, _, p in rows]).correlation
        best = model_order[0][0]
        say(f"Spearman rank correlation (measured vs model, {len(rows)} grids): {rho:.2f}; the model's best grid "
            f"{best} is measured #{[g for g, _, _ in rows].index(best) + 1}")


def predicted(args) -> dict:
    """The performance model's step time of each placement case, on a nominal profile of the bed."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf import predict as pr
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    profile = nominal_profile(args, 2)
    cfg = resolve_model("gpt-tiny", hidden=args.hidden, seq=args.seq, batch=args.batch)
    grid = GridShape(data=1, z=2, y=1, x=2)
    out = {"block": pr.predict(cfg, grid, profile, ranks_per_node=2).step_s,
           "block+overlap": pr.predict(cfg, grid, profile, OverlapConfig.parse("all"), ranks_per_node=2).step_s}
    original = pr.axis_placement
    pr.axis_placement = lambda g, rpn: {"x": "inter", "y": "-", "z": "intra", "data": "-"}
    try:
        out["cyclic"] = pr.predict(cfg, grid, profile, ranks_per_node=2).step_s
    finally:
        pr.axis_placement = original
    return out


SCRIPT = """#!/bin/bash
#SBATCH --nodes=2 --ntasks=4 --ntasks-per-node=2 --time=5 --output={log}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 UCX_TLS=tcp,self
{launch} {py} -m fourd_mpi run --gz 2 --gx 2 --steps 2 --warmup 1 --trace-level step --results-dir {tmp}
"""


def launch(args, name, env, say) -> None:
    state = tb.load_state(name)
    senv = {**env, "SLURM_CONF": state["slurm"]["conf"], "UCX_TLS": "tcp,self"}
    mpiexec = str(Path(PY).parent / "mpiexec")
    launchers = {"srun --mpi=pmi2": "srun --mpi=pmi2", "mpiexec in allocation": f"{mpiexec} -iface eth0 -n 4"}
    say()
    say(f"## 2. launching a 2-node Slurm job (4 ranks, fourd-mpi run --gz 2 --gx 2 --steps 2): {args.launch_repeats} "
        f"jobs per launcher, alternating; hung = not done in {args.launch_timeout:.0f} s (then scancel)")
    tally = {k: {"ok": 0, "failed": 0, "hung": 0, "pmi2 errors": 0, "s": []} for k in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for k, line in launchers.items():
            say(f"#   {k}: sbatch with: {line} {PY} -m fourd_mpi run --gz 2 --gx 2 --steps 2 --warmup 1 ...")
        for r in range(args.launch_repeats):
            for k, line in launchers.items():
                log = os.path.join(tmp, f"job-{r}-{k.split()[0]}.out")
                script = os.path.join(tmp, "job.sh")
                Path(script).write_text(SCRIPT.format(log=log, launch=line, py=PY, tmp=tmp))
                t0 = time.monotonic()
                job = subprocess.run(["sbatch", "--parsable", script], env=senv, capture_output=True, text=True,
                                     cwd=tmp).stdout.strip().split(";")[0]
                state_ = "?"
                while time.monotonic() - t0 < args.launch_timeout:
                    info = subprocess.run(["scontrol", "show", "job", "-o", job], env=senv, capture_output=True,
                                          text=True).stdout
                    state_ = (re.search(r"JobState=(\S+)", info) or [None, "?"])[1]
                    if state_ in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                        break
                    time.sleep(1)
                took = time.monotonic() - t0
                if state_ == "COMPLETED":
                    tally[k]["ok"] += 1
                    tally[k]["s"].append(took)
                elif state_ in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                    tally[k]["failed"] += 1
                else:
                    tally[k]["hung"] += 1
                    subprocess.run(["scancel", job], env=senv)
                    time.sleep(3)
                text = open(log, errors="replace").read() if os.path.exists(log) else ""
                tally[k]["pmi2 errors"] += text.count("invalid client request")
    say(f"{'launcher':<24} {'completed':>9} {'failed':>7} {'hung':>5} {'pmi2 plugin errors':>19} "
        f"{'median s to completion':>23}")
    for k, t in tally.items():
        med = f"{statistics.median(t['s']):.1f}" if t["s"] else "-"
        say(f"{k:<24} {t['ok']:>9} {t['failed']:>7} {t['hung']:>5} {t['pmi2 errors']:>19} {med:>23}")


if __name__ == "__main__":
    sys.exit(main())
