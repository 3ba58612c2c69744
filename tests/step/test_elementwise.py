"""The lean elementwise math equals the textbook formulas, in place where it says so."""

import math

import numpy as np
import pytest

from fourd_mpi.step import elementwise

C, A = math.sqrt(2.0 / math.pi), 0.044715


def naive_gelu(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + A * x ** 3)))


def naive_gelu_backward(x, dy):
    t = np.tanh(C * (x + A * x ** 3))
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3 * A * x * x))


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-13), (np.float32, 1e-5)])
def test_gelu_forward_and_backward(rng, dtype, rtol):
    u = rng.standard_normal((33, 17)).astype(dtype) * 3
    dg = rng.standard_normal(u.shape).astype(dtype)
    out = np.empty_like(u)
    assert elementwise.gelu(u, out) is out
    np.testing.assert_allclose(out, naive_gelu(u.astype(np.float64)), rtol=rtol, atol=rtol)
    expected = naive_gelu_backward(u.astype(np.float64), dg.astype(np.float64))
    separate = elementwise.gelu_backward(u, dg.copy(), np.empty_like(u))
    np.testing.assert_allclose(separate, expected, rtol=rtol, atol=rtol)
    in_place = dg.copy()
    assert elementwise.gelu_backward(u, in_place, in_place) is in_place  # out may be dg
    np.testing.assert_array_equal(in_place, separate)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_is_finite_and_right_far_out(dtype):
    """exp(-2z) overflows for u below about -10 (float32): the clip keeps GeLU and its derivative right."""
    u = np.array([-1e4, -300.0, -50.0, -12.0, -1e-6, 0.0, 1e-6, 12.0, 50.0, 300.0, 1e4], dtype=dtype)
    out, grad = np.empty_like(u), np.empty_like(u)
    with np.errstate(over="raise", invalid="raise"):
        elementwise.gelu(u, out)
        elementwise.gelu_backward(u, np.ones_like(u), grad)
    # far left both are ~0: the tanh form rounds 1 + tanh(z) to exactly 0, the sigmoid form keeps the
    # true tiny value (-1.6e-61 at u = -12 in float64) or, where exp is clipped, a value below 1e-20
    tiny = 1e-20 if dtype == np.float32 else 1e-50
    np.testing.assert_allclose(out, naive_gelu(u.astype(np.float64)), rtol=1e-6, atol=tiny)
    np.testing.assert_allclose(grad, naive_gelu_backward(u.astype(np.float64), np.ones(len(u))), rtol=1e-6,
                               atol=tiny)


def test_layernorm_forward_backward_match_the_formulas(rng):
    m, h = 12, 10
    x = rng.standard_normal((m, h))
    gamma, beta = rng.standard_normal(h), rng.standard_normal(h)
    dy = rng.standard_normal((m, h))
    mean = x.sum(axis=1, keepdims=True) / h
    xhat = np.empty_like(x)
    var = elementwise.centered_squares(x, mean, xhat) / h
    rstd = 1.0 / np.sqrt(var + 1e-5)
    y, xhat = elementwise.layernorm_apply(x, mean, rstd, gamma, beta, np.empty_like(x), xhat)
    ref_xhat = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(xhat, ref_xhat, rtol=1e-12)
    np.testing.assert_allclose(y, ref_xhat * gamma + beta, rtol=1e-12)
    partial = np.empty((m, 2))
    dgamma, dbeta = elementwise.layernorm_backward_local(dy, xhat, gamma, partial)
    np.testing.assert_allclose(partial[:, 0], (dy * gamma).sum(1), rtol=1e-12)
    np.testing.assert_allclose(partial[:, 1], (dy * gamma * xhat).sum(1), rtol=1e-12)
    np.testing.assert_allclose(dgamma, (dy * xhat).sum(0), rtol=1e-12)
    np.testing.assert_allclose(dbeta, dy.sum(0), rtol=1e-12)
    dx = elementwise.layernorm_backward_finish(dy, xhat, gamma, rstd, partial, h, np.empty_like(x))
    g = dy * gamma
    ref = rstd * (g - g.mean(1, keepdims=True) - xhat * (g * xhat).mean(1, keepdims=True))
    np.testing.assert_allclose(dx, ref, rtol=1e-11, atol=1e-13)


def test_causal_softmax_and_its_backward(rng):
    b, nh, s = 2, 3, 7
    scores = rng.standard_normal((b, nh, s, s))
    scale = 0.37
    masked = np.where(np.triu(np.ones((s, s), bool), 1), -np.inf, scores * scale)
    ref = np.exp(masked - masked.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    probs = scores.copy()
    assert elementwise.causal_softmax_(probs, scale) is probs
    np.testing.assert_allclose(probs, ref, rtol=1e-13, atol=1e-300)
    assert np.all(probs[..., np.triu_indices(s, 1)[0], np.triu_indices(s, 1)[1]] == 0)
    dprobs = rng.standard_normal(probs.shape)
    ref_d = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) * scale
    got = elementwise.softmax_backward_(probs, dprobs.copy(), scale)
    np.testing.assert_allclose(got, ref_d, rtol=1e-12, atol=1e-15)


def test_mse_parts(rng):
    y, t = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    dy = np.empty_like(y)
    local = elementwise.mse_parts(y, t, dy, 40)
    assert local == pytest.approx(((y - t) ** 2).sum(), rel=1e-14)
    np.testing.assert_allclose(dy, (y - t) / 40, rtol=1e-15)


def test_adam_and_sgd_updates_match_the_textbook(rng):
    p0 = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(3)]
    p, m, v = p0.copy(), np.zeros(50), np.zeros(50)
    ref_p, ref_m, ref_v = p0.copy(), np.zeros(50), np.zeros(50)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    for t, g in enumerate(grads, start=1):
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        elementwise.adam_update(p, g, m, v, lr, b1, b2, c1, c2, eps)
        ref_m = b1 * ref_m + (1 - b1) * g
        ref_v = b2 * ref_v + (1 - b2) * g * g
        ref_p = ref_p - lr * (ref_m / c1) / (np.sqrt(ref_v / c2) + eps)
    np.testing.assert_allclose(p, ref_p, rtol=1e-13)
    np.testing.assert_allclose(m, ref_m, rtol=1e-13)
    np.testing.assert_allclose(v, ref_v, rtol=1e-13)

    p, vel, ref_p, ref_vel = p0.copy(), np.zeros(50), p0.copy(), np.zeros(50)
    for g in grads:
        elementwise.sgd_update(p, g, vel, 0.1, 0.5)
        ref_vel = 0.5 * ref_vel + g
        ref_p = ref_p - 0.1 * ref_vel
    np.testing.assert_allclose(p, ref_p, rtol=1e-14)
    plain = p0.copy()
    elementwise.sgd_update(plain, grads[0], None, 0.1, 0.0)
    np.testing.assert_allclose(plain, p0 - 0.1 * grads[0], rtol=1e-15)


def test_scratch_comes_from_the_callers_pool(rng):
    """The chained path takes its scratch arrays from ``empty`` (the backend pool), nothing else."""
    asked = []

    def empty(shape, dtype):
        asked.append((tuple(shape), np.dtype(dtype)))
        return np.empty(shape, dtype)

    u = rng.standard_normal((8, 6))
    elementwise.gelu_backward(u, np.ones_like(u), np.empty_like(u), empty)
    elementwise.adam_update(u.copy(), u, np.zeros_like(u), np.zeros_like(u), 1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8,
                            empty)
    assert asked == [((8, 6), np.dtype(np.float64))] * 4
