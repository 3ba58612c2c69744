"""The pipeline's pure parts: option checks, stage split, rank order, the schedules (simulated with
threads, one per stage, messages through queues), and the performance model's formulas."""

from __future__ import annotations

import queue
import threading

import pytest

from fourd_mpi.algorithms import pipeline_plan as plan
from fourd_mpi.algorithms import registry
from fourd_mpi.algorithms.pipeline_plan import SCHEDULES
from fourd_mpi.algorithms.pipeline_schedule import run
from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import resolve_values


@pytest.mark.parametrize("values, world, message", [
    ({"algorithm": "pipeline", "ginter": 3}, 8, "--ginter 3 does not divide the world size 8"),
    ({"algorithm": "pipeline", "ginter": 4}, 8, "--ginter 4: more pipeline stages than blocks (gpt-tiny has 2"),
    ({"algorithm": "pipeline", "ginter": 2, "microbatches": 3, "gx": 4}, 8,
     "--microbatches 3 does not divide the batch shard of 8 sequence(s) per rank"),
    ({"algorithm": "pipeline", "ginter": 2, "microbatches": 4, "gdata": 4}, 8,
     "--microbatches 4 does not divide the batch shard of 2 sequence(s)"),
    ({"ginter": 2}, 8, "--ginter 2: --algorithm axonn4d (AxoNN 4D (data x 3D tensor parallelism)) has no pipeline"),
    ({"algorithm": "megatron1d", "microbatches": 2}, 8, "--microbatches 2: --algorithm megatron1d"),
    ({"algorithm": "pipeline", "ginter": 2, "gx": 2, "gy": 2, "gz": 2}, 8,
     "has product 8, which does not divide the world size 4: choose sizes whose product divides 4 "
     "(the 4D grid of each of the 2 pipeline stages: world size 8 / --ginter 2 = 4 ranks)"),
])
def test_bad_pipeline_options_are_one_clear_error(values, world, message):
    with pytest.raises(ConfigError) as err:
        resolve_values(values, world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_stage_grid_is_inferred_from_world_over_stages():
    o = resolve_values({"algorithm": "pipeline", "ginter": 2, "gz": 2}, 8)
    assert (o.ginter, str(o.grid)) == (2, "2x2x1x1")
    assert plan.grid5d_text(o) == "2x2x2x1x1"
    # the run's grid over the world: one more axis, inter, between data and the tensor axes (rank order)
    assert list(registry.get("pipeline").grid_dims(o).items()) == [("data", 2), ("inter", 2), ("z", 2), ("y", 1),
                                                                  ("x", 1)]
    four = resolve_values({"algorithm": "axonn4d", "gz": 2}, 8)
    assert list(registry.get("axonn4d").grid_dims(four).items()) == [("data", 4), ("z", 2), ("y", 1), ("x", 1)]
    o = resolve_values({"algorithm": "pipeline", "ginter": 3, "layers": 3}, 6)
    assert str(o.grid) == "2x1x1x1"


@pytest.mark.parametrize("layers, stages", [(2, 2), (3, 2), (7, 3), (4, 4), (10, 4), (5, 1)])
def test_stages_are_contiguous_and_balanced(layers, stages):
    ranges = [plan.stage_blocks(layers, stages, s) for s in range(stages)]
    assert [b for r in ranges for b in r] == list(range(layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True) and min(sizes) >= 1


def test_rank_order_is_data_inter_then_tensor():
    stages, tensor, data = 3, 4, 2
    seen = set()
    for r in range(stages * tensor * data):
        stage, stage_rank = plan.place(r, stages, tensor)
        assert plan.world_rank(stage, stage_rank, stages, tensor) == r
        seen.add((stage, stage_rank))
        assert stage == (r // tensor) % stages  # stage neighbours are G_z G_y G_x world ranks apart
    assert len(seen) == stages * tensor * data


class _Sim:
    """One stage of a simulated pipeline: forward/backward post messages to the neighbours' inboxes."""

    def __init__(self, stage, stages, m, inboxes, log, lock):
        self.stage, self.stages, self.microbatches = stage, stages, m
        self.inboxes, self.log, self.lock = inboxes, log, lock
        self.arrived = []  # messages received, not yet handed to the schedule or used
        self.taken = set()  # messages next_message handed to the schedule
        self.held = set()
        self.most_held = 0

    def _receive(self, message):
        if message in self.taken:
            return
        while message not in self.arrived:
            self.arrived.append(self.inboxes[self.stage].get(timeout=10))
        self.arrived.remove(message)

    def next_message(self):
        if not self.arrived:
            self.arrived.append(self.inboxes[self.stage].get(timeout=10))
        backward = [msg for msg in self.arrived if msg[0] == "backward"]
        message = backward[0] if backward else self.arrived[0]
        self.arrived.remove(message)
        self.taken.add(message)
        return message

    def forward(self, k):
        if self.stage > 0:
            self._receive(("forward", k))
        self.held.add(k)
        self.most_held = max(self.most_held, len(self.held))
        with self.lock:
            self.log.append((self.stage, "F", k))
        if self.stage < self.stages - 1:
            self.inboxes[self.stage + 1].put(("forward", k))

    def backward(self, k):
        if self.stage < self.stages - 1:
            self._receive(("backward", k))
        assert k in self.held, f"stage {self.stage}: backward of {k} before its forward"
        self.held.remove(k)
        with self.lock:
            self.log.append((self.stage, "B", k))
        if self.stage > 0:
            self.inboxes[self.stage - 1].put(("backward", k))


def _simulate(schedule, stages, m):
    inboxes = [queue.Queue() for _ in range(stages)]
    log, lock, errors = [], threading.Lock(), []
    sims = [_Sim(s, stages, m, inboxes, log, lock) for s in range(stages)]

    def drive(sim):
        try:
            run(schedule, sim)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(s,)) for s in sims]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a simulated stage hangs"
    return log, sims


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages, m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 4), (4, 7), (3, 6)])
def test_schedules_finish_every_micro_batch_without_hanging(schedule, stages, m):
    log, sims = _simulate(schedule, stages, m)
    for s in range(stages):
        mine = [(kind, k) for st, kind, k in log if st == s]
        assert sorted(mine) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
        assert [k for kind, k in mine if kind == "B"] == list(range(m))  # backwards in micro-batch order
        # activations in flight: 1F1B min(p - s, m); AxoNN min(p, m) on every stage (stage 0 admits p)
        assert sims[s].most_held <= plan.inflight(schedule, stages, m, s), (s, sims[s].most_held)
    if schedule == "1f1b":  # the fixed order: w warm-up forwards, then alternating
        for s in range(stages):
            kinds = [kind for st, kind, _ in log if st == s]
            w = plan.one_f_one_b_warmup(stages, m, s)
            assert kinds[:w] == ["F"] * w and kinds[w:w + 2 * (m - w)] == ["F", "B"] * (m - w)


def test_model_formulas():
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.pipeline import message_bytes, p2p_volumes, pipeline_memory
    from fourd_mpi.perf.schedules import idle_share
    from fourd_mpi.step.presets import resolve_model

    assert idle_share("1f1b", 4, 4) == pytest.approx(3 / 7) and idle_share("axonn", 1, 8) == 0
    assert idle_share("interleaved", 4, 4, 2) == pytest.approx(3 / 11)  # 1.5 idle slots of 5.5
    cfg, grid = resolve_model("gpt-tiny", batch=16, layers=4), GridShape(2, 1, 1, 2)
    msg = message_bytes(cfg, grid, 4, "float64")
    assert msg == (16 // 2) * cfg.seq // 4 * (cfg.hidden // 2) * 8
    vol = p2p_volumes(cfg, grid, 3, 4, "float64")
    assert [v["send_bytes"] for v in vol.values()] == [4 * msg, 8 * msg, 4 * msg]
    one = pipeline_memory(cfg, grid, 4, 4, 0, "float64", schedule="1f1b")
    last = pipeline_memory(cfg, grid, 4, 4, 3, "float64", schedule="1f1b")
    # stage 0 holds 4 micro-batches' saved sets, the last stage 1; the input/target and transient once
    from dataclasses import replace

    from fourd_mpi.perf.memory import saved_activation_elements

    saved = saved_activation_elements(replace(cfg, layers=1, batch=cfg.batch // 4), grid) * 8
    assert one.activations == last.activations + 3 * saved and one.weights == last.weights
    assert pipeline_memory(cfg, grid, 4, 4, 3, "float64", schedule="axonn").activations == one.activations


def test_prediction_has_predicts_shape_and_reduces_to_it_with_one_stage():
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.perf.pipeline import predict_pipeline
    from fourd_mpi.perf.predict import predict
    from fourd_mpi.perf.schedules import idle_share
    from fourd_mpi.step.presets import resolve_model

    profile = load_profile("laptop")
    cfg, grid = resolve_model("gpt-tiny", batch=16, layers=4), GridShape(1, 1, 1, 2)
    flat = predict(cfg, grid, profile)
    one = predict_pipeline(cfg, grid, profile, 1, 1)
    assert one.step_s == pytest.approx(flat.step_s) and one.exposed_s[("inter", "bubble")] == 0
    for stages, m in ((2, 1), (2, 4), (4, 8)):
        p = predict_pipeline(cfg, grid, profile, stages, m, ranks_per_node=8)
        assert p.step_s == pytest.approx(p.compute_s + p.exposed_total_s)
        assert p.placement["inter"] == "intra" and p.wire_bytes["inter"] > 0
        work = p.exposed_s[("inter", "bubble")] / (stages - 1) * m  # bubble = (p - 1) slots of W/m
        assert p.exposed_s[("inter", "bubble")] / (work * (m + stages - 1) / m) == pytest.approx(
            idle_share("axonn", stages, m))
    assert predict_pipeline(cfg, grid, profile, 4, 4, ranks_per_node=4).placement["inter"] == "inter"


def test_the_stage_grid_axes_are_placed_in_the_pipelines_world():
    """Rank order data, inter, z, y, x: with 2 stages of 2x1x2x1 on nodes of 4 ranks both stages share a
    node and the data axis (stride 4) crosses nodes, as the run records it (a stage grid placed alone
    would put data inside the node)."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.core.placement import NodePlacement
    from fourd_mpi.perf.machine import load_profile, world_levels
    from fourd_mpi.perf.pipeline import predict_pipeline
    from fourd_mpi.step.presets import resolve_model

    grid = GridShape(2, 1, 2, 1)
    levels = world_levels(grid, 2, 4)
    assert levels == {"x": "-", "y": "intra", "z": "-", "inter": "intra", "data": "inter"}
    recorded = NodePlacement.from_nodes([0] * 4 + [1] * 4, {"data": 2, "inter": 2, "z": 1, "y": 2, "x": 1})
    assert recorded.inter_node_axes == ["data"]
    assert world_levels(GridShape(1, 1, 2, 2), 2, 4) == {"x": "intra", "y": "intra", "z": "-", "inter": "inter",
                                                        "data": "-"}
    profile = load_profile("laptop", fallback="perlmutter")
    p = predict_pipeline(resolve_model("gpt-tiny", batch=8), grid, profile, 2, 2, ranks_per_node=4)
    assert p.placement["data"] == "inter" and p.placement["inter"] == "intra" and p.placement["y"] == "intra"


def test_each_slot_is_one_micro_batch_with_its_own_latencies():
    """The time model predicts one slot as the 4D step of one micro-batch (B/m sequences) on the fullest
    stage, so every collective but the gradient synchronization counts m times at its micro-batch size
    (its latency m times), and the optimizer update once. On a latency-bound profile more
    micro-batches therefore stop paying: the step has an optimum in m (before, the prediction fell
    monotonically with m: 30 ms at m = 64 for this case on perlmutter, against 116 ms at m = 1)."""
    from dataclasses import replace

    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.perf.pipeline import predict_pipeline, stage_config
    from fourd_mpi.perf.predict import compute_time, predict
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    profile = load_profile("perlmutter")
    cfg, grid = resolve_model("gpt-small", batch=64, layers=8, seq=256), GridShape(1, 1, 2, 2)
    sync = (("data", "allreduce"), ("z", "reduce_scatter"), ("z", "allreduce"))
    for m in (2, 8):
        p = predict_pipeline(cfg, grid, profile, 4, m, ranks_per_node=4)
        micro = replace(stage_config(cfg, 4), batch=64 // m)
        one = predict(micro, grid, profile, ranks_per_node=4)
        for key, seconds in one.comm_s.items():
            assert p.comm_s[key] == pytest.approx(seconds * (1 if key in sync else m)), key
        update = compute_time(micro, grid, profile, OverlapConfig(), "float32", 4)["optimizer"]
        assert 0 < update < one.compute_s
        assert p.compute_s == pytest.approx(m * (one.compute_s - update) + update)
    steps = {m: predict_pipeline(cfg, grid, profile, 4, m, ranks_per_node=4).step_s for m in (1, 4, 64)}
    assert steps[4] < steps[1] and steps[4] < steps[64]
