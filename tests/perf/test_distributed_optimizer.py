"""The distributed optimizer's communication: ``--shard-optimizer data`` replaces the data axis'
gradient all-reduce by a reduce-scatter of the gradients and an all-gather of the updated parameters (Megatron-LM's
distributed optimizer, ZeRO stage 1): the same ring volume in two collectives. Known answers by hand."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.terms import distributed_optimizer_volumes
from fourd_mpi.step.presets import ModelConfig

GPT1 = ModelConfig("g", "gpt", layers=1, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=4)


def test_volumes_by_hand():
    # S = 1 MiB over 4 ranks: all-reduce 2 x 3/4 S = 1,572,864 bytes; reduce-scatter and all-gather 3/4 S each
    v = distributed_optimizer_volumes(2 ** 20, 4)
    assert v == {"allreduce": 1_572_864, "reduce_scatter": 786_432, "allgather": 786_432, "sum": 1_572_864}
    assert distributed_optimizer_volumes(2 ** 20, 1)["sum"] == 0


def _run(shard: str, overlap: str):
    prof = load_profile("dgx-a100")
    sc = Scenario(GPT1, GridShape(4, 1, 1, 1), "dgx-a100", algorithm="dp", dtype="bfloat16", vocab=0,
                  shard_optimizer=shard, overlap=overlap)
    return predict_scenario(sc, prof)


def test_the_all_gather_by_hand():
    # dgx-a100's network section inside a node: lat 9 us x p + (p-1)/p S / 225 GB/s per message. One block in
    # bf16 over G_data = 4: four weight gradients (3h^2, h^2, f h, h f = 12 h^2 elements) and two LayerNorms'
    # gamma and beta (4 messages of h): 8 messages, 2 (12 h^2 + 4 h) bytes
    r = _run("data", "none")
    h = 1024
    expected = 8 * 4 * 9e-6 + 0.75 * 2 * (12 * h * h + 4 * h) / 225e9
    assert r.terms["dist_opt_allgather"] == pytest.approx(expected, rel=1e-9)


def test_blocking_reduce_scatter_and_all_gather_cost_the_all_reduce():
    # overlap none: every all-reduce exposed; a ring all-reduce = reduce-scatter + all-gather (latencies add, the
    # bandwidth term halves twice): the step's gradient synchronization is the same
    plain, dist = _run("none", "none"), _run("data", "none")
    assert dist.terms["grad_sync"] == pytest.approx(plain.terms["grad_sync"], rel=1e-9)
    assert dist.terms["dist_opt_reduce_scatter"] == pytest.approx(dist.terms["dist_opt_allgather"], rel=1e-9)
    assert "dist_opt_allgather" not in plain.terms


def test_hidden_all_reduces_leave_the_all_gather_exposed():
    # overlap all: the all-reduces hide behind the backward pass; the all-gather after the update does not
    plain, dist = _run("none", "all"), _run("data", "all")
    assert dist.terms["grad_sync"] > plain.terms["grad_sync"]
    assert dist.exposed_s["data"] - plain.exposed_s["data"] == pytest.approx(
        dist.terms["grad_sync"] - plain.terms["grad_sync"], rel=1e-9)
    assert -1e-12 <= dist.step_s - plain.step_s <= dist.terms["dist_opt_allgather"] + 1e-12
