"""``fourd-mpi bench collectives``: pure helpers, and the calibration end to end under mpiexec."""


import numpy as np
import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import bus_factor, fit_alpha_beta
from fourd_mpi.run.collbench import default_grids, imb_overlap, message_sizes, osu_overlap


def test_message_sizes_are_whole_elements_per_rank():
    assert message_sizes(8, 4096, 8, 4 * 3) == [12, 72, 516, 4104]
    assert message_sizes(8, 64, 2, 4) == [8, 16, 32, 64]
    with pytest.raises(ConfigError, match="larger than --max-size"):
        message_sizes(64, 8, 2, 4)


def test_formulas():
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert osu_overlap(t_ovrl=1.0, t_cpu=1.0, t_pure=1.0) == 100.0  # fully hidden
    assert osu_overlap(t_ovrl=2.0, t_cpu=1.0, t_pure=1.0) == 0.0    # serialized
    assert imb_overlap(t_ovrl=1.5, t_cpu=1.0, t_pure=1.0) == 50.0
    assert imb_overlap(t_ovrl=3.0, t_cpu=1.0, t_pure=1.0) == 0.0


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 5e-6, 2e-10
    pts = []
    for kind in ("allreduce",):
        for p in (2, 4, 8):
            for s in (8, 1024, 65536, 1 << 20):
                k = 2
                pts.append((kind, p, s, k * (p - 1) * alpha + k * (p - 1) / p * s * beta))
    fit = fit_alpha_beta(pts)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["rms_rel_error"] < 1e-9
    assert fit_alpha_beta([]) is None


def test_default_grids_cover_every_group_size():
    assert [str(g) for g in default_grids(12)] == ["6x1x1x2", "4x1x1x3", "3x1x1x4", "2x1x1x6"]
    assert default_grids(5) == []


@pytest.mark.mpi
@pytest.mark.parametrize("nranks, flags", [(3, []), (4, ["--gx", "2", "--gy", "2"])])
def test_calibration_end_to_end(run_mpi, tmp_path, nranks, flags):
    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.perf.predict import predict
    from fourd_mpi.step.presets import resolve_model

    out = tmp_path / "prof.yaml"
    table = tmp_path / "table.txt"
    proc = run_mpi(nranks, ["bench", "collectives", *flags, "--max-size", "4K", "--factor", "8", "--iters", "3",
                            "--min-time", "0", "--accept-poor-fit", "--warmup", "1", "--overlap-sizes", "1",
                            "--gemm-size", "64", "--dtypes", "float32",
                            "-o", out, "--report", table, "--name", "t"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for word in ("iallgather", "ireduce_scatter", "iallreduce", "allgather", "reduce_scatter", "allreduce",
                 "busbw", "#wrong", "in-place", "out-of-place", "OSU%", "IMB%",
                 "# OSU overlap % = max(0, 100 - 100*(t_ovrl - t_cpu)/t_pure)", "no inter-node level",
                 "# Avg bus bandwidth    :", "# Out of bounds values : 0 OK"):
        assert word in text, word
    assert "world" in text
    if flags:  # y has the size of x: measured once, reported for both
        assert "on 1x1x2x2:x,1x1x2x2:y (intra-node, p = 2)" in text
    prof = load_profile(str(out))
    assert prof.name == "t" and prof.ranks_per_node == nranks
    assert set(prof.data["levels"]) == {"intra"}
    assert prof.gemm_tflops("float32") > 0 and prof.data["compute"]["oversubscription"] >= 1
    # the model can use it for grids on this node, and says what is missing beyond it
    cfg = resolve_model("mlp-tiny", batch=12, hidden=12 * 4, ffn_hidden=24 * 4)
    grid = GridShape(1, 1, 1, nranks) if nranks == 3 else GridShape(1, 1, 2, 2)
    assert predict(cfg, grid, prof).step_s > 0
    with pytest.raises(ConfigError, match="no 'inter' level"):
        predict(cfg, GridShape(2, 1, 1, nranks), prof)
    assert table.read_text().startswith("# fourd-mpi bench collectives")


@pytest.mark.mpi
def test_bad_input_is_one_line_once(run_mpi, tmp_path):
    """Errors in the options: one line, printed by rank 0 only; every rank exits 2."""
    quick = ["--ops", "allreduce", "--max-size", "8", "--iters", "1", "--min-time", "0", "--warmup", "0",
             "--overlap-sizes", "0",
             "--gemm-size", "16", "--dtypes", "float32", "--no-in-place"]
    for args, message in ((["--grid", "1x1x2x2"], "product is not the world size 3"),
                          (["--ops", "alltoall"], "--ops: unknown alltoall"),
                          (["--min-size", "1M", "--max-size", "8"], "larger than --max-size"),
                          (["--format", "xml"], "invalid choice: 'xml'"),  # argparse, before MPI
                          # rank 0 checks it before the run (was: after it), every rank exits 2
                          ([*quick, "--report", tmp_path / "no" / "dir" / "r.txt"],
                           "does not exist (create it first)")):
        proc = run_mpi(3, ["bench", "collectives", "-o", tmp_path / "x.yaml", *args], timeout=60)
        assert proc.returncode == 2, proc.stderr
        errors = [l for l in proc.stderr.splitlines() if l.startswith("fourd-mpi: error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "x.yaml").exists()


def test_result_check_patterns_and_counter():
    """The fill pattern gives exact expected results, and the counter finds corrupted elements."""
    from fourd_mpi.run.collbench import count_wrong, fill_pattern

    p, size = 3, 4 * 3 * 10
    inputs = {k: [fill_pattern(k, size, p, r)[0] for r in range(p)] for k in ("allreduce", "allgather",
                                                                             "reduce_scatter")}
    total = np.sum(inputs["allreduce"], axis=0)
    for r in range(p):
        assert np.array_equal(fill_pattern("allreduce", size, p, r)[1], total)
        assert np.array_equal(fill_pattern("allgather", size, p, r)[1], np.concatenate(inputs["allgather"]))
        rs_total = np.sum(inputs["reduce_scatter"], axis=0)
        n = rs_total.size // p
        assert np.array_equal(fill_pattern("reduce_scatter", size, p, r)[1], rs_total[r * n:(r + 1) * n])
    result = total.copy()
    assert count_wrong(result, total) == 0
    result[[1, 5]] += 1
    assert count_wrong(result, total) == 2
    assert count_wrong(result[:-1], total) == total.size  # wrong shape: everything is wrong


@pytest.mark.mpi
def test_ops_subset_csv_and_json(run_mpi, tmp_path):
    """--ops any subset: only those measured, csv/json rows parse back with the expected columns; the
    profile holds fits of what was measured only and says which ops it lacks; an axis of every rank
    is the world's group (measured once, listed under both names)."""
    import csv
    import io
    import json

    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.perf.predict import predict
    from fourd_mpi.run.collbench import CSV_COLUMNS
    from fourd_mpi.step.presets import resolve_model

    common = ["bench", "collectives", "--max-size", "512", "--iters", "2", "--min-time", "0", "--accept-poor-fit",
              "--warmup", "1", "--overlap-sizes", "0", "--gemm-size", "32", "--dtypes", "float32"]
    prof_path = tmp_path / "p.yaml"
    proc = run_mpi(3, [*common, "-o", prof_path, "--ops", "iallreduce,allreduce,iallgather", "--format", "csv",
                       "--report", tmp_path / "r.csv"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.csv").read_text().strip() == proc.stdout.strip()
    assert proc.stdout.startswith("# latency:") and "# algbw = S / latency;  busbw = algbw" in proc.stdout
    body = "\n".join(l for l in proc.stdout.splitlines() if not l.startswith("#"))
    rows = list(csv.DictReader(io.StringIO(body)))
    assert rows and list(rows[0]) == CSV_COLUMNS
    assert {r["op"] for r in rows} == {"iallreduce", "allreduce", "iallgather"}
    assert {r["placement"] for r in rows} == {"out-of-place", "in-place"}
    assert all(r["wrong"] == "0" and float(r["time_us"]) > 0 for r in rows)
    assert all(float(r["min_lat_us"]) <= float(r["avg_lat_us"]) <= float(r["max_lat_us"]) for r in rows)
    assert {r["redop"] for r in rows if r["op"] == "iallgather"} == {"none"}
    assert {r["count"] for r in rows} >= {str(int(r["size"]) // 4) for r in rows}
    # the profile: fits of what was measured, and the op it lacks
    assert "no fit of reduce_scatter" in proc.stderr and "ireduce_scatter" in proc.stderr
    prof = load_profile(str(prof_path))
    assert prof.data["calibration"]["missing_ops"] == ["ireduce_scatter"]
    assert prof.data["calibration"]["measured_ops"] == ["iallreduce", "allreduce", "iallgather"] or \
        set(prof.data["calibration"]["measured_ops"]) == {"iallreduce", "allreduce", "iallgather"}
    assert prof.missing_fits() == ["intra:reduce_scatter"] and "no fit of intra:reduce_scatter" in prof.describe()
    assert set(prof.data["levels"]["intra"]) >= {"allreduce", "allgather"}
    cfg = resolve_model("gpt-tiny", batch=6)
    with pytest.raises(ConfigError, match="no reduce_scatter fit at the 'intra' level.*--ops including "
                                          "ireduce_scatter"):
        predict(cfg, GridShape(1, 3, 1, 1), prof)  # z uses reduce-scatters
    with_fb = load_profile(str(prof_path), fallback="laptop")
    pred = predict(cfg, GridShape(1, 3, 1, 1), with_fb)
    assert pred.step_s > 0 and any("no reduce_scatter fit" in n and "laptop" in n for n in pred.notes)

    # 2 ranks, --gx 2: x spans every rank, so it is the world's group: one measurement, both names
    proc = run_mpi(2, [*common, "-o", tmp_path / "q.yaml", "--gx", "2", "--ops", "reduce_scatter", "--format",
                       "json", "--no-in-place"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {r["op"] for r in doc["rows"]} == {"reduce_scatter"} and doc["formulas"]
    assert {r["placement"] for r in doc["rows"]} == {"out-of-place"}
    assert set(doc["rows"][0]) == set(CSV_COLUMNS)
    assert [c["axes"] for c in doc["communicators"]] == [["1x1x1x2:x", "world"]]
    assert {r["axes"] for r in doc["rows"]} == {"1x1x1x2:x,world"}
    assert doc["wrong"] == 0 and doc["avg_busbw_gbps"] > 0 and "us" in doc["units"]
    # only a blocking op: nothing to fit, so no profile, and it says why (stdout stays JSON)
    assert doc["profile"]["path"] is None and "no machine profile written" in doc["profile"]["reason"]
    assert "no machine profile written" in proc.stderr
    assert not (tmp_path / "q.yaml").exists()


@pytest.mark.mpi
def test_same_size_axes_reported_for_both(run_mpi, tmp_path):
    """y the same size as x on one node: measured once, listed (table header, csv axes) under both."""
    import csv
    import io

    proc = run_mpi(4, ["bench", "collectives", "--gx", "2", "--gy", "2", "--no-world", "--ops", "iallreduce",
                       "--max-size", "64", "--iters", "2", "--min-time", "0", "--accept-poor-fit", "--warmup", "0",
                       "--overlap-sizes", "0", "--gemm-size",
                       "16", "--dtypes", "float32", "--no-in-place", "-o", tmp_path / "p.yaml", "--format", "csv"],
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO("\n".join(l for l in proc.stdout.splitlines() if not l.startswith("#")))))
    assert {r["axes"] for r in rows} == {"1x1x2x2:x,1x1x2x2:y"} and {r["p"] for r in rows} == {"2"}
    assert len(rows) == len({r["size"] for r in rows})  # once per size, not once per axis


def test_report_formats_without_mpi():
    """Table, csv and json of a hand-made result: the nccl-tests columns, the closing lines, a wrong
    element reported as FAILED, NaN as JSON null, times in us."""
    import csv
    import io
    import json

    from fourd_mpi.perf.calibration import Row
    from fourd_mpi.run.collbench import CSV_COLUMNS, avg_busbw, format_result, total_wrong

    rows = [Row("world", "intra", 2, "iallreduce", 64, 3, 10e-6, False, 8e-6, 6e-6, 10e-6, 0, "world"),
            Row("world", "intra", 2, "iallreduce", 64, 3, 20e-6, True, 15e-6, 10e-6, 20e-6, 3, "world"),
            Row("world", "intra", 2, "allgather", 64, 3, 0.0, False, 0.0, 0.0, 0.0, 0, "world")]
    result = {"rows": rows, "overlap": [], "syncs": [{"comm": "world", "axes": "world", "level": "intra", "p": 2,
                                                      "sync_s": 5e-6}],
              "compute": {"alone": {"float32": 0.01}, "all": {"float32": 0.005}, "mem_bandwidth_gbs": {"alone": 1.0},
                          "op_overhead_s": {"alone": 1e-6}},
              "grids": [], "comms": [{"comm": "world", "axes": ["world"], "level": "intra", "p": 2}],
              "num_nodes": 1, "ranks_per_node": 2, "world_size": 2}
    assert total_wrong(result) == 3
    # busbw = algbw * 2(p-1)/p = S/t for p = 2: 6.4 and 3.2 GB/s; the row with t = 0 has none
    assert avg_busbw(result) == pytest.approx((64 / 10e-6 + 64 / 20e-6) / 2 / 1e9)
    table = format_result(result, "table")
    head = [l for l in table.splitlines() if l.startswith("#") and "size" in l and "count" in l][0]
    for word in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "avg", "min", "max"):
        assert word in head, word
    assert "# Out of bounds values : 3 FAILED" in table and "# Avg bus bandwidth    : 0.0048 GB/s" in table
    assert "5.0 us" in table  # synchronization in us
    doc = json.loads(format_result(result, "json"))  # strict: no NaN
    assert doc["wrong"] == 3 and doc["rows"][2]["algbw_gbps"] is None
    assert doc["rows"][1]["placement"] == "in-place" and doc["rows"][1]["time_us"] == pytest.approx(20)
    assert doc["sync"][0]["sync_us"] == pytest.approx(5) and doc["compute"]["op_overhead_us"]["alone"] == 1
    text = format_result(result, "csv")
    parsed = list(csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#")))))
    assert list(parsed[0]) == CSV_COLUMNS and [r["wrong"] for r in parsed] == ["0", "3", "0"]
