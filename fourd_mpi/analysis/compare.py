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
(issue 32: an identical configuration rerun a minute later was "faster", p = 0.0004). By default
(``unit="auto"``) a configuration is therefore compared **run against run**: the samples are the
runs' median step times, one per run, whenever both sides have at least :func:`min_runs` runs,
the fewest for which the exact two-sided Mann-Whitney test can reach ``p < alpha`` at all (4 at
alpha 0.05: the least p of n against n runs is ``2 / C(2n, n)``, 0.1 at 3, 0.029 at 4). With fewer
runs it compares steps and says so in one line: the verdict then holds for these runs only, not for
the configuration. ``unit="step"`` or ``"run"`` forces one unit.

A run named on both sides is left out of the baseline (:func:`drop_new_from_baseline`): a baseline
given as an index query never matches the new runs themselves.

Verdict with threshold ``t`` and level ``alpha``: **slower** when ``p < alpha``, the interval lies
above 1 and ``ratio > 1 + t``; **faster** when ``p < alpha``, the interval lies below 1 and
``ratio < 1 - t``; **same** otherwise (not significant, or within the threshold, or fewer than
:data:`MIN_SAMPLES` steps on a side); **unmatched** for a configuration on one side only.
A slower configuration is a regression (``fourd-mpi compare`` exits 1).
Needs scipy (the ``analysis`` extra). No MPI.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.errors import ConfigError

VERDICTS = ("slower", "faster", "same", "unmatched")
UNITS = ("auto", "run", "step")
MIN_RUNS_WHY = ("the fewest runs per side for which the exact two-sided Mann-Whitney p can fall below {alpha:g}: "
                "n against n runs give at least 2/C(2n,n)")
STEP_UNIT_NOTE = ("steps as samples: {new} new and {old} baseline run(s), a run-level test needs {need} per side; "
                  "steps of one run share its machine state, so this verdict holds for these runs, not for the "
                  "configuration")
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
    #: "auto": runs when both sides have :func:`min_runs` runs, else steps; "step": every measured step is a
    #: sample; "run": each run's median step time is one
    unit: str = "auto"

    def statistics_text(self) -> str:
        """The statistics in words, for every output format."""
        steps = ("the per-step times (a step's time: max over ranks of its span, measured steps; runs of one "
                 "configuration pooled per side)")
        runs = "the runs' median step times (one sample per run; a step's time: max over ranks of its span)"
        samples = {"step": steps, "run": runs}.get(self.unit) or (
            f"{runs} when both sides have at least {min_runs(self.alpha)} runs ({MIN_RUNS_WHY.format(alpha=self.alpha)}), "
            f"else {steps}")
        return (f"ratio = median(new)/median(old) of {samples}; "
                f"{100 * self.confidence:g}% percentile bootstrap CI of the ratio ({self.resamples} resamples, "
                f"sides resampled independently, seed {self.seed}); p: Mann-Whitney U two-sided; "
                f"slower: p < {self.alpha:g}, CI above 1 and ratio > 1 + {100 * self.threshold:g}%; "
                f"faster: p < {self.alpha:g}, CI below 1 and ratio < 1 - {100 * self.threshold:g}%")


def min_runs(alpha: float) -> int:
    """The fewest runs ``n`` per side whose exact two-sided Mann-Whitney p can be below ``alpha``: the least
    p of ``n`` against ``n`` samples (complete separation) is ``2 / C(2n, n)`` (4 at alpha 0.05)."""
    from math import comb

    n = 1
    while 2.0 / comb(2 * n, n) >= alpha:
        n += 1
    return n


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
    unit: str = ""  #: the samples this comparison used: "run" or "step" ("" when unmatched)
    unit_note: str = ""  #: why steps were compared although runs are the default (:data:`STEP_UNIT_NOTE`)

    @property
    def regression(self) -> bool:
        return self.verdict == "slower"

    def as_dict(self) -> Dict:
        def side(s: Optional[Side]):
            if s is None:
                return None
            return {"runs": s.run_ids, "traces": s.traces, "steps": int(len(s.samples)),
                    "run_medians_s": [float(v) for v in s.run_medians], "samples_s": [float(v) for v in s.samples]}

        return {"config_key": self.key, "configuration": self.label, "verdict": self.verdict,
                "new_median_s": _json_number(self.new_median_s), "old_median_s": _json_number(self.old_median_s),
                "ratio": _json_number(self.ratio), "ci_low": _json_number(self.ci_low),
                "ci_high": _json_number(self.ci_high), "p_value": _json_number(self.p_value), "note": self.note,
                "unit": self.unit or None, "unit_note": self.unit_note or None,
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


def compare_sides(key: str, new: Side, old: Side, settings: Settings) -> Comparison:
    """One matched configuration: ratio, interval, p-value and verdict (see the module's notes)."""
    out = Comparison(key, describe(new.entry), new, old, "same")
    out.unit = settings.unit
    if settings.unit == "auto":
        need = min_runs(settings.alpha)
        enough = min(len(new.run_medians), len(old.run_medians)) >= need
        out.unit = "run" if enough else "step"
        if not enough:
            out.unit_note = STEP_UNIT_NOTE.format(new=len(new.run_medians), old=len(old.run_medians), need=need)
    x, y = new.values(out.unit), old.values(out.unit)
    if len(x) and len(y):
        out.new_median_s, out.old_median_s = float(np.median(x)), float(np.median(y))
        out.ratio = out.new_median_s / out.old_median_s
    if min(len(x), len(y)) < MIN_SAMPLES:
        what = "measured steps" if out.unit == "step" else "runs"
        out.note = f"fewer than {MIN_SAMPLES} {what} on a side: no test"
        return out
    out.ci_low, out.ci_high = ratio_interval(x, y, settings)
    out.p_value = mann_whitney_p(x, y)
    significant = out.p_value < settings.alpha
    if significant and out.ci_low > 1 and out.ratio > 1 + settings.threshold:
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
        samples = np.asarray(samples, dtype=np.float64)
        side.samples = np.concatenate([side.samples, samples])
        if len(samples):
            side.run_medians.append(float(np.median(samples)))
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


def exit_status(comparisons: Sequence[Comparison]) -> int:
    """1 when any configuration is slower (a regression), else 0."""
    return 1 if any(c.regression for c in comparisons) else 0
