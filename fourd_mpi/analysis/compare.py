"""Regression check: new runs against baseline runs, matched by configuration key.

For each configuration key (:func:`fourd_mpi.results.index.config_key`) the per-step times of the
runs on each side are pooled (a step's time is the max over ranks of its span, measured steps
only: :func:`fourd_mpi.trace.summary.step_stats`) and compared:

- ``ratio = median(new) / median(old)`` of the pooled per-step times;
- a percentile bootstrap confidence interval of that ratio (``scipy.stats.bootstrap``, the two
  sides resampled independently, fixed seed, so the same inputs give the same interval);
- the two-sided Mann-Whitney U test of the two samples (``scipy.stats.mannwhitneyu``, exact for
  small samples without ties), whose p-value says whether the step-time distributions differ.

**The unit of the samples.** The steps of a run are not independent of the run: a busy machine,
another node, the placement of the ranks or the state of the caches moves all of them, so a test on
pooled steps calls two runs of one configuration "different" far more often than ``alpha`` says
(measured here: an identical configuration rerun a minute later was "faster", p = 0.0004). By default
(``unit="auto"``) a configuration is therefore compared **run against run**: the samples are the
runs' median step times, one per run, whenever both sides have at least :func:`min_runs` runs,
the fewest for which the exact two-sided Mann-Whitney test can reach ``p < alpha`` at all (4 at
alpha 0.05: the least p of n against n runs is ``2 / C(2n, n)``, 0.1 at 3, 0.029 at 4). With fewer
runs the verdict is **inconclusive** (never a regression, exit 0): the ratio, interval and p of the
pooled steps are still shown, for information, with one line saying how many runs each side needs.
Only the run-level and paired tests have a calibrated false-change rate (docs/guide/regressions.md:
20 identical reruns gave 1 and 0 false changes); two runs of one configuration minutes apart differ
"significantly" step by step far more often than ``alpha``. ``unit="step"`` or ``"run"`` forces one
unit (a forced ``step`` gives a verdict, uncalibrated: the caller asked for it).

**Paired runs** (``unit="paired"``; chosen by ``auto`` when the runs interleave). A slow drift of the
machine (other jobs starting and ending) moves the run medians of both sides far more than a 15 %
change, so two independent samples of runs overlap and Mann-Whitney misses the change (measured here: 10
of 20 planted 15 % slowdowns found under load). When the two sides' runs were made alternately
(A B B A ... or A B A B ...), each new run and the baseline run made next to it share the machine's
state, and their ratio cancels the drift. The design:

- every run's start time is the ``time`` of its index entry (the trace's ``start_time``);
- the runs **interleave** when, ordered by start time, no side has more than 2 runs in a row
  (:func:`interleaved`); ``auto`` then pairs them when that gives at least :func:`min_pairs` pairs
  (6 at alpha 0.05: the least exact two-sided signed-rank p of ``n`` pairs is ``2 / 2**n``);
- each new run is paired with the baseline run next to it in start-time order, one to one
  (:func:`pair_runs`: A B B A gives (A B) (B A)); runs left over stay unpaired (counted in the output line);
- ``d_i = log(new median_i / old median_i)`` of each pair; ``p``: the two-sided Wilcoxon signed-rank
  test of the ``d_i`` (``scipy.stats.wilcoxon``, exact for small samples without ties);
- ``ratio = exp(HL)``, HL the Hodges-Lehmann estimate (median of the Walsh averages
  ``(d_i + d_j) / 2, i <= j``), and its exact distribution-free interval ``[W_(C), W_(M+1-C)]``
  (``M = n(n+1)/2`` sorted Walsh averages; ``C`` the largest ``k`` with ``P(T+ <= k-1) <= (1-confidence)/2``
  under the null distribution of the signed-rank statistic, :func:`signed_rank_null`; Hollander and
  Wolfe, *Nonparametric Statistical Methods*), exponentiated. Without ties or zero differences the
  interval excludes 1 exactly when the exact two-sided p is at most ``1 - confidence``.

A run named on both sides is left out of the baseline (:func:`drop_new_from_baseline`): a baseline
given as an index query never matches the new runs themselves.

Verdict with threshold ``t`` and level ``alpha``: **inconclusive** when ``auto`` had too few runs
for a run-level or paired test (above), or ``run`` has fewer than :func:`min_runs` runs on a side
or ``paired`` fewer than :func:`min_pairs` pairs (no p could fall below ``alpha``); else **slower**
when ``p < alpha``, the interval lies above 1 and ``ratio > 1 + t``; **faster** when ``p < alpha``,
the interval lies below 1 and ``ratio < 1 - t``; **same** otherwise (not significant, or within the
threshold, or fewer than :data:`MIN_SAMPLES` steps on a side); **unmatched** for a configuration on
one side only.
A slower configuration is a regression (``fourd-mpi compare`` exits 1).

**Unpinned runs** (:func:`binding_note`): when some run of either side has ranks that were not pinned to CPUs
of their own (its index entry's ``pinned`` is false: the trace's ``binding``, :mod:`fourd_mpi.core.binding`),
one note says how many and how to pin; the spread of run medians is then larger, so smaller changes go
undetected. Runs of unknown binding (traces older than the key) give no note. The note never changes a verdict.
Needs scipy (the ``analysis`` extra). No MPI.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import ConfigError

VERDICTS = ("slower", "faster", "same", "inconclusive", "unmatched")
UNITS = ("auto", "run", "step", "paired")
MIN_RUNS_WHY = ("the fewest runs per side for which the exact two-sided Mann-Whitney p can fall below {alpha:g}: "
                "n against n runs give at least 2/C(2n,n)")
STEP_UNIT_NOTE = ("inconclusive: {new} new and {old} baseline run(s); a verdict needs at least {need} runs per side "
                  "(or {pairs} pairs of alternating runs): run {more}; the steps of one run share its machine "
                  "state, so the step-level figures shown are for information, not a verdict")
PAIRED_NOTE = ("paired: {pairs} of neighbouring runs (each new run with the baseline run next to it in start "
               "time{why}), Wilcoxon signed-rank on the log ratios of their median step times{left}")
#: pairing: the most runs of one side in a row, ordered by start time, for the runs to count as interleaved
MAX_IN_A_ROW = 2
#: the exact null distribution of the signed-rank statistic is computed up to this many pairs (a normal
#: approximation of the interval's rank beyond)
EXACT_PAIRS = 400
#: fewer measured steps than this on a side: no test (the exact Mann-Whitney p of 2 against 2
#: steps is at least 1/3, never significant)
MIN_SAMPLES = 3


@dataclass(frozen=True)
class Settings:
    threshold: float = 0.05  #: fraction: 0.05 is 5 %
    alpha: float = 0.05  #: significance level of the Mann-Whitney test
    confidence: float = 0.95  #: of the bootstrap interval
    resamples: int = 9999
    seed: int = 0
    #: "auto": pairs of runs when the runs interleave in time and give :func:`min_pairs` pairs, else runs when both
    #: sides have :func:`min_runs` runs, else steps; "step": every measured step is a sample; "run": each run's
    #: median step time is one; "paired": each new run's median with that of the baseline run next to it in time
    unit: str = "auto"

    def statistics_text(self) -> str:
        """The statistics in words, for every output format."""
        steps = ("the per-step times (a step's time: max over ranks of its span, measured steps; runs of one "
                 "configuration pooled per side)")
        runs = "the runs' median step times (one sample per run; a step's time: max over ranks of its span)"
        unpaired = (f"ratio = median(new)/median(old) of {{samples}}; {100 * self.confidence:g}% percentile bootstrap "
                    f"CI of the ratio ({self.resamples} resamples, sides resampled independently, seed {self.seed}); "
                    f"p: Mann-Whitney U two-sided")
        paired = (f"paired: each new run with the baseline run next to it in start time (one to one), d = log of the "
                  f"ratio of their median step times (a step's time: max over ranks of its span); ratio = "
                  f"exp(Hodges-Lehmann estimate of d: median of the Walsh averages) with its exact "
                  f"{100 * self.confidence:g}% signed-rank CI; p: Wilcoxon signed-rank two-sided")
        if self.unit == "paired":
            method = paired
        elif self.unit in ("step", "run"):
            method = unpaired.format(samples={"step": steps, "run": runs}[self.unit])
        else:
            method = (f"{paired}, when the runs interleave in time (ordered by start time, at most {MAX_IN_A_ROW} of "
                      f"a side in a row) and give at least {min_pairs(self.alpha)} pairs (n pairs give an exact p >= "
                      f"2/2^n); else " + unpaired.format(
                          samples=f"{runs} when both sides have at least {min_runs(self.alpha)} runs "
                                  f"({MIN_RUNS_WHY.format(alpha=self.alpha)}), else {steps}, shown for "
                                  f"information with the verdict inconclusive"))
        return (f"{method}; slower: p < {self.alpha:g}, CI above 1 and ratio > 1 + {100 * self.threshold:g}%; "
                f"faster: p < {self.alpha:g}, CI below 1 and ratio < 1 - {100 * self.threshold:g}%")


def min_runs(alpha: float) -> int:
    """The fewest runs ``n`` per side whose exact two-sided Mann-Whitney p can be below ``alpha``: the least
    p of ``n`` against ``n`` samples (complete separation) is ``2 / C(2n, n)`` (4 at alpha 0.05)."""
    from math import comb

    n = 1
    while 2.0 / comb(2 * n, n) >= alpha:
        n += 1
    return n


def plural(count: int, noun: str) -> str:
    """``1 pair``, ``2 pairs``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def min_pairs(alpha: float) -> int:
    """The fewest pairs ``n`` whose exact two-sided Wilcoxon signed-rank p can be below ``alpha``: the least p
    of ``n`` pairs (all differences of one sign) is ``2 / 2**n`` (6 at alpha 0.05: 0.03125; 5 give 0.0625)."""
    n = 1
    while 2.0 / 2 ** n >= alpha:
        n += 1
    return n


def start_seconds(entry: Dict) -> Optional[float]:
    """The start time of a run in seconds since the epoch, from its index entry's ``time`` (ISO 8601, the
    trace's ``start_time``; read as the index queries read it, :func:`fourd_mpi.results.query.parse_time`);
    ``None`` when missing or unreadable."""
    from fourd_mpi.results.query import parse_time

    text = str(entry.get("time") or "")
    try:
        return parse_time(text).timestamp() if text else None
    except ConfigError:
        return None


def interleaved(new_times: Sequence[float], old_times: Sequence[float], most: int = MAX_IN_A_ROW) -> bool:
    """Whether the runs of the two sides alternate in time: ordered by start time (ties: baseline first), no
    side has more than ``most`` runs in a row (A B B A A B ... and A B A B ... do; A A A B B B does not)."""
    if not len(new_times) or not len(old_times):
        return False
    order = sorted([(t, 0) for t in old_times] + [(t, 1) for t in new_times])
    longest = streak = 1
    for (_, before), (_, side) in zip(order, order[1:]):
        streak = streak + 1 if side == before else 1
        longest = max(longest, streak)
    return longest <= most


def pair_runs(new_times: Sequence[float], old_times: Sequence[float]) -> List[Tuple[int, int]]:
    """Neighbouring runs as pairs: all runs ordered by start time (ties: baseline first), walked from the earliest;
    a run and the next one form a pair when they belong to different sides (both are then taken), else the run
    stays unpaired and the walk moves on. A B B A A B B A gives (A1 B1) (B2 A2) ...; A B A B gives (A1 B1) (A2 B2)
    ... (a nearest-in-time rule is ambiguous there: each B sits between two A's). Returns ``(new index,
    old index)`` pairs in time order."""
    order = sorted([(t, 0, j) for j, t in enumerate(old_times)] + [(t, 1, i) for i, t in enumerate(new_times)])
    pairs, k = [], 0
    while k + 1 < len(order):
        first, second = order[k], order[k + 1]
        if first[1] == second[1]:
            k += 1
            continue
        new_run, old_run = (second, first) if first[1] == 0 else (first, second)
        pairs.append((new_run[2], old_run[2]))
        k += 2
    return pairs


def signed_rank_null(n: int) -> np.ndarray:
    """``P(T+ = t)`` for ``t = 0 .. n(n+1)/2``: the exact null distribution of the Wilcoxon signed-rank statistic
    of ``n`` untied nonzero differences (each rank ``1..n`` positive with probability 1/2, independently), by the
    recursion ``P_n(t) = (P_{n-1}(t) + P_{n-1}(t - n)) / 2``, ``P_0 = [1]``. Shape ``(n(n+1)/2 + 1,)``."""
    dist = np.ones(1)
    for k in range(1, n + 1):
        nxt = np.zeros(len(dist) + k)
        nxt[:len(dist)] += dist
        nxt[k:] += dist
        dist = nxt / 2.0
    return dist


def interval_rank(n: int, confidence: float) -> int:
    """``C``: the largest ``k >= 1`` with ``P(T+ <= k-1) <= (1 - confidence)/2`` (0 when even ``k = 1`` fails:
    too few pairs for this confidence). The Hodges-Lehmann interval is the ``C``-th smallest and ``C``-th
    largest Walsh average; ``C - 1`` is the table's two-sided critical value of ``T`` (reject when ``T <= C-1``).
    Exact up to :data:`EXACT_PAIRS` pairs, the normal approximation beyond."""
    half = (1.0 - confidence) / 2.0
    if n <= EXACT_PAIRS:
        cdf = np.cumsum(signed_rank_null(n))
        return int(np.count_nonzero(cdf <= half + 1e-12))  # cdf[k-1] <= half for k = 1..C (cdf increases)
    from statistics import NormalDist

    mean, sd = n * (n + 1) / 4.0, np.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)
    return max(0, int(np.floor(mean + NormalDist().inv_cdf(half) * sd + 0.5)))


def hodges_lehmann(d: np.ndarray, confidence: float) -> Tuple[float, float, float]:
    """``(estimate, low, high)`` of the centre of the differences ``d`` (shape ``(n,)``): the median of the
    ``M = n(n+1)/2`` Walsh averages ``(d_i + d_j)/2, i <= j``, and ``[W_(C), W_(M+1-C)]`` with ``C`` from
    :func:`interval_rank` (``(-inf, inf)`` when ``C = 0``)."""
    d = np.asarray(d, dtype=np.float64)
    i, j = np.triu_indices(len(d))
    walsh = np.sort((d[i] + d[j]) / 2.0)
    c = interval_rank(len(d), confidence)
    if c == 0:
        return float(np.median(walsh)), float("-inf"), float("inf")
    return float(np.median(walsh)), float(walsh[c - 1]), float(walsh[len(walsh) - c])


def wilcoxon_p(d: np.ndarray) -> float:
    """Two-sided p of the Wilcoxon signed-rank test of ``d`` against 0 (``scipy.stats.wilcoxon``: zero
    differences dropped; exact for small samples without ties, the normal approximation otherwise); 1 when
    every difference is 0."""
    from scipy import stats

    d = np.asarray(d, dtype=np.float64)
    if not np.any(d != 0):
        return 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few nonzero differences or ties: scipy warns, the p stays valid
        return float(stats.wilcoxon(d, alternative="two-sided").pvalue)


def drop_new_from_baseline(new_runs, old_runs):
    """``(baseline runs without any run that is also a new run, the run ids left out)``; runs are
    ``(entry, samples, path)`` and match by the real path of their trace, or by run id and configuration key
    (a copy of the same trace elsewhere)."""
    import os

    ids = {(entry["run_id"], entry["config_key"]) for entry, _, _ in new_runs}
    paths = {os.path.realpath(path) for _, _, path in new_runs}
    kept, dropped = [], []
    for run in old_runs:
        entry, _, path = run
        if (entry["run_id"], entry["config_key"]) in ids or os.path.realpath(path) in paths:
            dropped.append(entry["run_id"])
        else:
            kept.append(run)
    return kept, dropped


@dataclass
class Side:
    """The runs of one configuration on one side: their ids, trace paths and pooled per-step times (s)."""

    entry: Dict  #: the index entry of the first run (describes the configuration)
    run_ids: List[str] = field(default_factory=list)
    traces: List[str] = field(default_factory=list)
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0))
    run_medians: List[float] = field(default_factory=list)
    #: aligned with :attr:`run_medians` (runs with at least one measured step): their ids and start times (s
    #: since the epoch, ``None`` when the entry has none)
    median_ids: List[str] = field(default_factory=list)
    start_times: List[Optional[float]] = field(default_factory=list)
    #: aligned with :attr:`run_ids`: whether each run's ranks were pinned (``None``: unknown, an older trace)
    pinned: List[Optional[bool]] = field(default_factory=list)

    def timed(self) -> bool:
        """Whether every run with a median has a start time (the runs can be paired; true of no runs)."""
        return all(t is not None for t in self.start_times)

    def values(self, unit: str) -> np.ndarray:
        """The test's samples: the pooled per-step times (``step``) or one median per run (``run``)."""
        return self.samples if unit == "step" else np.asarray(self.run_medians, dtype=np.float64)


@dataclass
class Comparison:
    key: str
    label: str
    new: Optional[Side]
    old: Optional[Side]
    verdict: str
    new_median_s: float = float("nan")  #: median of the new side's samples (steps or run medians)
    old_median_s: float = float("nan")
    ratio: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    p_value: float = float("nan")
    note: str = ""
    unit: str = ""  #: the samples this comparison used: "paired", "run" or "step" ("" when unmatched)
    #: why steps were compared although runs are the default (:data:`STEP_UNIT_NOTE`), or the pairs
    #: (:data:`PAIRED_NOTE`)
    unit_note: str = ""
    pairs: List[Tuple[str, str]] = field(default_factory=list)  #: (new run id, baseline run id) when paired

    @property
    def regression(self) -> bool:
        return self.verdict == "slower"

    def as_dict(self) -> Dict:
        def side(s: Optional[Side]):
            if s is None:
                return None
            return {"runs": s.run_ids, "traces": s.traces, "pinned": s.pinned, "steps": int(len(s.samples)),
                    "run_medians_s": [float(v) for v in s.run_medians], "samples_s": [float(v) for v in s.samples]}

        return {"config_key": self.key, "configuration": self.label, "verdict": self.verdict,
                "new_median_s": _json_number(self.new_median_s), "old_median_s": _json_number(self.old_median_s),
                "ratio": _json_number(self.ratio), "ci_low": _json_number(self.ci_low),
                "ci_high": _json_number(self.ci_high), "p_value": _json_number(self.p_value), "note": self.note,
                "unit": self.unit or None, "unit_note": self.unit_note or None,
                "pairs": [{"new": a, "baseline": b} for a, b in self.pairs] if self.unit == "paired" else None,
                "new": side(self.new), "baseline": side(self.old)}


def _json_number(value: float) -> Optional[float]:
    return float(value) if np.isfinite(value) else None


def parse_threshold(text: str) -> float:
    """``5%`` -> 0.05; a plain fraction below 1 (``0.05``) as is."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ConfigError(f"--threshold {text!r}: give a percentage (5%) or a fraction (0.05)") from None
    if not raw.endswith("%") and value >= 1:
        raise ConfigError(f"--threshold {text!r}: a plain number is a fraction below 1; write {raw}% for percent")
    if not 0 <= value < 1 or not np.isfinite(value):
        raise ConfigError(f"--threshold {text!r}: must be at least 0% and below 100%")
    return value


def describe(entry: Dict) -> str:
    """A configuration in a few words: model, grid, ranks, algorithm, and the short key."""
    return (f"{entry.get('model') or '?'} {entry.get('grid') or '?'} on {entry.get('world_size')} ranks, "
            f"{entry.get('algorithm')} [{entry['config_key'][:8]}]")


def _median_ratio(new, old, axis=-1):
    return np.median(new, axis=axis) / np.median(old, axis=axis)


def ratio_interval(new: np.ndarray, old: np.ndarray, settings: Settings) -> Tuple[float, float]:
    """Percentile bootstrap interval of ``median(new) / median(old)`` (``scipy.stats.bootstrap``)."""
    from scipy import stats

    seed = np.random.default_rng(settings.seed)
    kwargs = ({"rng": seed} if "rng" in inspect.signature(stats.bootstrap).parameters else {"random_state": seed})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degenerate sample (all steps equal) warns; the interval is exact
        result = stats.bootstrap((new, old), _median_ratio, vectorized=True, paired=False,
                                 confidence_level=settings.confidence, n_resamples=settings.resamples,
                                 method="percentile", batch=1000, **kwargs)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def mann_whitney_p(new: np.ndarray, old: np.ndarray) -> float:
    """Two-sided p-value of the Mann-Whitney U test (``scipy.stats.mannwhitneyu``)."""
    from scipy import stats

    return float(stats.mannwhitneyu(new, old, alternative="two-sided").pvalue)


def choose_unit(new: Side, old: Side, settings: Settings) -> Tuple[str, str, Optional[List[Tuple[int, int]]]]:
    """``(unit, note, pairs)`` of one configuration under ``settings.unit`` (see the module's notes): ``auto``
    pairs the runs when both sides' runs have start times, interleave and give :func:`min_pairs` pairs, else
    compares runs when both sides have :func:`min_runs`, else steps. ``unit="paired"`` with runs that have no
    start time is a :class:`ConfigError`."""
    unit = settings.unit
    pairs = None
    if unit in ("auto", "paired") and new.timed() and old.timed():
        pairs = pair_runs(new.start_times, old.start_times)
    if unit == "paired" and pairs is None:
        raise ConfigError(f"--unit paired: {describe(new.entry)}: some runs have no start time (their index entry's "
                          f"'time'), so they cannot be paired by time; use --unit run")
    if unit == "auto":
        if pairs is not None and len(pairs) >= min_pairs(settings.alpha) and interleaved(new.start_times,
                                                                                           old.start_times):
            unit = "paired"
        elif min(len(new.run_medians), len(old.run_medians)) >= min_runs(settings.alpha):
            unit = "run"
        else:
            need = min_runs(settings.alpha)
            more = " and ".join(f"{need - have} more {side} run(s)" for side, have in
                                (("new", len(new.run_medians)), ("baseline", len(old.run_medians))) if have < need)
            return "step", STEP_UNIT_NOTE.format(new=len(new.run_medians), old=len(old.run_medians), need=need,
                                                 pairs=min_pairs(settings.alpha), more=more), None
    if unit != "paired":
        return unit, "", None
    left = len(new.run_medians) + len(old.run_medians) - 2 * len(pairs)
    why = ("; the runs alternate in time, at most " f"{MAX_IN_A_ROW} of a side in a row, and give at least "
           f"{min_pairs(settings.alpha)} pairs" if settings.unit == "auto" else "")
    note = PAIRED_NOTE.format(pairs=plural(len(pairs), "pair"), why=why,
                              left=f"; {left} run(s) left unpaired" if left else "")
    return unit, note, pairs


def compare_sides(key: str, new: Side, old: Side, settings: Settings) -> Comparison:
    """One matched configuration: ratio, interval, p-value and verdict (see the module's notes)."""
    out = Comparison(key, describe(new.entry), new, old, "same")
    out.unit, out.unit_note, pairs = choose_unit(new, old, settings)
    x, y = new.values(out.unit), old.values(out.unit)
    if len(x) and len(y):
        out.new_median_s, out.old_median_s = float(np.median(x)), float(np.median(y))
        out.ratio = out.new_median_s / out.old_median_s
    if out.unit == "paired":
        out.pairs = [(new.median_ids[i], old.median_ids[j]) for i, j in pairs]
        d = np.log(np.array([x[i] / y[j] for i, j in pairs], dtype=np.float64))
        centre, low, high = hodges_lehmann(d, settings.confidence) if len(d) else (np.nan, np.nan, np.nan)
        out.ratio = float(np.exp(centre))
        if len(d) < min_pairs(settings.alpha):  # below it no signed-rank p can reach alpha
            out.verdict = "inconclusive"
            out.note = (f"fewer than {min_pairs(settings.alpha)} pairs of runs: no test (n pairs give an exact "
                        f"signed-rank p >= 2/2^n, never below {settings.alpha:g} with fewer)")
            return out
        out.ci_low, out.ci_high, out.p_value = float(np.exp(low)), float(np.exp(high)), wilcoxon_p(d)
    else:
        if out.unit == "run" and min(len(x), len(y)) < min_runs(settings.alpha):
            # the same number auto asks for (and the help says): below it no p can reach alpha
            out.verdict = "inconclusive"
            out.note = (f"fewer than {min_runs(settings.alpha)} runs on a side: no test "
                        f"({MIN_RUNS_WHY.format(alpha=settings.alpha)})")
            return out
        if min(len(x), len(y)) < MIN_SAMPLES:
            out.note = f"fewer than {MIN_SAMPLES} measured steps on a side: no test"
            return out
        out.ci_low, out.ci_high = ratio_interval(x, y, settings)
        out.p_value = mann_whitney_p(x, y)
    significant = out.p_value < settings.alpha
    if out.unit == "step" and settings.unit == "auto":  # too few runs: figures for information, no verdict
        out.verdict, out.note = "inconclusive", "too few runs for a calibrated test"
    elif significant and out.ci_low > 1 and out.ratio > 1 + settings.threshold:
        out.verdict = "slower"
    elif significant and out.ci_high < 1 and out.ratio < 1 - settings.threshold:
        out.verdict = "faster"
    elif not significant:
        out.note = f"not significant, p >= {settings.alpha:g}"
    elif out.ci_low <= 1 <= out.ci_high:
        out.note = "CI includes 1"
    else:
        out.note = f"within the {100 * settings.threshold:g}% threshold"
    return out


def group_by_key(runs: Sequence[Tuple[Dict, np.ndarray, str]]) -> Dict[str, Side]:
    """``(entry, per-step times, trace path)`` of each run -> one :class:`Side` per configuration key
    (samples pooled; a run named twice counted once)."""
    sides: Dict[str, Side] = {}
    for entry, samples, path in runs:
        side = sides.setdefault(entry["config_key"], Side(entry))
        if entry["run_id"] in side.run_ids and path in side.traces:
            continue
        side.run_ids.append(entry["run_id"])
        side.traces.append(path)
        pinned = entry.get("pinned")
        side.pinned.append(pinned if isinstance(pinned, bool) else None)
        samples = np.asarray(samples, dtype=np.float64)
        side.samples = np.concatenate([side.samples, samples])
        if len(samples):
            side.run_medians.append(float(np.median(samples)))
            side.median_ids.append(entry["run_id"])
            side.start_times.append(start_seconds(entry))
    return sides


def compare_runs(new_runs, old_runs, settings: Settings) -> List[Comparison]:
    """Every configuration of either side, matched ones first (in the new side's order), then those
    only in the new runs, then those only in the baseline."""
    new, old = group_by_key(new_runs), group_by_key(old_runs)
    out = [compare_sides(k, new[k], old[k], settings) for k in new if k in old]
    out += [Comparison(k, describe(new[k].entry), new[k], None, "unmatched",
                       new_median_s=float(np.median(new[k].values(settings.unit))) if len(new[k].samples) else
                       float("nan"), note="no baseline run of this configuration") for k in new if k not in old]
    out += [Comparison(k, describe(old[k].entry), None, old[k], "unmatched",
                       old_median_s=float(np.median(old[k].values(settings.unit))) if len(old[k].samples) else
                       float("nan"), note="only in the baseline") for k in old if k not in new]
    return out


def config_differences(new_config: Dict, old_config: Dict, most: int = 8) -> str:
    """The options in which two runs' configurations differ (``keyed_config``: what the config key hashes), as
    ``name new->baseline`` pairs, at most ``most`` of them: what a user needs when no configuration matched."""
    from fourd_mpi.results.index import keyed_config

    new, old = keyed_config(new_config), keyed_config(old_config)
    differ = [f"{name} {new.get(name, '(unset)')}->{old.get(name, '(unset)')}" for name in sorted(set(new) | set(old))
              if new.get(name) != old.get(name)]
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return ", ".join(differ[:most]) + more


def exit_status(comparisons: Sequence[Comparison]) -> int:
    """1 when any configuration is slower (a regression), else 0."""
    return 1 if any(c.regression for c in comparisons) else 0


def binding_note(comparisons: Sequence[Comparison]) -> str:
    """One line when some run of either side had ranks that were not pinned (:mod:`fourd_mpi.core.binding`): how
    many of each side's runs, and how to pin; ``""`` when every run was pinned or its binding is unknown. Each run
    is counted once (by trace path) however many configurations it appears in."""
    from fourd_mpi.core.binding import HOW_TO_PIN

    counts = []
    for name, which in (("new", "new"), ("baseline", "old")):
        runs: Dict[str, Optional[bool]] = {}
        for c in comparisons:
            side = getattr(c, which)
            if side is not None:
                runs.update(zip(side.traces, side.pinned))
        counts.append((name, sum(v is False for v in runs.values()), len(runs)))
    if not any(free for _, free, _ in counts):
        return ""
    sides = " and ".join(f"{free} of {total} {name} run(s)" for name, free, total in counts)
    return (f"note: ranks not pinned in {sides} (their trace's binding: ranks sharing a CPU or free on every CPU "
            f"of their node); unpinned ranks spread the run medians more, so smaller changes go undetected; pin "
            f"them ({HOW_TO_PIN}); see docs/guide/regressions.md")
