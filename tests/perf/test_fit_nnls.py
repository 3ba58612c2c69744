"""`model calibrate`'s non-negative fit (fourd_mpi.perf.predict.fit_term_weights) with scipy's NNLS.

The reference below is the solver it replaced (20,000 steps of projected gradient from the clipped
least-squares start): on a well-conditioned problem, where that solver converged, both give the same
weights; on nearly collinear terms NNLS's residual is never worse and often better.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import TERMS
from fourd_mpi.perf.predict import fit_term_weights

pytest.importorskip("scipy")


def _old_projected_gradient(features, measured, iterations=20000):
    """The former solver, verbatim in its arithmetic: returns the weights of the used terms."""
    used = [t for t in TERMS if any(f[t] > 0 for f in features)]
    y = np.asarray(measured, dtype=float)
    a = np.array([[f[t] for t in used] for f in features], dtype=float) / y[:, None]
    scale = a.max(axis=0)
    a = a / scale
    x = np.maximum(np.linalg.lstsq(a, np.ones(len(y)), rcond=None)[0], 0.0)
    step = 1.0 / max(np.linalg.norm(a, 2) ** 2, 1e-300)
    for _ in range(iterations):
        x = np.maximum(0.0, x - step * (a.T @ (a @ x - 1.0)))
    return {t: float(v / s) for t, v, s in zip(used, x, scale)}


def _relative_residual(weights, features, measured):
    """sum_i (sum_t w_t f_it / y_i - 1)^2: the objective both solvers minimise."""
    return float(sum((sum(weights.get(t, 0.0) * f[t] for t in TERMS) / y - 1.0) ** 2
                     for f, y in zip(features, measured)))


def _case(rng, runs, collinear=0.0, noise=0.0):
    """Random positive features of 4 terms (calls and sync stay zero), measured = truth . f (+ noise).
    ``collinear``: how close the columns are to one common column (1 = identical)."""
    base = rng.uniform(0.5, 2.0, size=runs)
    cols = {}
    for t in ("gemm", "attention", "elementwise", "comm"):
        own = rng.uniform(0.5, 2.0, size=runs)
        cols[t] = (collinear * base + (1 - collinear) * own) * rng.uniform(1e-4, 1e-2)
    features = [{t: float(cols[t][i]) if t in cols else 0.0 for t in TERMS} for i in range(runs)]
    truth = {t: rng.uniform(0.2, 3.0) for t in cols}
    measured = [sum(truth[t] * f[t] for t in cols) * (1 + noise * rng.standard_normal()) for f in features]
    return features, measured, truth


def test_well_conditioned_fit_is_identical_to_the_converged_old_solver():
    rng = np.random.default_rng(7)
    features, measured, truth = _case(rng, runs=12)
    weights, predicted = fit_term_weights(features, measured)
    old = _old_projected_gradient(features, measured)
    for t in truth:
        assert weights[t] == pytest.approx(old[t], rel=1e-9, abs=1e-12), t
        assert weights[t] == pytest.approx(truth[t], rel=1e-9), t  # exact data: the true weights
    assert weights["calls"] == 1.0 and weights["sync"] == 1.0  # zero in every row: keep weight 1
    assert predicted == pytest.approx(measured, rel=1e-9)


def test_nnls_residual_never_worse_than_the_old_solver_on_nearly_collinear_terms():
    rng = np.random.default_rng(2026)
    ratios = []
    for _ in range(30):
        features, measured, _ = _case(rng, runs=8, collinear=rng.uniform(0.95, 0.9999), noise=0.05)
        new, _ = fit_term_weights(features, measured)
        assert all(new[t] >= 0.0 for t in TERMS)
        r_new = _relative_residual(new, features, measured)
        r_old = _relative_residual(_old_projected_gradient(features, measured), features, measured)
        assert r_new <= r_old * (1 + 1e-9) + 1e-15
        ratios.append(r_old / r_new if r_new > 0 else 1.0)
    # the old fixed step count stops short somewhere in these cases
    assert max(ratios) > 1.001, ratios


def test_terms_argument_and_too_few_runs():
    rng = np.random.default_rng(3)
    features, measured, _ = _case(rng, runs=6)
    weights, _ = fit_term_weights(features, measured, terms=["gemm", "comm"])
    assert weights["attention"] == 0.0 and weights["elementwise"] == 0.0 and weights["gemm"] > 0
    with pytest.raises(ConfigError, match="at least 4 traces"):
        fit_term_weights(features[:3], measured[:3])


def test_missing_scipy_gives_one_clear_line():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "scipy" or name.startswith("scipy."):
            raise ImportError("No module named 'scipy'")
sys.meta_path.insert(0, Block())
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import TERMS
from fourd_mpi.perf.predict import fit_term_weights
f = {t: 1.0 for t in TERMS}
try:
    fit_term_weights([f] * 8, [1.0] * 8)
except ConfigError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("model calibrate needs scipy for its non-negative least-squares fit: "
                                   "pip install 'fourd_mpi[analysis]' (or pip install scipy)")
