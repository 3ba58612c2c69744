"""FP8 GEMMs in the model: the data sheet's dense FP8 rates, the blocks' GEMMs at the profile's FP8
rate and nothing else, BF16 storage plus Transformer Engine's FP8 weight cache, one-line refusals. Known answers
by hand."""

import pytest

from fourd_mpi.cli.model_predict import PREDICT_OPTIONS, scenario_from
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import peaks, terms
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import stage_memory
from fourd_mpi.run.options import OPTIONS
from fourd_mpi.step.presets import ModelConfig

GPT = ModelConfig("g", "gpt", layers=8, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=64)


def test_data_sheet_fp8_rates():
    # H100 SXM and H200 SXM: 3,958 TFLOP/s FP8 with 2:4 sparsity, 1,979 dense; A100 and MI250X: no FP8
    assert peaks.peak_tflops(peaks.device("h100-sxm"), "float8") == 1979.0
    assert peaks.peak_tflops(peaks.device("h200"), "float8") == 1979.0
    assert peaks.peak_tflops(peaks.device("h100-pcie"), "float8") == 3026.0 / 2
    assert peaks.peak_tflops(peaks.device("a100"), "float8") is None
    assert peaks.peak_tflops(peaks.device("mi250x-gcd"), "float8") is None
    assert load_profile("dgx-h100").peak_tflops("float8") == 1979.0


def test_fp8_weight_cache_known_answer():
    # a 4096 x 4096 weight: its FP8 copy and FP8 transpose, 1 byte each = 32 MiB
    assert terms.fp8_weight_cache_bytes(4096 * 4096) == 32 * 2 ** 20
    assert terms.storage_dtype("float8") == "bfloat16" and terms.storage_dtype("float16") == "float16"
    assert terms.model_dtype("fp8") == "float8"


def test_fp8_speeds_up_the_block_gemms_only():
    prof = load_profile("dgx-h100")
    kw = dict(algorithm="megatron1d", vocab=51200)
    bf16 = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", dtype="bfloat16", **kw), prof)
    fp8 = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", dtype="float8", **kw), prof)
    # the profile's sustained rates: 800 (bf16) and 1,601 (fp8) TFLOP/s: GEMM seconds scale by 800/1601
    assert fp8.terms["step_gemm"] == pytest.approx(bf16.terms["step_gemm"] * 800.0 / 1601.0, rel=1e-12)
    for same in ("step_attention", "step_head", "optimizer", "step_elementwise"):
        assert fp8.terms[same] == pytest.approx(bf16.terms[same], rel=1e-12), same
    assert fp8.peak_tflops == 1979.0 and bf16.peak_tflops == 989.0
    assert fp8.step_s < bf16.step_s


def test_fp8_memory_is_bf16_state_plus_the_weight_cache():
    # one rank (grid 1x1x1x1): 8 blocks of 4 h^2 + 2 h f = 12 x 1024^2 GEMM weight elements, 2 bytes of cache each
    prof = load_profile("dgx-h100")
    bf16 = Scenario(GPT, GridShape(1, 1, 1, 1), "dgx-h100", algorithm="dp", dtype="bfloat16").resolved()
    fp8 = Scenario(GPT, GridShape(1, 1, 1, 1), "dgx-h100", algorithm="dp", dtype="float8").resolved()
    a, b = stage_memory(bf16, 0, prof), stage_memory(fp8, 0, prof)
    assert b["fp8_weights"] == 2 * 8 * 12 * 1024 ** 2 and "fp8_weights" not in a
    for part in ("weights", "gradients", "master", "optimizer", "activations", "comm_buffers"):
        assert a[part] == b[part], part
    assert b["total"] - a["total"] == b["fp8_weights"]


def test_fp8_refusals_are_one_line():
    with pytest.raises(ConfigError, match="A100 data sheet gives no FP8 rate"):
        predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-a100", algorithm="megatron1d", dtype="float8"),
                         load_profile("dgx-a100"))
    with pytest.raises(ConfigError, match="invalid choice: 'float8'"):  # run: NumPy has no FP8 arithmetic
        OPTIONS["dtype"].parse("float8")


def _values(**over):
    values = {name: default for name, (_, default, _) in PREDICT_OPTIONS.items()}
    values.update(grid="1x1x8x1", batch=64, profile="dgx-h100", algorithm="megatron1d", **over)
    return values


def test_model_predict_takes_fp8_as_float8():
    sc, _ = scenario_from(_values(dtype="fp8"))
    assert sc.dtype == "float8"
    with pytest.raises(ConfigError, match="--dtype 'float4': choose"):
        scenario_from(_values(dtype="float4"))
