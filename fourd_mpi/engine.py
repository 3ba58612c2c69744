"""The training step: forward, loss, backward, gradient synchronization, optimizer.

Gradient synchronization after the layers' own collectives: FC weight shards are
already summed over Z (reduce-scatter in backward) and are all-reduced over data;
LayerNorm parameters are all-reduced over Z and data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from .collectives import Collectives
from .model import Model, SyntheticData, WeightPolicy, mse_loss


@dataclass
class StepResult:
    step: int
    loss: float
    #: wall time of the step, max over ranks (seconds)
    seconds: float
    #: this rank's wall time of the step (seconds)
    local_seconds: float


class Trainer:
    """Runs training steps of ``model`` on ``data``.

    Collective over the whole grid: every rank calls :meth:`step` with the same index.
    """

    def __init__(self, model: Model, data: SyntheticData, comm: Collectives, optimizer,
                 cache_weights: bool = False):
        self.model = model
        self.data = data
        self.comm = comm
        self.optimizer = optimizer
        self.weights = WeightPolicy(comm, cache_weights)
        self.params = model.parameters()
        self.global_elements = model.cfg.batch * model.cfg.seq * model.cfg.hidden

    def forward_backward(self, step: int):
        """Loss and gradients (fully reduced) for the batch of ``step``; returns ``(loss, y)``."""
        x, target = self.data.batch(step)
        y, saved = self.model.forward(x, self.weights)
        loss, dy = mse_loss(y, target, self.comm, self.global_elements)
        self.model.backward(dy, saved, self.weights)
        self.synchronize_gradients()
        return loss, y

    def synchronize_gradients(self) -> None:
        for p in self.params:
            for axis in p.reduce_axes:
                p.grad = self.comm.allreduce(axis, p.grad).wait()

    def step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        loss, _ = self.forward_backward(step)
        self.optimizer.step()
        self.comm.backend.synchronize()
        local = time.perf_counter() - t0
        slowest = self.comm.grid.cart.allreduce(local, op=MPI.MAX)
        return StepResult(step=step, loss=loss, seconds=slowest, local_seconds=local)
