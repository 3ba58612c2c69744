"""The training step: forward, loss, backward, gradient synchronization, optimizer.

The overlap schedule (which collective is waited where) is in
:mod:`fourd_mpi.scheduling`; the step checks at its end that no request is
left in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from .collectives import Collectives
from .model import Model, SyntheticData, mse_loss
from .overlap import OverlapConfig
from .scheduling import GradientSync, StepContext, WeightFetcher


@dataclass
class StepResult:
    step: int
    loss: float
    #: wall time of the step, max over ranks (seconds)
    seconds: float
    #: this rank's wall time of the step (seconds)
    local_seconds: float


class Trainer:
    """Runs training steps of ``model`` on ``data`` with the given overlap options.

    Collective over the whole grid: every rank calls :meth:`step` with the same index.
    """

    def __init__(self, model: Model, data: SyntheticData, comm: Collectives, optimizer,
                 overlap: OverlapConfig = OverlapConfig()):
        self.model = model
        self.data = data
        self.comm = comm
        self.optimizer = optimizer
        self.overlap = overlap
        self.weights = WeightFetcher(comm, model.fc_layers(), overlap)
        self.grads = GradientSync(comm, overlap)
        self.ctx = StepContext(comm, self.weights, self.grads, overlap)
        self.global_elements = model.cfg.batch * model.cfg.seq * model.cfg.hidden
        if overlap.dp:
            comm.on_poll.append(self.grads.advance)

    def evaluate(self, step: int) -> float:
        """Loss of the batch of ``step``, forward only (no gradients, no update)."""
        x, target = self.data.batch(step)
        self.weights.begin_forward()
        y, _ = self.model.forward(x, self.ctx)
        self.weights.finish()
        return mse_loss(y, target, self.comm, self.global_elements)[0]

    def forward_backward(self, step: int):
        """Loss and fully reduced gradients for the batch of ``step``; returns ``(loss, y)``."""
        x, target = self.data.batch(step)
        self.weights.begin_forward()
        y, saved = self.model.forward(x, self.ctx)
        self.weights.begin_backward()
        loss, dy = mse_loss(y, target, self.comm, self.global_elements)
        self.grads.begin()
        self.model.backward(dy, saved, self.ctx)
        self.grads.finish()
        self.comm.check_quiescent("the end of the backward pass")
        return loss, y

    def step(self, step: int) -> StepResult:
        # keep only this step's collective records (the trace writer consumes them per step)
        self.comm.records.clear()
        t0 = time.perf_counter()
        loss, _ = self.forward_backward(step)
        self.optimizer.step()
        self.comm.backend.synchronize()
        local = time.perf_counter() - t0
        slowest = self.comm.grid.cart.allreduce(local, op=MPI.MAX)
        return StepResult(step=step, loss=loss, seconds=slowest, local_seconds=local)
