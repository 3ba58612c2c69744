"""One step-time statistic everywhere, and the per-step export.

The run summary printed by ``fourd-mpi run``, the runs and breakdown tables of ``fourd-mpi analyze``
and the data frame behind ``fourd-mpi plot breakdown`` show the same step time (median over the
measured steps of the max over ranks) and quartiles, to the last printed digit.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
from conftest import REPO, mpi_env, mpirun

from fourd_mpi.analysis import plots
from fourd_mpi.analysis.tables import STEPS_COLUMNS, breakdown, runs_table, steps_table
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.summary import Summary, step_stats
from fourd_mpi.util.text import format_number

SAMPLES = REPO / "results" / "samples"

_SUMMARY = re.compile(r"step time: median (\S+) s over (\d+) step\(s\) \(min (\S+), q1 (\S+), q3 (\S+), max (\S+);")


def fourd(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


def table_cells(text: str, section: str) -> dict:
    """The first data row of a ``== section ==`` table printed by ``analyze``: column -> printed cell."""
    block = text.split(f"== {section} ==", 1)[1].strip().splitlines()
    header, row = block[0].split(), block[2].split()
    assert len(header) == len(row), block[:3]
    return dict(zip(header, row))


def printed_everywhere(trace_path, summary_lines, tmp_path):
    """The step median, q1 and q3 as each place prints them: the run summary, ``analyze`` (runs and
    breakdown tables) and the plot's data frame (formatted as the tables format numbers)."""
    proc = fourd("analyze", trace_path, "--what", "runs,breakdown")
    assert proc.returncode == 0, proc.stderr
    runs = table_cells(proc.stdout, "runs")
    wide = table_cells(proc.stdout, "breakdown")
    match = _SUMMARY.search("\n".join(summary_lines))
    assert match, summary_lines
    trace = load_trace(str(trace_path))
    data = plots.breakdown_data(breakdown(trace))
    assert len(data) == 1
    frame = data.iloc[0]
    # the bars of the figure: segments summing to step_s, error bar q1-q3
    segments = data.drop(columns=["step_s", "step_q1_s", "step_q3_s"]).iloc[0]
    assert float(segments.sum()) == pytest.approx(float(frame.step_s), rel=1e-12)
    svg = tmp_path / "breakdown.svg"
    proc = fourd("plot", "breakdown", trace_path, "-o", svg)
    assert proc.returncode == 0, proc.stderr
    bar_label = f"{float(frame.step_s) * 1e3:.3g} ms"  # the figure's own label (3 digits, ms)
    assert bar_label in svg.read_text()
    return {
        "summary": (match.group(1), match.group(4), match.group(5)),
        "analyze runs": (runs["step_median_s"], runs["step_q1_s"], runs["step_q3_s"]),
        "analyze breakdown": (wide["step_s"], None, None),
        "plot data": tuple(format_number(float(frame[c])) for c in ("step_s", "step_q1_s", "step_q3_s")),
    }


def check_agree(found):
    median, q1, q3 = found["summary"]
    for where, (m, a, b) in found.items():
        assert m == median, (where, found)
        if a is not None:
            assert (a, b) == (q1, q3), (where, found)


def test_sample_trace_agrees_everywhere(tmp_path):
    """On a committed sample: the summary the run printed (stored in the trace), analyze and the plot."""
    path = SAMPLES / "grid-1x2x2x2-overlap.h5"
    trace = load_trace(str(path))
    stored = trace.metadata["summary"]
    summary = Summary(**{f.name: stored[f.name] for f in fields(Summary) if f.name in stored})
    found = printed_everywhere(path, summary.lines(), tmp_path)
    check_agree(found)
    stats = step_stats(trace)
    assert found["summary"][0] == format_number(stats.median_s)
    # the number the issue reported as two different step times for one run
    assert runs_table([trace]).step_median_s[0] == breakdown(trace).step_s[0] == stats.median_s


@pytest.mark.mpi
def test_real_run_summary_analyze_and_plot_agree(tmp_path):
    results = tmp_path / "results"
    proc = mpirun(4, ["run", "--model", "gpt-tiny", "--gx", "2", "--gz", "2", "--batch", "8", "--steps", "6",
                      "--warmup", "1", "--display", "quiet", "--peak-tflops", "1", "--results-dir", results,
                      "--run-id", "agree"], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    path = results / "agree.h5"
    found = printed_everywhere(path, lines, tmp_path)
    check_agree(found)
    assert _SUMMARY.search(proc.stdout).group(2) == "5"
    # the stored summary is the printed one
    trace = load_trace(str(path))
    stats = step_stats(trace)
    assert trace.metadata["summary"]["median_s"] == stats.median_s
    assert (trace.metadata["summary"]["q1_s"], trace.metadata["summary"]["q3_s"]) == (stats.q1_s, stats.q3_s)
    # and the per-step export reproduces it: median over measured steps of step_max_s
    steps = steps_table(trace)
    per_step = steps[~steps.warmup].groupby("step").step_max_s.first()
    assert float(np.median(per_step)) == stats.median_s
    measured = steps[~steps.warmup]
    assert (measured.compute_s + measured.harness_s).sum() / measured.step_s.sum() == pytest.approx(
        trace.metadata["summary"]["compute_share"] + trace.metadata["summary"].get("harness_share", 0), rel=1e-9)
    waits = measured[[f"wait_{a}_s" for a in ("data", "z", "y", "x")]].sum(axis=1)
    assert list(waits) == pytest.approx(list(measured.wait_s), rel=1e-9, abs=1e-9)
    assert (measured.mpi_s >= measured.wait_s).all()  # MPI time: waits, and the I* calls and tests


# ---------------------------------------------------------------------------
# analyze --what steps
# ---------------------------------------------------------------------------

def test_steps_table_known_answers(tmp_path):
    """The hand-placed trace of test_analysis: every value is that of the /rank_steps record."""
    from test_analysis import BWD, SPAN, WAIT, hand_events, write_trace

    trace = load_trace(write_trace(tmp_path / "hand-run.h5", hand_events(), world=2))
    df = steps_table(trace)
    assert list(df.columns) == STEPS_COLUMNS and len(df) == 6
    assert list(zip(df.step, df["rank"])) == [(s, r) for s in range(3) for r in range(2)]
    assert list(df.warmup) == [True, True, False, False, False, False]
    assert (df.run_id == "hand-run").all()
    assert list(df.step_s * 1e9) == pytest.approx([SPAN[r][s] for s in range(3) for r in range(2)])
    assert list(df.step_max_s * 1e9) == pytest.approx([max(SPAN[0][s], SPAN[1][s]) for s in range(3) for _ in range(2)])
    assert list(df.compute_s * 1e9) == pytest.approx([150 + (5000 if s == 0 else BWD[r])
                                                      for s in range(3) for r in range(2)])
    assert list(df.wait_s * 1e9) == pytest.approx([WAIT[r] for _ in range(3) for r in range(2)])
    assert list(df.wait_x_s * 1e9) == pytest.approx([WAIT[r] for _ in range(3) for r in range(2)])
    assert (df[["wait_data_s", "wait_z_s", "wait_y_s", "harness_s"]] == 0).all().all()
    assert list(df.mpi_s) == list(rs_mpi := trace.rank_steps["mpi_ns"][
        np.lexsort((trace.rank_steps["rank"], trace.rank_steps["step"]))] * 1e-9) and (rs_mpi > 0).all()
    assert list(df.loss) == [1.0] * 6
    rs = trace.rank_steps[np.lexsort((trace.rank_steps["rank"], trace.rank_steps["step"]))]
    assert list(df.step_s) == list((rs["end_ns"] - rs["start_ns"]) * 1e-9)
    assert list(df.compute_s) == list(rs["compute_ns"] * 1e-9)
    assert list(df.wait_s) == list(rs["wait_ns"] * 1e-9)
    assert list(df.loss) == list(rs["loss"])
    # below level op the per-axis MPI time is unknown
    coarse = steps_table(load_trace(write_trace(tmp_path / "coarse.h5", hand_events(), world=2, level="step")))
    assert coarse[[f"wait_{a}_s" for a in ("data", "z", "y", "x")]].isna().all().all()
    assert list(coarse.wait_s) == list(df.wait_s)


def test_analyze_steps_formats(tmp_path):
    path = SAMPLES / "weak-2.h5"
    expected = steps_table(load_trace(str(path)))
    out = tmp_path / "steps.csv"
    proc = fourd("analyze", path, "--what", "steps", "--format", "csv", "-o", out)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert list(rows[0]) == STEPS_COLUMNS and len(rows) == len(expected) == 8
    for row, (_, want) in zip(rows, expected.iterrows()):
        assert (row["run_id"], int(row["step"]), int(row["rank"]), row["warmup"]) == \
            (want.run_id, want.step, want["rank"], str(want.warmup))
        for column in STEPS_COLUMNS[4:]:
            assert float(row[column]) == pytest.approx(float(want[column]), rel=1e-14), column
    proc = fourd("analyze", path, "--what", "steps", "--format", "json")
    data = json.loads(proc.stdout)
    assert list(data) == ["steps"] and len(data["steps"]) == 8
    assert [(r["step"], r["rank"], r["warmup"]) for r in data["steps"]] == \
        [(int(s), int(r), bool(w)) for s, r, w in zip(expected.step, expected["rank"], expected.warmup)]
    assert [r["step_s"] for r in data["steps"]] == pytest.approx(list(expected.step_s), rel=1e-14)
    assert [r["wait_x_s"] for r in data["steps"]] == pytest.approx(list(expected.wait_x_s), rel=1e-14)
    assert [r["mpi_s"] for r in data["steps"]] == pytest.approx(list(expected.mpi_s), rel=1e-14)
    md = fourd("analyze", path, "--what", "steps", "--format", "markdown")
    assert md.returncode == 0 and "## steps" in md.stdout
    assert re.search(r"^\| run_id +\| +step \| +rank \|", md.stdout, re.M), md.stdout
    table = fourd("analyze", path, "--what", "steps")
    assert table.returncode == 0 and "wait_x_s" in table.stdout
    assert "== steps ==" not in fourd("analyze", path).stdout  # only when asked for
