"""Uneven pipeline stages: blocks per stage by the default rule and by Megatron-LM's first/last
counts, the step timed by the fullest stage and memory counted with each stage's own blocks. Known answers by hand."""

from dataclasses import replace

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.prediction import predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import stage_memory
from fourd_mpi.perf.terms import stage_layers
from fourd_mpi.step.presets import ModelConfig


def test_default_split_gives_the_first_stages_one_block_more():
    # 70 = 12 x 5 + 10: ten stages of 6, two of 5; 126 = 16 x 7 + 14: fourteen of 8, two of 7
    assert stage_layers(70, 12) == (6,) * 10 + (5,) * 2
    assert stage_layers(126, 16) == (8,) * 14 + (7,) * 2
    assert stage_layers(48, 8) == (6,) * 8


def test_megatron_first_and_last_counts_split_the_rest_evenly():
    # Llama 3 405B (Dubey et al. 2024, 3.3.2): one layer less on the first and the last stage: 7 + 14 x 8 + 7 = 126
    assert stage_layers(126, 16, 7, 7) == (7,) + (8,) * 14 + (7,)
    # 70 on 12 with 5 and 5: 60 over the 10 middle stages
    assert stage_layers(70, 12, 5, 5) == (5,) + (6,) * 10 + (5,)
    # only the last given: 70 - 4 = 66 over the 11 others
    assert stage_layers(70, 12, None, 4) == (6,) * 11 + (4,)
    assert stage_layers(10, 2, 4, 6) == (4, 6)
    for args, text in [((70, 12, 6, 6), "leave 58 for 10"), ((10, 2, 4, 5), "!= 10 layers"),
                       ((10, 1, 4, None), "need --ginter 2"), ((10, 3, 10, None), "between 1 and 9")]:
        with pytest.raises(ConfigError, match=text):
            stage_layers(*args)


GPT70 = ModelConfig("g70", "gpt", layers=70, hidden=1024, heads=16, ffn_hidden=4096, seq=1024, batch=96)


def test_the_fullest_stage_times_the_step():
    # 70 layers on 12 stages hold 6 blocks on the fullest stage, as 72 layers on 12 stages on every stage: the slot,
    # bubble and step are the same; only the FLOP counts (whole model) differ
    prof = load_profile("dgx-h100")
    kw = dict(algorithm="megatron1d", stages=12, microbatches=48, vocab=32000)
    uneven = predict_scenario(Scenario(GPT70, GridShape(2, 1, 1, 1), "dgx-h100", **kw), prof)
    even = predict_scenario(Scenario(replace(GPT70, layers=72), GridShape(2, 1, 1, 1),
                                     "dgx-h100", **kw), prof)
    assert uneven.step_s == even.step_s and uneven.bubble_s == even.bubble_s
    assert any("10 x 6, 2 x 5" in n for n in uneven.notes)


def test_memory_counts_each_stage_with_its_own_blocks():
    # one rank per stage (grid 1x1x1x1), bf16 mixed precision: weights 2 bytes per parameter; a GPT block has
    # 4 h^2 + 2 h f + 4 h = 4 x 1024^2 + 2 x 1024 x 4096 + 4096 = 12,587,008 parameters; the last stage holds
    # 5 blocks and the embedding V h = 32000 x 1024
    prof = load_profile("dgx-h100")
    sc = Scenario(GPT70, GridShape(1, 1, 1, 1), "dgx-h100", algorithm="megatron1d", stages=12, microbatches=96,
                  vocab=32000).resolved()
    block = 4 * 1024 ** 2 + 2 * 1024 * 4096 + 4 * 1024
    assert stage_memory(sc, 11, prof)["weights"] == 2 * (5 * block + 32000 * 1024)
    assert stage_memory(sc, 0, prof)["weights"] == 2 * (6 * block + 32000 * 1024)
    assert stage_memory(sc, 5, prof)["weights"] == 2 * 6 * block
    # 1F1B: the last stage keeps min(p - s, m) = 1 micro-batch's inputs of its 5 blocks, the first 12 x 6 = 72
    # (full recompute: one [b s, h] input each, b = 1, s = 1024, h = 1024, 2 bytes)
    first, last = stage_memory(sc, 0, prof)["activations"], stage_memory(sc, 11, prof)["activations"]
    with_six_blocks_last = Scenario(replace(GPT70, layers=72), GridShape(1, 1, 1, 1),
                                    "dgx-h100", algorithm="megatron1d", stages=12, microbatches=96,
                                    vocab=32000).resolved()
    assert stage_memory(with_six_blocks_last, 11, prof)["activations"] - last == 1 * 1024 * 1024 * 2
    assert stage_memory(with_six_blocks_last, 0, prof)["activations"] == first


def test_interleaved_on_uneven_stages_is_llama3s_layout():
    """Interleaved on uneven stages (Llama 3, arXiv 2407.21783, section 3.3.2): 126 blocks on 16 stages as 7,
    14 x 8, 7 with V = 8 chunks of one block (the end stages' first/last chunk holds only the embedding/the head)
    runs; the bubble is (p - 1)/v slots of the fullest stage. A layout whose fullest stage does not split into v
    chunks, or a stage lacking more than one chunk, is refused in one line."""
    from fourd_mpi.perf import schedules

    assert stage_layers(126, 16, 7, 7) == (7,) + (8,) * 14 + (7,)
    schedules.check_schedule("interleaved", 16, 8, 126, 32, stage_layers(126, 16, 7, 7))
    schedules.check_schedule("interleaved", 12, 2, 70, 96, stage_layers(70, 12))  # 10 x 6, 2 x 5: chunks 3, 3|2
    with pytest.raises(ConfigError, match="must split into 4 equal chunks"):
        schedules.check_schedule("interleaved", 12, 4, 70, 96, stage_layers(70, 12))
    with pytest.raises(ConfigError, match="at most one chunk"):
        schedules.check_schedule("interleaved", 4, 4, 28, 8, (4, 8, 8, 8))
    prof = load_profile("dgx-h100")
    sc = Scenario(GPT70, GridShape(1, 1, 1, 1), "dgx-h100", algorithm="megatron1d", stages=12,
                  schedule="interleaved", chunks=2, microbatches=96)
    r = predict_scenario(sc, prof)
    plain = predict_scenario(Scenario(GPT70, GridShape(1, 1, 1, 1), "dgx-h100", algorithm="megatron1d", stages=12,
                                      microbatches=96), prof)
    slot = (r.step_s - r.bubble_s - r.terms["optimizer"] - r.terms["grad_sync"] - r.terms["embedding_sync"]
            - r.terms["pipeline_critical"]) / 96
    assert r.bubble_s == pytest.approx(slot * 11 / 2, rel=1e-9)
    assert r.bubble_s < plain.bubble_s
