"""Machine profiles from published data: the ``network`` section (AxoNN's placement table, bus bandwidth
by size and GPU count, latency per rank), the cited sources, and bf16 (pure, no MPI)."""

import math
import os

import pytest
import yaml

from fourd_mpi.cli.main import main
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import PROFILES_DIR, axis_inner_products, axis_placement, load_profile
from fourd_mpi.perf.predict import predict
from fourd_mpi.perf.volumes import step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import resolve_model
from fourd_mpi.util.units import GIB


def test_inter_node_time_is_the_published_busbw_interpolated_in_log_size():
    pm = load_profile("perlmutter")
    # 1 GiB all-gather over 16 GPUs (ip 1): 61.6 GB/s measured; t = (p-1)/p * S / busbw
    assert pm.network_time("allgather", 16, GIB, 1, "inter") == pytest.approx(15 / 16 * GIB / 61.6e9)
    # 64 MiB is 2/3 of the way from 16 MiB to 128 MiB in log size: 34.1 + 2/3 (57.9 - 34.1)
    bw = 34.1 + 2 / 3 * (57.9 - 34.1)
    assert pm.busbw_by_size("allgather", 16, 64 * 2 ** 20)[0] == pytest.approx(bw)
    # 24 GPUs: between the 16 and 32 columns in log p
    w = math.log(24 / 16) / math.log(2)
    assert pm.busbw_by_size("allgather", 24, GIB)[0] == pytest.approx(61.6 + w * (63.0 - 61.6))
    # outside the table: clamped (1,024 GPUs take the 512 column)
    assert pm.busbw_by_size("allgather", 1024, 4 * GIB)[0] == pytest.approx(53.4)
    # ip = 2: two groups per node share its NICs (AxoNN's min(4, ip)); ip 8 shares like 4
    t1 = pm.network_time("reduce_scatter", 64, GIB, 1, "inter")
    assert pm.network_time("reduce_scatter", 64, GIB, 2, "inter") == pytest.approx(2 * t1)
    assert pm.network_time("reduce_scatter", 64, GIB, 8, "inter") == pytest.approx(4 * t1)
    # below the smallest measured size: at least the latency term, 9 us per rank
    assert pm.network_time("allgather", 512, 1024, 1, "inter") == pytest.approx(512 * 9e-6)


def test_intra_node_groups_use_axonns_placement_table_with_latency():
    pm = load_profile("perlmutter")
    # group of 4 inside a node (ip 1): 225 GB/s; all-reduce latency = all-gather + reduce-scatter per rank
    t = pm.network_time("allreduce", 4, 1e8, 1, "intra")
    assert t == pytest.approx(4 * 18e-6 + 2 * 3 / 4 * 1e8 / 225e9)
    assert pm.network_time("allgather", 2, 1e8, 2, "intra") == pytest.approx(2 * 9e-6 + 1e8 / 2 / 76e9)


def test_frontier_allreduce_combines_reduce_scatter_and_allgather():
    fr = load_profile("frontier")
    ag, rs = 71.6, 73.7  # 256 GCDs at 1 GB
    assert fr.busbw_by_size("allreduce", 256, 1e9)[0] == pytest.approx(2 / (1 / ag + 1 / rs))
    assert fr.placement_gbs(4, 2) == 36 and fr.placement_gbs(16, 64) == 5


def _write(tmp_path, name, data):
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        yaml.safe_dump(data, fh)
    return path


def test_placement_rule_and_inter_node_fallback(tmp_path):
    base = yaml.safe_load(open(os.path.join(PROFILES_DIR, "perlmutter.yaml")))
    base["network"]["use"] = "placement"
    prof = load_profile(_write(tmp_path, "p.yaml", base))
    # AxoNN's latency-aware model: latency * G + volume / get_bw(ip, group); ip 4: 20 GB/s
    assert prof.network_time("allgather", 8, 1e9, 4, "inter") == pytest.approx(8 * 9e-6 + 7 / 8 * 1e9 / 20e9)
    del base["network"]["busbw_by_size"]
    base["network"]["use"] = "measured"
    prof = load_profile(_write(tmp_path, "q.yaml", base))
    # no size table: inter_node_gbs / min(ip, 4) plus the latency
    assert prof.network_time("allgather", 8, 1e9, 2, "inter") == pytest.approx(8 * 9e-6 + 7 / 8 * 1e9 / (59.52e9 / 2))


def test_bad_size_table_is_one_line_naming_the_key(tmp_path):
    base = yaml.safe_load(open(os.path.join(PROFILES_DIR, "perlmutter.yaml")))
    base["network"]["busbw_by_size"]["allgather"]["busbw_gbs"][0] = [1.0, 2.0]
    with pytest.raises(ConfigError, match=r"network.busbw_by_size.allgather: busbw_gbs must have 4 rows") as exc:
        load_profile(_write(tmp_path, "bad.yaml", base))
    assert "\n" not in str(exc.value)
    base = yaml.safe_load(open(os.path.join(PROFILES_DIR, "perlmutter.yaml")))
    base["network"]["busbw_by_size"]["reduce_scatter"] = "allreduce"
    with pytest.raises(ConfigError, match="names 'allreduce', which has no table"):
        load_profile(_write(tmp_path, "bad2.yaml", base))


def test_predict_costs_every_collective_with_the_network_section():
    pm = load_profile("perlmutter")
    cfg = resolve_model("gpt-tiny")
    grid = GridShape(2, 2, 1, 2)  # x intra (ip 1), z inter (ip 2), data inter (ip 4)
    pred = predict(cfg, grid, pm, OverlapConfig(), "bfloat16")
    place, inner = axis_placement(grid, 4), axis_inner_products(grid)
    assert inner == {"x": 1, "y": 2, "z": 2, "data": 4}
    expected = sum(c.count * pm.network_time(c.op, c.p, c.message_bytes, inner[c.axis], place[c.axis], 4)
                   for c in step_collectives(cfg, grid, OverlapConfig(), "bfloat16"))
    assert pred.comm_total_s == pytest.approx(expected)


@pytest.mark.parametrize("name", ["perlmutter", "frontier"])
def test_every_constant_has_a_source_and_no_tuning_is_stated(name):
    path = os.path.join(PROFILES_DIR, f"{name}.yaml")
    text = open(path).read()
    assert "No constant was tuned" in text
    data = load_profile(name).data
    src = data["sources"]
    for dtype in data["compute"]["gemm_tflops"]:
        assert f"compute.gemm_tflops.{dtype}" in src
    for key in ("mem_bandwidth_gbs", "op_overhead_s", "device", "training_dtype"):  # device: its peaks in perf/peaks.py
        assert f"compute.{key}" in src
    for key in data["network"]:
        if key not in ("description", "use", "busbw_by_size"):
            assert f"network.{key}" in src
    for op in data["network"]["busbw_by_size"]:
        assert f"network.busbw_by_size.{op}" in src
    for level in data["levels"]:
        assert f"levels.{level}" in src
    assert "progress.overlap_efficiency" in src
    # what is carried over or not measured says so
    gemm = src["compute.gemm_tflops.bfloat16"]
    if name == "perlmutter":  # the A100's own published matmul ceiling at the sustained clock
        assert "[mamf]" in gemm and "[clock]" in gemm and "assumption" in gemm
    else:
        assert all(w in gemm for w in ("transfer", "0.809"))


def test_bf16_rates_and_training_dtype(tmp_path):
    pm = load_profile("perlmutter")
    assert pm.gemm_tflops("bfloat16") == 248.0 and pm.peak_tflops("bfloat16") == 312.0  # 267.9 x 1305/1410
    assert pm.training_dtype == "bfloat16" and load_profile("laptop").training_dtype == "float32"
    # a profile calibrated before bf16 existed: its float16 rate, noted
    base = yaml.safe_load(open(os.path.join(PROFILES_DIR, "laptop.yaml")))
    prof = load_profile(_write(tmp_path, "old.yaml", base))
    assert prof.gemm_tflops("bfloat16") == 0.005 and any("no bfloat16 GEMM rate" in n for n in prof.notes)
    del base["compute"]["gemm_tflops"]["float16"]
    with pytest.raises(ConfigError, match="no GEMM rate for bfloat16"):
        load_profile(_write(tmp_path, "old2.yaml", base)).gemm_tflops("bfloat16")


def test_tune_defaults_to_the_sites_training_dtype(capfd):
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--site", "perlmutter", "--top", "1"]) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[0].startswith("dtype bfloat16: the training dtype of machine profile perlmutter")
    assert "; bfloat16" in out
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--profile", "laptop", "--top", "1"]) == 0
    assert capfd.readouterr().out.startswith("dtype float32: the training dtype of machine profile laptop")
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--site", "perlmutter", "--dtype", "float16",
                 "--top", "1"]) == 0
    out = capfd.readouterr().out
    assert "training dtype" not in out and "; float16" in out
