"""Which axes cross nodes, from a node assignment list (pure: no MPI), with known answers.

World ranks are row-major over the axes, outermost first (``data, z, y, x``; pipeline ``data, inter, z, y,
x``); an axis crosses nodes when any of its communicators spans more than one node."""

from __future__ import annotations

import pytest

from fourd_mpi.core.placement import WORLD, NodePlacement, axis_node_spans, canonical_nodes, inter_node_axes


def dims(data, z, y, x):
    return {"data": data, "z": z, "y": y, "x": x}


@pytest.mark.parametrize("grid, nodes, crossing, spans", [
    # 2 nodes x 4 ranks: X and Y (4 innermost ranks) stay on a node, Z crosses
    ((1, 2, 2, 2), [0] * 4 + [1] * 4, ["z"], {"x": 1, "y": 1, "z": 2, "data": 1}),
    # 4 nodes x 2 ranks: only X (2 innermost) stays; Y and Z cross
    ((1, 2, 2, 2), [0, 0, 1, 1, 2, 2, 3, 3], ["z", "y"], {"x": 1, "y": 2, "z": 2, "data": 1}),
    # 4 nodes x 2: data outermost (stride 4) and X of 4 both cross
    ((2, 1, 1, 4), [0, 0, 1, 1, 2, 2, 3, 3], ["data", "x"], {"x": 2, "y": 1, "z": 1, "data": 2}),
    # one node: nothing crosses
    ((2, 2, 1, 2), [0] * 8, [], {"x": 1, "y": 1, "z": 1, "data": 1}),
    # one rank per node: every axis larger than 1 crosses, each communicator spans its full size
    ((2, 1, 2, 2), list(range(8)), ["data", "y", "x"], {"x": 2, "y": 2, "z": 1, "data": 2}),
    # 8 nodes x 1 on 1x1x1x8: X spans all 8
    ((1, 1, 1, 8), list(range(8)), ["x"], {"x": 8, "y": 1, "z": 1, "data": 1}),
])
def test_even_placements(grid, nodes, crossing, spans):
    p = NodePlacement.from_nodes(nodes, dims(*grid))
    assert p.inter_node_axes == crossing
    for axis, span in spans.items():
        assert p.spans[axis] == [span] * len(nodes), axis
    assert p.spans[WORLD] == [len(set(nodes))] * len(nodes)
    assert p.num_nodes == len(set(nodes))


def test_uneven_placement_crosses_where_any_communicator_does():
    # 1x1x3x2 on nodes of 5 and 1 ranks: X communicators {0,1}, {2,3} stay, {4,5} spans nodes 0 and 1
    p = NodePlacement.from_nodes([0, 0, 0, 0, 0, 1], dims(1, 1, 3, 2))
    assert p.spans["x"] == [1, 1, 1, 1, 2, 2]
    assert p.spans["y"] == [1, 2, 1, 2, 1, 2]  # {0,2,4} on node 0; {1,3,5} on 0 and 1
    assert p.inter_node_axes == ["y", "x"] and p.crosses("x") and not p.crosses("z")
    assert p.span("x", 0) == 1 and p.span("x", 5) == 2
    assert p.ranks_per_node == [1, 5]


def test_nodes_of_three_ranks_on_a_grid_of_two():
    # 1x1x3x2 with 3 ranks per node: X {2,3} straddles the boundary, Y {0,2,4}: nodes 0,0,1
    p = NodePlacement.from_nodes([0, 0, 0, 1, 1, 1], dims(1, 1, 3, 2))
    assert p.spans["x"] == [1, 1, 2, 2, 1, 1]
    assert p.spans["y"] == [2, 2, 2, 2, 2, 2]


def test_pipeline_axes():
    # 5D data x inter x z x y x x = 1x2x1x1x2 (rank order data, inter, z, y, x) on 2 nodes of 2: stages on
    # different nodes, X inside a node
    p = NodePlacement.from_nodes([0, 0, 1, 1], {"data": 1, "inter": 2, "z": 1, "y": 1, "x": 2})
    assert p.inter_node_axes == ["inter"]
    assert p.spans["inter"] == [2, 2, 2, 2] and p.spans["x"] == [1, 1, 1, 1]


def test_node_labels_are_numbered_by_lowest_rank():
    assert canonical_nodes(["b", "b", "a", "a"]) == [0, 0, 1, 1]
    assert canonical_nodes([4, 0, 4, 0]) == [0, 1, 0, 1]
    # interleaved (round-robin) placement: X of 2 always crosses, Y never
    p = NodePlacement.from_nodes(["n1", "n2", "n1", "n2"], dims(1, 1, 2, 2), hosts=["n1", "n2"])
    assert p.nodes == [0, 1, 0, 1] and p.inter_node_axes == ["x"]
    assert p.describe() == "2 node(s) (n1: ranks 0,2; n2: ranks 1,3); axes across nodes: x"


def test_round_trip_through_the_metadata_form():
    p = NodePlacement.from_nodes([0, 0, 1, 1, 2, 2, 3, 3], dims(1, 2, 2, 2), hosts=["a", "b", "c", "d"])
    d = p.as_dict()
    assert d["inter_node_axes"] == ["z", "y"] and d["max_node_span"] == {"data": 1, "z": 2, "y": 2, "x": 1,
                                                                          WORLD: 4}
    q = NodePlacement.from_dict(d)
    assert (q.nodes, q.hosts, q.spans, q.dims) == (p.nodes, p.hosts, p.spans, p.dims)


def test_wrong_length_is_refused():
    with pytest.raises(ValueError, match="node assignment has 6 ranks but the grid 1x2x2x2 has 8"):
        axis_node_spans([0] * 6, dims(1, 2, 2, 2))


def test_inter_node_axes_ignores_the_world():
    assert inter_node_axes({"x": [1, 1], WORLD: [2, 2]}) == []
