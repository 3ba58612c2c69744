"""The training step: forward, loss, backward, gradient synchronization, optimizer.

The overlap schedule (which collective is waited where) is in
:mod:`fourd_mpi.step.schedule`; the step checks at its end that no request is
left in flight. With OUP (:mod:`fourd_mpi.step.overlap`) the optimizer updates each
parameter as its gradient completes (:func:`update_as_ready`) and the step ends with
the next step's first weight all-gather in flight, unless it is the last step
(``last``): that gather is the next step's collective (its trace record moves there),
and :meth:`Trainer.close` waits for one that no step took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.collectives import Collectives
from fourd_mpi.step.model import Model, SyntheticData, held_bytes, mse_loss, mse_loss_parts, reduce_loss
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.schedule import GradientSync, StepContext, WeightFetcher


@dataclass
class StepResult:
    step: int
    loss: float
    #: wall time of the step, max over ranks (seconds)
    seconds: float
    #: this rank's wall time of the step (seconds)
    local_seconds: float
    #: this rank's events of the step (:data:`fourd_mpi.trace.events.EVENT_DTYPE`, aligned clock)
    events: Optional[np.ndarray] = None
    #: this rank's step span (``perf_counter_ns``) and its time in compute ops and blocked in waits
    start_ns: int = 0
    end_ns: int = 0
    compute_ns: int = 0
    wait_ns: int = 0
    #: this rank's time inside MPI calls (issues, tests, waits) during the step
    mpi_ns: int = 0
    #: bytes of activations this rank kept from the end of the forward pass for the backward pass, and
    #: the most held at once during the backward pass (recompute rebuilds a block's): measured from the arrays
    saved_activation_bytes: int = 0
    peak_activation_bytes: int = 0
    #: this rank's time blocked waiting for another pipeline stage's message (``--algorithm pipeline``; 0 otherwise)
    bubble_ns: int = 0


class Trainer:
    """Runs training steps of ``model`` on ``data`` with the given overlap options.

    Collective over the whole grid: every rank calls :meth:`step` with the same index.
    """

    def __init__(self, model: Model, data: SyntheticData, comm: Collectives, optimizer,
                 overlap: OverlapConfig = OverlapConfig(), recompute: str = "none"):
        self.model = model
        #: activation recompute (:data:`~fourd_mpi.step.presets.RECOMPUTE_MODES`, :mod:`fourd_mpi.step.model`)
        self.recompute = recompute
        self.saved_activation_bytes = 0
        self.data = data
        self.comm = comm
        self.optimizer = optimizer
        self.overlap = overlap
        self.weights = WeightFetcher(comm, model.fc_layers(), overlap)
        self.grads = GradientSync(comm, overlap)
        self.ctx = StepContext(comm, self.weights, self.grads, overlap)
        comm.tracer.set_layers(model.layer_names())
        self.global_elements = model.cfg.batch * model.cfg.seq * model.cfg.hidden
        if overlap.dp:
            comm.on_poll.append(self.grads.advance)
        self._group_sizes = {axis: comm.grid.size(axis) for axis in ("data", "z", "y", "x")}

    def evaluate(self, step: int) -> float:
        """Loss of the batch of ``step``, forward only (no gradients, no update)."""
        x, target = self.data.batch(step)
        self.weights.begin_forward()
        y, _ = self.model.forward(x, self.ctx)
        self.weights.finish()
        return mse_loss(y, target, self.comm, self.global_elements, self.model.loss_axes)[0]

    def forward_backward(self, step: int, defer_loss: bool = False, complete: bool = True):
        """Loss and fully reduced gradients for the batch of ``step``; returns ``(loss, y)``.

        ``defer_loss``: the loss is not read back from the device here (that would make the host wait for
        every kernel queued before it, inside the step): ``loss`` is None and :meth:`reduce_loss` gives it
        later, e.g. once the optimizer's kernels are queued and the device synchronized. ``complete``
        False (OUP): the gradient collectives are left in flight for :func:`update_as_ready`."""
        trace = self.comm.tracer
        x, target = self.data.batch(step)  # prepared before the steps, as a data loader delivers it
        trace.enter_phase("forward")
        self.weights.begin_forward()
        y, saved = self.model.forward(x, self.ctx, self.recompute)
        self.saved_activation_bytes = held_bytes(saved)
        self.weights.begin_backward(self.model.backward_weight_order(self.recompute),
                                    "recompute" if self.recompute == "full" else "backward")
        with trace.layer("loss", "forward"):
            self._loss_local, dy = mse_loss_parts(y, target, self.comm, self.global_elements)
        trace.enter_phase("backward")
        self.grads.begin()
        self.model.backward(dy, saved, self.ctx)
        if complete:
            self.grads.finish()
            self.comm.check_quiescent("the end of the backward pass")
        return (None if defer_loss else self.reduce_loss()), y

    def reduce_loss(self) -> float:
        """The loss of the last :meth:`forward_backward`: its partial sum read back and all-reduced over the
        model's loss axes (blocking; collective over them)."""
        with self.comm.tracer.layer("loss", "forward"):
            return reduce_loss(self._loss_local, self.comm, self.global_elements, self.model.loss_axes)

    def step(self, step: int, last: bool = False) -> StepResult:
        """One training step; ``last``: no step follows (OUP issues no all-gather for a next one)."""
        return timed_step(self, step, self.comm.grid.world, "the end-of-step MAX all-reduce over world", last)

    def close(self, within_s: Optional[float] = None) -> bool:
        """Wait for an all-gather issued ahead for a step that never ran (OUP; collective over Z); ``within_s``:
        give up after that many seconds and return False (:meth:`~fourd_mpi.step.schedule.WeightFetcher.drain`)."""
        return self.weights.drain(within_s)


def update_as_ready(trainer, step: int, last: bool) -> None:
    """OUP: complete the gradients of ``trainer`` (its ``grads``, ``optimizer``, ``weights``), updating each
    parameter as soon as its own collectives have completed, in completion order; right after the first
    layer's weight is updated, unless ``last``, issue its all-gather for the next step's forward pass. Then
    check that nothing else is in flight."""
    comm, trace, optimizer, weights = trainer.comm, trainer.comm.tracer, trainer.optimizer, trainer.weights

    def ready(param) -> None:
        with trace.op("optimizer"):
            optimizer.update(param)
        if not last:
            weights.prefetch_next(param)

    optimizer.begin()
    trainer.grads.finish(ready)
    with trace.op("optimizer"):
        optimizer.end()  # parameters whose gradients needed no collective
    comm.check_quiescent(f"the end of step {step}", expected=list(weights.ahead.values()))


def timed_step(trainer, step: int, world, what: str, last: bool = False) -> StepResult:
    """One timed training step of ``trainer`` (a :class:`Trainer` or a pipeline stage's trainer: its
    ``comm``, ``forward_backward``, ``optimizer``, ``model``, ``saved_activation_bytes``, ``overlap``,
    ``grads``, ``weights``): forward and backward, the optimizer, then the step's slowest time, MAX
    all-reduced over ``world`` (collective over it; ``what`` names that all-reduce for the hang watch). The
    trace's step events are the collectives of this step: those issued in it, less an all-gather issued for
    the next step (OUP, unless ``last``), plus the one the previous step issued for this one."""
    comm = trainer.comm
    trace = comm.tracer
    trace.begin_step(step)
    comm.records[:] = trainer.weights.ahead_records()  # only this step's collective records (the step's events)
    oup = trainer.overlap.oup
    t0 = time.perf_counter_ns()
    deferred = hasattr(trainer, "reduce_loss")  # no host read of the loss before the step's work is queued
    try:
        if deferred:
            loss, _ = trainer.forward_backward(step, defer_loss=True, complete=not oup)
        else:
            loss, _ = trainer.forward_backward(step, complete=not oup)
        trace.enter_phase("optimizer")
        if oup:
            update_as_ready(trainer, step, last)
        else:
            with trace.op("optimizer"):
                trainer.optimizer.step()
        comm.backend.synchronize()
        if deferred:
            loss = trainer.reduce_loss()
    except BaseException:
        if trace.ranges is not None:  # NVTX (--nvtx): the step's open ranges end with it
            trace.ranges.unwind()
        raise
    t1 = time.perf_counter_ns()
    ahead = trainer.weights.ahead_records()
    if ahead:  # issued for the next step: its record goes there
        comm.records[:] = [r for r in comm.records if not any(r is a for a in ahead)]
    events = trace.end_step(t0, t1, comm.records, trainer._group_sizes)
    local = (t1 - t0) * 1e-9
    with comm.watch(f"{what} of step {step}"):
        slowest = world.allreduce(local, op=MPI.MAX)
    return StepResult(step=step, loss=loss, seconds=slowest, local_seconds=local, events=events,
                      start_ns=t0, end_ns=t1, compute_ns=trace.compute_ns, wait_ns=trace.wait_ns,
                      mpi_ns=trace.mpi_ns, saved_activation_bytes=trainer.saved_activation_bytes,
                      peak_activation_bytes=trainer.model.peak_activation_bytes, bubble_ns=trace.bubble_ns)
