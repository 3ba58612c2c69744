"""Figures of fourd_mpi.analysis.plots: hand-built analysis frames and a real 8-rank trace."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import types

import numpy as np
import pandas as pd
import pytest

matplotlib = pytest.importorskip("matplotlib")

import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from conftest import REPO, mpirun  # noqa: E402

from fourd_mpi.analysis import plots  # noqa: E402

FORMATS = ("png", "svg", "pdf")


# ---------------------------------------------------------------------------
# hand-built frames (the column spec of fourd_mpi.analysis.tables)
# ---------------------------------------------------------------------------

RUN_IDS = ["20260101-000000-aaaaaa", "20260101-000100-bbbbbb", "20260101-000200-fast-cccccc"]


def runs_frame():
    return pd.DataFrame(dict(
        run_id=RUN_IDS, label=["", "", "fast"], grid=["1x2x2x2", "1x1x2x4", "1x2x2x2"], world_size=[8, 8, 8],
        overlap=["none", "oag,ors,oar,dp,od (prefetch depth 1, 2 token chunks)", "oag,ors"],
        step_median_s=[0.04, 0.03, 0.02],
        config_key=["m/none/poll", "m/oag,ors,oar,dp,od/poll", "m/oag,ors/poll/fast"]))


def breakdown_frame():
    rows = []
    for k, rid in enumerate(RUN_IDS):
        for cat, v in [("gemm", 0.010), ("attention", 0.003), ("layernorm", 0.002), ("gelu", 0.001),
                       ("loss", 0.0005), ("harness", 0.0003), ("optimizer", 0.002)]:
            phase = "optimizer" if cat == "optimizer" else "none" if cat == "harness" else "forward"
            rows.append((rid, phase, cat, "none", v * (1 + 0.1 * k)))
        rows.append((rid, "backward", "gemm", "none", 0.01))
        for axis, v in [("x", 0.006), ("y", 0.004), ("z", 0.003)]:
            rows.append((rid, "backward", "exposed_comm", axis, v / (k + 1)))
        rows.append((rid, "all", "other", "none", 0.005))
    df = pd.DataFrame(rows, columns=["run_id", "phase", "category", "axis", "seconds_per_step"])
    df["share"] = df["seconds_per_step"] / df.groupby("run_id")["seconds_per_step"].transform("sum")
    return df


def comm_frame():
    rows = []
    for k, rid in enumerate(RUN_IDS):
        for op, axis in [("allgather", "z"), ("reduce_scatter", "z"), ("allreduce", "x"), ("allreduce", "y"),
                         ("allreduce", "data")]:
            pct = float("nan") if (k == 0 and axis == "data") else min(100.0, 10.0 + 30.0 * k + len(op))
            rows.append((rid, op, axis, 10.0, 1e6, 1e6, 1e-3, 1.0, 1.0, pct))
    return pd.DataFrame(rows, columns=["run_id", "op", "axis", "messages_per_step", "bytes_per_step",
                                       "wire_bytes_per_step", "inflight_median_s", "algbw_gbps", "busbw_gbps",
                                       "overlap_pct"])


def scaling_frame(mode):
    rows = []
    for key, base in [("gpt-tiny/none/poll", 0.03), ("gpt-tiny/oag,ors/poll", 0.02)]:
        for n, grid in [(1, "1x1x1x1"), (2, "1x1x1x2"), (4, "1x1x2x2"), (8, "1x2x2x2"), (16, "2x2x2x2")]:
            if mode == "weak":
                t = base * (1 + 0.05 * np.log2(n))
                rows.append((key, n, grid, t, n * base / t, base / t, base))
            else:
                t = base / n * (1 + 0.1 * np.log2(n))
                rows.append((key, n, grid, t, base / t, base / t / n, base / n))
    # a second grid of the same size: drawn as an open marker
    rows.append(("gpt-tiny/none/poll", 8, "1x1x2x4", rows[3][3] * 1.1, 0.0, rows[3][5] / 1.1, rows[3][6]))
    return pd.DataFrame(rows, columns=["config_key", "world_size", "grid", "step_median_s", "speedup",
                                       "efficiency", "ideal_step_s"])


# ---------------------------------------------------------------------------
# checks of written files
# ---------------------------------------------------------------------------

def check_file(path, fmt, texts=(), min_px=(300, 400)):
    assert os.path.isfile(path)
    size = os.path.getsize(path)
    assert size > 2000, f"{path} is only {size} bytes"
    if fmt == "png":
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[2] in (3, 4)
        h, w = img.shape[:2]
        assert h >= min_px[0] and w >= min_px[1], img.shape
        assert h <= 6000 and w <= 6000, img.shape
        assert img[..., :3].std() > 0.05  # not a blank canvas
    elif fmt == "svg":
        text = open(path, encoding="utf-8").read()
        assert text.lstrip().startswith("<?xml") and "<svg" in text
        for t in texts:
            assert t in text, f"{t!r} not in {path}"
    else:
        with open(path, "rb") as f:
            assert f.read(5) == b"%PDF-"


@pytest.fixture(autouse=True)
def no_leaked_figures():
    plt.close("all")
    yield
    assert plt.get_fignums() == [], "a plot function left a figure open"


# ---------------------------------------------------------------------------
# hand-built frames
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["weak", "strong"])
def test_scaling(tmp_path, fmt, mode):
    path = str(tmp_path / f"scaling.{fmt}")
    assert plots.plot_scaling(scaling_frame(mode), path, mode=mode) == path
    check_file(path, fmt, texts=["gpt-tiny, overlap none, progress poll", "gpt-tiny, overlap oag,ors, progress poll",
                                 "MPI ranks", "efficiency",
                                 "2x2x2x2", "16"])


def test_scaling_single_point_and_group_column(tmp_path):
    df = scaling_frame("weak").iloc[:1].copy()
    df["group"] = "line-a"
    path = plots.plot_scaling(df, str(tmp_path / "one.svg"))
    check_file(path, "svg", texts=["line-a"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("normalize", [False, True])
def test_breakdown(tmp_path, fmt, normalize):
    path = str(tmp_path / f"breakdown.{fmt}")
    assert plots.plot_breakdown(breakdown_frame(), runs_frame(), path, normalize=normalize) == path
    check_file(path, fmt, texts=["1x1x2x4", "overlap none", "fast", "gemm", "exposed comm, x axis",
                                 "exposed comm, z axis", "other"])


def test_breakdown_sums_phases_and_orders_like_runs(tmp_path):
    table = plots.breakdown_matrix(breakdown_frame())
    # gemm of the first run: forward 0.010 + backward 0.010
    assert table.loc[RUN_IDS[0], "gemm"] == pytest.approx(0.020)
    assert list(table.columns[-4:]) == ["exposed_comm:x", "exposed_comm:y", "exposed_comm:z", "other"]
    runs = runs_frame().iloc[::-1]
    path = plots.plot_breakdown(breakdown_frame(), runs, str(tmp_path / "h.png"), orientation="horizontal")
    check_file(path, "png")
    one = plots.plot_breakdown(breakdown_frame(), None, str(tmp_path / "phase.svg"), phase="backward")
    check_file(one, "svg", texts=[RUN_IDS[0], "phase backward"])


def test_breakdown_below_level_op(tmp_path):
    df = pd.DataFrame([("r", "all", "compute", "all", 0.01, 0.5), ("r", "all", "exposed_comm", "all", 0.008, 0.4),
                       ("r", "all", "other", "all", 0.002, 0.1)],
                      columns=["run_id", "phase", "category", "axis", "seconds_per_step", "share"])
    path = plots.plot_breakdown(df, None, str(tmp_path / "coarse.svg"))
    check_file(path, "svg", texts=["compute (all ops)", "exposed comm (all axes)"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_overlap(tmp_path, fmt):
    path = str(tmp_path / f"overlap.{fmt}")
    assert plots.plot_overlap(comm_frame(), path, runs_frame()) == path
    check_file(path, fmt, texts=["allgather", "reduce_scatter", "allreduce", "n/a", "in-flight",
                                 "overlap none", "%"])


def test_overlap_merges_extra_keys():
    df = comm_frame().iloc[:1].copy()
    df = pd.concat([df, df], ignore_index=True)
    df["phase"] = ["forward", "backward"]
    df["wait_s_per_step"] = [1.0, 3.0]
    df["inflight_s_per_step"] = [4.0, 4.0]
    table = plots.overlap_matrix(df)
    assert table.shape == (1, 1)
    assert table.iloc[0, 0] == pytest.approx(50.0)  # 100 * (1 - 4 / 8)


@pytest.mark.parametrize("call", [
    lambda df, p: plots.plot_scaling(df, p),
    lambda df, p: plots.plot_breakdown(df, None, p),
    lambda df, p: plots.plot_overlap(df, p),
])
def test_empty_frames_raise(tmp_path, call):
    columns = ["run_id", "config_key", "world_size", "step_median_s", "efficiency", "phase", "category",
               "seconds_per_step", "op", "axis", "overlap_pct"]
    with pytest.raises(ValueError, match="empty"):
        call(pd.DataFrame(columns=columns), str(tmp_path / "x.png"))
    assert not os.path.exists(tmp_path / "x.png")


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="missing column"):
        plots.plot_overlap(comm_frame().drop(columns="overlap_pct"), str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="must end in"):
        plots.plot_overlap(comm_frame(), str(tmp_path / "x.jpg"))
    with pytest.raises(ValueError, match="'weak' or 'strong'"):
        plots.plot_scaling(scaling_frame("weak"), str(tmp_path / "x.png"), mode="linear")
    with pytest.raises(ValueError, match="no rows of phase"):
        plots.plot_breakdown(breakdown_frame(), None, str(tmp_path / "x.png"), phase="sideways")
    with pytest.raises(ValueError, match="orientation"):
        plots.plot_breakdown(breakdown_frame(), None, str(tmp_path / "x.png"), orientation="diagonal")


def test_default_ranks_of_large_worlds():
    stub = types.SimpleNamespace(world_size=64)
    shown, note = plots._select_ranks(stub, None)
    assert shown == list(range(8)) and note == "ranks 0-7 of 64"
    shown, note = plots._select_ranks(types.SimpleNamespace(world_size=16), None)
    assert shown == list(range(16)) and note is None
    assert plots._select_ranks(stub, [3, 4, 5, 9])[1] == "ranks 3-5,9 of 64"


# ---------------------------------------------------------------------------
# a real 8-rank trace
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    from fourd_mpi.trace.read import load_trace

    results = tmp_path_factory.mktemp("plot-trace")
    proc = mpirun(8, ["run", "--gx", 2, "--gy", 2, "--gz", 2, "--steps", 3, "--overlap", "all",
                      "--results-dir", results, "--display", "quiet", "--peak-tflops", 1], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = glob.glob(str(results / "*.h5"))
    assert len(files) == 1, files
    return load_trace(files[0])


def expected_events(trace, step, ranks):
    df = trace.events_frame()
    sel = df[(df.step == step) & df["rank"].isin(ranks)]
    host = sel[sel.lane == "host"]
    comm = sel[sel.lane.astype(str).str.startswith("comm")]
    return dict(compute=int((host.op != "wait").sum()), wait=int((host.op == "wait").sum()), comm=len(comm))


def drawn_bars(fig):
    """Bars of event collections in the figure, by kind (gid ``event:<rank>:<row>:<op>``)."""
    out = dict(compute=0, wait=0, comm=0)
    for ax in fig.axes:
        for coll in ax.collections:
            gid = coll.get_gid() or ""
            if not gid.startswith("event:"):
                continue
            _, _, row, op = gid.split(":")
            kind = "comm" if row.startswith("comm") else "wait" if op == "wait" else "compute"
            out[kind] += len(coll.get_paths())
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("step, ranks", [(None, None), (2, [0, 3]), (0, 5)])
def test_timeline_counts(real_trace, step, ranks):
    fig, info = plots.timeline_figure(real_trace, step=step, ranks=ranks)
    try:
        want_step = 1 if step is None else step  # warm-up is step 0: default = first measured step
        want_ranks = list(range(8)) if ranks is None else ([ranks] if isinstance(ranks, int) else ranks)
        assert info["step"] == want_step and info["ranks"] == want_ranks
        want = expected_events(real_trace, want_step, want_ranks)
        assert want["compute"] > 0 and want["wait"] > 0 and want["comm"] > 0
        assert info["bars"] == want
        assert drawn_bars(fig) == want
        assert info["events"] == sum(want.values())
        # one collection per (rank, row, op): vectorized, not one artist per event
        assert len(info["collections"]) < sum(want.values()) / 5
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels.count("comm") == len(want_ranks)
        assert [x for x in labels if x != "comm"] == [f"rank {r}  host" for r in want_ranks]
        assert str(real_trace.metadata["run_id"]) in fig.axes[0].get_title()
        assert f"step {want_step}" in fig.axes[0].get_title()
    finally:
        plt.close(fig)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
def test_timeline_files(real_trace, tmp_path, fmt):
    path = str(tmp_path / f"timeline.{fmt}")
    assert plots.plot_timeline(real_trace, path) == path
    check_file(path, fmt, texts=["rank 0", "rank 7", "gemm", "allgather", "reduce_scatter", "allreduce",
                                 "wait (blocked)", "step 1", real_trace.metadata["grid"], "ms"],
               min_px=(800, 1000))


@pytest.mark.mpi
def test_timeline_invalid(real_trace, tmp_path):
    path = str(tmp_path / "t.png")
    with pytest.raises(ValueError, match=r"step 99 is not in the trace \(steps: 0-2\)"):
        plots.plot_timeline(real_trace, path, step=99)
    with pytest.raises(ValueError, match=r"rank 8 is out of range: the trace has ranks 0\.\.7"):
        plots.plot_timeline(real_trace, path, ranks=[0, 8])
    with pytest.raises(ValueError, match="rank -1 is out of range"):
        plots.plot_timeline(real_trace, path, ranks=-1)
    with pytest.raises(ValueError, match="ranks is empty"):
        plots.plot_timeline(real_trace, path, ranks=[])
    with pytest.raises(ValueError, match="step must be an integer"):
        plots.plot_timeline(real_trace, path, step="1")
    with pytest.raises(ValueError, match="must end in"):
        plots.plot_timeline(real_trace, str(tmp_path / "t.gif"))
    assert not os.path.exists(path)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", FORMATS)
def test_frames_of_real_trace(real_trace, tmp_path, fmt):
    analysis = pytest.importorskip("fourd_mpi.analysis.tables")
    runs = analysis.runs_table([real_trace])
    bd = analysis.breakdown(real_trace)
    cm = analysis.comm_table(real_trace)
    grid = real_trace.metadata["grid"]
    p = plots.plot_breakdown(bd, runs, str(tmp_path / f"breakdown.{fmt}"))
    check_file(p, fmt, texts=[grid, "gemm", "exposed comm, x axis", "other"])
    p = plots.plot_breakdown(bd, runs, str(tmp_path / f"share.{fmt}"), normalize=True)
    check_file(p, fmt, texts=["100 %", "share of the step"])
    p = plots.plot_overlap(cm, str(tmp_path / f"overlap.{fmt}"), runs)
    check_file(p, fmt, texts=["allgather", "allreduce", grid])
    # a real weak-scaling series: the committed sample traces, 1 to 8 ranks
    samples = sorted(glob.glob(str(REPO / "results" / "samples" / "weak-*.h5")))
    traces, problems = analysis.collect(samples)
    assert len(traces) == 4 and not problems
    sc = analysis.scaling(analysis.runs_table(traces), "weak")
    assert list(sc.world_size) == [1, 2, 4, 8]
    p = plots.plot_scaling(sc, str(tmp_path / f"scaling.{fmt}"), mode="weak")
    check_file(p, fmt, texts=["8", "1x2x2x2"])


def test_breakdown_bars_are_the_median_step_with_quartile_error_bars(tmp_path):
    df = breakdown_frame()
    totals = df.groupby("run_id").seconds_per_step.transform("sum")
    df["step_s"], df["step_q1_s"], df["step_q3_s"] = totals, totals * 0.9, totals * 1.2
    data = plots.breakdown_data(df)
    assert list(data.columns[-3:]) == ["step_s", "step_q1_s", "step_q3_s"]
    segments = data.drop(columns=["step_s", "step_q1_s", "step_q3_s"])
    assert list(segments.sum(axis=1)) == pytest.approx(list(data.step_s))
    assert list(data.step_q3_s / data.step_s) == pytest.approx([1.2] * 3)
    path = plots.plot_breakdown(df, runs_frame(), str(tmp_path / "bars.svg"))
    check_file(path, "svg", texts=["q1-q3 of step time", "median of max over ranks", "error bars: quartiles"])
    # frames without the step columns (older CSVs): bars, no error bars
    assert plots.breakdown_data(breakdown_frame()).step_s.isna().all()
    path = plots.plot_breakdown(breakdown_frame(), None, str(tmp_path / "plain.svg"))
    assert "q1-q3 of step time" not in open(path).read()


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["overlap", "breakdown", "timeline"])
def test_plot_command_as_typed(real_trace, tmp_path, kind):
    """The command, not the plotting function: `plot KIND TRACE [--baseline TRACE] -o FILE` writes the figure
    (`plot overlap --baseline` once ended in a NameError traceback)."""
    out = tmp_path / f"{kind}.png"
    extra = ["--baseline", real_trace.path] if kind == "overlap" else []
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "plot", kind, real_trace.path, *extra, "-o", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    check_file(str(out), "png")
