"""Megatron-LM 2020-2021's data-parallel gradient reduction in the model (fourd_mpi/perf/megatron_ddp.py)."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import axis_inner_products, axis_placement, load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.step.presets import ModelConfig


def test_megatron_lm_reduces_every_gradient_in_one_all_reduce():
    """``implementation: megatron-lm`` (Megatron-LM 2020-2021, DDP=local): the data axis pays one all-reduce
    of every gradient a rank holds (its blocks' weights and LayerNorms, its embedding shard) plus the
    loss's, instead of one per weight; known answer from the profile's own all-reduce price. With ``dp``
    overlap (PyTorch DDP) or one data rank nothing changes; other algorithms are refused."""
    from fourd_mpi.perf import megatron_ddp, vocab
    from fourd_mpi.perf.memory import parameter_elements
    from fourd_mpi.perf.predict import collective_time
    from fourd_mpi.perf.volumes import Collective

    prof = load_profile("dgx-a100")
    cfg = ModelConfig("1b", "gpt", 24, 1920, 15, 4 * 1920, 1024, 2048)
    grid = GridShape(128, 1, 1, 1)
    base = dict(algorithm="megatron1d", microbatch_size=16, recompute="full", dtype="float16", attention="unfused",
                overlap="none", precision="mixed")
    ours = predict_scenario(Scenario(cfg, grid, "dgx-a100", **base), prof)
    meg = predict_scenario(Scenario(cfg, grid, "dgx-a100", implementation="megatron-lm", **base), prof)
    place, inner = axis_placement(grid, 8), axis_inner_products(grid)
    grads = parameter_elements(cfg, grid) + vocab.embedding_elements(1920, 51200, 1)
    one = collective_time(Collective("ddp", "g", "allreduce", "data", 128, "step", 1, 2 * grads), prof, place, 8, inner)
    loss = collective_time(Collective("ddp", "l", "allreduce", "data", 128, "step", 1, 4), prof, place, 8, inner)
    assert meg.exposed_s["data"] == pytest.approx(one + loss, rel=1e-9)
    assert megatron_ddp.grad_sync_time(grads, 2, grid, prof, place, 8, inner) == pytest.approx(one + loss, rel=1e-12)
    # this suite's step: 24 x (4 weights + 2 LayerNorm pairs) latency-bound all-reduces, about 0.47 s
    assert ours.exposed_s["data"] > 10 * meg.exposed_s["data"]
    assert meg.step_s == pytest.approx(ours.step_s - ours.exposed_s["data"] + meg.exposed_s["data"], rel=1e-9)
    assert meg.compute_s == ours.compute_s and meg.memory == ours.memory
    for kw in (dict(base, overlap="dp"),):
        a = predict_scenario(Scenario(cfg, grid, "dgx-a100", **kw), prof)
        b = predict_scenario(Scenario(cfg, grid, "dgx-a100", implementation="megatron-lm", **kw), prof)
        assert a.step_s == b.step_s
    with pytest.raises(ConfigError, match="algorithm megatron1d or dp"):
        predict_scenario(Scenario(cfg, GridShape(1, 128, 1, 1), "dgx-a100", implementation="megatron-lm",
                                  **dict(base, algorithm="fsdp")), prof)
