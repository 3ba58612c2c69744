"""Optimizers that update only this rank's shards (SGD with momentum, Adam).

Every rank holding a replica of a parameter (LayerNorm over Y, for instance)
receives the same fully reduced gradient, so replicas stay identical.

``step()`` updates every parameter; the OUP overlap (:mod:`fourd_mpi.step.overlap`) instead calls
``begin()``, then ``update(p)`` for each parameter as soon as its gradient is complete (any order:
the updates are independent, element-wise), then ``end()``, which updates any parameter not
updated yet. Both give the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from fourd_mpi.errors import ConfigError
from fourd_mpi.step import elementwise

if TYPE_CHECKING:  # layers pull in the collectives (MPI); the option table reads OPTIMIZERS offline
    from fourd_mpi.step.layers import Parameter

OPTIMIZERS = ("sgd", "adam")


def _zeros_like(array):
    return elementwise.array_module(array).zeros_like(array)


class _PerParameter:
    """``step() = begin(); update(p) for every p; end()``, with ``update`` in any order."""

    params: List[Parameter]

    def _index_params(self) -> None:
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._done = set()

    def begin(self) -> None:
        self._done = set()

    def update(self, p: Parameter) -> None:
        """Update ``p`` (once per step; a parameter this optimizer does not hold is ignored)."""
        i = self._index.get(id(p))
        if i is not None and i not in self._done:
            self._done.add(i)
            self._update(i)

    def end(self) -> None:
        """Update the parameters ``update`` has not seen this step."""
        for i in range(len(self.params)):
            if i not in self._done:
                self._update(i)
        self._done = set()

    def step(self) -> None:
        self.begin()
        self.end()


class SGD(_PerParameter):
    """``v = momentum*v + g; w -= lr*v`` (plain SGD when momentum is 0), in place.

    ``empty(shape, dtype)``: where the update takes its scratch array (the backend's pool).
    """

    def __init__(self, params: List[Parameter], lr: float = 1e-2, momentum: float = 0.0, empty=None):
        self.params, self.lr, self.momentum, self.empty = params, lr, momentum, empty
        self.velocity = [_zeros_like(p.data) if momentum else None for p in params]
        self._index_params()

    def _update(self, i: int) -> None:
        p = self.params[i]
        elementwise.sgd_update(p.data, p.grad, self.velocity[i], self.lr, self.momentum, self.empty)


class Adam(_PerParameter):
    """Adam (Kingma and Ba) with bias correction, in place; state is per local shard.

    Moments start at zero (so the first update is the textbook one); ``m``, ``v``: per parameter.
    """

    def __init__(self, params: List[Parameter], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 empty=None):
        self.params, self.lr, self.betas, self.eps, self.empty = params, lr, betas, eps, empty
        self.m = [_zeros_like(p.data) for p in params]
        self.v = [_zeros_like(p.data) for p in params]
        self.t = 0
        self._index_params()

    def begin(self) -> None:
        """A new step: ``t += 1`` (the bias corrections of every update of this step)."""
        super().begin()
        self.t += 1

    def _update(self, i: int) -> None:
        p, b1, b2 = self.params[i], *self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        elementwise.adam_update(p.data, p.grad, self.m[i], self.v[i], self.lr, b1, b2, c1, c2, self.eps, self.empty)


def make_optimizer(name: str, params: List[Parameter], lr: float = None, empty=None):
    """``empty(shape, dtype)``: scratch arrays of the updates (None: fresh arrays)."""
    if name == "sgd":
        return SGD(params, lr=1e-2 if lr is None else lr, empty=empty)
    if name == "adam":
        return Adam(params, lr=1e-3 if lr is None else lr, empty=empty)
    raise ConfigError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
