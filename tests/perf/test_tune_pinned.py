"""tune's answers pinned (issue 30, "under 2 s for 32,768 ranks"): the top K, each algorithm's best and the
search's counts of three fixed rankings, as the code before the search was made faster computed them
(main at ac5c87c, which has the link-bound pipeline slot). A faster search must give the same answers to the last digit the model prints."""

import pytest

from fourd_mpi.perf.algorithms import rank_algorithms
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import resolve_model

EVERY = ["axonn4d", "megatron1d", "fsdp", "dp", "optimus3d", "pipeline"]
PIPE_TOP = [("pipeline", "128x1x16x1 microbatches=16 stages=16", 1.847966262084363),
            ("pipeline", "128x1x8x2 microbatches=16 stages=16", 2.0887219352534476),
            ("pipeline", "256x1x8x1 microbatches=8 stages=16", 2.1409401693689176),
            ("pipeline", "64x1x16x1 microbatches=32 stages=32", 2.291049323489189),
            ("pipeline", "64x1x32x1 microbatches=32 stages=16", 2.305200714514772)]
CASES = {
    # (model, batch, ranks, profile, algorithms, overlap, recompute): (top 5, best per algorithm,
    # (pruned, dropped, predicted))
    ("gpt-80b", 2048, 32768, "perlmutter", ("pipeline",), "none", "none"): (
        PIPE_TOP, {"pipeline": PIPE_TOP[0][1:]}, (9551, 3998, 36)),
    ("gpt-80b", 2048, 32768, "perlmutter", tuple(EVERY), "none", "none"): (
        PIPE_TOP, {"axonn4d": ("32x16x32x2", 3.1616312588656594), "optimus3d": ("8x16x16x16", 5.384832179737954),
                   "pipeline": PIPE_TOP[0][1:]}, (9971, 4402, 63)),
    ("gpt-80b", 4096, 1024, "dgx-a100", tuple(EVERY), "all", "full"): (
        [("pipeline", "32x2x4x1 microbatches=32 stages=4", 28.971496935216308),
         ("pipeline", "32x2x4x1 microbatches=64 stages=4", 29.47132009159111),
         ("pipeline", "16x8x4x1 microbatches=8 stages=2", 29.60206258353482),
         ("pipeline", "8x16x4x1 microbatches=8 stages=2", 29.632759722712592),
         ("pipeline", "4x32x4x1 microbatches=8 stages=2", 29.750475089034815)],
        {"optimus3d": ("16x4x4x4", 66.96705179785334),
         "pipeline": ("32x2x4x1 microbatches=32 stages=4", 28.971496935216308)}, (5192, 794, 100)),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-{len(c[4])}alg")
def test_tune_answers_are_pinned(case):
    model, batch, ranks, profile, names, overlap, recompute = case
    top, best, counts = CASES[case]
    prof = load_profile(profile)
    ranking = rank_algorithms(list(names), resolve_model(model, batch=batch), ranks, prof,
                              OverlapConfig.parse(overlap), "bfloat16",
                              memory_limit_bytes=prof.device_memory_gib * 2 ** 30, recompute=recompute, keep=5)
    got = [(e.algorithm, e.label, e.prediction.step_s) for e in ranking.entries[:5]]
    assert [g[:2] for g in got] == [t[:2] for t in top]
    assert [g[2] for g in got] == pytest.approx([t[2] for t in top], rel=1e-12)
    assert {k: v.label for k, v in ranking.best_by_algorithm().items()} == {k: v[0] for k, v in best.items()}
    for name, (_, step) in best.items():
        assert ranking.best_by_algorithm()[name].prediction.step_s == pytest.approx(step, rel=1e-12)
    assert (len(ranking.pruned), len(ranking.dropped), len(ranking.every)) == counts
