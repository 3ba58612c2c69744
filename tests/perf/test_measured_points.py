"""Known answers for the calibrated profile's per-size measurements:
the table ``bench collectives`` stores (:func:`fourd_mpi.perf.calibration.measured_points`), its monotone
interpolation (:func:`fourd_mpi.perf.machine.interpolate_measured`) and the model's use of it."""

from __future__ import annotations

import copy

import pytest
import yaml

from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import Row, measured_points
from fourd_mpi.perf.machine import PROFILES_DIR, interpolate_measured, load_profile, monotone
from fourd_mpi.perf.predict import collective_parts
from fourd_mpi.perf.volumes import Collective


def test_monotone_pools_adjacent_violators():
    assert monotone([1, 2, 3]) == [1, 2, 3]
    assert monotone([3, 1, 2]) == [2, 2, 2]
    assert monotone([1, 5, 3, 4]) == [1, 4, 4, 4]
    assert monotone([2.0]) == [2.0]


def test_interpolation_is_linear_between_points_flat_below_and_extends_the_last_slope():
    pts = [[1000, 1.0], [2000, 2.0], [4000, 2.5]]
    assert interpolate_measured(pts, 10) == 1.0          # below the smallest: latency-bound
    assert interpolate_measured(pts, 1500) == pytest.approx(1.5)
    assert interpolate_measured(pts, 2000) == pytest.approx(2.0)  # a measurement is reproduced
    assert interpolate_measured(pts, 3000) == pytest.approx(2.25)
    assert interpolate_measured(pts, 8000) == pytest.approx(3.5)  # 2.5 + 4000 B at 0.25 s / 1000 B
    # a larger message that measured cheaper (noise) is pooled first: [1, 3, 2] -> [1, 2.5, 2.5]
    assert interpolate_measured([[1, 1.0], [2, 3.0], [3, 2.0]], 2) == pytest.approx(2.5)
    assert interpolate_measured(list(reversed(pts)), 1500) == pytest.approx(1.5)  # order does not matter


def row(p, size, t, comm="world", level="inter", op="iallreduce", per_node=0):
    return Row(comm, level, p, op, size, 20, t, False, t, t, t, 0, comm, per_node)


def test_the_stored_table_is_the_median_per_size_and_group_size():
    rows = [row(2, 1024, 1e-3, "a"), row(2, 1024, 3e-3, "b"), row(2, 1024, 2e-3, "c"), row(2, 4096, 4e-3),
            row(4, 1024, 5e-3),  # one size only: not enough to interpolate, left out
            row(8, 1024, float("nan")), row(8, 4096, 0.0), row(1, 1024, 1e-3)]  # unusable or p = 1
    assert measured_points(rows) == {"2": [[1024, 2e-3], [4096, 4e-3]]}


def profile_with(tmp_path, measured):
    data = yaml.safe_load(open(f"{PROFILES_DIR}/laptop.yaml"))
    data = copy.deepcopy(data)
    data["name"] = "measured"
    inter = copy.deepcopy(data["levels"]["intra"])
    inter["shared_by"] = 2
    inter["measured"] = measured
    data["levels"]["inter"] = inter
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_profile(str(path))


def test_the_model_costs_a_message_from_the_measurements_with_the_link_share(tmp_path):
    prof = profile_with(tmp_path, {"allreduce": {"2": [[1000, 0.001], [3000, 0.005]]}})
    c = Collective("block0.fc1", "grad_allreduce", "allreduce", "data", 2, "backward", 3, 2000)
    # 2 ranks of the node in the run, shared_by 2: the interpolated 0.003 s per message, 3 messages
    alpha_beta, _ = collective_parts(c, prof, {"data": "inter"}, ranks_on_node=2)
    assert alpha_beta == pytest.approx(3 * 0.003)
    # 4 ranks share the link where 2 did when measured: the part above the smallest size's time doubles
    alpha_beta, _ = collective_parts(c, prof, {"data": "inter"}, ranks_on_node=4)
    assert alpha_beta == pytest.approx(3 * (0.001 + 2 * 0.002))
    # no points for p = 4: the fit of the level (intra's alpha-beta copied here) prices it
    c4 = Collective("block0.fc1", "grad_allreduce", "allreduce", "data", 4, "backward", 1, 2000)
    fit, _ = prof.fit("inter", "allreduce", 4)
    assert collective_parts(c4, prof, {"data": "inter"}, ranks_on_node=2)[0] == \
        pytest.approx(fit.time("allreduce", 4, 2000, 1.0))


def test_groups_of_one_size_but_another_placement_are_kept_apart():
    # 4 nodes x 2 ranks: X of 4 (2 ranks on each of 2 nodes) and data of 4 (one rank on each of 4 nodes)
    rows = [row(4, 1024, 1e-3, "x", per_node=2), row(4, 4096, 2e-3, "x", per_node=2),
            row(4, 1024, 3e-3, "data", per_node=1), row(4, 4096, 8e-3, "data", per_node=1),
            row(2, 1024, 5e-4, "old"), row(2, 4096, 6e-4, "old")]  # per_node unknown (0): keyed by p
    assert measured_points(rows) == {"4@1": [[1024, 3e-3], [4096, 8e-3]], "4@2": [[1024, 1e-3], [4096, 2e-3]],
                                     "2": [[1024, 5e-4], [4096, 6e-4]]}
    # inside a node the group is the whole placement: keyed by p
    intra = [row(2, 1024, 1e-4, "x2", level="intra", per_node=2), row(2, 4096, 2e-4, "x2", level="intra", per_node=2)]
    assert measured_points(intra) == {"2": [[1024, 1e-4], [4096, 2e-4]]}


def test_the_model_prices_a_group_by_its_ranks_per_node(tmp_path):
    from fourd_mpi.perf.machine import group_per_node

    assert group_per_node(4, 1, 2) == 2   # X of 4 on nodes of 2: 2 per node
    assert group_per_node(4, 2, 2) == 1   # stride 2 on nodes of 2: one per node
    assert group_per_node(2, 1, 8) == 2   # inside a node: the whole group
    assert group_per_node(4, 2, 4) == 2   # stride 2 on nodes of 4: ranks 0, 2 | 4, 6
    prof = profile_with(tmp_path, {"allreduce": {"4@2": [[1000, 0.001], [3000, 0.003]],
                                                 "4@1": [[1000, 0.002], [3000, 0.010]]}})
    x = Collective("block0.fc1", "fwd_allreduce", "allreduce", "x", 4, "forward", 1, 3000)
    d = Collective("block0.fc1", "grad_allreduce", "allreduce", "data", 4, "backward", 1, 3000)
    inner = {"x": 1, "y": 4, "z": 4, "data": 2}  # as a grid 4x1x1x2's data axis, X of 4 as 1x1x1x4's
    assert collective_parts(x, prof, {"x": "inter"}, ranks_on_node=2, inner=inner)[0] == pytest.approx(0.003)
    assert collective_parts(d, prof, {"data": "inter"}, ranks_on_node=2, inner=inner)[0] == pytest.approx(0.010)
    # only g = 2 measured: one rank per node puts twice the groups on each link, the part above the
    # smallest size's time doubles (0.001 + 2 x 0.002)
    only2 = profile_with(tmp_path, {"allreduce": {"4@2": [[1000, 0.001], [3000, 0.003]]}})
    assert collective_parts(d, only2, {"data": "inter"}, ranks_on_node=2, inner=inner)[0] == pytest.approx(0.005)
    # an axis that block placement keeps on a node, put across nodes by the rank order: one rank per node
    y = Collective("block0.fc1", "fwd_allreduce", "allreduce", "y", 2, "forward", 1, 3000)
    two = profile_with(tmp_path, {"allreduce": {"2@1": [[1000, 0.004], [3000, 0.006]]}})
    assert collective_parts(y, two, {"y": "inter"}, ranks_on_node=2, inner={"y": 1})[0] == pytest.approx(0.006)


@pytest.mark.parametrize("bad", [
    {"allreduce": {"2": [[1000, 0.001]]}},                      # one point
    {"allreduce": {"2": [[1000, -1.0], [2000, 0.002]]}},         # negative time
    {"allreduce": {"two": [[1000, 0.001], [2000, 0.002]]}},      # group size not a number
    {"allreduce": {"4@": [[1000, 0.001], [2000, 0.002]]}},       # ranks per node missing
    {"broadcast": {"2": [[1000, 0.001], [2000, 0.002]]}},        # not a collective of the model
])
def test_a_bad_table_is_refused(tmp_path, bad):
    with pytest.raises(ConfigError):
        profile_with(tmp_path, bad)


def test_a_rank_order_other_than_consecutive_is_given_as_levels():
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.predict import predict
    from fourd_mpi.step.presets import resolve_model

    cfg = resolve_model("gpt-tiny")
    prof = load_profile("laptop", fallback="perlmutter")
    grid = GridShape(data=1, z=2, y=1, x=2)
    block = predict(cfg, grid, prof, ranks_per_node=2)
    assert block.placement["x"] == "intra" and block.placement["z"] == "inter"
    cyclic = predict(cfg, grid, prof, ranks_per_node=2, levels={"x": "inter", "z": "intra"})
    assert cyclic.placement["x"] == "inter" and cyclic.placement["z"] == "intra"
    assert cyclic.exposed_by_axis()["x"] > block.exposed_by_axis()["x"]
    with pytest.raises(ConfigError, match="intra|inter"):
        predict(cfg, grid, prof, ranks_per_node=2, levels={"x": "across"})


def test_a_pipeline_slot_is_never_shorter_than_its_message(tmp_path):
    from fourd_mpi.perf.machine import message_time
    from fourd_mpi.perf.schedules import link_bound_slot

    # W + t - e min(W, t): compute 3, message 1 -> 3 hidden fully (e = 1), 3.5 half hidden, 4 not at all
    assert link_bound_slot(3.0, 1.0, 1.0) == pytest.approx(3.0)
    assert link_bound_slot(3.0, 1.0, 0.5) == pytest.approx(3.5)
    assert link_bound_slot(3.0, 1.0, 0.0) == pytest.approx(4.0)
    assert link_bound_slot(1.0, 3.0, 1.0) == pytest.approx(3.0)  # the link is the bottleneck
    # across nodes the message is priced from the 2-rank points (a 2-rank all-gather of 2 x msg bytes),
    # with every rank of the node's stage sending at once: 4 senders where 2 shared the link when measured
    prof = profile_with(tmp_path, {"allgather": {"2@1": [[1000, 0.001], [3000, 0.003]]}})
    assert message_time(prof, "inter", 1000, senders=2) == pytest.approx(0.002)
    assert message_time(prof, "inter", 1000, senders=4) == pytest.approx(0.001 + 2 * 0.001)
    assert message_time(prof, "-", 1000, senders=4) == 0.0
    fit, _ = prof.fit("inter", "allgather", 2)  # without points (or inside a node): the level's fit
    assert message_time(prof, "inter", 1000) == pytest.approx(fit.time("allgather", 2, 2000))


# -- back-to-back runs: the step's data all-reduces -------------------------------

def profile_with_runs(tmp_path, measured, runs):
    prof = profile_with(tmp_path, measured)
    data = copy.deepcopy(prof.data)
    data["levels"]["inter"]["measured_runs"] = runs
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_profile(str(path))


def test_a_message_of_a_back_to_back_run_is_priced_from_the_run_points(tmp_path):
    single = {"allreduce": {"4@1": [[1000, 0.002], [3000, 0.006]], "4@2": [[1000, 0.001], [3000, 0.003]]}}
    runs = {"allreduce": {"4@1": [[1000, 0.003], [3000, 0.009]]}}
    prof = profile_with_runs(tmp_path, single, runs)
    assert prof.measured_source("inter", "allreduce", 4, 1) == ("measured", "4@1", 1.0)
    assert prof.measured_source("inter", "allreduce", 4, 1, run=True) == ("measured_runs", "4@1", 1.0)
    assert prof.measured_time("inter", "allreduce", 4, 2000, per_node=1) == pytest.approx(0.004)
    assert prof.measured_time("inter", "allreduce", 4, 2000, per_node=1, run=True) == pytest.approx(0.006)
    # runs measured at another g only: scaled from the nearest g as the single-message points are (x g'/g)
    assert prof.measured_source("inter", "allreduce", 4, 2, run=True) == ("measured_runs", "4@1", 0.5)
    # no runs of p ranks (or a profile without runs, as before): the single-message points
    assert prof.measured_source("inter", "allreduce", 8, 1, run=True) is None
    no_runs = profile_with(tmp_path, single)
    assert no_runs.measured_time("inter", "allreduce", 4, 2000, per_node=1, run=True) == pytest.approx(0.004)


def test_the_step_s_data_all_reduces_are_a_run_only_without_dp_overlap(tmp_path):
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.predict import back_to_back, lower_bound, predict
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    none, dp = OverlapConfig(), OverlapConfig.parse("dp")
    assert back_to_back("grad_allreduce", "data", none) and back_to_back("ln_grad_allreduce", "data", none)
    assert not back_to_back("grad_allreduce", "data", dp)      # issued as each gradient is ready
    assert not back_to_back("ln_grad_allreduce", "z", none)    # the Z all-reduce of LayerNorm: inside backward
    assert not back_to_back("fwd_allreduce", "y", none) and not back_to_back("loss", "data", none)
    # 4 nodes x 2 ranks, grid 4x1x2x1: data of 4 with one rank on each node (4@1); runs cost 1.5 x the single
    # messages above the smallest size's time; nothing else changes
    single = {"allreduce": {"4@1": [[1024, 0.001], [1048576, 0.041]]}}
    runs = {"allreduce": {"4@1": [[1024, 0.001], [1048576, 0.061]]}}
    prof, base = profile_with_runs(tmp_path, single, runs), profile_with(tmp_path, single)
    cfg = resolve_model("gpt-tiny", hidden=256, seq=64, batch=8)
    grid = GridShape(data=4, z=1, y=2, x=1)
    with_runs, without = predict(cfg, grid, prof, ranks_per_node=2), predict(cfg, grid, base, ranks_per_node=2)
    data_runs, data_single = with_runs.exposed_by_axis()["data"], without.exposed_by_axis()["data"]
    # per message: floor + (t - floor) x 1.5 for the messages above 1024 B; the 1 KiB and 8 B ones at the floor
    extra = sum(0.5 * 0.04 * (b - 1024) / (1048576 - 1024)
                for b in (524288, 524288, 131072, 393216) for _ in range(2))
    assert data_runs - data_single == pytest.approx(extra)
    assert with_runs.exposed_by_axis()["y"] == pytest.approx(without.exposed_by_axis()["y"])
    assert with_runs.compute_s == pytest.approx(without.compute_s)
    # with dp overlap the all-reduces are single messages again: the runs do not price them
    assert predict(cfg, grid, prof, dp, ranks_per_node=2).comm_s[("data", "allreduce")] == pytest.approx(
        predict(cfg, grid, base, dp, ranks_per_node=2).comm_s[("data", "allreduce")])
    # the tuner's bound prices them as predict does, so it stays a bound
    assert lower_bound(cfg, grid, prof, ranks_per_node=2) <= with_runs.step_s + 1e-12
    assert lower_bound(cfg, grid, prof, ranks_per_node=2) > lower_bound(cfg, grid, base, ranks_per_node=2)
