"""Context parallelism (Megatron-LM's --context-parallel-size, the ring of Liu et al. 2023): the
view every term but attention sees, the K/V ring's messages and their overlap with attention. Known answers by
hand."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import terms
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import scenario_memory
from fourd_mpi.step.presets import ModelConfig

GPT = ModelConfig("g", "gpt", layers=4, hidden=4096, heads=32, ffn_hidden=16384, seq=16384, batch=8, kv_heads=8)


def test_view_and_ring_by_hand():
    assert terms.context_parallel_view(8192, 64, 4, 2) == {"seq": 4096, "batch": 128, "data": 8}
    with pytest.raises(ConfigError, match="multiple of 2 x 3"):
        terms.context_parallel_view(8192, 64, 4, 3)
    # 4096 tokens, h 8192, 64 heads of 128, 8 K/V heads, G_y 8, bf16: K and V of 1 head each per rank, 2 MiB
    assert terms.context_parallel_kv_bytes(4096, 8192, 64, 8, 8, 2) == 2 * 2 ** 20
    assert terms.context_parallel_ring_messages(4, "full") == 12 and terms.context_parallel_ring_messages(4, "none") == 9
    assert terms.context_parallel_exposed(1.0, 0.4) == pytest.approx(0.6) and terms.context_parallel_exposed(0.3, 1.0) == 0


def test_step_is_the_view_plus_attention_and_the_exposed_ring():
    prof = load_profile("dgx-h100")
    sc = Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", vocab=51200, context_parallel=2)
    r = predict_scenario(sc, prof)
    view = predict_scenario(sc.context_view(), prof)
    assert r.gpus == 16 and view.gpus == 16 and view.scenario.model.seq == 8192
    # cp = 2, one micro-batch, no pipeline: one more chunk's attention, plus the ring's exposed part
    assert r.terms["cp_attention"] == pytest.approx(view.terms["step_attention"], rel=1e-12)
    assert r.step_s == pytest.approx(view.step_s + r.terms["cp_attention"] + r.terms["cp_ring_exposed"], rel=1e-12)
    assert r.memory == view.memory == scenario_memory(sc, prof)
    plain = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", vocab=51200),
                             prof)
    assert r.flops == plain.flops  # the model's FLOPs, whoever computes them


def test_context_parallel_needs_flash_attention():
    with pytest.raises(ConfigError, match="--attention fused"):
        predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", attention="unfused",
                                  context_parallel=2), load_profile("dgx-h100"))
