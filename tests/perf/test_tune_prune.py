"""tune's search (issue 30 item 3): every micro-batch size dividing the per-replica batch, lower bounds that
never exceed the prediction, and pruning that leaves the top K and each algorithm's best unchanged."""

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.algorithms import microbatch_counts, rank_algorithms
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.memory import block_elements, comm_buffer_elements, fc_weights
from fourd_mpi.perf.pipeline import pipeline_lower_bound, predict_pipeline
from fourd_mpi.perf.predict import lower_bound, predict
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

GPT = ModelConfig("g", "gpt", layers=8, hidden=256, heads=8, ffn_hidden=1024, seq=128, batch=64)


def test_microbatch_counts_are_every_divisor_bounded():
    assert microbatch_counts(12) == [1, 2, 3, 4, 6, 12]
    assert microbatch_counts(64, limit=8) == [1, 2, 4, 8]
    assert microbatch_counts(1) == [1]


@pytest.mark.parametrize("overlap", ["none", "all"])
@pytest.mark.parametrize("profile", ["perlmutter", "laptop"])
def test_lower_bounds_never_exceed_the_prediction(overlap, profile):
    prof = load_profile(profile)
    ov = OverlapConfig.parse(overlap)
    dtype = "bfloat16" if profile == "perlmutter" else "float32"
    for grid in (GridShape(2, 2, 2, 2), GridShape(4, 1, 4, 1), GridShape(1, 4, 1, 4)):
        for recompute in ("none", "full"):
            p = predict(GPT, grid, prof, ov, dtype, recompute=recompute)
            assert lower_bound(GPT, grid, prof, ov, dtype, recompute=recompute) <= p.step_s * (1 + 1e-12)
            assert lower_bound(GPT, grid, prof, ov, dtype, recompute=recompute, communication=False) <= p.step_s
            for stages, m in ((2, 2), (4, 8), (2, 16)):
                q = predict_pipeline(GPT, grid, prof, stages, m, overlap=ov, dtype=dtype, recompute=recompute)
                b = pipeline_lower_bound(GPT, grid, prof, stages, m, overlap=ov, dtype=dtype, recompute=recompute)
                assert b <= q.step_s * (1 + 1e-12)


def test_overlap_none_bound_is_the_whole_exposed_communication_of_4d():
    """Without overlap every collective is blocking: the bound is the prediction (device regime)."""
    prof = load_profile("perlmutter")
    grid = GridShape(2, 2, 2, 2)
    p = predict(GPT, grid, prof, OverlapConfig(), "bfloat16")
    assert lower_bound(GPT, grid, prof, OverlapConfig(), "bfloat16") == pytest.approx(p.step_s, rel=1e-9)


def test_comm_buffers_without_building_the_layer_list():
    """The l largest of the L-fold list of dW blocks, by hand: 2 layers of blocks {a, b}, window 3 -> a, a, b."""
    grid = GridShape(1, 2, 2, 2)
    cfg = ModelConfig("m", "mlp", layers=2, hidden=8, heads=1, ffn_hidden=16, seq=4, batch=4)
    blocks = sorted((block_elements(n, k, t, grid) for _, n, k, t in fc_weights(cfg, grid)), reverse=True)
    ov = OverlapConfig(oag=True, ors=True, prefetch_depth=1)
    window = [blocks[0], blocks[0], blocks[1]]
    gathers = blocks[0] + blocks[0]  # prefetch depth 1: two largest
    m = cfg.batch * cfg.seq // (grid.data * grid.z)
    widest = max(n // grid.y if not t else n // grid.x for _, n, _, t in fc_weights(cfg, grid))
    expect = gathers + sum(b + b // grid.z for b in window) + 2 * m * widest
    assert comm_buffer_elements(cfg, grid, ov, dw_window=3) == expect


@pytest.mark.parametrize("names,ranks,keep,limit", [(["pipeline"], 64, 3, None),
                                                     (["axonn4d", "fsdp", "pipeline"], 32, 2, None),
                                                     (["axonn4d", "pipeline"], 64, 3, 1.03 * 2 ** 30)])
def test_pruning_keeps_the_top_k_and_each_algorithms_best(names, ranks, keep, limit):
    """Also with a memory limit: pruned candidates are not memory-checked, the others are before predicting."""
    prof = load_profile("perlmutter")
    args = (names, GPT, ranks, prof, OverlapConfig.parse("all"), "bfloat16")
    full = rank_algorithms(*args, memory_limit_bytes=limit)
    cut = rank_algorithms(*args, memory_limit_bytes=limit, keep=keep)
    label = lambda e: (e.algorithm, str(e.grid), tuple(sorted(e.options.items())), e.prediction.step_s)
    assert [label(e) for e in cut.entries[:keep]] == [label(e) for e in full.entries[:keep]]
    assert {k: label(v) for k, v in cut.best_by_algorithm().items()} == \
        {k: label(v) for k, v in full.best_by_algorithm().items()}
    assert not full.pruned
    # nothing silently lost: predicted + pruned + dropped = considered
    assert len(cut.every) + len(cut.pruned) + len(cut.dropped) == cut.considered
    assert len(full.every) + len(full.dropped) == full.considered
    if cut.pruned:
        assert "not predicted" in cut.pruned_summary()
