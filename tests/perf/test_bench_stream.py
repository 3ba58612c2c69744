"""``fourd-mpi bench collectives`` reports as it goes: each size's row on standard output as soon as it is
measured (as OSU and nccl-tests print), a progress line on standard error, a bound on the whole sweep
(``--time-limit``), and, when the fit gate refuses the profile, the sizes whose fits would pass.

The plan, the bound and the stream are checked without MPI; the command under a real ``mpiexec`` on 2 and
3 ranks (rows read from the pipe while the job still runs; no assertion on wall time)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, find_mpiexec, mpi_env

from fourd_mpi.perf.calibration import Row, fit_window, fits_profile, poor_fit_line, poor_fits
from fourd_mpi.run.collbench import Budget, IterationRule, StreamReport, format_result, plan_items, progress_line

#: a row of the text report: size, count, type (nccl-tests' columns)
ROW = re.compile(r"^\s+(\d+)\s+\d+\s+float\s")
BLOCK = re.compile(r"^# (\w+) on (\S+) \(")


# -- the plan and the bound, without MPI --------------------------------------------------------------------

def test_the_plan_lists_every_measurement_in_the_order_they_run():
    items = plan_items([("world", 3, "inter")], [[12, 96]], ["iallreduce", "allgather"], (False, True), 1)
    # size by size: a bound that runs out leaves out the largest sizes of every kind of measurement
    assert [(i.what, i.op, i.size, i.inplace) for i in items] == [
        ("op", "iallreduce", 12, False), ("op", "iallreduce", 12, True),
        ("run", "iallreduce", 12, False), ("sync", "iallreduce", 8, False),  # across nodes: back-to-back runs
        ("op", "iallreduce", 96, False), ("op", "iallreduce", 96, True),
        ("run", "iallreduce", 96, False), ("overlap", "iallreduce", 96, False),
        ("op", "allgather", 12, False), ("op", "allgather", 12, True),
        ("op", "allgather", 96, False), ("op", "allgather", 96, True)]
    assert items[4].index == 2 and items[4].count == 2
    assert "iallreduce on world (p=3), size 2 of 2 (96 B), out-of-place" in progress_line(items[4], 4, 12, 1.0, 65.0)
    assert "[5/12]" in progress_line(items[4], 4, 12, 1.0, 65.0)
    assert "about 1 min 05 s left" in progress_line(items[4], 4, 12, 1.0, 65.0)


def _sweep(budget, items, seconds_of):
    """Run the budget's decisions as run_bench does, with a clock that advances by ``seconds_of(item, bound)``
    for each measured item; the items measured."""
    elapsed, measured = 0.0, []
    for i, item in enumerate(items):
        go, bound = budget.decide(i, elapsed)
        if go:
            measured.append(item)
            elapsed += seconds_of(item, bound)
            budget.record(item, latency(item))
    return measured, elapsed


def latency(item):
    """A slow link: 50 us plus 25 MB/s."""
    return 50e-6 + item.size / 25e6


def test_the_bound_leaves_out_the_largest_sizes_not_the_communicators_after_them():
    """Each communicator and collective gets its share of the time left: the largest sizes of the first do not
    take the time of the second's small and middle sizes."""
    sizes = [8 * 8 ** k for k in range(9)]  # 8 B ... 128 MiB
    items = plan_items([("a", 4, "inter"), ("b", 2, "inter")], [sizes, sizes], ["iallreduce", "allreduce"],
                       (False,), 0)
    rule = IterationRule(min_iters=20, min_time=0.2, max_time=10.0, warmup=3)
    budget = Budget(120.0, items, rule, reserve=1.5)

    def seconds(item, bound):  # warm-up, timed iterations within the bound, the check
        t = latency(item) * (4 if item.what == "run" else 1)
        return (rule.warmup + 1) * t + max(t, min(max(rule.min_iters * t, rule.min_time), bound))

    measured, elapsed = _sweep(budget, items, seconds)
    assert elapsed <= 120.0 - 1.5 + 1e-9
    # the small and middle sizes of both communicators and collectives are measured; the largest are left out
    for name in ("a", "b"):
        for op in ("iallreduce", "allreduce"):
            got = {i.size for i in measured if (i.name, i.op, i.what) == (name, op, "op")}
            assert got >= set(sizes[:6]), (name, op, sorted(got))
            assert (name, op, sizes[-1]) in {(i.name, i.op, i.size) for i in budget.skipped if i.what == "op"}
    line = budget.skipped_line()
    assert line.startswith(f"--time-limit 120 s left out {len(budget.skipped)} of {len(items)} measurements")
    assert "allreduce on b" in line and "128 MiB" in line
    summary = budget.summary(elapsed)
    assert summary["measured"] + len(summary["skipped"]) == summary["planned"] == len(items)
    assert budget.left(0, 0.0) <= 120.0
    # no bound: everything runs
    free = Budget(0.0, items, rule, reserve=1.5)
    assert all(free.decide(i, 1e9)[0] for i in range(len(items))) and free.skipped_line() is None


def test_with_min_time_m_at_most_T_over_m_rows_are_measured():
    """The bound leaves sizes out rather than cut a measurement below --min-time: every measured row takes at
    least m seconds, so T seconds hold at most max(1, T/m) rows (what the test under mpiexec counts)."""
    items = plan_items([("world", 2, "intra")], [[8 * 4 ** k for k in range(8)]], ["iallreduce"], (False,), 0)
    rule = IterationRule(min_iters=1, min_time=0.25, max_time=1.0, warmup=1)
    budget = Budget(2.5, items, rule, reserve=1.5)
    measured, _ = _sweep(budget, items, lambda item, bound: max(0.25, min(bound, 0.25)))
    rows = [i for i in measured if i.what == "op"]
    assert 1 <= len(rows) <= 4 and budget.skipped
    fresh = Budget(2.5, items, rule, reserve=1.5)
    for i, _ in enumerate(items):
        go, bound = fresh.decide(i, 0.0)
        assert not go or bound >= rule.min_time


def test_the_prediction_comes_from_the_sizes_measured_before():
    items = plan_items([("x", 2, "intra")], [[8, 64, 512, 4096]], ["iallreduce", "iallgather"], (False,), 0)
    budget = Budget(100.0, items, IterationRule(), reserve=0.0)
    assert budget.per_call(0, "iallreduce", 8) is None  # nothing measured: the first runs
    op = {(i.op, i.size): i for i in items if i.what == "op"}
    budget.record(op[("iallreduce", 8)], 1e-5)
    budget.record(op[("iallreduce", 64)], 2e-5)
    assert budget.per_call(0, "iallreduce", 512) == pytest.approx(2e-5 + (1e-5 / 56) * (512 - 64))  # the line
    assert budget.per_call(0, "iallgather", 64) == pytest.approx(2e-5)  # the same size by another op
    assert budget.per_call(0, "iallgather", 4) == pytest.approx(1e-5)  # below every size: the smallest's


# -- the stream ---------------------------------------------------------------------------------------------

def _result():
    rows = [Row("world", "intra", 2, "iallreduce", 8, 3, 10e-6, False, 8e-6, 6e-6, 10e-6, 0, "world"),
            Row("world", "intra", 2, "iallreduce", 8, 3, 12e-6, True, 9e-6, 7e-6, 12e-6, 0, "world"),
            Row("world", "intra", 2, "iallreduce", 64, 3, 20e-6, False, 15e-6, 10e-6, 20e-6, 0, "world"),
            Row("world", "intra", 2, "allgather", 64, 3, 30e-6, False, 30e-6, 30e-6, 30e-6, 0, "world")]
    return {"rows": rows, "overlap": [], "syncs": [], "runs": [],
            "compute": {"alone": {"float32": 0.01}, "all": {"float32": 0.005}, "mem_bandwidth_gbs": {"alone": 1.0},
                        "op_overhead_s": {"alone": 1e-6}},
            "grids": [], "comms": [{"comm": "world", "axes": ["world"], "level": "intra", "p": 2}],
            "rule": "1 warm-up iteration", "bound": "--time-limit 300 s", "num_nodes": 1, "ranks_per_node": 2,
            "world_size": 2, "skipped_line": "--time-limit 300 s left out 1 of 5 measurements: allgather on world 8 B"}


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_the_stream_prints_what_the_report_holds(fmt):
    """Fed the rows of each size as they are measured, the stream writes, in the end, exactly the report's text;
    the rows (table, csv) before the end."""
    result = _result()
    out, err = io.StringIO(), io.StringIO()
    stream = StreamReport(fmt, out, err, every=5.0, clock=iter(range(0, 100, 1)).__next__)
    stream.begin(result)
    by_size = {}
    for r in result["rows"]:
        by_size.setdefault((r.op, r.size), []).append(r)
    items = plan_items([("world", 2, "intra")], [[8, 64]], ["iallreduce", "allgather"], (False, True), 0)
    for (op, size), rows in by_size.items():
        i = next(k for k, item in enumerate(items) if (item.what, item.op, item.size) == ("op", op, size))
        stream.progress(items[i], i, len(items), float(i), 10.0)
        stream.rows(rows)
        if fmt != "json":
            assert ROW.match(out.getvalue().splitlines()[-1]) or "," in out.getvalue().splitlines()[-1]
    if fmt == "json":
        assert out.getvalue() == ""  # one document, at the end
    stream.end(result)
    assert out.getvalue() == format_result(result, fmt) + "\n"
    if fmt == "json":
        doc = json.loads(out.getvalue())
        assert doc["bound"] == "--time-limit 300 s" and len(doc["rows"]) == 4
    # progress: at the first item, then at each new communicator and op (allgather); not within 5 s otherwise
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("fourd-mpi bench: [1/9] iallreduce on world") \
        and "allgather" in lines[1], lines
    assert "# left out: --time-limit 300 s left out 1 of 5" in format_result(result, "table")


# -- the fit gate says which sizes would pass ---------------------------------------------------------------

def test_the_gate_names_the_sizes_whose_fits_pass():
    """A token-bucket link: messages up to its burst pass at memory speed, larger ones at the link rate; one
    alpha-beta line misses them all, a line over the sizes above the burst fits."""
    def t(size):
        return 1e-4 + size / 1e9 if size <= 32 * 1024 else size / 25e6

    sizes = [2048 * 4 ** k for k in range(7)]  # 2 KiB ... 8 MiB
    rows = [Row("world", "inter", 4, "iallreduce", s, 5, t(s), False, t(s), t(s), t(s), 0, "world") for s in sizes]
    assert poor_fits(fits_profile(rows))  # over every size: refused
    lo, hi, worst = fit_window(rows)
    assert (lo, hi) == (128 * 1024, 8 * 1024 ** 2) and worst < 0.25
    line = poor_fit_line(poor_fits(fits_profile(rows)), 0.25, (lo, hi, worst), searched=True)
    assert "the fits pass over the sizes 128 KiB - 8 MiB" in line and "--min-size 128K --max-size 8M" in line
    assert "\n" not in line and "--accept-poor-fit" in line
    # no range of 3 sizes fits: said so
    noisy = [Row("world", "inter", 4, "iallreduce", s, 5, tt, False, tt, tt, tt, 0, "world")
             for s, tt in zip(sizes, [1e-3, 1e-5, 1e-3, 1e-5, 1e-3, 1e-5, 1e-3])]
    assert fit_window(noisy) is None
    assert "no range of 3 or more measured sizes passes" in poor_fit_line(poor_fits(fits_profile(noisy)),
                                                                          searched=True)


# -- the command under mpiexec ------------------------------------------------------------------------------

def _bench(nranks, args):
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, "-m", "fourd_mpi", "bench", "collectives",
           *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 3])
def test_rows_arrive_while_the_job_runs(nranks, tmp_path):
    """The first row comes out while the job is still running (31 more measurements of at least --min-time 0.2 s
    each follow it: 6 s or more, against reading one line from the pipe), rows
    arrive in the order they are measured (ascending sizes, the --ops order), and the progress line names the
    collective, size i of n and the time left."""
    proc = _bench(nranks, ["--ops", "iallreduce,iallgather", "--max-size", "64K", "--factor", "4", "--iters", "2",
                           "--min-time", "0.2", "--warmup", "1", "--overlap-sizes", "0", "--gemm-size", "16",
                           "--dtypes", "float32", "--accept-poor-fit", "-o", tmp_path / "p.yaml"])
    try:
        lines, running_at_first_row = [], None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if running_at_first_row is None and ROW.match(line):
                running_at_first_row = proc.poll() is None
        rc = proc.wait(timeout=300)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, err
    assert running_at_first_row is True
    blocks, current = [], None
    for line in lines:
        m = BLOCK.match(line)
        if m:
            current = (m.group(1), [])
            blocks.append(current)
        elif ROW.match(line):
            current[1].append(int(ROW.match(line).group(1)))
    assert [b[0] for b in blocks] == ["iallreduce", "iallgather"]
    for op, sizes in blocks:  # 8, 32, ..., 64K rounded up to whole elements on every rank, ascending
        assert sizes == sorted(sizes) and len(sizes) == 8, (op, sizes)
    assert any(line.startswith("machine profile ") for line in lines)  # the summary, after the rows
    progress = [line for line in err.splitlines() if line.startswith("fourd-mpi bench: [")]
    assert progress and re.search(r"\[1/\d+\] iallreduce on world \(p=%d\), size 1 of 8 \(\d+ B\), out-of-place; "
                                  r"[\d.]+ s elapsed, about .+ left" % nranks, progress[0]), progress


@pytest.mark.mpi
def test_the_time_limit_bounds_the_rows_measured(run_mpi, tmp_path):
    """--time-limit 2.5 and --min-time 0.5: the compute calibration runs first (at least 0.6 s: 0.2 s alone and
    0.4 s all at once), so at most (2.5 - 0.6) / 0.5 = 3 rows of the 8 sizes fit; what the bound left out is
    counted in the JSON and named in one line."""
    common = ["bench", "collectives", "--ops", "iallreduce", "--max-size", "64K", "--factor", "4", "--iters", "1",
              "--min-time", "0.5", "--max-time", "1", "--warmup", "1", "--overlap-sizes", "0", "--gemm-size", "16",
              "--dtypes", "float32", "--no-in-place", "--accept-poor-fit", "--format", "json"]
    proc = run_mpi(2, [*common, "--time-limit", "2.5", "-o", tmp_path / "p.yaml"], timeout=240)
    assert proc.returncode in (0, 1), proc.stderr  # 1: too few sizes left for a profile is a refusal, not a crash
    doc = json.loads(proc.stdout)
    rows, sweep = doc["rows"], doc["sweep"]
    assert len(rows) <= 3, [r["size"] for r in rows]
    assert sweep["planned"] == 9 and sweep["measured"] + len(sweep["skipped"]) == 9  # 8 sizes and the sync
    assert [r["size"] for r in rows] == sorted(r["size"] for r in rows)
    notes = [line for line in proc.stderr.splitlines() if "--time-limit 2.5 s left out" in line]
    assert len(notes) == 1 and "of 9 measurements" in notes[0], proc.stderr
    assert "fourd-mpi bench: compute calibration first" in proc.stderr
