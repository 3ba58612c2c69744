"""The pipeline schedules: in which order a stage runs the forwards and backwards of its micro-batches.

A schedule drives a stage object (:class:`fourd_mpi.algorithms.pipeline.Stage`) through four
calls: ``forward(k)`` (waits for micro-batch ``k``'s activation from the previous stage unless
it is stage 0, runs the stage's blocks, sends the result on or, on the last stage, computes the
loss), ``backward(k)`` (waits for the gradient from the next stage unless it is the last stage,
back-propagates, sends the input gradient back), ``next_message()`` (blocks until the first of
the posted receives arrives: ``("forward" | "backward", k)``) and the sizes ``stage``,
``stages``, ``microbatches``. Notation: ``p`` stages, ``m`` micro-batches, stage ``s``.

**AxoNN** (Singh & Bhatele, IPDPS'22, message-driven): stage 0 injects ``min(p, m)``
micro-batches, then every backward it completes lets it inject the next one, so at most ``p``
micro-batches are in flight; the last stage runs each micro-batch's backward right after its
forward; every other stage reacts to whichever message arrives first (``MPI_Waitany`` over its
posted receives from both neighbours). In the steady state this is 1F1B, reached by messages
instead of a precomputed order.

**1F1B** (PipeDream-Flush, Narayanan et al. SC'21): stage ``s`` runs ``w = min(p - s - 1, m)``
warm-up forwards, then ``m - w`` pairs of one forward and one backward, then ``w`` cool-down
backwards; every wait is for one named message.

1F1B keeps at most ``min(p - s, m)`` micro-batches' activations on stage ``s``; AxoNN ``min(p, m)`` on
every stage (stage 0 admits ``p``; a later stage may forward all of them before the first backward
comes back), so its later stages can hold more. Both have the same bubble with equal stage times: a
stage idles ``(p-1)`` forward+backward slots of the ``m + p - 1`` of a step, the idle share
``(p-1)/(m+p-1)`` (:func:`fourd_mpi.perf.schedules.idle_share`).
No schedule communicates itself: the stage's calls do.
"""

from __future__ import annotations


def run_axonn(stage) -> None:
    """AxoNN's message-driven schedule on one stage (see the module doc)."""
    p, s, m = stage.stages, stage.stage, stage.microbatches
    last = s == p - 1
    if s == 0:
        injected = min(p, m)
        for k in range(injected):
            stage.forward(k)
            if last:  # one stage: nothing to wait for
                stage.backward(k)
        if last:
            for k in range(injected, m):
                stage.forward(k)
                stage.backward(k)
            return
        for _ in range(m):
            _, k = stage.next_message()  # only backward messages come to stage 0
            stage.backward(k)
            if injected < m:
                stage.forward(injected)
                injected += 1
        return
    if last:
        for _ in range(m):
            _, k = stage.next_message()  # only forward messages come to the last stage
            stage.forward(k)
            stage.backward(k)
        return
    for _ in range(2 * m):
        kind, k = stage.next_message()
        if kind == "forward":
            stage.forward(k)
        else:
            stage.backward(k)


def run_1f1b(stage) -> None:
    """The classic 1F1B schedule on one stage (see the module doc)."""
    p, s, m = stage.stages, stage.stage, stage.microbatches
    warmup = min(p - s - 1, m)
    for k in range(warmup):
        stage.forward(k)
    for i in range(m - warmup):
        stage.forward(warmup + i)
        stage.backward(i)
    for k in range(m - warmup, m):
        stage.backward(k)


RUNNERS = {"axonn": run_axonn, "1f1b": run_1f1b}


def run(schedule: str, stage) -> None:
    """Run ``schedule`` (:data:`SCHEDULES`) on ``stage``."""
    RUNNERS[schedule](stage)
