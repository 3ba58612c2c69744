"""Across node boundaries on the test bed (docs/multinode.md): calibration, placement, overlap against a
link, the ranking of every grid, the algorithms side by side, and the Slurm launch.

Brings up its own test bed (``bm<pid>``, 2 nodes, or 4 when a 4 x 2 layout is asked for, ``--rate``
links, Slurm when the launch part runs) and always takes it down. Every comparison is measured **side by
side, alternating** (round r runs every case once, then round r+1), with the 1-minute load average before
and after and the exact command of every case. The model's figures use only profiles that
``fourd-mpi bench collectives`` measured on the bed itself (part 0), never a step time.

0. ``calibration``: ``bench collectives`` on each rank layout used below (nodes x ranks per node), written
   as a machine profile (alpha-beta fits and the measured points the model interpolates; the fits' rms
   error is printed) and copied next to ``--output`` when given.
1. ``placement``: the same grid and model with X inside nodes (``--order block``: consecutive ranks on
   one node, so X is intra-node and Z inter-node) and with X across nodes (``--order cyclic``), and the
   block placement with ``--overlap all``; per case the median step time of each round (from the run's
   summary line: median over measured steps of the max over ranks), the ratio to ``block`` of the same
   round, the bytes on node 1's link, and the model's step and ratio.
2. ``overlap``: one axis of size 2 across the link (``--overlap-axis``: data, or z), one rank per node:
   ``--overlap none`` and ``--overlap all`` with each ``--progress`` mode, and the compute-only time
   (the same run with both ranks on one node, less its exposed communication) and communication-only
   time (the ``--overlap none`` run's exposed communication), both from the traces (``analyze --what
   breakdown``); the overlapped step / max(compute, communication) and the share of the communication
   hidden. ``--overlap-batch 32,64,128`` sweeps the batch: the same communication against growing compute.
3. ``ranking``: every grid of 8 ranks on each ``--rank-layouts`` layout, measured median step against
   the model's (the layout's calibrated profile); Spearman and where the model's best grid is measured.
4. ``algorithms``: the tuner's best configuration of each algorithm (``tune --algorithm all`` on the
   2 x 4 profile), measured side by side; the measured and the predicted order.
5. ``launch``: ``--launch-repeats`` two-node Slurm batch jobs of a 4-rank ``fourd-mpi run``, alternating
   ``srun --mpi=pmi2`` and hydra ``mpiexec -iface eth0`` inside the allocation; a job not done in
   ``--launch-timeout`` seconds is cancelled and counted as hung, with the pmi2 plugin's errors counted.

``--from-results FILE`` (offline, no bed, no MPI, not root): part 3 again from a committed report and the
profiles kept next to it (``<report>-profile-NxP.yaml``, e.g. ``multinode-profile-2x4.yaml``): per grid the
measured step, the model's step, its compute and exposed communication per axis (level, ``g`` = the group's
ranks per node, and which measured points priced it), Spearman and whether the model's best grid is within the
measured best two.
The measured step times are the report's; only the model is computed again (``--profile-dir DIR``: with the
profiles of DIR, e.g. measured again by ``bench collectives`` on the bed).

Run as root with ``OMP_NUM_THREADS=1``::

    python bench/multinode.py --output results/benchmarks/multinode.txt
    python bench/multinode.py --repeats 5 --rate 100mbit --hidden 256 --launch-repeats 0
    python bench/multinode.py --from-results results/benchmarks/multinode.txt

A quick look (one round, 2 steps of which 1 is measured, a calibration of small messages; about a minute):
``--repeats 1 --steps 2 --launch-repeats 0 --calibration "--max-size 32K --iters 3 --min-time 0"``. A run whose
case fails still writes the report, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import command_line  # noqa: E402
from fourd_mpi.testbed import bed as tb  # noqa: E402

PY = sys.executable


#: the runs of this invocation that failed: the report is still written, and the exit status is 1
FAILED = []


def failed(say, line: str) -> None:
    FAILED.append(line)
    say(line)


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
                    help="3. ranking: alternating rounds over every grid of 8 ranks (default 0: skip)")
    ap.add_argument("--rank-layouts", default="2x4",
                    help="3. ranking: comma list of NODESxPPN layouts of 8 ranks (default 2x4; e.g. 2x4,4x2)")
    ap.add_argument("--overlap-repeats", type=int, default=0,
                    help="2. overlap: alternating rounds (default 0: skip)")
    ap.add_argument("--overlap-hidden", type=int, default=512, help="2. overlap: hidden size (default 512)")
    ap.add_argument("--overlap-batch", default="16",
                    help="2. overlap: global batch, or a comma list swept in one run (default 16; e.g. 32,64,128: "
                         "the same communication against 1x, 2x, 4x the compute)")
    ap.add_argument("--overlap-layers", type=int, default=None,
                    help="2. overlap: transformer blocks (default gpt-tiny's): the first gather and the last "
                         "reduce-scatter of a pass have no compute to hide behind, 1/layers of the traffic")
    ap.add_argument("--overlap-poll-flops", default="auto",
                    help="2. overlap: --poll-flops of the poll case, or a comma list, one poll case each (default "
                         "auto, run's default; e.g. auto,1e7,1e9: a poll costs host time, and too few let TCP's "
                         "buffers run dry)")
    ap.add_argument("--overlap-ppn", type=int, choices=(1, 2), default=1,
                    help="2. overlap: ranks per node of the overlapped cases (default 1: the axis crosses the link; "
                         "2: both ranks on one node, shared memory, the one-node counterpart)")
    ap.add_argument("--overlap-axis", choices=("data", "z"), default="data",
                    help="2. overlap: the axis of size 2 across the link (default data: gradient all-reduces, "
                         "issued in backward; z: weight all-gathers in forward and backward, gradient "
                         "reduce-scatters in backward, which compute in both passes can hide)")
    ap.add_argument("--algorithm-repeats", type=int, default=0,
                    help="4. algorithms: alternating rounds (default 0: skip)")
    ap.add_argument("--calibration", metavar="OPTIONS", default="",
                    help="0. calibration: more fourd-mpi bench collectives options, after the defaults (the later "
                         "one wins), e.g. \"--max-size 32K --iters 3 --min-time 0\" for a quick look (default: "
                         f"{' '.join(CALIBRATION)})")
    ap.add_argument("--skip-placement", action="store_true", help="skip part 1")
    ap.add_argument("--output", help="also write the report here")
    ap.add_argument("--from-results", metavar="FILE",
                    help="offline: part 3's model again from a committed report FILE and the profiles next to it "
                         "(no bed, no MPI)")
    ap.add_argument("--profile-dir", metavar="DIR",
                    help="--from-results: take <report>-profile-NxP.yaml from DIR instead (profiles measured again)")
    args = ap.parse_args()
    if args.from_results:
        return from_results(args.from_results, args.profile_dir)
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

    layouts = [tuple(int(v) for v in text.split("x")) for text in args.rank_layouts.split(",")] \
        if args.rank_repeats else []
    nodes = max([2] + [n for n, _ in layouts])
    up = fourd("testbed", "up", "--name", name, "--nodes", nodes, "--rate", args.rate,
               *(["--slurm"] if args.launch_repeats else []), env=env)
    if up.returncode:
        print(up.stderr, file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="multinode-")
    try:
        say(f"# bench/multinode.py: test bed {name}, {nodes} nodes, links {args.rate} each way (tbf), "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        say(f"# command: {command_line()}")
        say(f"# machine: {os.cpu_count()} cores; load average (1 min) at start {load()}")
        needed = set(layouts)
        if not args.skip_placement:
            needed.add((2, 2))
        overlap_layout = (2, 1) if args.overlap_ppn == 1 else (1, 2)
        if args.overlap_repeats:
            needed.add(overlap_layout)
        if args.algorithm_repeats:
            needed.add((2, 4))
        if needed:
            say()
            say("## 0. calibration: fourd-mpi bench collectives on the bed, one profile per layout (nodes x ranks "
                "per node) used below")
        profiles = {lay: calibrate(args, name, env, say, lay, tmp) for lay in sorted(needed)}
        if not args.skip_placement:
            placement(args, name, env, say, profiles[(2, 2)])
        if args.overlap_repeats:
            overlap(args, name, env, say, profiles[overlap_layout])
        for lay in layouts:
            ranking(args, name, env, say, lay, profiles[lay])
        if args.algorithm_repeats:
            algorithms(args, name, env, say, profiles[(2, 4)])
        if args.launch_repeats:
            launch(args, name, env, say)
        say(f"# load average (1 min) at end {load()}")
    finally:
        fourd("testbed", "down", "--name", name, env=env)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.output:
        Path(args.output).write_text("\n".join(out) + "\n")
    if FAILED:
        print(f"multinode.py: {len(FAILED)} run(s) failed (the lines '... failed (STATUS): ...' above)",
              file=sys.stderr)
        return 1
    return 0


def placement(args, name, env, say, profile_path) -> None:
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
                axes = placement_of(done.stdout, ("x", "z"))
                if done.returncode or not match:
                    failed(say, f"# {case} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
                    continue
                link = (after["sent"] - before["sent"] + after["received"] - before["received"]) / 1e6
                results[case].append((r, float(match.group(1)), link, axes))
    model = predicted(args, profile_path)
    say(f"#   model: fourd_mpi.perf.predict with the 2 x 2 calibrated profile (part 0); cyclic = X inter, Z intra")
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


def placement_of(stdout: str, axes) -> dict:
    """``axis -> "intra-node" | "inter-node"`` of ``axes`` (each of size > 1) from a run's output: the full
    configuration's axis table where printed (``--show-config``), else the header's ``axes across nodes: ...``."""
    table = dict(re.findall(r"^\s+([a-z]+)\s+\d+\s+\S+\s+(\S+-node)", stdout, re.M))
    if all(a in table for a in axes):
        return {a: table[a] for a in axes}
    m = re.search(r"axes across nodes: ([a-z, ]+?)\s*$", stdout, re.M)
    if not m:
        return {}
    across = {a.strip() for a in m.group(1).split(",")}
    return {a: "inter-node" if a in across else "intra-node" for a in axes}


#: --accept-poor-fit: the bed's inter-node links are shaped by tbf, whose bursts pass small messages at once and
#: make the alpha-beta fits miss their measurements by 59-74 % rms (over bench collectives' 25 % limit); the model
#: uses the profile's measured points (levels.L.measured) first, which is what this benchmark needs.
#: --iters 5 --min-time 0.1: at least 5 iterations and 0.1 s per size (a 2 MiB all-reduce over a 200 Mbit/s
#: link takes 0.1-0.3 s, so 20 of each would make one layout's calibration about 10 minutes)
CALIBRATION = ["--min-size", "2K", "--factor", "4", "--max-size", "2M", "--iters", "5", "--min-time", "0.1",
               "--accept-poor-fit"]


def kept_profile(report: str, nodes: int, ppn: int, reading: bool = False) -> str:
    """Where the profile of layout ``nodes x ppn`` measured for ``report`` is kept: next to it, named after it
    (``multinode.txt``: ``multinode-profile-2x4.yaml``), so two reports never share one. Reading a report kept
    before this rule (``multinode-ranking/multinode-ranking.txt``; ``reading``), the older
    ``multinode-profile-NxP.yaml`` next to it when only that exists; a new profile never overwrites it."""
    stem = os.path.splitext(os.path.abspath(report))[0]
    named = f"{stem}-profile-{nodes}x{ppn}.yaml"
    older = os.path.join(os.path.dirname(stem), f"multinode-profile-{nodes}x{ppn}.yaml")  # reports before the rule
    return older if reading and not os.path.exists(named) and os.path.exists(older) else named


def calibrate(args, name, env, say, layout, tmp) -> str:
    """``bench collectives`` on ``layout`` (nodes, ranks per node) of the bed; the profile's path."""
    nodes, ppn = layout
    path = os.path.join(tmp, f"bed-{nodes}x{ppn}.yaml")
    options = [*CALIBRATION, *shlex.split(args.calibration)]
    argv = ["testbed", "mpiexec", "--name", name, "-n", nodes * ppn, "--ppn", ppn, "--", PY, "-m", "fourd_mpi",
            "bench", "collectives", *options, "-o", path, "--name", f"bed-{nodes}x{ppn}", "--fallback", "laptop"]
    say(f"#   {nodes} x {ppn}: fourd-mpi testbed mpiexec -n {nodes * ppn} --ppn {ppn} -- fourd-mpi bench collectives "
        f"{shlex.join(options)} -o bed-{nodes}x{ppn}.yaml --fallback laptop")
    done = fourd(*argv, env=env, timeout=3600)
    if done.returncode or not os.path.exists(path):
        say(f"#   failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        raise SystemExit(1)
    tail = done.stdout[done.stdout.find("machine profile"):].splitlines()[1:]
    for line in tail:
        if line.strip():
            say(f"#     {line.strip()}")
    if args.output:
        keep = kept_profile(args.output, nodes, ppn)
        shutil.copyfile(path, keep)
        say(f"#     kept as {os.path.relpath(keep, ROOT)}")
    return path


def _profile(path):
    from fourd_mpi.perf.machine import load_profile

    return load_profile(path)


def _step(done):
    match = re.search(r"step time: median ([0-9.]+) s", done.stdout)
    return float(match.group(1)) if done.returncode == 0 and match else None


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).correlation)


def every_grid(ranks: int = 8) -> list:
    """Every 4D grid ``DxZxYxX`` of ``ranks`` ranks (powers of two), in ``ranking``'s order."""
    out = []
    for d in (1, 2, 4, 8):
        for z in (1, 2, 4, 8):
            for y in (1, 2, 4, 8):
                x = ranks // (d * z * y) if ranks % (d * z * y) == 0 else 0
                if x:
                    out.append(f"{d}x{z}x{y}x{x}")
    return out


def model_steps(profile, ppn: int, hidden: int, seq: int, batch: int, grids) -> dict:
    """``grid -> Prediction`` of gpt-tiny on each grid the profile can price (block placement, ``ppn`` ranks
    per node; :func:`fourd_mpi.perf.predict.predict`, overlap none as the runs)."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf import predict as pr
    from fourd_mpi.step.presets import resolve_model

    cfg = resolve_model("gpt-tiny", hidden=hidden, seq=seq, batch=batch)
    out = {}
    for g in grids:
        d, z, y, x = map(int, g.split("x"))
        try:
            out[g] = pr.predict(cfg, GridShape(data=d, z=z, y=y, x=x), profile, ranks_per_node=ppn)
        except ConfigError:
            continue
    return out


def rank_summary(rows) -> dict:
    """``rows``: ``(grid, measured s, model s)``. Spearman's rank correlation of measured and model
    (``scipy.stats.spearmanr``), the model's best grid (smallest model step), its measured position (1 = the
    fastest measured) and ``within_two``: that position is 1 or 2 (the target: the model's best grid among
    the two fastest measured)."""
    by_measured = sorted(rows, key=lambda r: r[1])
    best = min(rows, key=lambda r: r[2])[0]
    position = [g for g, _, _ in by_measured].index(best) + 1
    return {"spearman": _spearman([m for _, m, _ in rows], [p for _, _, p in rows]), "best": best,
            "position": position, "within_two": position <= 2}


def axis_terms(prediction, profile, ppn: int) -> list:
    """Per axis of ``prediction``'s grid: ``(axis, exposed s, level, g, points)``: ``g`` the group's ranks on
    one node (inter-node axes, :func:`fourd_mpi.perf.machine.group_per_node`), ``points`` the measured point
    set of its all-reduce / all-gather that priced it (``p@g``; ``runs p@g``: the back-to-back points that price
    the data all-reduces where the profile has them; ``xS`` when scaled from another ``g``; ``fit`` where none)."""
    from fourd_mpi.perf.machine import axis_inner_products, group_per_node

    grid = prediction.grid
    inner = axis_inner_products(grid)
    exposed = prediction.exposed_by_axis()
    out = []
    for axis in ("data", "z", "y", "x"):
        if axis not in exposed:
            continue
        level = prediction.placement[axis]
        g = group_per_node(grid[axis], inner[axis], ppn) if level == "inter" else None
        g = 1 if g is not None and g >= grid[axis] else g
        ops = sorted({op for a, op in prediction.exposed_s if a == axis})
        src = profile.measured_source(level, ops[0], grid[axis], g, run=axis == "data") if ops else None
        label = "fit" if src is None else (("runs " if src[0] == "measured_runs" else "") + src[1]
                                           + (f" x{src[2]:.2f}" if src[2] != 1.0 else ""))
        out.append((axis, exposed[axis], level, g, label))
    return out


def parse_ranking(text: str) -> list:
    """Part 3's sections of a report: ``[(nodes, ppn, hidden, seq, batch, {grid: measured s})]``."""
    out = []
    for m in re.finditer(r"^## 3\. ranking: every grid of 8 ranks, (\d+) nodes x (\d+) \(block\), gpt-tiny "
                         r"h=(\d+) seq=(\d+) batch=(\d+).*?\n(.*?)(?=^Spearman|^## |\Z)", text, re.M | re.S):
        measured = {g: float(t) for g, t in re.findall(r"^(\d+x\d+x\d+x\d+)\s+([0-9.]+)", m.group(6), re.M)}
        out.append((*(int(v) for v in m.groups()[:5]), measured))
    return out


def from_results(path: str, profile_dir: str = None) -> int:
    """``--from-results``: part 3's model again from a committed report (offline); the profiles from
    ``profile_dir`` when given, else those next to the report."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        print(f"multinode.py: --from-results {path}: {e.strerror}", file=sys.stderr)
        return 2
    sections = parse_ranking(text)
    if not sections:
        print(f"multinode.py: --from-results {path}: no '## 3. ranking' section", file=sys.stderr)
        return 2
    from fourd_mpi.errors import ConfigError

    print(f"# part 3 from {path}: measured steps from the report, model again (fourd_mpi.perf.predict, overlap "
          f"none) with the profile of each layout; exposed per axis: seconds (level, g = ranks of one group on a "
          f"node, measured points that priced it)")
    for nodes, ppn, hidden, seq, batch, measured in sections:
        prof_path = kept_profile(path, nodes, ppn, reading=True)
        if profile_dir:
            prof_path = os.path.join(profile_dir, os.path.basename(prof_path))
        try:
            profile = _profile(prof_path)
        except (ConfigError, OSError) as e:
            print(f"multinode.py: --from-results: {nodes} x {ppn}: {e}", file=sys.stderr)
            return 2
        preds = model_steps(profile, ppn, hidden, seq, batch, measured)
        rows = sorted(((g, m, preds[g].step_s) for g, m in measured.items() if g in preds), key=lambda r: r[1])
        model_rank = {g: i + 1 for i, (g, _, _) in enumerate(sorted(rows, key=lambda r: r[2]))}
        print()
        print(f"## 3. {nodes} nodes x {ppn}, gpt-tiny h={hidden} seq={seq} batch={batch}; profile "
              f"{os.path.relpath(prof_path, ROOT)}")
        print(f"{'grid':<9} {'measured s':>10} {'rank':>5} {'model s':>8} {'model rank':>10} {'model/meas':>10} "
              f"{'compute s':>9}  exposed communication per axis")
        for i, (g, m, p) in enumerate(rows):
            terms = "  ".join(f"{a} {t:.3f} ({lv}{'' if gg is None else f', g={gg}'}, {src})"
                              for a, t, lv, gg, src in axis_terms(preds[g], profile, ppn))
            print(f"{g:<9} {m:>10.3f} {i + 1:>5} {p:>8.3f} {model_rank[g]:>10} {p / m:>10.2f} "
                  f"{preds[g].compute_s:>9.3f}  {terms}")
        if len(rows) > 2:
            s = rank_summary(rows)
            print(f"Spearman rank correlation (measured vs model, {len(rows)} grids): {s['spearman']:.2f}; the model's "
                  f"best grid {s['best']} is measured #{s['position']} "
                  f"({'within' if s['within_two'] else 'NOT within'} the measured best two)")
    return 0


def ranking(args, name, env, say, layout, profile_path) -> None:
    """Every grid of 8 ranks (``layout`` nodes x ranks per node, block order): measured median step
    against the model's with the layout's calibrated profile."""
    nodes, ppn = layout
    profile = _profile(profile_path)
    grids = {g: p.step_s for g, p in model_steps(profile, ppn, args.hidden, args.seq, args.batch,
                                                  every_grid()).items()}
    say()
    say(f"## 3. ranking: every grid of 8 ranks, {nodes} nodes x {ppn} (block), gpt-tiny h={args.hidden} "
        f"seq={args.seq} batch={args.batch}, {args.steps} measured steps, {args.rank_repeats} alternating rounds; "
        f"model: the {nodes} x {ppn} calibrated profile (part 0), ranks_per_node {ppn}")
    say(f"#   each: fourd-mpi testbed mpiexec -n 8 --ppn {ppn} -- "
        "fourd-mpi run --gdata D --gz Z --gy Y --gx X --model gpt-tiny "
        f"--hidden {args.hidden} --seq {args.seq} --batch {args.batch} --steps {args.steps} "
        "--warmup 1 --trace-level step")
    measured = {g: [] for g in grids}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rank_repeats):
            for g in grids:
                d, z, y, x = g.split("x")
                done = fourd("testbed", "mpiexec", "-n", 8, "--ppn", ppn, "--", PY, "-m", "fourd_mpi", "run",
                             "--gdata", d, "--gz", z, "--gy", y, "--gx", x, "--model", "gpt-tiny", "--hidden",
                             args.hidden, "--seq", args.seq, "--batch", args.batch, "--steps", args.steps,
                             "--warmup", 1, "--trace-level", "step", "--results-dir", tmp, env=env)
                match = re.search(r"step time: median ([0-9.]+) s", done.stdout)
                if done.returncode == 0 and match:
                    measured[g].append(float(match.group(1)))
                else:
                    failed(say, f"# {g} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-200:]}")
    rows = [(g, statistics.median(m), grids[g]) for g, m in measured.items() if m]
    rows.sort(key=lambda row: row[1])
    say(f"{'grid':<9} {'measured s':>10} {'rank':>5} {'model s':>8} {'model rank':>10}")
    model_order = sorted(rows, key=lambda row: row[2])
    model_rank = {row[0]: i + 1 for i, row in enumerate(model_order)}
    for i, (g, m, p) in enumerate(rows):
        say(f"{g:<9} {m:>10.3f} {i + 1:>5} {p:>8.3f} {model_rank[g]:>10}")
    if len(rows) > 2:
        s = rank_summary(rows)
        say(f"Spearman rank correlation (measured vs model, {len(rows)} grids): {s['spearman']:.2f}; the model's best "
            f"grid {s['best']} is measured #{s['position']}")


def predicted(args, profile_path) -> dict:
    """The performance model's step time of each placement case, with the bed's calibrated profile."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf import predict as pr
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    profile = _profile(profile_path)
    cfg = resolve_model("gpt-tiny", hidden=args.hidden, seq=args.seq, batch=args.batch)
    grid = GridShape(data=1, z=2, y=1, x=2)
    return {"block": pr.predict(cfg, grid, profile, ranks_per_node=2).step_s,
            "block+overlap": pr.predict(cfg, grid, profile, OverlapConfig.parse("all"), ranks_per_node=2).step_s,
            "cyclic": pr.predict(cfg, grid, profile, ranks_per_node=2, levels={"x": "inter", "z": "intra"}).step_s}


def _breakdown(path: str) -> dict:
    """``analyze --what breakdown,comm,runs`` of one trace: step seconds, the exposed communication, its transfer
    part (``transfer_wait_s_per_step``: waiting after every rank had issued) and the strategy that ran."""
    import json

    done = fourd("analyze", path, "--what", "breakdown,comm,runs", "--format", "json")
    tables = json.loads(done.stdout)
    rows = tables["breakdown"]
    comm = sum(r["seconds_per_step"] for r in rows if r["category"] == "exposed_comm")
    split = [r["transfer_wait_s_per_step"] for r in tables["comm"]]
    transfer = sum(float(v) for v in split if v is not None and v == v)  # NaN or null: no split (copies, p2p)
    ran = tables["runs"][0]["progress"]  # the runs table's short form of the strategy that ran
    return {"step_s": float(rows[0]["step_s"]), "comm_s": float(comm), "transfer_s": transfer, "progress": ran}


def overlap(args, name, env, say, profile_path) -> None:
    """One axis of size 2 across the link: overlapped step against max(compute-only, communication-only), per batch."""
    batches = [int(b) for b in str(args.overlap_batch).split(",")]
    for batch in batches:
        overlap_batch(args, name, env, say, profile_path, batch)
    if len(batches) > 1:
        say()
        say("# the communication is the same at every batch (weights and gradients do not grow with it); the "
            "compute grows with the batch, so comm/compute falls from the first row to the last")


#: part 2's case of ``--overlap all`` with every other option at its default (``--progress auto``)
DEFAULTS = "all, defaults"


def hidden_pct(exposed: float, baseline: float) -> float:
    """``100 * (1 - exposed / baseline)``: the share of ``baseline`` (the ``none`` run's wait of the same round)
    no longer exposed; negative when the overlapped run waits longer."""
    return 100.0 * (1.0 - exposed / baseline)


def defaults_meet(compute_x: float, hidden_transfer_pct: float, comm_share: float) -> bool:
    """The defaults' targets: compute inside the overlapped step within 1.05x of the compute alone, and at least
    80 % of the transfer hidden wherever comm / compute <= 0.5 (above it the hiding target does not apply)."""
    return compute_x <= 1.05 and (hidden_transfer_pct >= 80 or comm_share > 0.5)


def overlap_batch(args, name, env, say, profile_path, batch: int) -> None:
    """Part 2 at one global batch: the cases alternating, then the table and the slow-down lines."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf import predict as pr
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    h, layers = args.overlap_hidden, args.overlap_layers
    model = ["--model", "gpt-tiny", "--hidden", h, "--seq", 128, "--batch", batch,
             *(["--layers", layers] if layers else []), "--steps", args.steps, "--warmup", 1,
             "--trace-level", "op", "--gdata" if args.overlap_axis == "data" else "--gz", 2]
    polls = {f"all, poll {f if f == 'auto' else format(float(f), '.0e')}":
             ["--overlap", "all", "--progress", "poll", "--poll-flops", f]
             for f in str(args.overlap_poll_flops).split(",")}
    cases = {  # case: (ranks per node, run options)
        "compute-only (1 node)": (2, ["--overlap", "none"]),
        "none": (args.overlap_ppn, ["--overlap", "none"]),
        DEFAULTS: (args.overlap_ppn, ["--overlap", "all"]),
        **{case: (args.overlap_ppn, extra) for case, extra in polls.items()},
        "all, progress thread": (args.overlap_ppn, ["--overlap", "all", "--progress", "thread"]),
    }
    where = ("1 rank per node (2 nodes)" if args.overlap_ppn == 1 else
             "both ranks on one node (shared memory, no link)")
    cfg = resolve_model("gpt-tiny", hidden=h, seq=128, batch=batch, **({"layers": layers} if layers else {}))
    say()
    say(f"## 2. overlap{' against a link' if args.overlap_ppn == 1 else ' on one node'}: G_{args.overlap_axis} = 2, "
        f"gpt-tiny h={h} layers={cfg.layers} seq=128 batch={batch}, {args.steps} measured steps, "
        f"{args.overlap_repeats} alternating rounds; {where}, compute-only = both ranks on one node; load average "
        f"(1 min) {load()}")
    for case, (ppn, extra) in cases.items():
        say(f"#   {case}: fourd-mpi testbed mpiexec -n 2 --ppn {ppn} -- fourd-mpi run "
            f"{' '.join(map(str, model + extra))}")
    got = {c: [] for c in cases}
    for r in range(args.overlap_repeats):
        for i, (case, (ppn, extra)) in enumerate(cases.items()):
            path = os.path.join(tempfile.gettempdir(), f"{name}-ov{r}-{i}")
            shutil.rmtree(path, ignore_errors=True)
            done = fourd("testbed", "mpiexec", "--name", name, "-n", 2, "--ppn", ppn, "--", PY, "-m", "fourd_mpi",
                         "run", *model, *extra, "--results-dir", path, "--run-id", "ov", env=env)
            if _step(done) is None:
                failed(say, f"# {case} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
                continue
            got[case].append((r, _breakdown(os.path.join(path, "ov.h5"))))
            shutil.rmtree(path, ignore_errors=True)
    prof = _profile(profile_path)
    grid = GridShape(data=2, z=1, y=1, x=1) if args.overlap_axis == "data" else GridShape(data=1, z=2, y=1, x=1)
    say(f"#   compute = step - exposed comm of the 1-node run; comm = exposed comm of the 'none' run (nothing "
        f"overlaps it); bound = max(compute, comm) of the same round; hidden = 1 - exposed comm / comm of the "
        f"same round; transfer = analyze's transfer_wait_s_per_step (the waits after every rank had issued: "
        f"the imbalance, which no strategy can hide, left out); hidden transfer = 1 - transfer / transfer of the "
        f"'none' run of the same round; compute x = (step - exposed comm) / compute of the same round; "
        f"model: the 2 x 1 calibrated profile")
    say(f"{'case':<31} {'step s per round':<24} {'median s':>9} {'exposed comm s':>15} {'transfer s':>11} "
        f"{'vs bound (same round)':>22} {'hidden %':>9} {'hidden transfer %':>18} {'compute x':>18} {'model s':>8}")
    bound, comm, transfer = {}, {}, {}
    alone = {r: b["step_s"] - b["comm_s"] for r, b in got["compute-only (1 node)"]}
    for r, b in got["compute-only (1 node)"]:
        none = dict(got["none"]).get(r)
        if none is not None:
            bound[r] = max(alone[r], none["comm_s"])
            comm[r], transfer[r] = none["comm_s"], none["transfer_s"]

    def spread(values, fmt):
        return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})" \
            if values else "-"

    verdicts = {}
    for case, rows in got.items():
        if not rows:
            continue
        steps = [b["step_s"] for _, b in rows]
        ratio = spread([b["step_s"] / bound[r] for r, b in rows if r in bound], ".2f")
        overlapped = case.startswith("all")
        hidden = [100 * (1 - b["comm_s"] / comm[r]) for r, b in rows if comm.get(r)]
        hidden = f"{statistics.median(hidden):.0f}" if hidden and overlapped else "-"
        hidden_t = [hidden_pct(b["transfer_s"], transfer[r]) for r, b in rows if transfer.get(r)]
        slow = [(b["step_s"] - b["comm_s"]) / alone[r] for r, b in rows if r in alone]
        ran = sorted({b["progress"] for _, b in rows})
        label = f"{case} ({'/'.join(ran)})" if case == DEFAULTS else case
        if case.startswith("compute"):
            ms = pr.predict(cfg, grid, prof, ranks_per_node=2).compute_s
        else:
            ov = OverlapConfig.parse("all" if overlapped else "none")
            progress = "thread" if "thread" in case or (case == DEFAULTS and ran == ["thread"]) else "poll"
            ms = pr.predict(cfg, grid, prof, ov, progress=progress, ranks_per_node=args.overlap_ppn).step_s
        say(f"{label:<31} {' '.join(f'{v:.3f}' for v in steps):<24} {statistics.median(steps):>9.3f} "
            f"{statistics.median(b['comm_s'] for _, b in rows):>15.3f} "
            f"{statistics.median(b['transfer_s'] for _, b in rows):>11.4f} {ratio:>22} {hidden:>9} "
            f"{spread(hidden_t, '.0f') if overlapped else '-':>18} "
            f"{spread(slow, '.2f') if not case.startswith('compute') else '-':>18} {ms:>8.3f}")
        if case == DEFAULTS and slow and hidden_t:
            verdicts = {"compute": statistics.median(slow), "hidden": statistics.median(hidden_t)}
    if bound:
        share = statistics.median(comm[r] / alone[r] for r in comm)
        share_t = statistics.median(transfer[r] / alone[r] for r in transfer)
        say(f"# bound = max(compute, comm), median over rounds: {statistics.median(bound.values()):.3f} s; "
            f"comm / compute = {share:.2f} (transfer / compute = {share_t:.3f}); target: an overlapped step <= "
            f"1.10 x bound")
        if verdicts:
            meets = defaults_meet(verdicts["compute"], verdicts["hidden"], share)
            say(f"# defaults (--overlap all, --progress auto): compute x {verdicts['compute']:.2f} (target <= 1.05), "
                f"hidden transfer {verdicts['hidden']:.0f} % (target >= 80 % where comm / compute <= 0.5): "
                f"{'met' if meets else 'NOT met'}; medians over rounds")
    if bound and args.overlap_axis == "data":
        # data parallelism's gradient all-reduces start in backward: the forward pass (a third of the compute
        # by the 2:1 backward:forward FLOP count) cannot hide them within a step
        fwd = {r: (b["step_s"] - b["comm_s"]) / 3.0 for r, b in got["compute-only (1 node)"]}
        none = dict(got["none"])
        reach = {r: fwd[r] + max(2.0 * fwd[r], none[r]["comm_s"]) for r in fwd if r in none}
        for case in (*polls, "all, progress thread"):
            ratios = [b["step_s"] / reach[r] for r, b in got[case] if r in reach]
            if ratios:
                say(f"# {case}: step / (forward + max(backward, comm)) = {statistics.median(ratios):.2f} "
                    f"(forward = compute / 3: what gradient all-reduces, issued in backward, can never hide)")


#: ``tune``'s extra options of a configuration -> ``fourd-mpi run`` options
RUN_OPTION = {"stages": "--ginter", "microbatches": "--microbatches", "schedule": "--pipeline-schedule"}


def algorithms(args, name, env, say, profile_path) -> None:
    """The tuner's best configuration of each algorithm on 2 nodes x 4, measured side by side."""
    from fourd_mpi.perf.algorithms import rank_algorithms
    from fourd_mpi.step.presets import resolve_model

    prof = _profile(profile_path)
    cfg = resolve_model("gpt-tiny", hidden=args.hidden, seq=args.seq, batch=args.batch)
    names = ["axonn4d", "megatron1d", "fsdp", "optimus3d", "pipeline"]
    ranked = rank_algorithms(names, cfg, 8, prof, ranks_per_node=4)
    best = {}
    for e in ranked.every:  # each algorithm's fastest configuration that is not plain data parallelism
        if e.algorithm not in best and str(e.grid).split("x")[0] != "8":
            best[e.algorithm] = e
    say()
    say(f"## 4. algorithms side by side: each algorithm's best configuration by tune --algorithm all (the 2 x 4 "
        f"profile), 8 ranks on 2 nodes x 4, gpt-tiny h={args.hidden} seq={args.seq} batch={args.batch}, "
        f"{args.steps} measured steps, {args.algorithm_repeats} alternating rounds")
    argv = {}
    for n, e in best.items():
        if e is None:
            continue
        d, z, y, x = str(e.grid).split("x")
        extra = [str(a) for k, v in sorted(e.options.items()) if k in RUN_OPTION for a in (RUN_OPTION[k], v)]
        argv[n] = ["--algorithm", n, "--gdata", d, "--gz", z, "--gy", y, "--gx", x, *extra]
        say(f"#   {n}: fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run {' '.join(argv[n])} --model gpt-tiny "
            f"--hidden {args.hidden} --seq {args.seq} --batch {args.batch} --steps {args.steps} --warmup 1")
    measured = {n: [] for n in argv}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.algorithm_repeats):
            for n, a in argv.items():
                done = fourd("testbed", "mpiexec", "--name", name, "-n", 8, "--ppn", 4, "--", PY, "-m", "fourd_mpi",
                             "run", *a, "--model", "gpt-tiny", "--hidden", args.hidden, "--seq", args.seq, "--batch",
                             args.batch, "--steps", args.steps, "--warmup", 1, "--trace-level", "step",
                             "--results-dir", tmp, env=env)
                step = _step(done)
                if step is None:
                    failed(say, f"# {n} round {r + 1} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
                else:
                    measured[n].append(step)
    rows = sorted(((n, statistics.median(m), best[n]) for n, m in measured.items() if m), key=lambda t: t[1])
    order = {n: i + 1 for i, (n, _, _) in enumerate(sorted(rows, key=lambda t: t[2].prediction.step_s))}
    say("# each algorithm's fastest configuration other than plain data parallelism (8x1x1x1 is the same step under "
        "every name); megatron1d's grids are axonn4d grids, so both can name the same step")
    say(f"{'algorithm':<11} {'configuration':<34} {'measured s':>10} {'rank':>5} {'model s':>8} {'model rank':>10}")
    for i, (n, m, e) in enumerate(rows):
        say(f"{n:<11} {e.label:<34} {m:>10.3f} {i + 1:>5} {e.prediction.step_s:>8.3f} {order[n]:>10}")
    if len(rows) > 2:
        say(f"Spearman rank correlation (measured vs model, {len(rows)} algorithms): "
            f"{_spearman([m for _, m, _ in rows], [e.prediction.step_s for _, _, e in rows]):.2f}")


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
