"""The serial reference itself is right: analytic gradients against finite differences.

Runs in-process on one rank (grid 1x1x1x1 on COMM_SELF), float64.
"""

import numpy as np
import pytest

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve


def build(preset, recompute="none", **sizes):
    from mpi4py import MPI

    options = resolve(1, preset, {}, sizes, dtype="float64", backend="numpy", optimizer="sgd", recompute=recompute)
    return Run.build(MPI.COMM_SELF, options)


def loss_only(run, step=0):
    return run.trainer.evaluate(step)


@pytest.mark.parametrize("preset, sizes", [
    ("gpt-tiny", dict(layers=2, hidden=16, heads=4, seq=6, batch=2)),
    ("mlp-tiny", dict(layers=2, hidden=8, ffn_hidden=12, seq=3, batch=2)),
])
def test_gradients_match_finite_differences(preset, sizes):
    run = build(preset, **sizes)
    run.trainer.forward_backward(0)
    rng = np.random.default_rng(0)
    eps = 1e-6
    checked = 0
    for p in run.model.parameters():
        for i in rng.choice(p.data.size, size=min(4, p.data.size), replace=False):
            orig = p.data[i]
            p.data[i] = orig + eps
            up = loss_only(run)
            p.data[i] = orig - eps
            down = loss_only(run)
            p.data[i] = orig
            numeric = (up - down) / (2 * eps)
            analytic = p.grad[i]
            scale = max(abs(numeric), abs(analytic), 1e-7)
            assert abs(numeric - analytic) / scale < 1e-5, (p.name, i, numeric, analytic)
            checked += 1
    assert checked >= 4 * len(run.model.parameters()) - 4
    run.close()


def test_training_reduces_the_loss():
    run = build("gpt-tiny")
    # the same batch every step: SGD must drive its loss down monotonically
    losses = [run.trainer.step(0).loss for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    run.close()


@pytest.mark.parametrize("preset", ["gpt-tiny", "mlp-tiny"])
def test_recompute_gives_the_same_loss_and_gradients(preset):
    """Activation recompute reruns the same arithmetic on the same inputs: bit-identical on one rank."""
    results = {}
    for mode in ("none", "selective", "full"):
        run = build(preset, recompute=mode)
        loss, y = run.trainer.forward_backward(0)
        results[mode] = (loss, y.copy(), [p.grad.copy() for p in run.model.parameters()],
                         run.trainer.step(1).loss)
        run.close()
    loss, y, grads, loss1 = results["none"]
    for mode in ("selective", "full"):
        got = results[mode]
        assert got[0] == loss and got[3] == loss1 and np.array_equal(got[1], y), mode
        assert all(np.array_equal(a, b) for a, b in zip(got[2], grads)), mode
