"""The forced-configuration model (``model predict``), its new terms with known answers, and the
published table's summary (``model published``), which must not silently get worse."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import schedules, vocab
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.memory import block_elements, comm_buffer_elements, fc_weights
from fourd_mpi.perf.predict import predict
from fourd_mpi.perf.prediction import megatron_flops, predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import sequence_parallel_volumes, stage_memory
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = ModelConfig("g", "gpt", layers=8, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=64)


def cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


# --- vocabulary ---------------------------------------------------------------------------------

def test_vocab_flops_are_megatrons_vocabulary_term():
    # 6 B s h V: B = 2, s = 1024, h = 1024, V = 51200
    assert vocab.head_flops(2, 1024, 1024, 51200) == 6 * 2 * 1024 * 1024 * 51200
    cfg = ModelConfig("g", "gpt", 24, 2304, 24, 4 * 2304, 2048, 512)
    for recompute in ("full", "none"):
        term = megatron_flops(cfg, 51200, recompute) - megatron_flops(cfg, 0, recompute)
        assert term == pytest.approx(vocab.head_flops(512, 2048, 2304, 51200), rel=1e-12)
    # per rank: split over T = G_x G_y
    assert vocab.head_flops_per_rank(2048, 1024, 51200, 8) == 6 * 2048 * 1024 * 51200 / 8


def test_vocab_volumes_known_answer():
    # G_y = 8, G_x = 1, m = 2048 tokens, h = 4096, fp16: two all-reduces of 16 MiB + three of 8 KiB over Y
    got = vocab.volumes(2048, 4096, 51200, gx=1, gy=8, e=2)
    assert got == {"y": 2 * int(2 * 7 / 8 * 16 * 2 ** 20) + 3 * int(2 * 7 / 8 * 8192)}
    assert vocab.embedding_elements(4096, 51200, 8) == 4096 * 6400
    assert vocab.logits_bytes(2048, 51200, 8, 2) == 2048 * 6400 * 6


def test_vocab_adds_the_head_to_the_step_and_the_embedding_to_memory():
    prof = load_profile("dgx-a100")
    base = Scenario(GPT, GridShape(2, 1, 4, 1), "dgx-a100", algorithm="megatron1d", vocab=0, dtype="float16")
    with_v = Scenario(GPT, GridShape(2, 1, 4, 1), "dgx-a100", algorithm="megatron1d", vocab=51200, dtype="float16")
    a, b = predict_scenario(base, prof), predict_scenario(with_v, prof)
    assert b.step_s > a.step_s and b.terms["slot_head"] > 0 and a.terms["slot_head"] == 0
    assert b.memory["weights"] - a.memory["weights"] == 51200 * 1024 // 4 * 2


# --- schedules -----------------------------------------------------------------------------------

def test_interleaved_bubble_known_answers():
    assert schedules.bubble_fraction("1f1b", 8, 32) == 7 / 32
    assert schedules.bubble_fraction("interleaved", 8, 32, 4) == 7 / 128
    assert schedules.bubble_fraction("axonn", 8, 32) == 7 / 32
    assert schedules.bubble_slots("interleaved", 4, 3) == 1.0
    assert schedules.p2p_messages_per_microbatch("interleaved", 4, 3) == 6
    assert schedules.p2p_messages_per_microbatch("1f1b", 1) == 0


def test_interleaved_bubble_in_the_prediction():
    prof = load_profile("dgx-a100")
    kw = dict(algorithm="megatron1d", stages=4, microbatch_size=1, vocab=0, dtype="float16")
    r1 = predict_scenario(Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", schedule="1f1b", **kw), prof)
    r2 = predict_scenario(Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", schedule="interleaved", chunks=2, **kw),
                          prof)
    for r, v in ((r1, 1), (r2, 2)):
        slot = r.terms["slot_blocks"] + r.terms["slot_head"] + r.terms["slot_head_comm"] + r.terms["slot_p2p"]
        assert r.bubble_s == pytest.approx(slot * 3 / v, rel=1e-12)
    assert r2.bubble_s < r1.bubble_s and r2.terms["slot_p2p"] == pytest.approx(2 * r1.terms["slot_p2p"])


def test_inflight_block_passes_known_answers():
    # 1F1B stage 0: min(p, m) micro-batches x L/p blocks
    assert schedules.inflight_block_passes("1f1b", 4, 8, 16) == 16
    assert schedules.inflight_block_passes("1f1b", 4, 2, 16) == 8
    # interleaved stage 0: min(m v, 2 (p-1) + (v-1) p + 1) chunk passes of L/(p v) blocks: min(16, 11) x 2
    assert schedules.inflight_block_passes("interleaved", 4, 8, 16, 2) == 22
    with pytest.raises(ConfigError, match="multiple of 4 stages"):
        schedules.check_schedule("interleaved", 4, 2, 16, 6)
    with pytest.raises(ConfigError, match="needs --pipeline-schedule interleaved"):
        schedules.check_schedule("1f1b", 4, 2, 16, 8)


def test_pipeline_memory_counts_stored_inputs_and_one_working_set():
    prof = load_profile("dgx-a100")
    sc = Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", algorithm="megatron1d", stages=4, microbatch_size=1,
                  vocab=0, dtype="float16", recompute="full").resolved()
    m = sc.microbatches
    assert m == 32
    mem = stage_memory(sc, 0, prof)
    tokens, hx, e = 1 * GPT.seq, GPT.hidden, 2
    # one more micro-batch in flight adds only its stored block inputs (2 blocks x [b s, h])
    one_less = stage_memory(Scenario(**{**sc.__dict__, "stages": 4}).resolved(), 0, prof)
    assert one_less == mem
    deeper = Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", algorithm="megatron1d", stages=8, microbatch_size=1,
                      vocab=0, dtype="float16", recompute="full").resolved()
    # stage 0 of 8 holds min(8, 32) x 1 block input; of 4: min(4, 32) x 2: the same 8 stored inputs
    assert stage_memory(deeper, 0, prof)["activations"] == mem["activations"]
    stored = 8 * tokens * hx * e
    assert mem["activations"] > stored and mem["activations"] < stored + 8 * tokens * 4 * GPT.hidden * e


# --- sequence parallelism, dW window, gradient accumulation -------------------------------------------

def test_sequence_parallel_volumes_equal_the_all_reduce():
    v = sequence_parallel_volumes(2048, 4096, gy=8, gx=1, e=2)
    S = 2048 * 4096 * 2
    assert v["allreduce"] == 2 * (7 * S // 8) and v["reduce_scatter"] == v["allgather"] == 7 * S // 8
    assert v["sequence_parallel"] == v["allreduce"]


def test_sequence_parallel_splits_block_inputs_over_y():
    prof = load_profile("dgx-a100")
    kw = dict(algorithm="megatron1d", stages=2, microbatch_size=1, vocab=0, dtype="float16")
    off = Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", **kw).resolved()
    on = Scenario(GPT, GridShape(2, 1, 8, 1), "dgx-a100", sequence_parallel=True, **kw).resolved()
    a, b = stage_memory(off, 0, prof)["activations"], stage_memory(on, 0, prof)["activations"]
    passes = schedules.inflight_block_passes("1f1b", 2, off.microbatches, GPT.layers)
    tokens, e = GPT.seq, 2
    stored_saving = passes * tokens * (GPT.hidden - GPT.hidden // 8) * e
    working_saving = 4 * tokens * (GPT.hidden - GPT.hidden // 8) * e
    assert a - b == stored_saving + working_saving
    with pytest.raises(ConfigError, match="needs G_y > 1"):
        predict_scenario(Scenario(GPT, GridShape(8, 1, 1, 1), "dgx-a100", sequence_parallel=True), prof)


def test_bounded_dw_window_known_answer():
    grid = GridShape(1, 4, 1, 1)
    ors = OverlapConfig(ors=True)
    blocks = sorted((block_elements(n, k, t, grid) for _, n, k, t in fc_weights(GPT, grid) * GPT.layers), reverse=True)
    unbounded = comm_buffer_elements(GPT, grid, ors)
    for w in (1, 2, 5):
        bounded = comm_buffer_elements(GPT, grid, ors, dw_window=w)
        assert unbounded - bounded == sum(b + b // 4 for b in blocks[w:])


def test_gradient_accumulation_without_pipeline():
    prof = load_profile("dgx-a100")
    one = Scenario(GPT, GridShape(4, 2, 1, 1), "dgx-a100", algorithm="fsdp", vocab=0, dtype="float16")
    r1 = predict_scenario(one, prof)
    plain = predict(GPT, GridShape(4, 2, 1, 1), prof, OverlapConfig.parse("all"), "float16", "poll", "adam", None,
                    "full", "fused")
    assert r1.step_s == pytest.approx(plain.step_s, rel=1e-12)  # m = 1, no vocabulary: the plain 4D step
    acc = predict_scenario(Scenario(GPT, GridShape(4, 2, 1, 1), "dgx-a100", algorithm="fsdp", vocab=0,
                                    dtype="float16", microbatches=4), prof)
    t = acc.terms
    assert acc.step_s == pytest.approx(4 * t["slot_blocks"] + t["optimizer"] + t["grad_sync"], rel=1e-12)
    assert acc.memory["activations"] < r1.memory["activations"]


def test_scenario_refusals_are_one_line():
    prof = load_profile("dgx-a100")
    for sc, text in [
        (Scenario(GPT, GridShape(2, 1, 2, 2), "dgx-a100", algorithm="megatron1d"), "pins G_x = 1"),
        (Scenario(GPT, GridShape(2, 1, 4, 1), "dgx-a100", stages=3, schedule="interleaved", chunks=2,
                  microbatches=4), "must split into 2 equal chunks"),
        (Scenario(GPT, GridShape(2, 1, 4, 1), "dgx-a100", microbatch_size=3), "not a multiple of the micro-batch"),
        (Scenario(GPT, GridShape(2, 1, 4, 1), "dgx-a100", algorithm="optimus3d"), "covers the algorithms"),
    ]:
        with pytest.raises(ConfigError, match=text):
            predict_scenario(sc, prof)


# --- profiles ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dgx-a100", "dgx-a100-40gb", "dgx-h100", "h100-roce", "alps-gh200", "perlmutter",
                                  "frontier"])
def test_gpu_profiles_cite_every_constant_and_agree_on_fp16_and_bf16(name):
    prof = load_profile(name)
    rates = prof.data["compute"]["gemm_tflops"]
    assert rates["float16"] == rates["bfloat16"]
    sources = prof.data["sources"]
    for key in ("compute.device", "compute.gemm_tflops.bfloat16", "compute.mem_bandwidth_gbs",
                "network.latency_s_per_rank", "network.placement_gbs", "network.inter_node_gbs"):
        assert key in sources, key
    with open(prof.path) as fh:
        text = fh.read().lower()  # each file says nothing was fitted (tuned) to a training result
        assert "fitted" in text or "no constant was tuned" in text


# --- the published table -------------------------------------------------------------------------------

def test_published_summary_does_not_get_worse():
    from fourd_mpi.perf import published

    rows = published.evaluate(published.TARGET_SET)
    s = published.summary(rows)
    assert s["points"] == 11 and [r.gpus for r in rows[:10]] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    assert s["all_fit"]
    # the values at the second pass (median 7.3 %, worst 11.6 %, Spearman 0.95; first pass 11.2 %,
    # 18.5 %, 0.85): they may improve, never silently worsen
    assert s["median_abs_error"] <= 0.075
    assert s["spearman"] >= 0.94
    assert s["worst_error"] <= 0.12


def test_published_table_1_is_self_consistent():
    """The transcription of Table 1: TFLOP/s per GPU x GPUs = the aggregate PFLOP/s and / 312 = the % of
    peak, within the table's rounding (0.5 TFLOP/s per GPU, 0.5 %); GPUs = TP x PP x a data-parallel size
    dividing the batch."""
    from fourd_mpi.perf import published

    for p in published.load("narayanan_sc21")["points"]:
        assert abs(p["tflops_per_gpu"] * p["gpus"] / 1000 - p["pflops_aggregate"]) <= 0.5 * p["gpus"] / 1000 + 0.05
        assert abs(100 * p["tflops_per_gpu"] / 312 - p["pct_peak"]) <= 0.5 + 100 * 0.5 / 312
        dp = p["gpus"] // (p["tp"] * p["pp"])
        assert dp * p["tp"] * p["pp"] == p["gpus"] and p["batch"] % (dp * p["mbs"]) == 0
        assert p["layers"] % (p["pp"] * p["chunks"]) == 0


def test_claims_are_verified_and_the_4d_claim_has_the_right_winner():
    from fourd_mpi.perf import published

    claims = {c["name"]: c for c in published.evaluate_claims()}
    assert len(claims) == 3
    four_d = claims["4D vs Megatron-LM, gpt-80b, 1,024 Perlmutter A100s"]
    assert four_d["same_winner"]
    for name, (a, b) in {"PTD-P vs ZeRO-3, 175B GPT, 384 A100s": (153, 144),
                         "PTD-P vs ZeRO-3, 175B GPT, 768 A100s": (149, 88)}.items():
        c = claims[name]
        assert c["published_tflops"] == {"a": a, "b": b} and "NOT checked" not in c["source"]
        assert c["published_margin"] == pytest.approx(a / b - 1, abs=1e-3)
        # PTD-P's side is within 10 %; ZeRO-3's is the known miss (docs/model.md: what is still missing at 384)
        assert abs(c["a"].tflops_per_gpu() / a - 1) < 0.10
        assert c["b"].scenario.implementation == "deepspeed-2021"
    # 768 GPUs: with DeepSpeed 2021's blocking parameter gathers, PTD-P wins, as published (+69 %)
    assert claims["PTD-P vs ZeRO-3, 175B GPT, 768 A100s"]["same_winner"]
    # DeepSpeed 2021's own costs (zero3_2021): ZeRO-3 over-predicted 1.20 x and 1.07 x (1.33 x and 1.64 x before its
    # gathers' costs, 1.20 x and 1.30 x before its gradient reduce-scatters'); they may improve, never silently worsen
    assert claims["PTD-P vs ZeRO-3, 175B GPT, 384 A100s"]["b"].tflops_per_gpu() / 144 < 1.21
    assert claims["PTD-P vs ZeRO-3, 175B GPT, 768 A100s"]["b"].tflops_per_gpu() / 88 < 1.08


def test_table_2_summary_does_not_get_worse():
    """Table 2 (PTD-P against ZeRO-3): PTD-P's six rows within 11 % (median 5.3 %, Spearman 1.0 at the third
    pass); ZeRO-3's six at 0.71-1.41 x (median 24 %, 33 % before DeepSpeed 2021's per-parameter
    gradient reduce-scatters were priced; 1,536 GPUs now under-predicted, 0.71 x, the others over, docs/model.md):
    they may improve, never silently worsen; every row fits its GPU's memory."""
    from fourd_mpi.perf import published

    rows = published.evaluate(("narayanan_sc21_table2",))
    assert [(r.scheme, r.gpus) for r in rows] == [("zero3", 384), ("zero3", 768), ("zero3", 1536), ("zero3", 640),
                                                  ("zero3", 1120), ("zero3", 2240), ("ptdp", 384), ("ptdp", 768),
                                                  ("ptdp", 1536), ("ptdp", 560), ("ptdp", 1120), ("ptdp", 2240)]
    ptdp = published.summary([r for r in rows if r.scheme == "ptdp"])
    zero3 = published.summary([r for r in rows if r.scheme == "zero3"])
    assert ptdp["median_abs_error"] <= 0.054 and ptdp["worst_error"] <= 0.11 and ptdp["spearman"] >= 0.99
    assert zero3["median_abs_error"] <= 0.25 and zero3["worst_error"] <= 0.41
    # the known misses: ZeRO-3 over-predicted but at 1,536 GPUs (0.71 x)
    assert [r.ratio > 1 for r in rows if r.scheme == "zero3"] == [True, True, False, True, True, True]
    assert all(0.7 < r.ratio < 1.41 for r in rows if r.scheme == "zero3")
    assert ptdp["all_fit"] and zero3["all_fit"]
    assert all(r.result.scenario.implementation == "deepspeed-2021" for r in rows if r.scheme == "zero3")


def test_published_table_2_is_self_consistent():
    """Each Table 2 row against its own columns: the training time for 300B tokens (days) = 300e9 / (B s)
    steps x Megatron's FLOPs per step / (N x TFLOP/s), to the table's rounding (0.5 day, plus 1 %); the
    parameters from P = 12 l h^2 (1 + 13/12h + (V + s)/12lh); ZeRO-3 runs one micro-batch per step
    (B = N x mbs) and PTD-P's model-parallel size divides the GPUs and the batch."""
    from fourd_mpi.perf import published

    ds = published.load("narayanan_sc21_table2")
    V, s = ds["defaults"]["vocab"], ds["defaults"]["seq"]
    assert len(ds["points"]) == 12
    for p in ds["points"]:
        l, h, B, n = p["layers"], p["hidden"], p["batch"], p["gpus"]
        flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        days = 300e9 / (B * s) * flops / (n * p["tflops_per_gpu"] * 1e12) / 86400
        assert abs(days - p["days"]) <= 0.5 + 0.01 * p["days"], (p["name"], days)
        params = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert abs(params / 1e9 - p["params_b"]) <= 0.05, (p["name"], params / 1e9)
        if p["scheme"] == "zero3":
            assert B == n * p["mbs"] and p["grid"] == f"1x{n}x1x1"
        else:
            dp = n // (p["tp"] * p["pp"])
            assert dp * p["tp"] * p["pp"] == n and B % (dp * p["mbs"]) == 0 and l % (p["pp"] * p["chunks"]) == 0


def test_megatron_readme_2020_is_self_consistent_and_does_not_get_worse():
    """NVIDIA/Megatron-LM's README tables of 2020-09-11 (images/tables.tex): each row's TeraFLOPs per GPU x
    iteration time x GPUs = Megatron's 96 B s l h^2 (1 + s/6h + V/16lh) to the table's rounding (0.1 TFLOP/s,
    1 ms; the 72 convention would be 25 % off, so the runs counted the recompute); parameters from
    P = 12 l h^2 (1 + 13/12h + (V + s)/12lh) to 0.01 B. The model's summary at the third pass
    (median 1.2 %, worst 10.5 %: 8B on 1,024 GPUs, Spearman 1.00): it may improve, never silently worsen."""
    from fourd_mpi.perf import published

    ds = published.load("megatron_readme_2020")
    V, s = ds["defaults"]["vocab"], ds["defaults"]["seq"]
    assert ds["machine"] == "dgx-a100-40gb" and len(ds["points"]) == 8
    for p in ds["points"]:
        l, h, B = p["layers"], p["hidden"], p["batch"]
        flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        tflops = flops / (p["gpus"] * p["iteration_ms"] / 1000) / 1e12
        assert abs(tflops - p["tflops_per_gpu"]) <= 0.05 + p["tflops_per_gpu"] * 0.5 / p["iteration_ms"], \
            (p["name"], tflops)
        params = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert abs(params / 1e9 - p["params_b"]) <= 0.01, (p["name"], params / 1e9)
        assert B == p["gpus"] // p["tp"] * p["mbs"] and p["heads"] % p["tp"] == 0
    rows = published.evaluate(("megatron_readme_2020",))
    got = published.summary(rows)
    assert got["median_abs_error"] <= 0.013 and got["worst_error"] <= 0.106 and got["spearman"] >= 0.99
    assert got["all_fit"] and all(r.result.scenario.implementation == "megatron-lm" for r in rows)


def test_table_2_memory_claims_agree_with_its_caption():
    """Table 2's caption: 530B with ZeRO-3 and micro-batch 4 did not fit on 560 GPUs and ran on 640. The
    model says the same only because DeepSpeed's zero.Init partitions the embedding too (78.7 / 80.6 GiB
    required on 640 / 560 GPUs; 95.9 on 640 with it whole on every rank, as this suite's fsdp step keeps it)."""
    from fourd_mpi.perf import published

    claims = {c["name"]: c for c in published.evaluate_memory_claims()}
    assert set(claims) == {"zero3-530b-560-mbs4", "zero3-530b-640-mbs4"}
    assert not claims["zero3-530b-560-mbs4"]["published_fits"] and claims["zero3-530b-640-mbs4"]["published_fits"]
    assert all(c["agree"] for c in claims.values())
    assert claims["zero3-530b-640-mbs4"]["required_gib"] < 80 < claims["zero3-530b-560-mbs4"]["required_gib"]


def test_deepspeed_2021_partitions_the_embedding_and_pads_its_shards():
    """Known answers: with ``implementation: deepspeed-2021`` the embedding's weight, gradient, fp32 master
    and Adam state are ``ceil(V h / n)`` elements per rank instead of ``V h``; a grid whose weight blocks do
    not divide by G_z (DeepSpeed pads each shard) is accepted by the model, refused for this suite's step."""
    from fourd_mpi.perf.scenario import Scenario
    from fourd_mpi.perf.step_terms import scenario_memory

    prof = load_profile("dgx-a100")
    cfg = ModelConfig("g530", "gpt", 105, 20480, 128, 4 * 20480, 2048, 2560)
    kw = dict(algorithm="fsdp", microbatch_size=4, vocab=51200, dtype="float16", attention="unfused",
              overlap="ors,dp", memory_limit_gib=80)
    ours = scenario_memory(Scenario(cfg, GridShape(1, 640, 1, 1), "dgx-a100", **kw), prof)
    ds = scenario_memory(Scenario(cfg, GridShape(1, 640, 1, 1), "dgx-a100", implementation="deepspeed-2021", **kw),
                         prof)
    emb = 51200 * 20480
    shard = -(-emb // 640)
    # fp16 weight and gradient (2 + 2 bytes), fp32 master (4) and Adam's two moments (8)
    assert ours["weights"] - ds["weights"] == 2 * (emb - shard)
    assert ours["optimizer"] - ds["optimizer"] == 8 * (emb - shard)
    assert ours["total"] - ds["total"] == 16 * (emb - shard)
    odd = Scenario(replace(cfg, batch=2240), GridShape(1, 560, 1, 1), "dgx-a100", **kw)
    with pytest.raises(ConfigError, match="not divisible by G_z = 560"):
        scenario_memory(odd, prof)
    assert scenario_memory(replace(odd, implementation="deepspeed-2021"), prof)["required"] > 80 * 2 ** 30


def test_zero3_claims_gather_blocking_as_deepspeed_2021():
    """ZeRO-3's side of Table 2 runs with its parameter all-gathers blocking (claims.yaml: DeepSpeed v0.3.13's
    fetch_sub_module synchronizes every fetch; DeepSpeed issue #1069, PRs #1170 and #1188), not with overlap ``all``;
    known answer: blocking adds at least the gathers' exposed time, so the step is longer than with every
    overlap, and the z-axis (the ZeRO axis) exposes more."""
    import yaml

    from fourd_mpi.perf import published
    from fourd_mpi.perf.machine import load_profile

    with open(os.path.join(os.path.dirname(published.__file__), "claims.yaml")) as fh:
        text = fh.read()
    assert "#1069" in text and "#1188" in text and "torch.cuda.synchronize()" in text
    prof = load_profile("dgx-a100")
    ds = published.load("narayanan_sc21_table2")
    for claim in yaml.safe_load(text)["claims"][1:]:
        spec = next(p for p in ds["points"] if p["name"] == claim["b"]["point"])
        assert spec["algorithm"] == "fsdp" and spec["overlap"] == "ors,dp"
        blocking = published.predict_scenario(published.scenario_of(spec, ds["defaults"], ds["machine"]), prof)
        hidden = published.predict_scenario(published.scenario_of(dict(spec, overlap="all"), ds["defaults"],
                                                                  ds["machine"]), prof)
        assert blocking.step_s > hidden.step_s and blocking.exposed_s["z"] > hidden.exposed_s["z"]
        assert blocking.compute_s == pytest.approx(hidden.compute_s, rel=1e-3)  # (OD chunking changes the launches)


def test_spearman_known_answers():
    from fourd_mpi.perf.published import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # 1 - 6 sum d^2 / (n (n^2 - 1)) with d = (0, 0, 1, -1): 1 - 12/60
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)


def test_model_predict_cli_json_config_and_refusals(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("profile: dgx-a100\nmodel: gpt-80b\nbatch: 1536\ngrid: 16x1x8x1\nstages: 6\n"
                    "schedule: interleaved\nchunks_per_stage: 7\nmicrobatch_size: 1\nalgorithm: megatron1d\n")
    proc = cli("model", "predict", "--config", conf, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["scenario"]["gpus"] == 768 and doc["scenario"]["microbatches"] == 96
    assert set(doc["pct_peak"]) == {"megatron", "hardware", "model"}
    assert doc["formulas"]["bubble"].startswith("bubble = (p - 1)/(v m)")
    assert set(doc["memory_bytes"]) >= {"weights", "gradients", "master", "optimizer", "activations", "comm_buffers"}
    text = cli("model", "predict", "--config", conf, "--ginter", "3")  # the command line wins
    assert text.returncode == 0 and "x 3 stage(s)" in text.stdout and "% of 312 TFLOP/s peak" in text.stdout
    # the config's stages: and schedule: are today's spellings of run's ginter: and pipeline_schedule:
    assert "note: stages: is deprecated, use ginter:" in text.stderr
    assert "note: schedule: is deprecated, use pipeline_schedule:" in text.stderr
    # --stages and --schedule: hidden aliases of run's --ginter and --pipeline-schedule, with a note
    old = cli("model", "predict", "--config", conf, "--stages", "3", "--format", "json")
    assert old.returncode == 0 and json.loads(old.stdout)["scenario"]["stages"] == 3
    assert "note: --stages is deprecated, use --ginter" in old.stderr
    helptext = cli("model", "predict", "--help").stdout
    assert "--ginter" in helptext and "--pipeline-schedule" in helptext and "--stages" not in helptext
    for args, msg in [(("--grid", "16x1x8x1", "--ginter", "5", "--first-stage-layers", "8", "--last-stage-layers", "8"),
                       "not an equal whole number"),
                      (("--batch", "8"), "needs --grid"),
                      (("--grid", "1x1x8x1", "--batch", "8", "--profile", "nope"), "unknown machine profile"),
                      (("--config", tmp_path / "missing.yaml", "--grid", "1x1x1x1"), "cannot read predict config")]:
        bad = cli("model", "predict", "--model", "gpt-80b", "--batch", "16", *args)
        assert bad.returncode == 2 and msg in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_model_published_cli_prints_summary_and_claims():
    proc = cli("model", "published")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "summary over 11 points (the targets' set" in out and "median |error|" in out and "Spearman" in out
    by_set = out.split("by dataset (and by scheme where a dataset compares several):\n", 1)[1].split("\nto match:")[0]
    points = {line.split()[0]: line.split()[1] for line in by_set.splitlines()[2:]}
    assert points["narayanan-sc21-table2"] == "12" and points["megatron-readme-2020"] == "8" and "scheme zero3" in out
    assert "memory claims" in out
    assert "4D vs Megatron-LM" in out and "PTD-P vs ZeRO-3" in out and "published margin" in out


def test_model_without_pandas_is_one_line_or_works(tmp_path):
    code = ("import sys, runpy; sys.modules['pandas'] = None; sys.argv = ['fourd-mpi', 'model'] + sys.argv[1:]; "
            "runpy.run_module('fourd_mpi', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=300)

    bad = run("validate", str(tmp_path / "none.h5"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "fourd_mpi[analysis]" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    ok = run("published", "--dataset", "axonn_sc24", "--no-claims")
    assert ok.returncode == 0 and "summary over 1 points" in ok.stdout, ok.stderr


def test_tune_bounded_dw_window_lowers_memory_not_time():
    from fourd_mpi.perf.tune import rank_grids

    prof = load_profile("perlmutter")
    cfg = ModelConfig("g", "gpt", 8, 1024, 16, 4096, 1024, 64)
    kw = dict(overlap=OverlapConfig.parse("all"), dtype="bfloat16", grids=[GridShape(2, 4, 1, 1)])
    free = rank_grids(cfg, 8, prof, **kw).predictions[0]
    bounded = rank_grids(cfg, 8, prof, dw_window=1, **kw).predictions[0]
    blocks = sorted((block_elements(n, k, t, GridShape(2, 4, 1, 1))
                     for _, n, k, t in fc_weights(cfg, GridShape(2, 4, 1, 1)) * cfg.layers), reverse=True)
    assert free.memory.comm_buffers - bounded.memory.comm_buffers == sum(b + b // 4 for b in blocks[1:]) * 2
    assert bounded.step_s == free.step_s
    bad = cli("tune", "--ranks", "8", "--model", "gpt-small", "--algorithm", "fsdp", "--dw-window", "2")
    assert bad.returncode == 2 and "--dw-window applies to --algorithm axonn4d" in bad.stderr


def test_published_table_is_self_consistent():
    """Each Table 1 row against its own columns: % of peak = TFLOP/s / 312 (rounded), the parameter count
    from the paper's formula P = 12 l h^2 (1 + 13/12h + (V + s)/12lh) to the table's rounding (0.05 B or 1 %),
    and GPUs = TP x PP x DP."""
    from fourd_mpi.perf import published

    ds = published.load("narayanan_sc21")
    V, s = ds["defaults"]["vocab"], ds["defaults"]["seq"]
    for p in ds["points"]:
        assert abs(p["tflops_per_gpu"] / 312 * 100 - p["pct_peak"]) < 0.6, p["name"]
        l, h = p["layers"], p["hidden"]
        params = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert abs(params / 1e9 - p["params_b"]) <= max(0.05, 0.01 * p["params_b"]), (p["name"], params / 1e9)
        assert p["gpus"] % (p["tp"] * p["pp"]) == 0 and p["layers"] % (p["pp"] * p["chunks"]) == 0
        assert p["batch"] % (p["gpus"] // (p["tp"] * p["pp"]) * p["mbs"]) == 0


@pytest.mark.parametrize("family,names,gib", [("pipeline", ["pipeline"], 3.4), ("tensor4d", ["axonn4d", "fsdp"], 5.8)])
def test_memory_precheck_keeps_the_ranking(monkeypatch, family, names, gib):
    """Dropping what does not fit before predicting it (a family's memory hook) changes no answer."""
    from dataclasses import replace as dc_replace

    from fourd_mpi.algorithms.families import FAMILIES
    from fourd_mpi.perf import algorithms

    cfg = ModelConfig("g", "gpt", 8, 1024, 16, 4096, 1024, 64)
    prof = load_profile("perlmutter")
    kw = dict(overlap=OverlapConfig.parse("all"), dtype="bfloat16", memory_limit_bytes=gib * 2 ** 30)
    fast = algorithms.rank_algorithms(names, cfg, 16, prof, **kw)
    monkeypatch.setitem(FAMILIES, family, dc_replace(FAMILIES[family], memory=None))
    slow = algorithms.rank_algorithms(names, cfg, 16, prof, **kw)
    assert [(e.algorithm, e.label, e.prediction.step_s, e.need_bytes) for e in fast.every] == \
        [(e.algorithm, e.label, e.prediction.step_s, e.need_bytes) for e in slow.every]
    assert sorted(map(str, fast.dropped)) == sorted(map(str, slow.dropped)) and fast.dropped


def test_llama3_table_4_is_self_consistent_and_reported_as_it_is():
    """Llama 3's Table 4 (arXiv 2407.21783, section 3.3.2) against its own columns: GPUs = TP x CP x PP x DP,
    tokens per batch = DP x batch/DP x seq ("16M": 16.8e6 within 0.5M), TFLOPs/GPU / 989 (H100 dense BF16) = the
    BF16 MFU within the columns' rounding (TFLOP/s to 5, MFU to 0.5 %); the model's global batch = DP x batch/DP.
    The configuration is the paper's own (same section): the interleaved schedule with V = 8 one-block chunks on
    7, 14 x 8, 7 blocks (bubble (PP - 1)/(V M)), no activation checkpointing at 8K tokens, K and V all-gathered
    for context parallelism. The model's results are shipped as they are; this test pins the configuration and
    the one known memory miss (the model does not count the paper's proactive freeing of each stage's inputs and
    outputs, so the 8K DP 64 row needs more than 80 GB in the model although it ran), not a value."""
    from fourd_mpi.perf import published

    ds = published.load("llama3_405b")
    assert ds["machine"] == "h100-roce" and ds["metric"] == "mfu_pct" and len(ds["points"]) == 3
    for p in ds["points"]:
        d = dict(ds["defaults"], **p)
        assert d["tp"] * d["cp"] * d["pp"] * d["dp"] == d["gpus"], d["name"]
        assert abs(d["dp"] * d["batch_per_dp"] * d["seq"] - d["tokens_m"] * 2 ** 20) <= 0.5e6, d["name"]
        assert d["batch"] == d["dp"] * d["batch_per_dp"]
        lo, hi = (d["tflops_per_gpu"] - 5) / 989 * 100, (d["tflops_per_gpu"] + 5) / 989 * 100
        assert lo <= d["mfu_pct"] + 0.5 and d["mfu_pct"] - 0.5 <= hi, d["name"]
        assert sum((d["first_stage_layers"], 14 * 8, d["last_stage_layers"])) == d["layers"] == 126
    rows = published.evaluate(("llama3_405b",))
    assert [r.gpus for r in rows] == [8192, 16384, 16384]
    assert [r.result.fits() for r in rows] == [False, True, True]
    assert [r.result.scenario.context_parallel for r in rows] == [1, 1, 16]
    assert [r.result.scenario.recompute for r in rows] == ["none", "none", "selective"]
    for r in rows:
        sc = r.result.scenario
        assert (sc.schedule, sc.chunks, sc.stage_layers) == ("interleaved", 8, (7,) + (8,) * 14 + (7,))
        assert sc.context_parallel_comm == "allgather"


def test_mfu_metric_is_the_model_convention():
    """``mfu_pct`` is the % of peak of model FLOPs (PaLM's 6N + 12 l h s per token), the other metrics Megatron's."""
    from fourd_mpi.perf import published

    ds = published.load("llama3_405b")
    r = published.predict_point(ds, ds["points"][0], load_profile(ds["machine"]))
    assert published.metric_of(r, "mfu_pct") == r.pct_peak("model")
    assert published.metric_of(r, "pct_peak") == r.pct_peak("megatron")
    assert published.metric_of(r, "tflops_per_gpu") == r.tflops_per_gpu("megatron")


def test_framework_gemm_efficiency_known_answer_and_one_place(monkeypatch):
    """The per-framework GEMM efficiency (fourd_mpi/perf/published/framework_efficiency.yaml): t' = t / f
    (0.3 s at f = 0.75 -> 0.4 s, by hand); every shipped factor is 1.0 unless measured with a source; a factor f
    on Megatron-LM's GEMMs lengthens the step by exactly (1/f - 1) x its GEMM time, and `model predict` says
    which term applied."""
    from fourd_mpi.perf import terms

    assert terms.framework_gemm_time(0.3, 0.75) == pytest.approx(0.4)
    table = terms.framework_table()
    assert set(table) >= {"fourd", "megatron-lm", "deepspeed-2021", "pytorch-fsdp"}
    for name, entry in table.items():
        assert entry["factor"] == 1.0 or entry["measured"], name
        assert entry["source"], name
    assert terms.framework_efficiency("megatron-lm")["measured"] is False
    cfg = ModelConfig("gpt", "gpt", 8, 4096, 32, 4 * 4096, 2048, 64)
    sc = Scenario(cfg, GridShape(8, 1, 8, 1), "dgx-a100", algorithm="megatron1d", implementation="megatron-lm",
                  microbatch_size=1, vocab=51200, dtype="float16", attention="fused", recompute="full")
    profile = load_profile("dgx-a100")
    base = predict_scenario(sc, profile)
    assert any("framework GEMM efficiency of megatron-lm: x 1.00" in n and "not measured" in n for n in base.notes)
    patched = dict(table, **{"megatron-lm": {"factor": 0.5, "measured": True, "source": "test"}})
    monkeypatch.setattr(terms, "framework_table", lambda: patched)
    slow = predict_scenario(sc, profile)
    assert slow.terms["step_gemm"] == pytest.approx(2 * base.terms["step_gemm"])
    assert slow.step_s - base.step_s == pytest.approx(base.terms["step_gemm"], rel=1e-9)
    assert slow.compute_s - base.compute_s == pytest.approx(base.terms["step_gemm"], rel=1e-9)
    assert any("x 0.50" in n for n in slow.notes)
    own = predict_scenario(replace(sc, implementation="fourd"), profile)
    assert not any("framework GEMM efficiency" in n for n in own.notes)


def test_megascale_table_2_is_self_consistent():
    """MegaScale's Table 2, Megatron-LM rows (arXiv 2402.15627), against its own columns: throughput = batch x
    2048 / iteration time, days for 300B tokens = 300e9 / (batch x 2048) x iteration time, and MFU = (6 x 174.6e9
    + 12 l h s) x batch x s / (iteration time x GPUs x 312e12), each within 0.6 % (the iteration time to 0.1 s
    at 11.9 s is 0.42 %); GPUs = TP x PP x a data-parallel size dividing the batch; every point fits 80 GiB."""
    from fourd_mpi.perf import published

    ds = published.load("megascale_megatron")
    assert ds["machine"] == "dgx-a100" and ds["metric"] == "mfu_pct" and len(ds["points"]) == 8
    for p in ds["points"]:
        d = dict(ds["defaults"], **p)
        s, t, B, N = d["seq"], d["iteration_s"], d["batch"], d["gpus"]
        assert abs(B * s / t / 1e3 / d["tokens_per_s_k"] - 1) <= 0.006, d["name"]
        assert abs(300e9 / (B * s) * t / 86400 / d["days"] - 1) <= 0.006, d["name"]
        mfu = 100 * (6 * 174.6e9 + 12 * d["layers"] * d["hidden"] * s) * B * s / (t * N * 312e12)
        assert abs(mfu / d["mfu_pct"] - 1) <= 0.006, (d["name"], mfu)
        dp = N // (d["tp"] * d["pp"])
        assert dp * d["tp"] * d["pp"] == N and B % dp == 0
    rows = published.evaluate(("megascale_megatron",))
    assert all(r.result.fits() for r in rows)
    # at shipping: median 3.1 %, worst 6.6 % (3,072 GPUs), Spearman 0.95; may improve, never silently worsen
    got = published.summary(rows)
    assert got["median_abs_error"] <= 0.032 and got["worst_error"] <= 0.067 and got["spearman"] >= 0.94


def test_a_to_match_factor_that_cannot_match_says_none():
    """``to match``: a factor at or below 0 (the other terms alone exceed the published step, as for a row the
    model under-predicts with communication alone) prints ``none``, a zero term ``-``, others two decimals."""
    from fourd_mpi.perf.published import _factor

    assert [_factor(v) for v in (-1.04, 0.0, float("nan"), 1.234)] == ["none", "none", "-", "1.23"]


def test_every_shipped_point_is_a_model_predict_command(capsys):
    """Every configuration of every shipped point is expressible from the command line: the point's
    ``model predict`` command (``--format json``'s ``command``, :meth:`Scenario.predict_command`) run through the
    command line's own parser predicts the same step, to the last bits, and says it fits exactly when the point
    does."""
    import shlex

    from fourd_mpi.cli.main import main
    from fourd_mpi.perf import published

    rows = published.evaluate()
    assert len(rows) == 42
    doc = published.as_dict(rows)
    for row, point in zip(rows, doc["points"]):
        words = shlex.split(point["command"])
        assert words[:3] == ["fourd-mpi", "model", "predict"]
        assert main(words[1:] + ["--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["step_s"] == pytest.approx(row.result.step_s, rel=1e-12), point["name"]
        assert out["fits"] == row.result.fits(), point["name"]
