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
    added = t["zero3_regather"] + t["zero3_gather_copies"] + t["zero3_persistent_gather"] - t["zero3_ln_allreduce_removed"]
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
    assert t["grad_sync"] == pytest.approx(ours.terms["grad_sync"] - t["zero3_ln_allreduce_removed"], rel=1e-9)
    for kw, text in [(dict(base, algorithm="axonn4d"), "algorithm fsdp"), (dict(base, implementation="x"), "choose")]:
        kw.setdefault("implementation", "deepspeed-2021")
        with pytest.raises(ConfigError, match=text):
            predict_scenario(Scenario(GPT175, GridShape(1, 384, 1, 1), "dgx-a100", **kw), prof)
    with pytest.raises(ConfigError, match="grid 1xNx1x1"):
        predict_scenario(Scenario(GPT175, GridShape(2, 192, 1, 1), "dgx-a100", implementation="deepspeed-2021",
                                  **dict(base, microbatch_size=4)), prof)
