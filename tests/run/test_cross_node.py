"""Runs across the multi-node test bed (:mod:`fourd_mpi.testbed`, network namespaces): the node records of
the run header and the trace come from the launcher's node assignment, and ``analyze --what comm`` splits
the collectives into intra- and inter-node by the recorded node spans.

Needs root, iproute2 and util-linux; skipped with the reason elsewhere, except under ``CI=true``, where a
missing prerequisite is a failure. The bed of this module has a name of its own (``x`` + this process's
id) and is taken down after every test, also when it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, mpi_env

from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.testbed import bed as tb
from fourd_mpi.trace.events import LANE_COMM0
from fourd_mpi.trace.read import load_trace

pytestmark = pytest.mark.mpi

NAME = f"x{os.getpid() % 10 ** 7}"
HOSTS = [f"{NAME}-n{i}" for i in range(1, 5)]


def fourd(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


class Bed:
    """The module's test bed, brought up with as many nodes as a test asks for."""

    def up(self, nodes: int) -> None:
        state = tb.load_state(NAME)
        if state is not None and len(state["nodes"]) != nodes:
            self.down()
        done = fourd(["testbed", "up", "--name", NAME, "--nodes", nodes])
        assert done.returncode == 0, done.stderr

    def down(self) -> None:
        done = fourd(["testbed", "down", "--name", NAME])
        assert done.returncode == 0, done.stderr

    def link_sent(self, node: str) -> int:
        return tb.link_counters(tb.load_state(NAME))[node]["sent"]


@pytest.fixture
def bed():
    reason = tb.why_unavailable()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    b = Bed()
    yield b
    b.down()
    assert tb.load_state(NAME) is None, "test bed left behind"


def launch(bed, nodes, ppn, args, timeout=420):
    bed.up(nodes)
    return fourd(["testbed", "mpiexec", "--name", NAME, "-n", nodes * ppn, "--ppn", ppn, "--",
                  sys.executable, "-m", "fourd_mpi", *args], timeout=timeout)


def test_two_nodes_records_and_comm_split(bed, tmp_path):
    proc = launch(bed, 2, 4, ["run", "--gx", "2", "--gy", "2", "--gz", "2", "--model", "gpt-tiny", "--steps", "3",
                              "--trace-level", "op", "--results-dir", tmp_path, "--run-id", "two-nodes",
                              "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # the header: from MPI_COMM_TYPE_SHARED and the processor names, not from an assumption
    assert "on 8 ranks, 2 node(s), 4 rank(s) per node" in out, out
    assert f"2 node(s) ({HOSTS[0]}: ranks 0-3; {HOSTS[1]}: ranks 4-7); axes across nodes: z" in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ") and
            len(line.split()) > 4 and line.split()[0] in ("x", "y", "z", "data")}
    assert rows["x"][3] == "intra-node" and rows["y"][3] == "intra-node" and rows["z"][3] == "inter-node", rows

    trace = load_trace(str(tmp_path / "two-nodes.h5"))
    meta = trace.metadata
    assert meta["num_nodes"] == 2 and meta["ranks_per_node"] == [4, 4]
    p = meta["placement"]
    assert p["hosts"] == HOSTS[:2] and p["nodes"] == [0] * 4 + [1] * 4
    assert p["inter_node_axes"] == ["z"] and p["max_node_span"] == {"data": 1, "z": 2, "y": 1, "x": 1, "none": 2}
    ranks = np.sort(trace.ranks, order="rank")
    assert [h.decode() for h in ranks["hostname"]] == [HOSTS[0]] * 4 + [HOSTS[1]] * 4
    assert list(ranks["node"]) == [0] * 4 + [1] * 4 and list(ranks["local_rank"]) == [0, 1, 2, 3] * 2

    done = fourd(["analyze", str(tmp_path / "two-nodes.h5"), "--what", "comm", "--format", "json"])
    assert done.returncode == 0, done.stderr
    tables = json.loads(done.stdout)
    comm = tables["comm"]
    assert comm and {r["placement"] for r in comm if r["axis"] == "z"} == {"inter-node"}
    assert {r["placement"] for r in comm if r["axis"] in ("x", "y")} == {"intra-node"}
    split = {r["placement"]: r for r in tables["comm by placement"]}
    assert split["inter-node"]["axes"] == "z" and split["intra-node"]["axes"] in ("x,y", "y,x")
    inter_bytes = sum(r["bytes_per_step"] for r in comm if r["placement"] == "inter-node")
    assert split["inter-node"]["bytes_per_step"] == pytest.approx(inter_bytes) and inter_bytes > 0
    total = split["inter-node"]["bytes_pct"] + split["intra-node"]["bytes_pct"]
    assert total == pytest.approx(100.0)

    # the inter-node collectives really crossed the link (UCX_TLS=tcp,self): at least the wire volume the trace
    # gives for the second node's ranks went through its link (in TCP payload, plus headers)
    ev = trace.events
    z = trace.vocab["axes"].index("z")
    node2 = (ev["rank"] >= 4) & (ev["axis"] == z) & (ev["lane"] >= LANE_COMM0)
    sent = int(ev["wire_bytes"][node2].sum())
    assert sent > 0
    # the bed was made for this test: its counters hold this run's traffic (and the launcher's) only
    assert bed.link_sent(HOSTS[1]) >= sent, (bed.link_sent(HOSTS[1]), sent)


def test_four_nodes_verify_and_pipeline_node_numbering(bed, tmp_path):
    report = tmp_path / "verify.json"
    proc = launch(bed, 4, 2, ["verify", "--grid", "1x2x2x2", "--grid", "2x1x1x4", "--model", "mlp-tiny", "--dtype",
                              "float64", "--steps", "2", "--overlap", "none", "--overlap", "all", "--json", report])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ranks on 4 node(s)" in proc.stdout
    results = json.loads(report.read_text())["results"]
    assert all(r["ok"] for r in results)
    across = {r["grid"]: r["across_nodes"] for r in results}
    assert across == {"1x2x2x2": "z,y", "2x1x1x4": "data,x"}, across
    bed.down()

    # pipeline: 2 stages of 1x1x2x2 on 2 nodes of 4: every stage on its own node; the node of /ranks is
    # numbered over the world (stage 1's ranks are on node 1, not node 0 of their stage)
    proc = launch(bed, 2, 4, ["run", "--algorithm", "pipeline", "--ginter", "2", "--gx", "2", "--gy", "2",
                              "--model", "gpt-tiny", "--batch", "16", "--microbatches", "2", "--steps", "2",
                              "--trace-level", "op", "--results-dir", tmp_path, "--run-id", "pipe", "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "axes across nodes: inter" in proc.stdout, proc.stdout
    trace = load_trace(str(tmp_path / "pipe.h5"))
    p = trace.metadata["placement"]
    assert p["axes"] == ["data", "inter", "z", "y", "x"] and p["inter_node_axes"] == ["inter"]
    assert list(np.sort(trace.ranks, order="rank")["node"]) == [0] * 4 + [1] * 4
    comm = json.loads(fourd(["analyze", str(tmp_path / "pipe.h5"), "--what", "comm", "--format", "json"]).stdout)
    assert {r["placement"] for r in comm["comm"] if r["axis"] == "inter"} == {"inter-node"}
    assert {r["placement"] for r in comm["comm"] if r["axis"] in ("x", "y")} == {"intra-node"}


@pytest.mark.parametrize("algorithm, extra", [
    ("axonn4d", []), ("megatron1d", []), ("fsdp", []), ("dp", []), ("optimus3d", []),
    ("pipeline", ["--ginter", "2", "--model", "gpt-tiny", "--batch", "16", "--microbatches", "2"]),
])
def test_every_algorithm_verifies_on_every_grid_across_two_nodes(bed, tmp_path, algorithm, extra):
    """``verify --all-grids`` on 2 nodes x 4 ranks (the development matrix of docs/placement.md section 4 runs
    all 8 overlap variants on 2 x 4 and 4 x 2; here one, all of them at once, keeps the test short)."""
    report = tmp_path / "verify.json"
    model = [] if "--model" in extra else ["--model", "mlp-tiny"]
    proc = launch(bed, 2, 4, ["verify", "--algorithm", algorithm, "--all-grids", *model, *extra, "--dtype", "float64",
                              "--steps", "2", "--overlap", "all,cache", "--json", report])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["results"] and all(r["ok"] and r["nodes"] == 2 for r in data["results"]), data["results"]
    # what the run gathered from MPI equals the axes computed from the launcher's assignment (-ppn 4: ranks 0-3 on
    # the first node), world ranks row-major over data, (inter,) z, y, x
    for r in data["results"]:
        d, z, y, x = map(int, r["grid"].split("x"))
        dims = {"data": d, **({"inter": 2} if algorithm == "pipeline" else {}), "z": z, "y": y, "x": x}
        expected = NodePlacement.from_nodes([0] * 4 + [1] * 4, dims).inter_node_axes
        assert r["across_nodes"] == ",".join(expected), (r, expected)
