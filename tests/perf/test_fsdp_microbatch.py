"""FSDP's gradient accumulation as PyTorch runs it (Zhao et al. PVLDB 2023, PyTorch's
``FullyShardedDataParallel.no_sync``): a reduce-scatter per micro-batch into sharded partial sums. Known answers by
hand on dgx-a100's network section."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.terms import fsdp_microbatch_sync
from fourd_mpi.step.presets import ModelConfig

GPT = ModelConfig("g", "gpt", layers=2, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=32)


def test_reduce_scatter_counted_per_microbatch_by_hand():
    assert fsdp_microbatch_sync(3e-3, 8) == {"per_slot": 3e-3, "step": 24e-3, "once": 3e-3}


def _pair(overlap="none"):
    prof = load_profile("dgx-a100")
    kw = dict(algorithm="fsdp", dtype="bfloat16", vocab=0, microbatches=4, overlap=overlap)
    plain = predict_scenario(Scenario(GPT, GridShape(1, 8, 1, 1), "dgx-a100", **kw), prof)
    torch = predict_scenario(Scenario(GPT, GridShape(1, 8, 1, 1), "dgx-a100", implementation="pytorch-fsdp", **kw),
                             prof)
    return plain, torch


def test_memory_holds_sharded_sums_only():
    # no_sync-style accumulation keeps token-partial sums of every full weight: 12 h^2 elements per block, 2 blocks,
    # 2 bytes; PyTorch FSDP adds each micro-batch's reduce-scattered shard to the gradient shard instead
    plain, torch = _pair()
    assert plain.memory["comm_buffers"] - torch.memory["comm_buffers"] == 12 * 1024 ** 2 * 2 * 2
    assert plain.memory["gradients"] == torch.memory["gradients"]


def test_reduce_scatters_run_once_per_microbatch():
    # overlap none: every reduce-scatter is exposed. One micro-batch's: 2 blocks x 4 weights (3h^2, h^2, fh, hf), each
    # over 8 ranks inside a node at lat 9 us x 8 + 7/8 S / 225 GB/s, S = n k x 2 bytes; the step pays m = 4 of them
    # instead of one: 3 more
    plain, torch = _pair()
    h, f = 1024, 4096
    one = sum(8 * 9e-6 + 7 / 8 * n * 2 / 225e9 for n in (3 * h * h, h * h, f * h, h * f)) * 2
    assert torch.terms["fsdp_reduce_scatter"] == pytest.approx(4 * one, rel=1e-9)
    assert torch.step_s - plain.step_s == pytest.approx(3 * one, rel=1e-6)
    assert torch.exposed_s["z"] - plain.exposed_s["z"] == pytest.approx(3 * one, rel=1e-6)


def test_pytorch_fsdp_is_for_fsdp_only():
    with pytest.raises(ConfigError, match="pytorch-fsdp models PyTorch FSDP"):
        predict_scenario(Scenario(GPT, GridShape(8, 1, 1, 1), "dgx-a100", algorithm="dp",
                                  implementation="pytorch-fsdp"), load_profile("dgx-a100"))
