"""``compare`` with paired runs: runs made alternately, each new run paired with the baseline
run next to it in start time, Wilcoxon signed-rank test of the log ratios, Hodges-Lehmann ratio and interval.

Known answers are computed by hand (the null distribution of the signed-rank statistic by counting subsets of
the ranks) or read from the standard table of two-sided critical values at 0.05."""

from __future__ import annotations

import datetime
import json
import os
import re

import numpy as np
import pytest
from conftest import mpirun

from fourd_mpi.analysis.compare import (
    Settings,
    compare_runs,
    hodges_lehmann,
    interleaved,
    interval_rank,
    min_pairs,
    pair_runs,
    signed_rank_null,
    start_seconds,
    wilcoxon_p,
)
from fourd_mpi.analysis.compare_report import render
from fourd_mpi.cli.main import main
from fourd_mpi.errors import ConfigError

pytest.importorskip("scipy")

SETTINGS = Settings(resamples=2000)
T0 = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.timezone.utc)


def timed_run(side: str, i: int, median: float, at_s: float, steps: int = 9, spread: float = 0.01):
    """One run (entry, per-step times, path) of configuration 'a', started ``at_s`` seconds after T0, whose
    steps scatter ``spread`` around ``median`` (median exactly ``median``: symmetric steps)."""
    offsets = np.linspace(-spread, spread, steps)
    entry = {"config_key": "a" * 16, "run_id": f"{side}{i}", "model": "gpt-tiny", "grid": "1x1x1x2",
             "world_size": 2, "algorithm": "axonn4d",
             "time": (T0 + datetime.timedelta(seconds=at_s)).isoformat(timespec="milliseconds")}
    return entry, median * (1 + offsets), f"{side}{i}.h5"


def abba(old_medians, new_medians, duration_s: float = 10.0):
    """Baseline runs A_i and new runs B_i made in the order A B B A A B B A ... (``duration_s`` each)."""
    olds, news, t = [], [], 0.0
    for i, (a, b) in enumerate(zip(old_medians, new_medians)):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
            if side == "a":
                olds.append(timed_run("a", i, a, t))
            else:
                news.append(timed_run("b", i, b, t))
            t += duration_s
    return news, olds


def test_signed_rank_null_by_counting_subsets():
    """n = 3: the 8 sign patterns of ranks 1, 2, 3 give T+ = 0, 1, 2, 3 (twice: {3}, {1,2}), 4, 5, 6."""
    assert signed_rank_null(3) * 8 == pytest.approx([1, 1, 1, 2, 1, 1, 1])
    cdf = np.cumsum(signed_rank_null(8)) * 256  # sums <= 3: {}, {1}, {2}, {3}, {1,2}; <= 4 adds {4}, {1,3}
    assert cdf[3] == pytest.approx(5) and cdf[4] == pytest.approx(7)
    assert signed_rank_null(20).sum() == pytest.approx(1.0) and len(signed_rank_null(20)) == 211


@pytest.mark.parametrize("n, critical", [(6, 0), (7, 2), (8, 3), (9, 5), (10, 8), (12, 13), (15, 25), (20, 52)])
def test_interval_rank_matches_the_table_of_critical_values(n, critical):
    """Two-sided 0.05 critical values of the signed-rank T (reject when T <= critical), as printed in the
    standard tables of the Wilcoxon signed-rank test: the interval's rank C is critical + 1."""
    assert interval_rank(n, 0.95) == critical + 1


def test_too_few_pairs_have_no_interval_and_no_significance():
    assert interval_rank(5, 0.95) == 0 and min_pairs(0.05) == 6 and min_pairs(0.01) == 8  # 2/2^n < alpha
    assert hodges_lehmann(np.arange(1.0, 6.0), 0.95)[1:] == (float("-inf"), float("inf"))


@pytest.mark.parametrize("d, p", [([1, 2, 3, 4, 5, 6], 2 / 64),  # T- = 0: only the empty set, twice (two sides)
                                  ([-1, 2, 3, 4, 5, 6], 4 / 64),  # T- = 1: {} and {1}
                                  ([1, -2, 3, 4, 5, 6], 6 / 64)])  # T- = 2: {}, {1}, {2}
def test_exact_wilcoxon_p_by_hand(d, p):
    assert wilcoxon_p(np.asarray(d, dtype=float) / 100) == pytest.approx(p)


def test_hodges_lehmann_by_hand():
    """d = 1..6: the 21 Walsh averages are symmetric about 3.5 (the estimate); C = 1 at 0.95, so the interval
    is [min, max] = [1, 6]. d = 1..8: C = 4, the 4th smallest Walsh average is 2 (1, 1.5, 2, 2) and the 4th
    largest 7 (8, 7.5, 7, 7); the estimate 4.5."""
    assert hodges_lehmann(np.arange(1.0, 7.0), 0.95) == pytest.approx((3.5, 1.0, 6.0))
    assert hodges_lehmann(np.arange(1.0, 9.0), 0.95) == pytest.approx((4.5, 2.0, 7.0))


def test_interleaving_and_pairing_by_start_time():
    a, b = [0, 30, 40, 70], [10, 20, 50, 60]  # A B B A A B B A, 10 s apart
    assert interleaved(b, a) and interleaved([1, 3, 5], [0, 2, 4])  # A B A B A B
    assert not interleaved([3, 4, 5], [0, 1, 2]) and not interleaved([0, 1, 2, 5], [3, 4])  # 3 new runs in a row
    assert pair_runs(b, a) == [(0, 0), (1, 1), (2, 2), (3, 3)]  # each B with the A next to it
    assert pair_runs([10, 20, 50], a) == [(0, 0), (1, 1), (2, 2)]  # one baseline run left over
    assert start_seconds({"time": "2026-11-25T12:00:01.500+00:00"}) == T0.timestamp() + 1.5
    assert start_seconds({"time": ""}) is None and start_seconds({}) is None and start_seconds({"time": "x"}) is None


def test_drift_hides_a_slowdown_from_unpaired_runs_but_not_from_pairs():
    """The machine drifts: baseline run medians 0.10 .. 0.275 s over 8 ABBA blocks (+25 % a block), each new run
    1.15x the baseline run next to it (1 % noise). Unpaired, the two sets of runs overlap: Mann-Whitney p > 0.05,
    'same'. Paired: all 8 log ratios positive, exact p = 2/2^8, ratio ~1.15, 'slower'. The same drift with no
    slowdown (ratios 1 +- 1 %) is 'same' either way."""
    old = [0.1 * (1 + 0.25 * k) for k in range(8)]
    noise = [1.01, 0.99, 1.005, 0.995, 1.008, 0.992, 1.003, 0.997]
    news, olds = abba(old, [1.15 * o * e for o, e in zip(old, noise)])
    run_unit = compare_runs(news, olds, Settings(resamples=2000, unit="run"))[0]
    assert run_unit.unit == "run" and run_unit.verdict == "same" and run_unit.p_value > 0.05
    paired = compare_runs(news, olds, SETTINGS)[0]  # auto: interleaved, 8 >= 6 pairs
    assert paired.unit == "paired" and paired.verdict == "slower"
    assert paired.p_value == pytest.approx(2 / 256) and paired.ratio == pytest.approx(1.15, rel=0.01)
    assert 1 < paired.ci_low <= paired.ratio <= paired.ci_high
    assert paired.pairs == [(f"b{i}", f"a{i}") for i in range(8)]
    news, olds = abba(old, [o * e for o, e in zip(old, noise)])
    for unit in ("run", "auto"):
        assert compare_runs(news, olds, Settings(resamples=2000, unit=unit))[0].verdict == "same"


def test_auto_pairs_only_interleaved_runs_with_enough_pairs():
    old = [0.1] * 8
    news, olds = abba(old, [0.12] * 8)
    assert compare_runs(news, olds, SETTINGS)[0].unit == "paired"
    blocks = ([timed_run("a", i, 0.1, 10 * i) for i in range(8)], [timed_run("b", i, 0.12, 100 + 10 * i)
                                                                     for i in range(8)])
    assert compare_runs(blocks[1], blocks[0], SETTINGS)[0].unit == "run"  # A A A ... B B B: not interleaved
    news5, olds5 = abba(old[:5], [0.12] * 5)
    assert compare_runs(news5, olds5, SETTINGS)[0].unit == "run"  # 5 pairs: p >= 1/16, never significant
    untimed = [(dict(e, time=""), s, p) for e, s, p in news]
    assert compare_runs(untimed, olds, SETTINGS)[0].unit == "run"  # no start times: cannot pair
    with pytest.raises(ConfigError, match="--unit paired: .*no start time"):
        compare_runs(untimed, olds, Settings(resamples=100, unit="paired"))
    no_steps = [(e, np.zeros(0), p) for e, s, p in news]  # no measured step: no run median, nothing to pair
    empty = compare_runs(no_steps, olds, Settings(resamples=100, unit="paired"))[0]
    assert empty.unit == "paired" and empty.pairs == [] and "fewer than 6 pairs" in empty.note \
        and empty.verdict == "inconclusive"


def test_the_output_names_the_method_and_the_pairs():
    news, olds = abba([0.1] * 7, [0.12] * 6 + [0.1])  # 7 pairs, one new run more: A B B A ... A B B A A
    news = news + [timed_run("b", 99, 0.12, 1000)]
    c = compare_runs(news, olds, SETTINGS)[0]
    assert c.unit == "paired" and len(c.pairs) == 7
    assert c.unit_note.startswith("paired: 7 pairs of neighbouring runs (each new run with the baseline run next to it "
                                  "in start time; the runs alternate in time, at most 2 of a side in a row, and give "
                                  "at least 6 pairs), Wilcoxon signed-rank on the log ratios of their median step "
                                  "times; 1 run(s) left unpaired")
    table = render([c], SETTINGS, "table")
    assert "7 pairs" in table and f"{c.label}: {c.unit_note}" in table and "Wilcoxon signed-rank two-sided" in table
    data = json.loads(render([c], SETTINGS, "json"))["comparisons"][0]
    assert data["unit"] == "paired" and data["pairs"][0] == {"new": "b0", "baseline": "a0"} and len(data["pairs"]) == 7
    assert re.search(r"\| 7 pairs +\|", render([c], SETTINGS, "markdown"))
    explicit = Settings(resamples=100, unit="paired")
    assert "at most 2 of a side" not in compare_runs(news, olds, explicit)[0].unit_note
    assert explicit.statistics_text().startswith("paired: each new run with the baseline run next to it in start time")


def test_help_and_statistics_say_the_pairing_rule():
    from fourd_mpi.cli.args import walk_parsers
    from fourd_mpi.cli.main import build_parser

    parser = dict(walk_parsers(build_parser()))[("compare",)]
    text = next(a.help for a in parser._actions if "--unit" in a.option_strings)
    assert f"at least {min_pairs(0.05)} pairs (at --alpha 0.05" in text and "at most 2 of a side in a row" in text
    said = SETTINGS.statistics_text()
    assert f"at least {min_pairs(0.05)} pairs" in said and "at most 2 of a side in a row" in said


def test_alternating_real_runs_are_paired_by_their_start_times(tmp_path, capfd):
    """Real runs under mpiexec (2 ranks), made A B A B A B: the index entries' start times pair each B with the A
    just before it; --unit paired names 3 pairs, auto (3 runs a side: too few to pair or compare runs) steps."""
    results = tmp_path / "runs"
    for i in range(3):
        for side in ("a", "b"):
            proc = mpirun(2, ["run", "--gx", "2", "--model", "gpt-tiny", "--steps", "4", "--warmup", "1",
                              "--trace-level", "step", "--results-dir", results, "--run-id", f"{side}{i}",
                              "--display", "quiet"], timeout=300)
            assert proc.returncode == 0, proc.stderr[-2000:]
    capfd.readouterr()
    traces = {side: [str(results / f"{side}{i}.h5") for i in range(3)] for side in "ab"}
    out = tmp_path / "paired.json"
    code = main(["compare", *traces["b"], "--baseline", *traces["a"], "--unit", "paired", "--format", "json",
                 "-o", str(out), "--resamples", "200"])
    assert code in (0, 1)
    data = json.loads(out.read_text())["comparisons"][0]
    assert data["unit"] == "paired" and data["pairs"] == [{"new": f"b{i}", "baseline": f"a{i}"} for i in range(3)]
    assert data["unit_note"].startswith("paired: 3 pairs of neighbouring runs")
    entries = [json.loads(line) for line in (results / "index.jsonl").read_text().splitlines()]
    starts = {e["run_id"]: start_seconds(e) for e in entries}
    assert all(starts[f"a{i}"] < starts[f"b{i}"] for i in range(3))  # each pair: the A, then the B made after it
    os.remove(out)
    assert main(["compare", traces["b"][0], "--baseline", traces["a"][0], "--unit", "paired"]) == 0
    table = capfd.readouterr().out
    assert "1 pair " in table and "paired: 1 pair of neighbouring runs" in table and "fewer than 6 pairs" in table
    assert main(["compare", *traces["b"], "--baseline", *traces["a"], "--format", "json", "-o", str(out),
                 "--resamples", "200"]) in (0, 1)
    assert json.loads(out.read_text())["comparisons"][0]["unit"] == "step"
