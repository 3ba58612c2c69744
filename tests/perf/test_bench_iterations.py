"""``bench collectives`` with enough data.

- the iteration rule (:class:`fourd_mpi.run.collbench.IterationRule`): warm-up, then timed iterations
  until both ``--iters`` and ``--min-time`` are reached, bounded by ``--max-time``; every rank runs the
  same count (real mpiexec, 3 and 4 ranks, each rank's iterations taking a different time);
- the fit gate: a poor alpha-beta fit is refused with one line and exit 1 on every rank, written with
  ``--accept-poor-fit``;
- the step's own message sizes beside the table, with whether the measured sizes cover them.
"""

import json
import textwrap

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.calibration import Row, poor_fit_line, poor_fits
from fourd_mpi.run.collbench import IterationRule, cover_step_messages, message_sizes, step_message_lines, step_messages
from fourd_mpi.step.presets import resolve_model

# -- the iteration rule, pure -----------------------------------------------------------------------

def test_next_target_known_answers():
    rule = IterationRule(min_iters=20, min_time=0.2, max_time=10.0)
    # 1 ms an iteration: the time needs 1 + ceil(1.1 * 0.199 / 0.001) = 220, the growth cap 10 x 1 = 10
    assert rule.next_target(1, timed=0.001, wall=0.002) == 10
    # after 10: the time needs 10 + ceil(1.1 * 0.19 * 10 / 0.01) = 219, capped at 10 x 10
    assert rule.next_target(10, timed=0.01, wall=0.02) == 100
    assert rule.next_target(100, timed=0.1, wall=0.2) == 211  # 100 + ceil(1.1 * 0.1 * 100 / 0.1)
    # both reached: stop; only one of them: go on
    assert rule.next_target(20, timed=0.2, wall=0.4) == 0
    assert rule.next_target(19, timed=5.0, wall=6.0) == 20  # time enough, count not
    assert rule.next_target(300, timed=0.15, wall=0.3) > 300  # count enough, time not
    # the bounds: max_time of wall time (even at 1 iteration, below --iters), and max_iters
    assert rule.next_target(1, timed=9.0, wall=10.0) == 0
    assert rule.next_target(1, timed=3.0, wall=4.0) == 2  # 1 + int((10 - 4) / 4) iterations still fit
    assert IterationRule(20, 1e9, 1e9, max_iters=50).next_target(50, timed=1.0, wall=1.0) == 0
    # --min-time 0: --iters alone (checks at 1, 10, 20)
    zero = IterationRule(min_iters=20, min_time=0.0)
    assert [zero.next_target(n, n * 1e-3, n * 2e-3) for n in (1, 10, 20)] == [10, 20, 0]
    assert IterationRule(min_iters=1, min_time=0.0).next_target(1, 1e-3, 1e-3) == 0


def test_overlap_sizes_stay_at_most_4_mib():
    from fourd_mpi.run.collbench import overlap_sizes

    sizes = [8, 64, 512, 4096, 32768, 262144, 2097152, 16777216, 67108864]
    assert overlap_sizes(sizes, 2) == [262144, 2097152] and overlap_sizes(sizes, 0) == []
    assert overlap_sizes([8, 64], 2) == [8, 64] and overlap_sizes([8 << 20], 2) == [8 << 20]


def test_sizes_reach_the_maximum():
    """The default sweep reaches 64 MiB, measured even though the steps of 8 miss it."""
    assert message_sizes(8, 64 << 20, 8, 4) == [8, 64, 512, 4096, 32768, 262144, 2097152, 16777216, 67108864]
    assert message_sizes(8, 100, 8, 4) == [8, 64, 100]
    assert message_sizes(8, 4096, 8, 12) == [12, 72, 516, 4104]  # already there, rounded: not twice


# -- the iteration rule under mpiexec ---------------------------------------------------------------

AGREE = textwrap.dedent("""
    import json, sys, time
    from mpi4py import MPI
    from fourd_mpi.run.collbench import IterationRule, timed_iterations

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    min_iters, min_time, max_time, pause = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    # rank r's iterations take (r + 1) x pause: the ranks would stop at different counts if each decided alone
    times = timed_iterations(world, (world.Barrier, lambda: time.sleep(pause * (rank + 1))),
                             IterationRule(min_iters, min_time, max_time, warmup=2))
    got = world.gather([len(times), sum(times)], root=0)
    if rank == 0:
        print(json.dumps(got))
""")


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [3, 4])
def test_every_rank_runs_the_same_count_until_both_minimums(run_mpi, tmp_path, nranks):
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    # min count binds (no min time): exactly 4 on every rank
    proc = run_mpi(nranks, [4, 0.0, 10.0, 0.001], script=str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [n for n, _ in got] == [4] * nranks
    # min time binds: 0.05 s of timed iterations on the slowest rank (rank n-1: n ms an iteration)
    proc = run_mpi(nranks, [3, 0.05, 10.0, 0.001], script=str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    counts = {n for n, _ in got}
    assert len(counts) == 1 and counts.pop() >= 3, got  # one count on every rank
    assert max(t for _, t in got) >= 0.05, got  # the slowest rank reached the minimum time
    # the bound: 20 iterations wanted, 50 ms each on rank 0 (up to 200 ms on rank 3), at most 0.3 s
    proc = run_mpi(nranks, [20, 0.0, 0.3, 0.05], script=str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    counts = {n for n, _ in got}
    assert len(counts) == 1 and 1 <= counts.pop() < 20, got


@pytest.mark.mpi
def test_bench_rows_meet_both_minimums(run_mpi, tmp_path):
    """The command end to end on 3 ranks: every row ran at least --iters iterations, and the report states the
    rule. (The time rule is checked exactly above, on the per-rank sums: a row's iterations x its median
    is not that sum, a few slow iterations make them differ by any factor.)"""
    proc = run_mpi(3, ["bench", "collectives", "--ops", "iallreduce,allgather", "--max-size", "4K", "--iters", "5",
                       "--min-time", "0.02", "--warmup", "1", "--overlap-sizes", "0", "--gemm-size", "16",
                       "--dtypes", "float32", "--no-in-place", "--accept-poor-fit", "-o", tmp_path / "p.yaml",
                       "--format", "json"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["rows"] and all(r["iters"] >= 5 for r in doc["rows"]), [r["iters"] for r in doc["rows"]]
    assert "until both 5 iterations and 0.02 s" in doc["iterations"]


# -- the fit gate ---------------------------------------------------------------------------------

def _profile(rms_by_p):
    fits = {p: {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "points": 4, "rms_rel_error": rms}
            for p, rms in rms_by_p.items()}
    return {"levels": {"intra": {"allreduce": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9, "points": 8,
                                               "rms_rel_error": 0.9},
                                 "by_size": {"allreduce": fits}}}}


def test_poor_fits_and_their_line():
    assert poor_fits(_profile({"2": 0.1, "4": 0.2})) == []  # the per-size fits decide, not the overall one
    bad = poor_fits(_profile({"2": 0.1, "4": 0.25, "8": 0.67}))
    assert bad == [("intra", "allreduce", "8", 0.67), ("intra", "allreduce", "4", 0.25)]  # 25 %: refused
    line = poor_fit_line(bad)
    assert line == ("no machine profile written: the alpha-beta fit of allreduce at the intra-node level on p = 8 "
                    "misses its measurements by 67% rms (limit 25%, --max-fit-error) (1 more fit(s) at or over the "
                    "limit); "
                    "--accept-poor-fit writes it anyway (the model then uses the stored measured points, "
                    "levels.intra.measured)")
    # a collective without per-size fits: its fit over all sizes, named by the measured group sizes
    lone = {"levels": {"inter": {"allgather": {"alpha_s": 0, "beta_s_per_byte": 1e-9, "points": 3,
                                               "rms_rel_error": 0.3},
                                 "measured": {"allgather": {"3": [[8, 1e-5], [64, 2e-5]]}}}}}
    assert poor_fits(lone) == [("inter", "allgather", "3", 0.3)]


@pytest.mark.mpi
def test_a_poor_fit_is_refused_in_one_line_and_written_with_the_override(run_mpi, tmp_path):
    """On 3 ranks, --max-fit-error 0: every fit is at or over the limit (rms >= 0), so the known answer does
    not depend on this machine's noise: refused (exit 1 on every rank, one error line naming level,
    collective and group size, no file, the report still printed), then written with --accept-poor-fit."""
    import yaml

    common = ["bench", "collectives", "--ops", "iallreduce", "--max-size", "4K", "--iters", "2", "--min-time", "0",
              "--warmup", "0", "--overlap-sizes", "0", "--gemm-size", "16", "--dtypes", "float32", "--no-in-place",
              "--format", "json", "--max-fit-error", "0"]
    out = tmp_path / "p.yaml"
    proc = run_mpi(3, [*common, "-o", out], timeout=240)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("fourd-mpi: error: no machine profile written: the alpha-beta fit of allreduce at the "
                                "intra-node level on p = 3 misses its measurements by ")
    # no range of sizes passes a limit of 0 %: said so, in the same line
    assert ("(limit 0%, --max-fit-error); no range of 3 or more measured sizes passes (a link that is not "
            "alpha-beta, e.g. shaped by a token bucket); --accept-poor-fit writes it anyway") in errors[0]
    doc = json.loads(proc.stdout)  # the report is still there
    assert doc["rows"] and doc["profile"]["path"] is None and doc["profile"]["reason"] in errors[0]
    assert not out.exists() and "Traceback" not in proc.stderr
    proc = run_mpi(3, [*common, "-o", out, "--accept-poor-fit"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    prof = yaml.safe_load(out.read_text())
    assert prof["calibration"]["poor_fits"].startswith("1 fit(s) at or over 0% rms, written by --accept-poor-fit: "
                                                       "intra allreduce p=3 ")
    assert len(prof["levels"]["intra"]["measured"]["allreduce"]["3"]) == 4  # 12, 72, 516, 4104 B: what the model uses
    # the default limit, 25 %: the same command without --max-fit-error decides by the printed error
    assert poor_fits(prof, 1e9) == [] and poor_fits(prof, 0.0)


# -- the step's own messages ------------------------------------------------------------------------

def test_step_messages_known_answer():
    """gpt-tiny (hidden 64, ffn 256, seq 16, batch 8, 2 layers), float32, on 2x1x1x2: x is the tensor axis
    (fwd all-reduces of the normal layers, bwd ones of the transposed, LayerNorm's), data the gradients.
    m = B*s/G_data = 8*16/2 = 64 tokens; qkv [192, 64]: fwd all-reduce over x of m*n/G_y*4 = 64*192*4 =
    48 KiB; fc1 [256, 64]: 64*256*4 = 64 KiB; LayerNorm's forward all-reduces m*4 = 256 B."""
    cfg = resolve_model("gpt-tiny")
    msgs = step_messages(cfg, [GridShape(2, 1, 1, 2)], "float32")
    by = {(m["axis"], m["op"]): m for m in msgs}
    assert set(by) == {("x", "allreduce"), ("data", "allreduce")}
    x = by[("x", "allreduce")]
    assert x["p"] == 2 and x["sizes"][-1] == 64 * 256 * 4 and 48 * 1024 in x["sizes"] and 256 in x["sizes"]
    assert 8 in x["sizes"]  # the loss (one float64)
    # the measured rows of that axis: covered up to 64 KiB, not beyond
    rows = [Row("2x1x1x2:x", "intra", 2, "iallreduce", s, 3, 1e-5, axes="2x1x1x2:x") for s in (8, 64, 65536)]
    covered = cover_step_messages(msgs, rows, world_size=4)
    cx = next(m for m in covered if m["axis"] == "x")
    assert cx["covered"] is True and cx["measured"] == [8, 65536]
    small = cover_step_messages(msgs, rows[:2], world_size=4)
    assert next(m for m in small if m["axis"] == "x")["covered"] is False
    assert next(m for m in small if m["axis"] == "data")["covered"] is None  # not measured
    lines = step_message_lines(small, "gpt-tiny", "float32")
    assert lines[0].startswith("# the step's own messages (fourd-mpi run --model gpt-tiny --dtype float32")
    xline = next(l for l in lines if " x " in l)
    assert "all-reduce" in xline and "64 KiB" in xline \
        and "NOT covered: larger than the largest measured, 64 B" in xline
    assert any("data" in l and "not measured (--ops)" in l for l in lines)


@pytest.mark.mpi
def test_bench_prints_the_step_messages(run_mpi, tmp_path):
    """4 ranks, --gx 2 (grid 2x1x1x2), gpt-tiny: x's largest message is 64 KiB. Measured to 4 KiB: not covered,
    the line says so; to 64K: covered. 3 ranks (prime, no benchmarked grid): the run's default grid 3x1x1x1,
    whose data axis is the world."""
    common = ["bench", "collectives", "--ops", "iallreduce", "--iters", "1", "--min-time", "0", "--warmup", "0",
              "--overlap-sizes", "0", "--gemm-size", "16", "--dtypes", "float32", "--no-in-place",
              "--accept-poor-fit", "--factor", "16"]
    proc = run_mpi(4, [*common, "--gx", "2", "--max-size", "4K", "-o", tmp_path / "a.yaml"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("#   2x1x1x2")]
    x = [l for l in lines if " x " in l]
    assert len(x) == 1 and "all-reduce" in x[0] and "64 KiB" in x[0] and "NOT covered" in x[0], proc.stdout
    proc = run_mpi(4, [*common, "--gx", "2", "--max-size", "64K", "-o", tmp_path / "b.yaml"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    x = [l for l in proc.stdout.splitlines() if l.startswith("#   2x1x1x2 x ")]
    assert len(x) == 1 and x[0].endswith("covered (measured 8 B - 64 KiB)"), proc.stdout
    proc = run_mpi(3, [*common, "--max-size", "64", "-o", tmp_path / "c.yaml", "--format", "json"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["step_model"] == {"model": "gpt-tiny", "dtype": "float32"}
    assert {(m["grid"], m["axis"]) for m in doc["step_messages"]} == {("3x1x1x1", "data")}
    assert doc["step_messages"][0]["covered"] is False and doc["step_messages"][0]["measured"] == [12, 72]


# -- back-to-back runs: every group of an axis at once -----------------------------------------------

LOCKSTEP = textwrap.dedent("""
    import json, sys, time
    from mpi4py import MPI
    from fourd_mpi.run.collbench import IterationRule, iteration_barrier, timed_iterations

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comm = world.Split(rank % 2, rank)  # two groups of an axis, as a data axis of stride 2
    pause = 0.001 if rank % 2 == 0 else 0.05  # group 0's iterations are 50 x shorter than group 1's
    starts = []

    def body():
        starts.append(MPI.Wtime())
        time.sleep(pause)

    barrier = iteration_barrier(comm, world) if sys.argv[1] == "lockstep" else comm.Barrier
    timed_iterations(world, (barrier, body), IterationRule(8, 0.0, 10.0, warmup=0))
    got = world.gather(starts, root=0)
    if rank == 0:
        print(json.dumps(got))
""")


@pytest.mark.mpi
def test_every_group_of_an_axis_starts_each_run_together(run_mpi, tmp_path):
    """bench collectives' barrier before each timed back-to-back run is the world's (``iteration_barrier``, as
    the groups of a step start their data all-reduces together): the iteration i of every group starts within a
    barrier's latency of the others', while the groups' own barriers let a fast group run ahead."""
    script = tmp_path / "lockstep.py"
    script.write_text(LOCKSTEP)
    spread = {}
    for mode in ("lockstep", "own"):
        proc = run_mpi(4, [mode], script=str(script), timeout=120)
        assert proc.returncode == 0, proc.stderr
        starts = json.loads(proc.stdout)
        assert len({len(s) for s in starts}) == 1  # the same count on every rank (the rule's agreement)
        spread[mode] = max(max(s[i] for s in starts) - min(s[i] for s in starts) for i in range(len(starts[0])))
    # lockstep: each start within one slow iteration (50 ms) of the others, barrier latency included
    assert spread["lockstep"] < 0.04, spread
    # own barriers: after the rule's first check (1 iteration) the next 7 run unchecked: group 0 finishes them
    # in about 7 ms while group 1 needs 0.35 s, so its last starts are some 0.3 s apart
    assert spread["own"] > 0.1, spread
