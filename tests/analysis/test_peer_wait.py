"""The wait split of the comm table: ``peer_wait_ns`` (waiting for the last rank of the communicator to issue the
collective) against hand-made collectives with known answers, and the comm table's two columns adding up to
its ``wait_s_per_step`` on a real run's trace."""

from __future__ import annotations

import numpy as np

from fourd_mpi.analysis.tables.comm import PEER_WAIT_FORMULA, comm_table, peer_wait_ns
from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.trace.read import load_trace

AXES = ["none", "data", "z", "y", "x"]


def _coll(rows):
    """rows: (rank, step, axis word, issue, complete, wait) -> the column dict peer_wait_ns reads."""
    names = ("rank", "step", "axis", "issue_ns", "complete_ns", "wait_ns")
    cols = {n: np.array([r[i] if n != "axis" else AXES.index(r[i]) for r in rows], dtype=np.int64)
            for i, n in enumerate(names)}
    return cols


def _placement(**dims):
    full = {"data": 1, "z": 1, "y": 1, "x": 1, **dims}
    return NodePlacement.from_nodes([0] * int(np.prod(list(full.values()))), full)


def test_two_ranks_one_late_issuer():
    # rank 0 issues at 100 and waits from 150 to 300; rank 1 issues at 200 and never waits:
    # rank 0 waited 50 ns for rank 1 to issue, then 100 ns for the transfer
    coll = _coll([(0, 3, "z", 100, 300, 150), (1, 3, "z", 200, 310, 0)])
    assert peer_wait_ns(coll, _placement(z=2), AXES).tolist() == [50, 0]


def test_the_kth_collective_matches_the_kth_of_each_peer_and_groups_are_the_communicators():
    # grid z=2 x x=2: ranks 0,1 form one x-communicator, 2,3 the other; ranks 0,2 and 1,3 the z ones
    rows = [
        # x: two collectives per rank in step 5, listed out of order; the second of rank 1 is issued late
        (0, 5, "x", 10, 400, 100), (0, 5, "x", 500, 900, 300),
        (1, 5, "x", 520, 800, 0), (1, 5, "x", 12, 380, 0),
        # the other x-communicator: issued together, waits are all transfer
        (2, 5, "x", 10, 90, 40), (3, 5, "x", 11, 95, 0),
        # z between ranks 0 and 2: rank 2 issues 70 ns after rank 0's wait began (wait 30..130 of rank 0)
        (0, 5, "z", 20, 130, 100), (2, 5, "z", 100, 140, 0),
        # a wait entirely before the peer issued counts whole, at most the wait
        (1, 6, "z", 0, 50, 50), (3, 6, "z", 1000, 1010, 0),
        # the world (axis none): the last of four issues
        (0, 7, "none", 0, 100, 100), (1, 7, "none", 0, 100, 100), (2, 7, "none", 60, 100, 40),
        (3, 7, "none", 80, 100, 20),
    ]
    got = peer_wait_ns(_coll(rows), _placement(z=2, x=2), AXES).tolist()
    # rank 0's first x wait spans 300..400, rank 1's first issue was at 12: nothing; its second spans
    # 600..900 and rank 1 issued the second at 520: nothing either; rank 1 never waited
    assert got[:4] == [0, 0, 0, 0]
    assert got[4:6] == [0, 0]
    assert got[6:8] == [70, 0]
    assert got[8:10] == [50, 0]
    assert got[10:] == [80, 80, 20, 0]


def test_an_axis_the_placement_lacks_has_no_peers():
    coll = _coll([(0, 0, "y", 0, 100, 100)])
    assert peer_wait_ns(coll, _placement(z=1), AXES).tolist() == [0]
    assert "last rank" in PEER_WAIT_FORMULA


def test_the_two_columns_add_up_to_the_wait_of_a_real_run(run_mpi, tmp_path):
    done = run_mpi(3, ["run", "--model", "gpt-tiny", "--hidden", 48, "--heads", 3, "--seq", 16, "--batch", 6,
                       "--layers", 2, "--steps", 3, "--gz", 3, "--overlap", "all", "--trace-level", "op",
                       "--display", "quiet", "--results-dir", tmp_path, "--run-id", "w"])
    assert done.returncode == 0, done.stderr
    table = comm_table(load_trace(str(tmp_path / "w.h5")))
    assert len(table)
    np.testing.assert_allclose(table["peer_wait_s_per_step"] + table["transfer_wait_s_per_step"],
                               table["wait_s_per_step"], rtol=1e-9, atol=1e-12)
    assert (table["peer_wait_s_per_step"] >= 0).all() and (table["transfer_wait_s_per_step"] >= 0).all()


def test_a_pipeline_s_sends_and_receives_are_not_split(run_mpi, tmp_path):
    """Sends and receives have no k-th peer on a communicator: both columns NaN on their rows; the collectives of
    the same run are split."""
    done = run_mpi(4, ["run", "--model", "gpt-tiny", "--hidden", 48, "--heads", 3, "--seq", 16, "--batch", 8,
                       "--layers", 2, "--steps", 3, "--algorithm", "pipeline", "--ginter", 2, "--microbatches", 2,
                       "--gz", 2, "--overlap", "all", "--trace-level", "op", "--display", "quiet",
                       "--results-dir", tmp_path, "--run-id", "p"])
    assert done.returncode == 0, done.stderr
    table = comm_table(load_trace(str(tmp_path / "p.h5")))
    p2p = table[table["op"].isin(["send", "recv"])]
    coll = table[table["op"].isin(["allgather", "reduce_scatter", "allreduce"])]
    assert len(p2p) and len(coll)
    assert p2p["peer_wait_s_per_step"].isna().all() and p2p["transfer_wait_s_per_step"].isna().all()
    np.testing.assert_allclose(coll["peer_wait_s_per_step"] + coll["transfer_wait_s_per_step"],
                               coll["wait_s_per_step"], rtol=1e-9, atol=1e-12)
