"""The step equation's terms (fourd_mpi/perf/step_terms.py) and the views of a scenario they take
(fourd_mpi/perf/scenario.py). Known answers by hand."""

import pytest

from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import pipeline_bubble

H100 = load_profile("dgx-h100")  # 8 GPUs per node


def scenario(**options):
    return Scenario.from_options({"model": "gpt-80b", "batch": 48, "grid": "1x1x8x1", **options}, H100)


def test_the_bubble_is_p_minus_1_over_v_slots():
    # 1F1B, p = 3: (3 - 1)/1 = 2 slots of 1.5 s = 3 s (Narayanan et al. SC'21, 2.2)
    assert pipeline_bubble(scenario(ginter=3), 1.5) == 3.0
    # interleaved, p = 3, v = 7 (42 blocks = 3 x 7 chunks of 2): (3 - 1)/7 slots of 7 s = 2 s
    sc = scenario(ginter=3, **{"pipeline-schedule": "interleaved", "chunks-per-stage": 7})
    assert sc.interleaving == 7
    assert pipeline_bubble(sc, 7.0) == pytest.approx(2.0)
    # AxoNN's schedule counts no chunks (v = 1 whatever chunks says): 2 slots
    assert scenario(ginter=3, **{"pipeline-schedule": "axonn"}).interleaving == 1
    # one stage: no bubble
    assert pipeline_bubble(scenario(), 1.5) == 0.0


def test_the_views_of_a_scenario():
    fp8 = scenario(dtype="fp8")
    assert (fp8.store_dtype, fp8.gemm_dtype) == ("bfloat16", "float8")  # FP8 GEMMs, BF16 storage
    bf16 = scenario(dtype="bfloat16")
    assert (bf16.store_dtype, bf16.gemm_dtype) == ("bfloat16", None)
    # ranks per node: the profile's 8, at most the world (8 x 3 stages = 24; one stage of 8; 1x1x2x1 = 2)
    assert scenario(ginter=3).node_ranks(H100) == 8
    assert scenario(grid="1x1x2x1").node_ranks(H100) == 2
    assert scenario(grid="1x1x2x1", **{"ranks-per-node": 4}).node_ranks(H100) == 4
    # one slot's model: the fullest stage's blocks (43 on 3 stages: 15, 14, 14) on B/m sequences (48/4 = 12)
    sc = scenario(ginter=3, layers=43, microbatches=4).resolved()
    assert (sc.micro_config.layers, sc.micro_config.batch) == (15, 12)
    # context parallelism 2: s/2 tokens per rank, twice the data ranks, the same sequences per data rank
    view = scenario(grid="2x1x4x1", **{"context-parallel": 2}).context_view()
    assert (view.model.seq, view.grid.data, view.context_parallel) == (2048 // 2, 4, 1)
