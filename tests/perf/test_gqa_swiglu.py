"""Grouped-query attention and SwiGLU MLPs in the model: parameters, FLOPs, activation memory
and collective volumes, with known answers by hand (Llama 2 70B: Touvron et al. 2023, Table 1 and section 2.2;
GQA: Ainslie et al. 2023; SwiGLU: Shazeer 2020)."""

from dataclasses import replace

import pytest

from fourd_mpi.cli.model_predict import PREDICT_OPTIONS, scenario_from
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.memory import block_saved_elements
from fourd_mpi.perf.predict import compute_time
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.volumes import step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, model_problems, validate_model

# Llama 2 70B: 80 layers, h 8192, 64 heads, 8 K/V heads, ffn 28672, vocabulary 32000, sequence 4096
LLAMA70 = ModelConfig("llama2-70b", "gpt", 80, 8192, 64, 28672, 4096, 64, kv_heads=8, mlp="swiglu")


def test_llama2_70b_parameters_match_the_published_total():
    # per block: QKV 8192 x (8192 + 2 x 8 x 128) = 83,886,080; projection 8192^2 = 67,108,864;
    # SwiGLU 3 x 8192 x 28672 = 704,643,072: 855,638,016 GEMM weights
    assert LLAMA70.gemm_weight_count() == 855_638_016
    # the suite counts LayerNorm's gamma and beta (4h); Llama's RMSNorm has gamma alone (2h) and one more at the
    # end; its input embedding and output layer are untied (2 V h)
    llama = LLAMA70.parameter_count() - 80 * 2 * 8192 + 8192 + 2 * 32000 * 8192
    assert llama == 68_976_648_192 and round(llama / 1e9, 2) == 68.98


def test_multi_head_gelu_counts_are_unchanged():
    gpt = ModelConfig("g", "gpt", 2, 1024, 16, 4096, 512, 8)
    assert gpt.gemm_weight_count() == 12 * 1024 ** 2
    assert gpt.parameter_count() == 2 * (12 * 1024 ** 2 + 4 * 1024)
    assert replace(gpt, kv_heads=16).gemm_weight_count() == gpt.gemm_weight_count()  # kv = heads: MHA
    assert set(gpt.as_dict()) == {"name", "kind", "layers", "hidden", "heads", "ffn_hidden", "seq", "batch"}
    assert LLAMA70.as_dict()["kv_heads"] == 8 and LLAMA70.as_dict()["mlp"] == "swiglu"


def test_flops_count_the_actual_weights():
    # B = 1, s = 4096: 80 (6 x 4096 x 855,638,016 + 12 x 4096^2 x 8192)
    cfg = replace(LLAMA70, batch=1)
    assert cfg.flops_per_step() == 80 * (6 * 4096 * 855_638_016 + 12 * 4096 ** 2 * 8192)
    # GEMM seconds follow the weights: GQA + SwiGLU over MHA + GeLU = 855,638,016 / (4 h^2 + 2 h f) = 738,197,504
    mha = replace(cfg, kv_heads=None, mlp="gelu", layers=1)
    prof = load_profile("dgx-h100")
    a = compute_time(replace(cfg, layers=1), GridShape(1, 1, 1, 1), prof, OverlapConfig(), "bfloat16", 1)["gemm"]
    b = compute_time(mha, GridShape(1, 1, 1, 1), prof, OverlapConfig(), "bfloat16", 1)["gemm"]
    assert a / b == pytest.approx(855_638_016 / 738_197_504, rel=1e-12)


def test_collective_volumes_use_the_qkv_and_swiglu_shapes():
    # grid 2x1x8x1, bf16: the data all-reduce of QKV's gradient shard (10240/8) x 8192 x 2 bytes, FC1's
    # (2 x 28672/8) x 8192 x 2 bytes; the X-free backward all-reduce over Y of QKV's input stays m x h x 2
    cfg = replace(LLAMA70, layers=1, batch=2)
    rows = {(c.layer, c.role): c for c in step_collectives(cfg, GridShape(2, 1, 8, 1), OverlapConfig(), "bfloat16")}
    assert rows[("block0.qkv", "grad_allreduce")].message_bytes == 10240 // 8 * 8192 * 2
    assert rows[("block0.fc1", "grad_allreduce")].message_bytes == 2 * 28672 // 8 * 8192 * 2
    assert rows[("block0.fc2", "grad_allreduce")].message_bytes == 8192 // 8 * 28672 * 2
    assert rows[("block0.qkv", "bwd_allreduce")].message_bytes == 4096 * 8192 * 2


def test_activations_keep_the_narrower_qkv_and_the_wider_swiglu():
    # per token on G_y = 8: QKV output (10240 - 3 x 8192)/8 = -1792 elements; SwiGLU keeps 3 f/8, GeLU 2 f/8:
    # + 28672/8 = 3584; tokens m = B s = 1 x 4096
    cfg = replace(LLAMA70, layers=1, batch=1)
    mha = replace(cfg, kv_heads=None, mlp="gelu")
    grid = GridShape(1, 1, 8, 1)
    for recompute in ("none", "selective"):
        diff = block_saved_elements(cfg, grid, "fused", recompute) - block_saved_elements(mha, grid, "fused", recompute)
        assert diff == 4096 * (-1792 + 3584)


def test_refusals_are_one_line():
    grid = GridShape(1, 1, 16, 1)
    assert any("must divide --heads 64" in p for p in model_problems(replace(LLAMA70, kv_heads=7), grid))
    assert any("key/value head count 8 is not divisible by 16" in p for p in model_problems(LLAMA70, grid))
    assert any("MLP kind 'relu'" in p for p in model_problems(replace(LLAMA70, mlp="relu"), grid))
    with pytest.raises(ConfigError, match="for the model only"):  # run's step: multi-head attention, GeLU
        validate_model(LLAMA70, GridShape(1, 1, 8, 1))


def _values(**over):
    values = {name: default for name, (_, default, _) in PREDICT_OPTIONS.items()}
    values.update(grid="1x1x8x1", profile="dgx-h100", algorithm="megatron1d", stages=8, microbatches=64, vocab=32000,
                  layers=80, hidden=8192, heads=64, seq=4096, batch=64, **over)
    values["ffn-hidden"] = 28672
    return values


def test_model_predict_takes_kv_heads_and_mlp():
    sc, prof = scenario_from(_values(**{"kv-heads": 8, "mlp": "swiglu"}))
    assert sc.model.kv_heads == 8 and sc.model.mlp == "swiglu" and "--kv-heads 8 --mlp swiglu" in sc.model.name
    r = predict_scenario(sc, prof)
    # model FLOPs: 6 B s l x weights + 12 B s^2 l h + the head 6 B s h V
    B, s, h, V = 64, 4096, 8192, 32000
    assert r.flops["model"] == pytest.approx(80 * (6 * B * s * 855_638_016 + 12 * B * s * s * h) + 6 * B * s * h * V,
                                             rel=1e-12)
    assert any("grouped-query attention / SwiGLU" in n for n in r.notes)
    with pytest.raises(ConfigError, match="--mlp 'relu': choose gelu, swiglu"):
        scenario_from(_values(mlp="relu"))
