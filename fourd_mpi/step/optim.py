"""Optimizers that update only this rank's shards (SGD with momentum, Adam).

Every rank holding a replica of a parameter (LayerNorm over Y, for instance)
receives the same fully reduced gradient, so replicas stay identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from fourd_mpi.errors import ConfigError

if TYPE_CHECKING:  # layers pull in the collectives (MPI); the option table reads OPTIMIZERS offline
    from fourd_mpi.step.layers import Parameter

OPTIMIZERS = ("sgd", "adam")


class SGD:
    """``v = momentum*v + g; w -= lr*v`` (plain SGD when momentum is 0)."""

    def __init__(self, params: List[Parameter], lr: float = 1e-2, momentum: float = 0.0):
        self.params, self.lr, self.momentum = params, lr, momentum
        self.velocity = [None] * len(params)

    def step(self) -> None:
        for i, p in enumerate(self.params):
            g = p.grad
            if self.momentum:
                self.velocity[i] = g if self.velocity[i] is None else self.momentum * self.velocity[i] + g
                g = self.velocity[i]
            p.data -= self.lr * g


class Adam:
    """Adam (Kingma and Ba) with bias correction; state is per local shard."""

    def __init__(self, params: List[Parameter], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = [None] * len(params)
        self.v = [None] * len(params)
        self.t = 0

    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for i, p in enumerate(self.params):
            g = p.grad
            self.m[i] = (1 - b1) * g if self.m[i] is None else b1 * self.m[i] + (1 - b1) * g
            self.v[i] = (1 - b2) * g * g if self.v[i] is None else b2 * self.v[i] + (1 - b2) * g * g
            p.data -= self.lr * (self.m[i] / c1) / ((self.v[i] / c2) ** 0.5 + self.eps)


def make_optimizer(name: str, params: List[Parameter], lr: float = None):
    if name == "sgd":
        return SGD(params, lr=1e-2 if lr is None else lr)
    if name == "adam":
        return Adam(params, lr=1e-3 if lr is None else lr)
    raise ConfigError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
