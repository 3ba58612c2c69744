"""AxoNN inter-layer (pipeline) parallelism composed with the 4D tensor algorithm (``--algorithm pipeline``).

The world is ``G_inter`` stages of ``G_data x G_z x G_y x G_x`` ranks each: one
:class:`~fourd_mpi.core.grid.ProcessGrid` with the axes ``data, inter, z, y, x`` outermost first
(:func:`~fourd_mpi.algorithms.pipeline_plan.grid_dims`, built by :meth:`fourd_mpi.run.build.Run.build`).
Stage ``s`` (this rank's ``inter`` coordinate) runs the 4D step on the grid's
:meth:`~fourd_mpi.core.grid.ProcessGrid.sub` over ``data, z, y, x`` and holds a contiguous, balanced range of
the blocks
(:func:`~fourd_mpi.algorithms.pipeline_plan.stage_blocks`), the same block objects (names,
weights, collectives per layer) as the 4D step. Stage 0 takes the input, the last stage
computes the loss.

Each rank's batch shard (``B/(G_data G_z)`` sequences) is split into ``m = --microbatches``
micro-batches of whole sequences. Between stages a micro-batch's activation ``[m_micro, h/G_x]``
(rep Y) goes forward and its gradient (same shape) backward, point to point between the ranks
with equal 4D coordinates in adjacent stages, over the grid's ``inter`` communicator
(:mod:`fourd_mpi.core.p2p`; tags: micro-batch and
direction). The order of a stage's forwards and backwards is the schedule's
(:mod:`fourd_mpi.algorithms.pipeline_schedule`: AxoNN's message-driven one or 1F1B).

Gradients accumulate over the micro-batches (the token-partial ``dW`` blocks and LayerNorm
gradients, before any reduction); the gradient synchronization (reduce-scatter over Z of FC
weights, all-reduce over Z of LayerNorm parameters, then all-reduce over data) is issued in the
last micro-batch's backward only (:class:`AccumulatingGrads`), so its volume is the 4D step's.
The loss is ``sum((y - t)^2) / (2 B s h)`` over the whole batch, summed from the last stage's
micro-batches and all-reduced over the world once per step, as is the step's slowest time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from fourd_mpi.algorithms import pipeline_plan as plan
from fourd_mpi.algorithms.pipeline_schedule import run as run_schedule
from fourd_mpi.core.collectives import Collectives
from fourd_mpi.core.layout import activation_layout
from fourd_mpi.core.p2p import BACKWARD, FORWARD, PointToPoint, tag
from fourd_mpi.step import elementwise
from fourd_mpi.step.engine import StepResult, timed_step
from fourd_mpi.step.model import GPTBlock, MLPBlock, Model, SyntheticData, held_bytes
from fourd_mpi.step.schedule import GradientSync, StepContext, WeightFetcher


class PipelineModel(Model):
    """The blocks of one stage, built for one micro-batch (``B/m`` sequences: the attention's local batch).

    Weights depend only on ``(seed, layer name, global index)`` and the block count, so stage ``s``
    holds exactly the blocks ``stage_blocks(...)`` of the serial model."""

    def __init__(self, cfg, grid, backend, stage: int, stages: int, microbatches: int, seed: int = 0, counter=None):
        self.cfg = cfg
        self.grid = grid
        self.backend = backend
        self.stage, self.stages = stage, stages
        self.blocks_range = plan.stage_blocks(cfg.layers, stages, stage)
        micro = replace(cfg, batch=cfg.batch // microbatches)
        block_cls = GPTBlock if cfg.kind == "gpt" else MLPBlock
        self.blocks = [block_cls(i, micro, grid, backend, seed, counter) for i in self.blocks_range]
        self.activation_layout = activation_layout("x")
        self.peak_activation_bytes = 0
        #: the trace's layer vocabulary, the whole model's (every stage's blocks, then the loss): set by the trainer
        self.all_layer_names: List[str] = []

    def stage_layer_names(self) -> List[str]:
        return [name for block in self.blocks for name in block.layer_names()]

    def layer_names(self) -> List[str]:
        return list(self.all_layer_names) or self.stage_layer_names() + ["loss"]


class PipelineData:
    """The synthetic batches where a stage needs them: inputs on stage 0, targets on the last stage (both
    ``[m_local, h/G_x]``, :class:`~fourd_mpi.step.model.SyntheticData`); nothing on the others.
    :meth:`micro` gives micro-batch ``k``'s rows (whole sequences, a view)."""

    def __init__(self, cfg, grid, backend, seed: int, batches: int, first: bool, last: bool, microbatches: int):
        self.inner = SyntheticData(cfg, grid, backend, seed=seed, batches=batches) if (first or last) else None
        self.last = last
        self.microbatches = microbatches
        self.global_shape = (cfg.batch * cfg.seq, cfg.hidden)
        self._batches = batches
        self.prep_seconds = self.inner.prep_seconds if self.inner is not None else 0.0

    @property
    def batches(self) -> int:
        return self._batches

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes if self.inner is not None else 0

    def batch(self, step: int):
        return self.inner.batch(step)

    def micro(self, step: int, k: int):
        """``(x, target)`` rows of micro-batch ``k`` (views of the prepared batch)."""
        x, t = self.inner.batch(step)
        rows = x.shape[0] // self.microbatches
        part = slice(k * rows, (k + 1) * rows)
        return x[part], t[part]

    def global_index(self) -> np.ndarray:
        """Flat indices into ``[B*s, h]`` of this rank's output piece: the last stage's, none elsewhere."""
        if self.last:
            return self.inner.global_index()
        return np.zeros(0, dtype=np.int64)


class AccumulatingGrads(GradientSync):
    """:class:`GradientSync` over micro-batches: token-partial gradients are summed locally until
    :attr:`final` (the stage's last backward), whose :meth:`reduce` issues the first collective of the
    sum (then the data all-reduce as usual). Every rank of a stage runs its backwards in the same order,
    so the collectives are issued in the same order everywhere."""

    def __init__(self, comm: Collectives, overlap):
        super().__init__(comm, overlap)
        self.final = True
        self._sums: Dict[str, object] = {}

    def reduce(self, param, partial, first) -> None:
        held = self._sums.pop(param.name, None)
        if held is not None:
            held += partial
            partial = held
        if not self.final:
            self._sums[param.name] = partial if held is not None else partial.copy()
            return
        self.add(param, first(partial))

    def begin(self) -> None:
        super().begin()
        if self._sums:
            raise RuntimeError(f"gradients of the previous step never reduced: {sorted(self._sums)}")


class Stage:
    """One stage's work on micro-batches, driven by a schedule (:mod:`fourd_mpi.algorithms.pipeline_schedule`)."""

    def __init__(self, trainer: "PipelineTrainer", step: int):
        t = trainer
        self.t, self.step = t, step
        self.stage, self.stages, self.microbatches = t.stage, t.stages, t.microbatches
        self.first, self.last = t.stage == 0, t.stage == t.stages - 1
        self.saved: Dict[int, object] = {}
        self.dy: Dict[int, object] = {}
        self.outputs: Dict[int, object] = {}
        self.loss_local = 0.0
        self.backwards = 0
        self.peak = 0
        self._next = {FORWARD: 0, BACKWARD: 0}
        self._posted = {}
        self._post(FORWARD)
        self._post(BACKWARD)

    def _post(self, direction: int) -> None:
        """Post the receive of the next expected message in ``direction`` (one ahead per direction)."""
        k = self._next[direction]
        if k >= self.microbatches or (direction == FORWARD and self.first) or (direction == BACKWARD and self.last):
            return
        neighbour = self.stage - 1 if direction == FORWARD else self.stage + 1
        self._posted[direction] = (k, self.t.p2p.irecv(self.t.message_shape, neighbour, tag(k, direction)))

    def _take(self, direction: int, k: int, what: str):
        posted_k, handle = self._posted.pop(direction)
        if posted_k != k:
            raise RuntimeError(f"stage {self.stage}: micro-batch {k} needed, the posted receive is for {posted_k}")
        array = self.t.p2p.wait(handle, what)
        self._next[direction] = k + 1
        self._post(direction)
        return array

    def next_message(self):
        """The first posted message to arrive, as ``("forward" | "backward", k)``; backward messages first in
        the list (``MPI_Waitany`` returns the lowest completed index), so a stage frees activations first."""
        order = [d for d in (BACKWARD, FORWARD) if d in self._posted]
        index = self.t.p2p.wait_first([self._posted[d][1] for d in order], self.t.comm.grid.cart,
                                      f"the next pipeline message of stage {self.stage}")
        direction = order[index]
        return ("forward" if direction == FORWARD else "backward"), self._posted[direction][0]

    def forward(self, k: int) -> None:
        t = self.t
        trace = t.comm.tracer
        trace.enter_phase("forward")
        if self.first:
            x = t.data.micro(self.step, k)[0]
        else:
            x = self._take(FORWARD, k, f"the activation of micro-batch {k} from stage {self.stage - 1}")
        t.weights.begin_forward()
        y, saved = t.model.forward(x, t.ctx, t.recompute)
        self.saved[k] = saved
        self.peak = max(self.peak, held_bytes(list(self.saved.values())))
        if self.last:
            with trace.layer("loss", "forward"), trace.op("loss"):
                target = t.data.micro(self.step, k)[1]
                dy = t.comm.backend.empty(y.shape)
                self.loss_local += elementwise.mse_parts(y, target, dy, t.global_elements)
            self.dy[k] = dy
            self.outputs[k] = y
        else:
            t.p2p.isend(y, self.stage + 1, tag(k, FORWARD))
            t.p2p.retire_sends()

    def backward(self, k: int) -> None:
        t = self.t
        trace = t.comm.tracer
        trace.enter_phase("backward")
        if self.last:
            dy = self.dy.pop(k)
        else:
            dy = self._take(BACKWARD, k, f"the gradient of micro-batch {k} from stage {self.stage + 1}")
        t.grads.final = self.backwards == self.microbatches - 1
        t.weights.begin_backward(t.model.backward_weight_order(t.recompute),
                                 "recompute" if t.recompute == "full" else "backward")
        dx = t.model.backward(dy, self.saved.pop(k), t.ctx)
        self.peak = max(self.peak, t.model.peak_activation_bytes + held_bytes(list(self.saved.values())))
        self.backwards += 1
        if not self.first:
            t.p2p.isend(dx, self.stage - 1, tag(k, BACKWARD))
            t.p2p.retire_sends()


class PipelineTrainer:
    """Training steps of one stage; collective over the world (every rank calls :meth:`step` with the same index).

    Same interface as :class:`~fourd_mpi.step.engine.Trainer` (``step``, ``forward_backward``, ``overlap``)."""

    def __init__(self, model: PipelineModel, data: PipelineData, comm: Collectives, optimizer, options, world):
        self.model, self.data, self.comm, self.optimizer = model, data, comm, optimizer
        self.options = options
        self.world = world
        self.stage, self.stages, self.microbatches = model.stage, model.stages, options.microbatches
        self.schedule = options.pipeline_schedule
        self.overlap = options.overlap
        self.recompute = options.recompute
        # the ranks with equal 4D coordinates in every stage; its rank is the stage (owned by the grid)
        self.inter = comm.grid.root.axis_comm("inter")
        names = self.inter.allgather(model.stage_layer_names())
        model.all_layer_names = [n for part in names for n in part] + ["loss"]
        comm.tracer.set_layers(model.layer_names())
        self.weights = WeightFetcher(comm, model.fc_layers(), self.overlap)
        self.grads = AccumulatingGrads(comm, self.overlap)
        self.ctx = StepContext(comm, self.weights, self.grads, self.overlap)
        if self.overlap.dp:
            comm.on_poll.append(self.grads.advance)
        self.p2p = PointToPoint(self.inter, comm)
        cfg, grid = options.model, comm.grid.shape
        self.global_elements = cfg.batch * cfg.seq * cfg.hidden
        tokens = (cfg.batch // (grid.data * grid.z)) * cfg.seq
        self.message_shape = (tokens // self.microbatches, cfg.hidden // grid.x)
        self._group_sizes = {axis: comm.grid.size(axis) for axis in ("data", "z", "y", "x")}
        self._group_sizes["inter"] = 2  # a message has one sender and one receiver
        self.saved_activation_bytes = 0

    def describe(self) -> str:
        """One header line (the same on every rank)."""
        o = self.options
        blocks = " ".join(f"[{r.start},{r.stop})" for r in (plan.stage_blocks(o.model.layers, o.ginter, s)
                                                          for s in range(o.ginter)))
        shard = plan.local_sequences(o)
        return (f"pipeline: {o.ginter} stages of grid {o.grid} = 5D grid {plan.grid5d_text(o)} (inter x data x z x y x "
                f"x; rank order {', '.join(plan.RANK_ORDER)}), blocks per stage {blocks}, {o.microbatches} "
                f"micro-batch(es) of {shard // o.microbatches} sequence(s) per rank, schedule {o.pipeline_schedule}")

    def trace_metadata(self) -> Dict:
        """Keys of the trace metadata: the pipeline's settings, and the run's grid (read from it) as readers
        spell it: ``grid5d`` ``inter x data x z x y x x`` (text and, under ``pipeline``, sizes, which
        :meth:`fourd_mpi.trace.read.Trace.placement` reads in traces without a placement) and the rank order."""
        o, root = self.options, self.comm.grid.root
        grid5d = {axis: root.dims[axis] for axis in plan.GRID5D_AXES}
        return {"grid5d": "x".join(str(size) for size in grid5d.values()),
                "pipeline": {"stages": o.ginter, "microbatches": o.microbatches, "schedule": o.pipeline_schedule,
                             "grid5d": grid5d, "grid5d_axes": " x ".join(plan.GRID5D_AXES),
                             "rank_order": ", ".join(root.axes) + " (outermost first)",
                             "stage_blocks": [[r.start, r.stop] for r in (plan.stage_blocks(o.model.layers, o.ginter, s)
                                                                          for s in range(o.ginter))],
                             "bubble": "host time blocked waiting for another stage's message (op bubble, "
                                       "axis inter)"}}

    def forward_backward(self, step: int, complete: bool = True):
        """Loss (the same on every rank) and fully reduced gradients of this stage for the batch of ``step``;
        returns ``(loss, y)``, ``y`` the last stage's output ``[m_local, h/G_x]`` (empty on other stages).
        ``complete`` False (OUP): the gradient collectives are left in flight for the optimizer
        (:func:`~fourd_mpi.step.engine.update_as_ready`)."""
        self.grads.begin()
        stage = Stage(self, step)
        run_schedule(self.schedule, stage)
        self.comm.tracer.enter_phase("backward")
        if complete:
            self.grads.finish()
            self.comm.check_quiescent("the end of the pipeline's backward passes")
        self.p2p.complete_sends()
        self.saved_activation_bytes = stage.peak
        self.model.peak_activation_bytes = stage.peak
        # the partial sums stay on the device until here (mse_parts): one read, after the step's work is queued
        contribution = float(stage.loss_local) if stage.last and self.comm.grid.coords["y"] == 0 else 0.0
        with self.comm.watch(f"the loss all-reduce over the world, step {step}"):
            total = self.world.allreduce(contribution, op=MPI.SUM)
        if stage.last:
            y = self.comm.backend.xp.concatenate([stage.outputs[k] for k in range(self.microbatches)], axis=0)
        else:
            y = self.comm.backend.empty((0, self.message_shape[1]))
        return total / (2.0 * self.global_elements), y

    def step(self, step: int, last: bool = False) -> StepResult:
        """One training step; ``last``: no step follows (OUP issues no all-gather for a next one)."""
        return timed_step(self, step, self.world, "the end-of-step MAX all-reduce over the world", last)

    def close(self, within_s: Optional[float] = None) -> bool:
        """An all-gather issued ahead for a step that never ran (OUP): as
        :meth:`fourd_mpi.step.engine.Trainer.close`."""
        return self.weights.drain(within_s)


def build_state(options, grid, backend, counter):
    """``(model, data)`` of this rank's stage (``grid``: the stage's 4D grid,
    :meth:`~fourd_mpi.core.grid.ProcessGrid.sub` of the run's grid, whose ``inter`` coordinate is the
    stage). No collective (called inside the allocation guard)."""
    stage = grid.root.coords["inter"]
    first, last = stage == 0, stage == options.ginter - 1
    model = PipelineModel(options.model, grid, backend, stage, options.ginter, options.microbatches,
                          seed=options.seed, counter=counter)
    data = PipelineData(options.model, grid, backend, options.seed, min(options.data_batches, options.steps),
                        first, last, options.microbatches)
    return model, data


def make_trainer(model, data, comm, optimizer, options):
    """The stage's :class:`PipelineTrainer`. Collective over the world (gathers the layer names over ``inter``)."""
    return PipelineTrainer(model, data, comm, optimizer, options, comm.grid.world)
