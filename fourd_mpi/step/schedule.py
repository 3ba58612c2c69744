"""When the step's collectives are issued and waited: the overlap schedule.

:class:`WeightFetcher` hands each 4D layer its all-gathered weight block, on
demand, prefetched ``prefetch_depth`` layers ahead (OAG), or from the forward
cache. With full activation recompute the backward pass needs every block's
weights first for the block's recompute forward: they are gathered then (phase
``recompute``; or taken from the forward cache) and kept until the block's own
backward GEMMs have used them (at most one block's weights), so recompute adds
no weight all-gather. :class:`GradientSync` takes each gradient's first
collective (the reduce-scatter over Z of FC weights, the all-reduce over Z of LayerNorm
parameters), keeps it in flight (ORS) or waits at once, and then all-reduces
the shard over data, as soon as it is ready (DP) or before the optimizer.

OUP (:mod:`fourd_mpi.step.overlap`): :meth:`GradientSync.finish` hands each parameter to the
optimizer as soon as its gradient is complete, in completion order, and
:meth:`WeightFetcher.prefetch_next` issues the next step's first weight all-gather right after
the update of that layer's weight; the next :meth:`WeightFetcher.begin_forward` takes it.

Ordering rule: MPI matches collectives on one communicator by issue order, so
every collective is issued at a point of the program that all ranks reach in
the same order. The only lazily issued collectives are the data all-reduces,
and they are issued strictly in gradient order (a FIFO), so their order on the
data communicator is the same on every rank whatever the timing. The OUP
prefetch is the one all-gather (over Z) issued while the updates run in a
rank-dependent order; every other collective over Z of the step was issued in
the backward pass, so it is the step's last over Z on every rank.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from fourd_mpi.core.collectives import Collectives
from fourd_mpi.step.overlap import OverlapConfig


class WeightFetcher:
    """All-gathered weight blocks for a list of layers used in a known order."""

    def __init__(self, comm: Collectives, layers: List, overlap: OverlapConfig):
        self.comm = comm
        self.layers = layers
        self.overlap = overlap
        self.cache: Dict[str, object] = {}
        self._order: List = []
        self._next = 0
        self._phase = "idle"
        self._gather_phase = "forward"
        self._issued: Dict[str, object] = {}
        #: OUP: the all-gathers issued at the end of a step for the next forward pass (layer name -> handle)
        self.ahead: Dict[str, object] = {}

    def _start(self, order: List, ahead=None) -> None:
        if self._issued:
            raise RuntimeError(f"prefetched weights never used: {sorted(self._issued)}")
        self._order, self._next = order, 0
        self._issued.update(ahead or {})
        if self.overlap.oag:
            self._prefetch(0)

    def begin_forward(self) -> None:
        """Start a forward pass; it takes the gathers :meth:`prefetch_next` issued (OUP)."""
        self.cache.clear()
        self._phase = self._gather_phase = "forward"
        ahead, self.ahead = self.ahead, {}
        self._start(list(self.layers), ahead)

    def prefetch_next(self, param) -> None:
        """OUP: ``param`` has just been updated; if it is the first layer's weight, issue that layer's all-gather
        for the next forward pass now (its send buffer is the updated shard, which nothing changes before the
        next update). Collective over the gather axis, issued at the same point on every rank (module docstring)."""
        first = self.layers[0] if self.layers and self.overlap.oup else None
        if first is None or param is not getattr(first, "weight", None) or first.name in self.ahead:
            return
        self.ahead[first.name] = first.gather_weight(self.comm, self.comm.tracer.tag(first.name, "forward"))

    def ahead_records(self) -> List:
        """The trace records of the gathers issued ahead (a completed size-1 gather has none)."""
        return [h.record for h in self.ahead.values() if h.record is not None]

    def drain(self, within_s: Optional[float] = None) -> bool:
        """Wait for the gathers issued ahead that no forward pass took (after the run's last step).

        ``within_s``: give up after that many seconds (testing the requests, the progress engine polled
        between tests) and return False: a run that failed on one rank only must not wait for a gather its
        peers never complete (it goes on to abort the job). None: wait as long as it takes."""
        ahead, self.ahead = self.ahead, {}
        if within_s is None:
            for handle in ahead.values():
                handle.wait()
            return True
        deadline = time.monotonic() + within_s
        pending = list(ahead.values())
        while pending:
            pending = [h for h in pending if not h.test()]
            if pending and time.monotonic() > deadline:
                return False
            if pending:
                self.comm.poll(record=False)
                time.sleep(0.001)
        return True

    def begin_backward(self, order: Optional[List] = None, gather_phase: str = "backward") -> None:
        """Called right after forward, so OAG's first backward gathers overlap the loss.

        ``order``: the layers in the order the backward pass first needs their weights (default:
        reversed forward order; full recompute: each block's layers in forward order, last block
        first). ``gather_phase``: the trace phase of the gathers issued ahead (``recompute`` when
        they serve the recompute forward)."""
        self._phase = "backward"
        self._gather_phase = gather_phase
        order = list(reversed(self.layers)) if order is None else list(order)
        self._start([layer for layer in order if layer.name not in self.cache])

    def finish(self) -> None:
        """End a forward-only pass: drop the cache; nothing may be left prefetched."""
        self.cache.clear()
        self._phase = "idle"
        self._start([])

    def _prefetch(self, position: int) -> None:
        stop = min(len(self._order), position + self.overlap.prefetch_depth + 1)
        for layer in self._order[position:stop]:
            if layer.name not in self._issued:
                tag = self.comm.tracer.tag(layer.name, self._gather_phase)  # its own layer, not the current one
                self._issued[layer.name] = layer.gather_weight(self.comm, tag)

    def get(self, layer, keep: bool = False):
        """The weight block of ``layer`` (flat), waiting for its all-gather if needed.

        ``keep`` (the recompute forward inside the backward pass): the block stays in the cache
        for the layer's backward GEMMs, which take it from there without a second gather."""
        if self._phase == "backward" and layer.name in self.cache:
            return self.cache[layer.name] if keep else self.cache.pop(layer.name)
        position = self._order.index(layer, self._next)
        self._next = position + 1
        if self.overlap.oag:
            self._prefetch(position)  # this layer and the next prefetch_depth ones
        handle = self._issued.pop(layer.name, None) or layer.gather_weight(self.comm)
        block = handle.wait()
        if (self._phase == "forward" and self.overlap.cache) or keep:
            self.cache[layer.name] = block
        return block


class GradientSync:
    """Completes every gradient: its first collective, then the data all-reduce."""

    def __init__(self, comm: Collectives, overlap: OverlapConfig):
        self.comm = comm
        self.overlap = overlap
        self._fifo: deque = deque()

    def begin(self) -> None:
        if self._fifo:
            raise RuntimeError("gradients of the previous step were never synchronized")

    def reduce(self, param, partial, first) -> None:
        """``partial``: this rank's token-partial gradient of ``param``; ``first(partial)`` issues its first
        collective (over Z) and returns the handle. Issued now (a program point, see :meth:`add`); a
        subclass may accumulate instead (pipeline micro-batches: :mod:`fourd_mpi.algorithms.pipeline`)."""
        self.add(param, first(partial))

    def add(self, param, handle) -> None:
        """``handle``: the param's first collective (issued now, at a program point)."""
        if not self.overlap.ors:
            handle.wait()
        # the data all-reduce may be issued later, elsewhere: trace it under the param's own layer
        tag = self.comm.tracer.tag(param.name.rsplit(".", 1)[0], "backward")
        self._fifo.append([param, handle, list(param.reduce_axes), tag])
        if self.overlap.dp:
            self.advance()

    def advance(self) -> None:
        """Issue data all-reduces for ready shards, in FIFO order only (see module docstring)."""
        for entry in self._fifo:
            param, handle, axes, tag = entry
            if not axes:
                continue
            if not handle.test():
                return  # later entries wait their turn: keeps the issue order identical on all ranks
            entry[1] = self.comm.allreduce(axes.pop(0), handle.wait(), tag)

    def finish(self, ready: Optional[Callable] = None) -> None:
        """Wait for everything, issuing the remaining stages in FIFO order; sets ``param.grad``.

        ``ready(param)`` (OUP): called for each param as soon as its gradient is complete, in the order they
        complete, while the later ones are still in flight; the data all-reduces are issued as soon as
        their shards are ready (FIFO order, :meth:`advance`), whatever ``dp`` says."""
        if ready is not None:
            return self._finish_as_ready(ready)
        while self._fifo:
            param, handle, axes, tag = self._fifo[0]
            value = handle.wait()
            if axes:
                self._fifo[0][1] = self.comm.allreduce(axes.pop(0), value, tag)
                continue
            param.grad = value
            self._fifo.popleft()

    def _finish_as_ready(self, ready: Callable) -> None:
        while self._fifo:
            self.advance()
            at = next((i for i, entry in enumerate(self._fifo) if not entry[2] and entry[1].test()), None)
            if at is None:  # none complete: block until one is, among those in their last collective and the
                # first with a stage left (after advance(), its data all-reduce is the next to issue, FIFO)
                staged = next((entry for entry in self._fifo if entry[2]), None)
                self.comm.wait_any([entry[1] for entry in self._fifo if not entry[2] or entry is staged])
                continue
            done = self._fifo[at]
            del self._fifo[at]
            done[0].grad = done[1].wait()
            ready(done[0])


@dataclass
class StepContext:
    """What a block needs to run: the collectives, the weight source, the gradient sync."""

    comm: Collectives
    weights: WeightFetcher
    grads: GradientSync
    overlap: OverlapConfig
    #: trace phase of forward computations: ``forward``, or ``recompute`` when a block's forward is
    #: run again inside the backward pass (its weights are then kept for the block's backward)
    phase: str = "forward"

    @property
    def chunks(self) -> int:
        return self.overlap.chunks if self.overlap.od else 1


def linear_forward(layer, x, ctx: StepContext):
    """Gather the weight over Z, GEMM, all-reduce over the layer's in axis (phase ``ctx.phase``)."""
    with ctx.comm.tracer.layer(layer.name, ctx.phase):
        weight = ctx.weights.get(layer, keep=ctx.phase == "recompute")
        return layer.forward(x, weight, ctx.comm, ctx.chunks).wait()


def linear_backward(layer, dy, x, ctx: StepContext):
    """Backward of one 4D layer; returns ``dx``. The gradient goes to ``ctx.grads``.

    OAR: the ``dx`` all-reduce stays in flight while the ``dW`` GEMM runs.
    """
    comm = ctx.comm
    with comm.tracer.layer(layer.name, "backward"):
        dx = layer.backward_input(dy, ctx.weights.get(layer), comm)
        if not ctx.overlap.oar:
            dx.wait()
        dw_block = layer.backward_weight(dy, x, comm)
        ctx.grads.reduce(layer.weight, dw_block, lambda block: layer.reduce_weight_grad(block, comm))
        return dx.wait()
