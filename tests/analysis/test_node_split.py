"""``analyze --what comm``'s intra-/inter-node split on hand-made traces with known answers (no MPI).

A collective is inter-node when its rank's communicator along its axis spans more than one node
(metadata ``placement.node_span``; traces without it: derived from ``/ranks`` host names)."""

from __future__ import annotations

import pytest
from test_analysis import LANE_COMM0, LANE_HOST, LANE_STEP, event, write_trace

from fourd_mpi.analysis.tables import COMM_PLACEMENT_COLUMNS, comm_placement_table, comm_table
from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.trace.read import load_trace


def collective_events(world, axes):
    """Per rank and step (0 warm-up, 1, 2): an all-reduce of 4096 bytes over ``axes[0]`` (1000 ns in flight) and
    an all-gather of 2048 bytes over ``axes[1]`` (500 ns)."""
    events = []
    for rank in range(world):
        for step in range(3):
            t0 = 1_000_000 + step * 100_000
            events += [
                event(rank, step, "step", LANE_STEP, t0, t0 + 5000),
                event(rank, step, "gemm", LANE_HOST, t0 + 3000, t0 + 4000, phase="forward", flops=1e5),
                event(rank, step, "allreduce", LANE_COMM0, t0 + 100, t0 + 1100, axis=axes[0], nbytes=4096, wire=4096,
                      issue=t0 + 100, complete=t0 + 1100, wait=200),
                event(rank, step, "allgather", LANE_COMM0 + 1, t0 + 2000, t0 + 2500, axis=axes[1], nbytes=2048,
                      wire=1024, issue=t0 + 2000, complete=t0 + 2500, wait=100),
            ]
    return events


GRID = {"data": 1, "z": 2, "y": 1, "x": 2}  # 4 ranks: X innermost (ranks 0,1 and 2,3), Z stride 2


@pytest.mark.parametrize("recorded", [True, False], ids=["metadata", "derived-from-ranks"])
def test_two_nodes_x_inside_z_across(tmp_path, recorded):
    hosts = ["n1", "n1", "n2", "n2"]
    extra = {"placement": NodePlacement.from_nodes(hosts, GRID, hosts=["n1", "n2"]).as_dict()} if recorded else {}
    trace = load_trace(write_trace(tmp_path / "split.h5", collective_events(4, ("x", "z")), 4, grid=GRID,
                                   hosts=hosts, extra_meta=extra))
    assert trace.placement().inter_node_axes == ["z"]
    df = comm_table(trace)
    rows = {(r.op, r.axis): r for r in df.itertuples()}
    assert set(rows) == {("allreduce", "x"), ("allgather", "z")}
    assert (rows["allreduce", "x"].placement, rows["allreduce", "x"].node_span) == ("intra-node", 1)
    assert (rows["allgather", "z"].placement, rows["allgather", "z"].node_span) == ("inter-node", 2)
    split = comm_placement_table(df)
    assert list(split.columns) == COMM_PLACEMENT_COLUMNS
    by = {r.placement: r for r in split.itertuples()}
    assert by["intra-node"].bytes_per_step == 4096 and by["inter-node"].bytes_per_step == 2048
    assert by["intra-node"].bytes_pct == pytest.approx(200 / 3) and by["inter-node"].bytes_pct == pytest.approx(100 / 3)
    assert by["intra-node"].inflight_s_per_step == pytest.approx(1000e-9)
    assert by["inter-node"].inflight_s_per_step == pytest.approx(500e-9)
    assert by["inter-node"].inflight_pct == pytest.approx(100 / 3)
    assert (by["intra-node"].axes, by["inter-node"].axes) == ("x", "z")


def test_uneven_nodes_split_one_axis(tmp_path):
    # nodes of 3 and 1 ranks: X communicator {0,1} stays on n1, {2,3} spans n1 and n2 -> half the X bytes cross
    hosts = ["n1", "n1", "n1", "n2"]
    grid = {"data": 1, "z": 1, "y": 2, "x": 2}
    placement = NodePlacement.from_nodes(hosts, grid, hosts=["n1", "n2"])
    trace = load_trace(write_trace(tmp_path / "uneven.h5", collective_events(4, ("x", "y")), 4, grid=grid,
                                   hosts=hosts, extra_meta={"placement": placement.as_dict()}))
    df = comm_table(trace)
    x = df[df.axis == "x"].set_index("placement")
    assert set(x.index) == {"intra-node", "inter-node"}
    assert x.loc["intra-node", "bytes_per_step"] == 2048 and x.loc["inter-node", "bytes_per_step"] == 2048
    assert x.loc["intra-node", "messages_per_step"] == 0.5
    y = df[df.axis == "y"]  # Y {0,2} on n1, {1,3} across
    assert sorted(y.placement) == ["inter-node", "intra-node"]
    split = comm_placement_table(df).set_index("placement")
    assert split.loc["inter-node", "bytes_per_step"] == 2048 + 1024
    assert split.loc["inter-node", "axes"] in ("x,y", "y,x")


def test_one_node_has_only_intra_rows(tmp_path):
    trace = load_trace(write_trace(tmp_path / "one.h5", collective_events(4, ("x", "z")), 4, grid=GRID))
    df = comm_table(trace)
    assert set(df.placement) == {"intra-node"} and set(df.node_span) == {1}
    assert list(comm_placement_table(df).placement) == ["intra-node"]
