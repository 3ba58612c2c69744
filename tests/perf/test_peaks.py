"""The one table of data-sheet peaks and the three utilization figures (MFU, HFU, % of measured GEMM):
known answers."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import yaml

from fourd_mpi.perf import peaks
from fourd_mpi.perf.machine import PROFILES_DIR, load_profile
from fourd_mpi.trace.events import RANK_STEP_DTYPE
from fourd_mpi.trace.summary import summarize


@pytest.mark.parametrize("runtime_name, entry", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200"),
    ("AMD Instinct MI250X gfx90a", "mi250x-gcd"), ("Tesla V100-SXM2-16GB", None)])
def test_runtime_names_find_their_data_sheet(runtime_name, entry):
    dev = peaks.match_device(runtime_name)
    assert (dev.name if dev else None) == entry


def test_data_sheet_values_and_dtype_columns():
    a100, h100 = peaks.device("a100"), peaks.device("h100-sxm")
    assert peaks.peak_tflops(a100, "bfloat16") == 312.0 and peaks.peak_tflops(a100, "float32") == 19.5
    assert peaks.peak_tflops(a100, "float32", tf32=True) == 156.0  # --tf32: tensor-core FP32
    assert peaks.peak_tflops(h100, "float16") == 989.0 and peaks.peak_tflops(h100, "float64") == 67.0
    assert peaks.peak_tflops(peaks.device("mi250x-gcd"), "tf32") is None
    for dev in peaks.DEVICES:
        assert "data sheet" in dev.source and dev.peaks["bfloat16"] == dev.peaks["float16"]
    with pytest.raises(KeyError, match="known: gh200"):
        peaks.device("v100")


def test_cpu_and_unknown_gpus_have_no_peak_and_say_so():
    assert peaks.runtime_peak(None, "float32") == (None, peaks.NO_CPU_PEAK)
    value, why = peaks.runtime_peak("Tesla V100", "float32")
    assert value is None and "--peak-tflops" in why
    value, source = peaks.runtime_peak("NVIDIA H100 80GB HBM3", "bfloat16")
    assert value == 989.0 and "H100 Tensor Core GPU data sheet" in source and "bfloat16 dense" in source


def test_utilization_known_answer():
    # 1e15 FLOPs per step in 2 s on 4 ranks with a 250 TFLOP/s peak: 1e15 / (2 * 4 * 250e12) = 50 %
    assert peaks.utilization_pct(1e15, 2.0, 4, 250.0) == pytest.approx(50.0)
    assert np.isnan(peaks.utilization_pct(1e15, 2.0, 4, None))


def _rows(seconds):
    rows = np.zeros(2 * len(seconds), dtype=RANK_STEP_DTYPE)
    for i, s in enumerate(seconds):
        for r in range(2):
            rows[2 * i + r]["rank"], rows[2 * i + r]["step"] = r, i
            rows[2 * i + r]["end_ns"] = int(s * 1e9)
    return rows


def test_summary_names_mfu_hfu_and_gemm_apart():
    # 2 ranks, step 0.5 s, model 4e12 FLOPs, hardware (full recompute) 16/3e12: model 4 TFLOP/s per rank
    s = summarize(_rows([0.5, 0.5, 0.5]), 2, 4e12, 128, 10.0, "data sheet: test", hardware_flops_per_step=16e12 / 3,
                  recompute="full", gemm_tflops=8.0)
    assert s.model_tflops_per_rank == pytest.approx(4.0)
    assert s.mfu_pct == pytest.approx(40.0) and s.hfu_pct == pytest.approx(160 / 3) \
        and s.gemm_pct == pytest.approx(50.0)
    text = "\n".join(s.lines())
    assert "MFU: 40.00%  [MFU = model FLOPs per step / (median step time x ranks x data-sheet peak" in text
    assert "HFU: 53.33%  [HFU = hardware FLOPs" in text
    assert "% of measured GEMM: 50.0% of 8000.000 GFLOP/s  [% of measured GEMM = model FLOP/s per rank" in text
    d = s.as_dict()
    assert (d["mfu_pct"], d["gemm_pct"]) == (s.mfu_pct, s.gemm_pct) and "percent_of_peak" not in d
    cpu = summarize(_rows([0.5, 0.5]), 2, 4e12, 128, None, peaks.NO_CPU_PEAK, gemm_tflops=8.0)
    assert np.isnan(cpu.mfu_pct) and np.isnan(cpu.hfu_pct) and cpu.gemm_pct == pytest.approx(50.0)
    assert f"MFU, HFU: {peaks.NO_CPU_PEAK}" in cpu.lines()


def test_stored_summaries_old_and_new():
    assert peaks.stored_peaks({"peak_tflops": 312.0, "gemm_tflops": 0.02}) == (312.0, 0.02)
    assert peaks.stored_peaks({"peak_tflops": None, "gemm_tflops": 0.02}) == (None, 0.02)
    # before the split: one peak, a measured GEMM unless the user gave --peak-tflops
    assert peaks.stored_peaks({"peak_tflops": 0.02, "peak_source": "measured standalone GEMM, median over ranks"}) \
        == (None, 0.02)
    assert peaks.stored_peaks({"peak_tflops": 1.0, "peak_source": "--peak-tflops"}) == (1.0, None)
    assert peaks.stored_peaks({}) == (None, None)


def test_profiles_take_their_peaks_from_the_one_table():
    """No built-in profile carries peak numbers of its own: each GPU profile names its device."""
    for path in sorted(glob.glob(os.path.join(PROFILES_DIR, "*.yaml"))):
        data = yaml.safe_load(open(path))
        assert "peak_tflops" not in data["compute"], path
        if data.get("backend") == "cupy":
            dev = peaks.device(data["compute"]["device"])
            profile = load_profile(data["name"])
            assert profile.peak_tflops("bfloat16") == dev.peaks["bfloat16"]
    assert load_profile("perlmutter").peak_tflops("bfloat16") == 312.0
    assert load_profile("laptop").peak_tflops("float32") is None  # a CPU: no data-sheet peak
