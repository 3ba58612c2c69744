"""Known answers for the calibrated profile's per-size measurements (issue 32 item 2, issue 29 item 5):
the table ``bench collectives`` stores (:func:`fourd_mpi.perf.collbench.measured_points`), its monotone
interpolation (:func:`fourd_mpi.perf.machine.interpolate_measured`) and the model's use of it."""

from __future__ import annotations

import copy

import pytest
import yaml

from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.collbench import Row, measured_points
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


def row(p, size, t, comm="world", level="inter", op="iallreduce"):
    return Row(comm, level, p, op, size, 20, t, False, t, t, t, 0, comm)


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


@pytest.mark.parametrize("bad", [
    {"allreduce": {"2": [[1000, 0.001]]}},                      # one point
    {"allreduce": {"2": [[1000, -1.0], [2000, 0.002]]}},         # negative time
    {"allreduce": {"two": [[1000, 0.001], [2000, 0.002]]}},      # group size not a number
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
