"""DeepSpeed 2021's ZeRO-3 (``--implementation deepspeed-2021``), each term with a known answer
computed by hand from the dgx-a100 profile's constants (fourd_mpi/perf/zero3_2021.py cites DeepSpeed's code)."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import zero3_2021
from fourd_mpi.perf.machine import axis_inner_products, axis_placement, load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

GPT175 = ModelConfig("gpt-175b", "gpt", layers=96, hidden=12288, heads=96, ffn_hidden=49152, seq=2048, batch=1536)
SMALL = ModelConfig("g", "gpt", layers=8, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=64)
LAT, INTER, OP, VIEW, BW = 9e-6, 180e9, 1e-5, 2e-6, 1800e9  # dgx-a100: latency/rank, IB bus GB/s, launch, HBM


def t_ag(nbytes, n):
    """dgx-a100's all-gather over a Z group crossing nodes (ip 1: one group per rank's NIC): lat n + (n-1)/n S / bw."""
    return LAT * n + (n - 1) / n * nbytes / INTER


def test_rank_copies_known_answers():
    assert zero3_2021.rank_copies(12288, 384) == 384      # 32 elements each
    assert zero3_2021.rank_copies(100, 384) == 100        # 1 each, ranks 100.. hold padding only
    assert zero3_2021.rank_copies(1000, 384) == 334       # 3 each: ceil(1000 / 3)
    assert zero3_2021.rank_copies(0, 8) == 0


def test_gathers_per_microbatch_follow_the_reuse_distance():
    g = GridShape(1, 384, 1, 1)
    got = zero3_2021.gathers_per_microbatch(GPT175, g, "full")
    h = 12288
    assert got == [("qkv", 3 * h * h, 3), ("proj", h * h, 3), ("fc1", 4 * h * h, 3), ("fc2", 4 * h * h, 2)]
    # fc1's distance is fc2 twice: 2 x 603,979,776 = 1.21e9 > 1e9; fc2 has none
    assert 2 * 4 * h * h > zero3_2021.MAX_REUSE_DISTANCE
    assert [x[2] for x in zero3_2021.gathers_per_microbatch(GPT175, g, "none")] == [2, 2, 2, 2]
    assert [x[2] for x in zero3_2021.gathers_per_microbatch(SMALL, GridShape(1, 16, 1, 1), "full")] == [2, 2, 2, 2]


def test_persistent_parameters_of_megatrons_gpt():
    p = zero3_2021.persistent_numels(SMALL, GridShape(1, 16, 1, 1))
    assert len(p) == 8 * 8 + 2 and sum(p) == 8 * (4 * 1024 + 3072 + 1024 + 4096 + 1024) + 2 * 1024
    assert len(zero3_2021.persistent_numels(GPT175, GridShape(1, 384, 1, 1))) == 8 * 96 + 2  # all below 1e5


def t_rs(nbytes, n):
    """dgx-a100's reduce-scatter over such a group: the all-gather's price (the profile gives both the same)."""
    return t_ag(nbytes, n)


def test_padded_ranks_known_answers():
    assert zero3_2021.padded_ranks(12288, 384) == 0        # 32 elements each, all whole
    assert zero3_2021.padded_ranks(100, 384) == 284        # 1 each: ranks 100..383 take torch.zeros
    assert zero3_2021.padded_ranks(1000, 384) == 51        # 3 each: 333 whole, rank 333 partial, 50 past the end
    assert zero3_2021.padded_ranks(20480, 2240) == 192     # 530B's LayerNorm: 10 each, 2048 whole


def test_block_small_numels_are_the_layernorms_then_the_biases():
    assert zero3_2021.block_small_numels(SMALL, GridShape(1, 16, 1, 1)) == [1024] * 4 + [3072, 1024, 4096, 1024]


def _gradient_reduce(cfg, n):
    prof = load_profile("dgx-a100")
    grid = GridShape(1, n, 1, 1)
    return zero3_2021.gradient_reduce_time(cfg, grid, prof, axis_placement(grid, 8), 8, axis_inner_products(grid),
                                           "float16")


def test_gradient_reduce_known_answer_small_model():
    # 16 ranks, every parameter divides: 2 views per slice, 16 copy launches (more than the copies' bytes), the transfer
    n, h, f = 16, 1024, 4096
    want = 0.0
    for numel in (3 * h * h, h * h, f * h, h * f, h, h, h, h, 3 * h, h, f, h):
        s = 2 * numel
        want += 2 * n * VIEW + max(n * OP, 2 * s / BW) + t_rs(s, n)
    assert _gradient_reduce(SMALL, n) == pytest.approx(want, rel=1e-9)
    # the copies' bytes exceed the launches only for the weights of 4M elements: 2 x 8 MB / 1.8 TB/s = 9.3 us < 160 us
    assert 2 * 2 * f * h / BW < n * OP


def test_gradient_reduce_known_answer_530b_on_2240():
    n, h = 2240, 20480
    cfg = ModelConfig("gpt-530b", "gpt", layers=105, hidden=h, heads=128, ffn_hidden=4 * h, seq=2048, batch=2240)
    # a LayerNorm weight: 2048 whole slices (2 views each), 192 torch.zeros, 2240 launches, a latency-bound transfer
    ln = 2 * 2048 * VIEW + 192 * OP + n * OP + t_rs(2 * 10 * n, n)
    assert ln == pytest.approx(0.052672, abs=1e-6)  # 8.19 + 1.92 + 22.4 + 20.16 ms
    want = 0.0
    for numel in (3 * h * h, h * h, 4 * h * h, 4 * h * h, h, h, h, h, 3 * h, h, 4 * h, h):
        c = -(-numel // n)
        z = zero3_2021.padded_ranks(numel, n)
        s = 2 * c * n
        want += 2 * (n - z) * VIEW + z * OP + max(n * OP, 2 * s / BW) + t_rs(s, n)
    got = _gradient_reduce(cfg, n)
    assert got == pytest.approx(want, rel=1e-9)
    # 12 reduce-scatters of 2240 ranks, 0.68 s a block: the 4 weights 51.5 ms each + 55.9 ms of bytes, the 8 small
    # ones 52.4 ms each on average: 4.1 x the block's 166 ms of backward GEMMs at 2048 tokens
    assert got == pytest.approx(0.6815, abs=1e-3)
    assert got > 4 * 4 * 2048 * 12 * h * h / 248e12


def _terms(cfg, n, recompute):
    prof = load_profile("dgx-a100")
    grid = GridShape(1, n, 1, 1)
    return zero3_2021.terms(cfg, grid, prof, axis_placement(grid, 8), 8, axis_inner_products(grid), "float16",
                            recompute, OverlapConfig.parse("ors,dp"))


def test_terms_known_answers_small_model():
    n = 16
    got = _terms(SMALL, n, "none")
    assert got["regather"] == 0.0
    h, f = 1024, 4096
    copies = 0.0
    for elements in (3 * h * h, h * h, f * h, h * f):
        s = 2 * elements
        copies += 2 * (n * VIEW + max(0.0, n * OP - t_ag(s, n)) + 3 * s / BW)
    assert got["gather_copies"] == pytest.approx(8 * copies, rel=1e-9)
    # 66 persistent parameters of at least 16 elements: 16 copies each, 3 views and a launch per copy
    padded = 8 * (4 * h + 3 * h + h + f + h) + 2 * h
    persist = 66 * 16 * (3 * VIEW + OP) + n * (VIEW + OP) + t_ag(2 * padded, n)
    assert got["persistent_gather"] == pytest.approx(persist, rel=1e-9)
    assert got["persistent_gather"] == pytest.approx(0.017233, abs=2e-6)  # 17.088 ms of loop + 0.145 ms gather
    # the fsdp step's LayerNorm gradient all-reduces: 2 LayerNorms x 2 messages of h fp16 per block, ring all-reduce
    ln = 2 * 2 * (2 * LAT * n + 2 * (n - 1) / n * 2 * h / INTER)
    assert got["ln_grad_allreduce"] == pytest.approx(8 * ln, rel=1e-6)


def test_terms_known_answers_175b_on_384():
    n, h = 384, 12288
    got = _terms(GPT175, n, "full")
    ag = {w: t_ag(2 * e, n) for w, e in (("qkv", 3 * h * h), ("proj", h * h), ("fc1", 4 * h * h), ("fc2", 4 * h * h))}
    assert ag["qkv"] == pytest.approx(8.476e-3, rel=1e-3)
    assert got["regather"] == pytest.approx(96 * (ag["qkv"] + ag["proj"] + ag["fc1"]), rel=1e-9)
    assert got["regather"] == pytest.approx(2.280, abs=2e-3)
    # every transfer is longer than its 384 copy launches (3.84 ms): no launch tail; the loop of views 0.768 ms
    assert min(ag.values()) > n * OP
    per = {w: n * VIEW + 3 * 2 * e / BW for w, e in (("qkv", 3 * h * h), ("proj", h * h), ("fc1", 4 * h * h),
                                                     ("fc2", 4 * h * h))}
    assert got["gather_copies"] == pytest.approx(96 * (3 * (per["qkv"] + per["proj"] + per["fc1"]) + 2 * per["fc2"]),
                                                 rel=1e-9)
    # 770 persistent parameters x 384 copies x (3 views + 1 launch) = 4.731 s
    assert got["persistent_gather"] == pytest.approx(770 * 384 * 16e-6, rel=2e-3)


def test_deepspeed_2021_in_the_step_and_its_refusals():
    prof = load_profile("dgx-a100")
    base = dict(algorithm="fsdp", microbatch_size=4, recompute="full", dtype="float16", attention="unfused",
                overlap="ors,dp", precision="mixed")
    ours = predict_scenario(Scenario(GPT175, GridShape(1, 384, 1, 1), "dgx-a100", **base), prof)
    ds = predict_scenario(Scenario(GPT175, GridShape(1, 384, 1, 1), "dgx-a100", implementation="deepspeed-2021",
                                   **base), prof)
    t = ds.terms
    added = (t["zero3_regather"] + t["zero3_gather_copies"] + t["zero3_persistent_gather"]
             - t["zero3_ln_allreduce_removed"])
    # the gradient reduce-scatters (12.1 s) replace the fsdp step's exposed ones: all hidden by the backward GEMMs
    # (23.0 s: dX and dW, 4 x 8192 tokens x 12 h^2 per block at 248 TFLOP/s) at micro-batch 4
    assert _gradient_reduce(GPT175, 384) * 96 == pytest.approx(12.1, abs=0.1)
    assert t["zero3_grad_reduce"] == 0.0
    added -= t["zero3_fsdp_reduce_scatter_removed"]
    # the partitioned embedding: 2 gathers (m = 1) and a reduce-scatter instead of the all-reduce over Z
    grid = GridShape(1, 384, 1, 1)
    emb = zero3_2021.embedding_time(51200 * 12288 * 2, grid, 1, prof, axis_placement(grid, 8), 8,
                                    axis_inner_products(grid))
    assert t["embedding_sync"] == pytest.approx(emb, rel=1e-9) and emb < 0.1
    added += t["embedding_sync"] - ours.terms["embedding_sync"]
    assert ds.step_s == pytest.approx(ours.step_s + added, rel=1e-9)
    assert ds.exposed_s["z"] == pytest.approx(ours.exposed_s["z"] + added, rel=1e-9)
    assert ds.compute_s == ours.compute_s
    shard = -(-51200 * 12288 // 384)  # the embedding's elements on a rank: V h whole, or its ZeRO-3 shard
    assert ours.memory["total"] - ds.memory["total"] == 16 * (51200 * 12288 - shard)
    assert t["grad_sync"] == pytest.approx(ours.terms["grad_sync"] - t["zero3_ln_allreduce_removed"]
                                           - t["zero3_fsdp_reduce_scatter_removed"], rel=1e-9)
    for kw, text in [(dict(base, algorithm="axonn4d"), "algorithm fsdp"), (dict(base, implementation="x"), "choose")]:
        kw.setdefault("implementation", "deepspeed-2021")
        with pytest.raises(ConfigError, match=text):
            predict_scenario(Scenario(GPT175, GridShape(1, 384, 1, 1), "dgx-a100", **kw), prof)
    with pytest.raises(ConfigError, match="grid 1xNx1x1"):
        predict_scenario(Scenario(GPT175, GridShape(2, 192, 1, 1), "dgx-a100", implementation="deepspeed-2021",
                                  **dict(base, microbatch_size=4)), prof)


def test_deepspeed_2021_gradient_reduce_exposed_past_the_backward_gemms():
    # 1,536 ranks, micro-batch 1: the reduce-scatters, 12 x (6.14 ms of views + 15.36 of launches + 13.82 of latency)
    # + 20.1 ms of bytes = 0.444 s a block, outlast the block's backward GEMMs (60 ms)
    prof = load_profile("dgx-a100")
    grid = GridShape(1, 1536, 1, 1)
    kw = dict(algorithm="fsdp", microbatch_size=1, recompute="full", dtype="float16", attention="unfused",
              overlap="ors,dp", precision="mixed")
    ds = predict_scenario(Scenario(GPT175, grid, "dgx-a100", implementation="deepspeed-2021", **kw), prof).terms
    gemm_bwd = 96 * 4 * 2048 * 12 * 12288 ** 2 / 248e12
    grad = 96 * _gradient_reduce(GPT175, 1536)
    assert gemm_bwd == pytest.approx(5.746, abs=1e-3) and grad == pytest.approx(42.63, abs=0.01)
    assert ds["zero3_grad_reduce"] == pytest.approx(grad - gemm_bwd, rel=1e-6)
    assert ds["zero3_fsdp_reduce_scatter_removed"] >= 0.0
