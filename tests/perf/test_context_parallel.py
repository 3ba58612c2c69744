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
    assert terms.context_parallel_ring_messages(4, "full") == 12 \
        and terms.context_parallel_ring_messages(4, "none") == 9
    assert terms.context_parallel_exposed(1.0, 0.4) == pytest.approx(0.6) \
        and terms.context_parallel_exposed(0.3, 1.0) == 0


def test_step_is_the_view_plus_attention_and_the_exposed_kv():
    prof = load_profile("dgx-h100")
    sc = Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", vocab=51200, context_parallel=2)
    r = predict_scenario(sc, prof)
    view = predict_scenario(sc.context_view(), prof)
    assert r.gpus == 16 and view.gpus == 16 and view.scenario.model.seq == 8192
    # cp = 2, one micro-batch, no pipeline: one more chunk's attention, plus the ring's exposed part
    assert r.terms["cp_attention"] == pytest.approx(view.terms["step_attention"], rel=1e-12)
    assert r.step_s == pytest.approx(view.step_s + r.terms["cp_attention"] + r.terms["cp_comm_exposed"], rel=1e-12)
    assert r.memory == view.memory == scenario_memory(sc, prof)
    plain = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", vocab=51200),
                             prof)
    assert r.flops == plain.flops  # the model's FLOPs, whoever computes them


def test_context_parallel_needs_flash_attention():
    with pytest.raises(ConfigError, match="--attention fused"):
        predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", attention="unfused",
                                  context_parallel=2), load_profile("dgx-h100"))


def test_llama3_allgather_exposes_the_gathers_in_full():
    """Llama 3's context parallelism (arXiv 2407.21783, section 3.3.2): K and V all-gathered before attention,
    exposed; the backward reduce-scatters dK and dV. Per slot: ``L_s (n_ag t_ag + n_rs t_rs)`` with the
    collectives priced at the context ranks' placement, by hand from the profile's own prices."""
    from fourd_mpi.perf.machine import message_time

    assert terms.context_parallel_allgather_messages("none") == (1, 1)
    assert terms.context_parallel_allgather_messages("selective") == (1, 1)
    assert terms.context_parallel_allgather_messages("full") == (2, 1)
    prof = load_profile("dgx-h100")
    base = dict(algorithm="megatron1d", vocab=51200, context_parallel=2, recompute="full")
    ring = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", **base), prof)
    gather = predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", context_parallel_comm="allgather",
                                       **base), prof)
    # the same view and attention; only the exposed K/V sharing differs
    assert gather.terms["cp_attention"] == ring.terms["cp_attention"]
    # G_y 8 ranks x cp 2 = 16 > 8 ranks per node: the context ranks cross nodes. One micro-batch of b = 8
    # sequences (batch 8, one data shard), 8192 tokens of each per rank: K and V are 8 x 8192 tokens x (8 K/V
    # heads x 128 / G_y 8) x 2 (K, V) x 2 bytes = 32 MiB; the all-gather moves 2 such chunks
    kv = terms.context_parallel_kv_bytes(8 * 8192, 4096, 32, 8, 8, 2)
    assert kv == 32 * 2 ** 20
    if prof.has_network:
        t_ag = prof.network_time("allgather", 2, 2 * kv, 8, "inter", prof.ranks_per_node)
        t_rs = prof.network_time("reduce_scatter", 2, 2 * kv, 8, "inter", prof.ranks_per_node)
    else:
        t_ag = t_rs = message_time(prof, "inter", kv)
    assert gather.terms["cp_comm_exposed"] == pytest.approx(4 * (2 * t_ag + t_rs), rel=1e-12)  # 4 blocks, m = 1
    assert gather.step_s - ring.step_s == pytest.approx(gather.terms["cp_comm_exposed"] - ring.terms["cp_comm_exposed"],
                                                        rel=1e-9)
    assert any("all-gather context parallelism" in n for n in gather.notes)
    with pytest.raises(ConfigError, match="--context-parallel-comm 'p2p': choose ring, allgather"):
        predict_scenario(Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", context_parallel_comm="p2p", **base), prof)


def test_model_predict_takes_the_context_parallel_comm():
    """``model predict --context-parallel-comm allgather`` gives the scenario's prediction; a bad value is one line
    with the choices, exit 2."""
    import json
    import subprocess
    import sys

    args = ["--batch", "8", "--grid", "1x1x8x1", "--algorithm", "megatron1d", "--layers", "4", "--hidden", "4096",
            "--heads", "32", "--kv-heads", "8", "--seq", "16384", "--context-parallel", "2", "--profile", "dgx-h100"]
    run = [sys.executable, "-m", "fourd_mpi", "model", "predict", *args]
    proc = subprocess.run([*run, "--context-parallel-comm", "allgather", "--format", "json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sc = Scenario(GPT, GridShape(1, 1, 8, 1), "dgx-h100", algorithm="megatron1d", context_parallel=2,
                  context_parallel_comm="allgather", vocab=51200)
    assert json.loads(proc.stdout)["step_s"] == pytest.approx(predict_scenario(sc, load_profile("dgx-h100")).step_s,
                                                              rel=1e-12)
    bad = subprocess.run([*run, "--context-parallel-comm", "p2p"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "fourd-mpi: error: --context-parallel-comm 'p2p': choose ring, allgather"]
