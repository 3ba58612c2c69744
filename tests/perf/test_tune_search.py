"""``tune --search``: scenarios of every axis ``model predict`` can express, with a bound.

No wall-time asserts (project rule): the 32,768-rank search is checked by its candidate count against the bound;
its time is measured by hand (docs/guide/model-and-tuning.md)."""

from __future__ import annotations

import json

import pytest

from fourd_mpi.cli.main import main
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario, scenario_lower_bound
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.search import AXES, MAX_SCENARIOS, candidates, parse_axes, search
from fourd_mpi.step.presets import resolve_labelled


def _base(cfg, profile, **more):
    options = {"model": cfg, "grid": "1x1x1x1", "vocab": 0, "recompute": "none", "attention": "unfused",
               "pipeline-schedule": "axonn", "dw-window": "none", "overlap": "none", "memory-limit": 0}
    options.update(more)
    return Scenario.from_options(options, profile)


@pytest.fixture(scope="module")
def small():
    profile = load_profile("laptop")
    cfg = resolve_labelled("gpt-tiny", layers=4, hidden=64, heads=4, ffn_hidden=256, seq=64, batch=8)
    return cfg, profile


def test_the_candidate_count_of_a_small_case_is_the_hand_count(small):
    # 4 ranks, 4 layers, batch 8, axes ginter, pipeline-schedule, microbatch-size (no context parallelism):
    # p = 1: the 10 ordered grids of 4 (C(2+3, 3)), m = 1 only (one stage: accumulation is a relief)     -> 10
    # p = 2: the 4 grids of 2 ranks; shard B/(G_data G_z) = 4 for 2x1x1x1 and 1x2x1x1, 8 for 1x1x2x1 and
    #        1x1x1x2; m = the powers of two shard/b with 2 <= m: {2, 4} or {2, 4, 8}; schedules 1f1b, axonn
    #        and interleaved v = 2 (4 layers = 2 stages x 2 chunks; v = 4 would need 8), m even: 3 each
    #        -> (2 + 2 + 3 + 3) x 3 = 30
    # p = 4: grid 1x1x1x1, shard 8, m in {4, 8}; 1f1b and axonn (4 layers leave no second chunk)      -> 4
    cfg, profile = small
    axes = ("ginter", "pipeline-schedule", "microbatch-size")
    found = candidates(_base(cfg, profile), 4, axes, {})
    assert len(found) == 10 + 30 + 4
    assert sum(1 for c in found if c[4] == "interleaved") == 10


def test_pinned_options_fix_their_axes(small):
    cfg, profile = small
    base = _base(cfg, profile, ginter=2, **{"pipeline-schedule": "1f1b", "recompute": "full"})
    found = search(base, 4, profile, AXES, {"ginter": 2, "pipeline-schedule": "1f1b", "recompute": "full"}, keep=3)
    assert found.pinned == {"ginter": 2, "pipeline-schedule": "1f1b", "recompute": "full"}
    assert all(r.scenario.stages == 2 and r.scenario.schedule == "1f1b" and r.scenario.recompute == "full"
               for r in found.results)
    # 4 grids of 2 ranks x m in {2, 4} or {2, 4, 8}, one schedule: 2 + 2 + 3 + 3
    assert found.candidates == 10


def test_reliefs_are_used_only_where_the_plain_candidate_does_not_fit(small):
    cfg, profile = small
    found = search(_base(cfg, profile), 4, profile, AXES, {}, keep=5)  # no memory limit: everything fits
    assert all(r.scenario.recompute == "none" and not r.scenario.sequence_parallel
               and r.scenario.shard_optimizer == "none" and (r.scenario.stages > 1 or r.scenario.microbatches == 1)
               for r in found.results)
    assert found.predicted + found.pruned + found.memory_dropped == found.candidates
    assert "context-parallel" in dict(found.not_searched)  # unfused attention
    for r in found.results:  # the bound the search prunes with never exceeds the prediction
        assert scenario_lower_bound(r.scenario, profile) <= r.step_s * (1 + 1e-12)
    assert [r.step_s for r in found.results] == sorted(r.step_s for r in found.results)


def test_the_top_k_equals_predicting_every_candidate(small):
    cfg, profile = small
    axes = ("ginter", "pipeline-schedule", "microbatch-size")
    base = _base(cfg, profile)
    found = search(base, 4, profile, axes, {}, keep=3)
    from fourd_mpi.perf.search import scenario_of

    every = sorted(predict_scenario(scenario_of(base, c), profile).step_s for c in candidates(base, 4, axes, {}))
    assert [r.step_s for r in found.results[:3]] == pytest.approx(every[:3], rel=1e-12)


def test_the_full_search_at_32768_ranks_stays_under_the_bound():
    profile = load_profile("perlmutter")
    cfg = resolve_labelled("gpt-80b", batch=2048)
    base = _base(cfg, profile, dtype="bfloat16", **{"memory-limit": None})
    found = search(base, 32768, profile, AXES, {}, keep=5)
    assert found.candidates < MAX_SCENARIOS
    assert found.predicted < 1000  # the rest is pruned by the bound, not predicted
    assert found.results[0].step_s < found.results[-1].step_s


def test_search_words():
    assert parse_axes("grid") == ()
    assert parse_axes("all") == AXES
    assert parse_axes("recompute,ginter") == ("ginter", "recompute")
    with pytest.raises(ConfigError, match="choose grid, all"):
        parse_axes("stages")


def test_tune_json_has_the_search_only_with_search(capsys):
    argv = ["tune", "--ranks", "4", "--model", "gpt-tiny", "--batch", "8", "--profile", "laptop", "--format", "json"]
    assert main(argv) == 0
    assert "search" not in json.loads(capsys.readouterr().out)
    assert main(argv + ["--search", "ginter,microbatch-size", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["search"]["axes"] == ["grid", "ginter", "microbatch-size"]
    assert doc["search"]["scenarios"] <= doc["search"]["max_scenarios"]
    assert len(doc["top"]) == 3 and {"ginter", "microbatches"} <= set(doc["top"][0]["options"])


def test_a_pinned_option_alone_searches_scenarios(capsys):
    assert main(["tune", "--ranks", "4", "--model", "gpt-tiny", "--batch", "8", "--profile", "laptop",
                 "--ginter", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "searched" in out and "pinned: ginter 2, microbatches 4" in out and "p=2 axonn b=" in out


def test_one_pipeline_memory_estimate_known_answer():
    """pipeline_memory (run's admission, tune --algorithm pipeline) is step_terms.stage_memory with this suite's
    buffers. Hand count: 4 layers, h 8, heads 2, ffn 32, seq 4, batch 4 on grid 1x1x1x1, 2 stages of 2 blocks,
    m = 2 micro-batches of b = 2 sequences (8 tokens), float32 (4 bytes), 1f1b, full recompute:
    - activations: stage 0 holds min(2 - 0, 2) = 2 micro-batches' block inputs, stage 1 min(1, 2) = 1, so
      stage 0 - stage 1 = 1 micro-batch x 2 blocks x 8 tokens x 8 x 4 B = 512 B;
    - this suite's token-partial sums (m > 1, whatever G_z): per block qkv 3h h = 192, proj h h = 64, fc1 f h =
      256, fc2 h f = 256 -> 768 elements x 2 blocks x 4 B = 6,144 B, which a Megatron-like step (G_z = 1: no
      reduce-scatter to accumulate for) does not hold; stage 0's receive buffers are two in both (2 x 8 x 8 x 4)."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.pipeline import pipeline_memory
    from fourd_mpi.perf.step_terms import stage_memory
    from fourd_mpi.step.overlap import OverlapConfig

    cfg = resolve_labelled("gpt-tiny", layers=4, hidden=8, heads=2, ffn_hidden=32, seq=4, batch=4)
    grid = GridShape(1, 1, 1, 1)
    first = pipeline_memory(cfg, grid, 2, 2, 0, "float32", schedule="1f1b", recompute="full", attention="fused")
    last = pipeline_memory(cfg, grid, 2, 2, 1, "float32", schedule="1f1b", recompute="full", attention="fused")
    assert first.activations - last.activations == 512
    sc = Scenario(cfg, grid, "", algorithm="pipeline", stages=2, schedule="1f1b", microbatch_size=2, microbatches=2,
                  vocab=0, recompute="full", dtype="float32", attention="fused", overlap=OverlapConfig(oag=True),
                  dw_window=None)
    megatron_like = stage_memory(sc, 0)
    assert first.comm_buffers - megatron_like["comm_buffers"] == 6144
    assert first.activations == megatron_like["activations"] and first.weights == megatron_like["weights"]
