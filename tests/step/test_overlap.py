"""Overlap options and progress strategies: same losses and gradients as the blocking step.

Every overlap option alone, all of them, all with weight caching, under each
progress strategy, on grids with G_z > 1 and G_data > 1, compared with the
blocking single-rank reference (float64, tolerance 1e-10). A tiny poll chunk
forces the chunked GEMM path; ``--check-buffers`` proves no send buffer changes
while its collective is in flight; the engine itself checks that no request is
left un-waited at the end of every backward pass.
"""

import json

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.overlap import OverlapConfig

GRIDS = ["2x2x1x2", "1x2x2x2", "2x2x2x1", "1x4x1x2"]
OVERLAPS = ["oag", "ors", "oar", "dp", "od", "oup", "cache", "all", "all,cache", "oag,ors"]


def test_parse_overlap_lists():
    assert OverlapConfig.parse("none").enabled == []
    assert OverlapConfig.parse("all").enabled == ["oag", "ors", "oar", "dp", "od", "oup"]
    c = OverlapConfig.parse("ORS, oag", prefetch_depth=3)
    assert c.enabled == ["oag", "ors"] and c.prefetch_depth == 3 and str(c).startswith("oag,ors")
    with pytest.raises(ConfigError, match="unknown overlap 'oaq'"):
        OverlapConfig.parse("oag,oaq")
    with pytest.raises(ConfigError, match="--chunks"):
        OverlapConfig.parse("od", chunks=0)


def test_inapplicable_options_are_named():
    notes = OverlapConfig.parse("all,cache").inapplicable(GridShape(1, 1, 2, 4))
    assert any(n.startswith("oag has no effect: G_z = 1") for n in notes)
    assert any(n.startswith("dp has no effect: G_data = 1") for n in notes)
    assert not any(n.startswith("oar") or n.startswith("od") for n in notes)
    assert OverlapConfig.parse("all").inapplicable(GridShape(2, 2, 1, 2)) == []
    assert any(n.startswith("oup has no effect: G_z = G_data = 1") for n in notes)
    assert not any(n.startswith("oup") for n in OverlapConfig.parse("oup").inapplicable(GridShape(2, 1, 2, 1)))


class _Handle:
    """A collective that completes at a given tick of :class:`_Clock` (test() and wait() see it)."""

    def __init__(self, clock, done_at, value, record=None):
        self.clock, self.done_at, self.value, self.record = clock, done_at, value, record

    def test(self):
        return self.clock.now >= self.done_at

    def wait(self):
        self.clock.now = max(self.clock.now, self.done_at)
        return self.value


class _Clock:
    now = 0


class _FakeComm:
    """Collectives stand-in: each data all-reduce completes ``delay[name]`` ticks after it is issued."""

    def __init__(self, clock, delay):
        self.clock, self.delay, self.issued = clock, delay, []
        self.tracer = type("T", (), {"tag": staticmethod(lambda layer, phase: (0, 0))})()

    def wait_any(self, handles):
        self.clock.now = max(self.clock.now, min(h.done_at for h in handles))

    def allreduce(self, axis, value, tag=None):
        name = value["name"]
        self.issued.append(name)
        return _Handle(self.clock, self.clock.now + self.delay[name], dict(value, reduced=True))


def test_gradients_are_handed_over_in_completion_order_and_data_stages_issued_in_fifo_order():
    """OUP: ``finish(ready)`` gives each param to ``ready`` as soon as its last collective completes (here c, whose
    reduce-scatter is done at once and whose data all-reduce is fast, before a and b, issued earlier), while the
    data all-reduces are issued in gradient order (a, b, c) on every rank whatever the timing."""
    from types import SimpleNamespace

    from fourd_mpi.step.schedule import GradientSync

    clock = _Clock()
    comm = _FakeComm(clock, {"a": 10, "b": 10, "c": 1})
    sync = GradientSync(comm, OverlapConfig(ors=True, oup=True))
    params = {n: SimpleNamespace(name=f"{n}.weight", reduce_axes=("data",), grad=None) for n in "abc"}
    sync.begin()
    for name, rs_done in (("a", 3), ("b", 2), ("c", 0)):  # reduce-scatters issued in backward order
        sync.add(params[name], _Handle(clock, rs_done, {"name": name}))
    order = []

    def ready(p):
        order.append((p.name, clock.now))
        clock.now += 1  # the update takes a tick: later collectives progress meanwhile

    sync.finish(ready)
    assert comm.issued == ["a", "b", "c"]
    assert [n for n, _ in order] == ["c.weight", "a.weight", "b.weight"]
    assert all(p.grad["reduced"] for p in params.values())


def test_per_parameter_updates_in_any_order_equal_the_step():
    """SGD and Adam: ``begin(); update(p) in reverse order; end()`` gives what ``step()`` gives. Known answer
    (SGD, lr 0.1): ``w = 1 - 0.1 * 0.5 = 0.95``; Adam's first update is ``-lr * sign(g)`` (m/c1 = g,
    sqrt(v/c2) = |g|): ``1 - 1e-3 = 0.999`` (to ``lr * eps / |g|`` = 2e-11, below the tolerance)."""
    import numpy as np

    from fourd_mpi.step.optim import make_optimizer

    def params():
        return [SimpleParam(f"p{i}", np.full(3, 1.0), np.full(3, 0.5)) for i in range(3)]

    for name, lr, expected in (("sgd", 0.1, 0.95), ("adam", 1e-3, 0.999)):
        a, b = params(), params()
        opt_a, opt_b = make_optimizer(name, a, lr=lr), make_optimizer(name, b, lr=lr)
        for _ in range(2):
            opt_a.step()
            opt_b.begin()
            for p in reversed(b[1:]):
                opt_b.update(p)
            opt_b.update(b[2])  # once per step: a second call changes nothing
            opt_b.end()  # b[0]: never handed over, updated here
        for p, q in zip(a, b):
            np.testing.assert_array_equal(p.data, q.data)
        first = params()
        make_optimizer(name, first, lr=lr).step()
        np.testing.assert_allclose(first[0].data, expected, rtol=1e-10)


class SimpleParam:
    def __init__(self, name, data, grad):
        self.name, self.data, self.grad = name, data, grad


@pytest.mark.mpi
@pytest.mark.parametrize("progress", ["poll", "none", "thread", "auto"])
def test_every_overlap_matches_the_blocking_reference(run_mpi, tmp_path, progress):
    report = tmp_path / "overlap.json"
    args = ["verify", "--dtype", "float64", "--steps", "3", "--progress", progress, "--check-buffers",
            "--poll-flops", "3000", "--chunks", "3", "--prefetch-depth", "2", "--json", report]
    args += [a for g in GRIDS for a in ("--grid", g)] + [a for o in OVERLAPS for a in ("--overlap", o)]
    proc = run_mpi(8, args, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    assert len(results) == len(GRIDS) * len(OVERLAPS)
    # auto: the strategy it chose, said with it (8 ranks here: poll where a node lacks 2 CPUs per rank)
    said = {progress} if progress != "auto" else {"poll (auto)", "thread (auto)"}
    assert all(r["ok"] and r["progress"] in said for r in results)


@pytest.mark.mpi
def test_mlp_stack_with_all_overlaps(run_mpi):
    proc = run_mpi(8, ["verify", "--model", "mlp-tiny", "--dtype", "float64", "--all-grids",
                       "--overlap", "all,cache", "--poll-flops", "2000", "--check-buffers"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "20 passed, 0 failed" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_request_bookkeeping_and_progress(run_mpi, nranks):
    proc = run_mpi(nranks, [], script="tests/helpers/mpi_overlap_check.py", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "overlap checks ok" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [3, 4])
def test_oup_gathers_the_updated_weights_across_the_step_boundary(run_mpi, nranks):
    """tests/helpers/mpi_oup_check.py: the all-gather issued at the end of a step holds the weights after the
    update, belongs to the next step's trace, and neither the last step nor close() leaves it in flight."""
    proc = run_mpi(nranks, ["3"], script="tests/helpers/mpi_oup_check.py", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "oup checks ok" in proc.stdout


@pytest.mark.mpi
def test_oup_trace_puts_the_prefetched_gather_in_the_step_that_uses_it(run_mpi, tmp_path):
    """``run --overlap all``, 3 steps, level op: the trace passes its invariants (comm lanes included: the
    gather issued at the end of step k overlaps step k's last collectives), every step has the same all-gathers,
    and in steps 1 and 2 the first layer's forward all-gather was issued before the step began."""
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    proc = run_mpi(4, ["run", "--gz", "2", "--gx", "2", "--overlap", "all", "--steps", "3", "--warmup", "0",
                       "--results-dir", tmp_path, "--run-id", "oup", "--display", "quiet"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trace = load_trace(tmp_path / "oup.h5")
    assert check_invariants(trace) == []
    ev = trace.events
    first = trace.code("layer", "block0.qkv")
    for rank in range(4):
        gathers = ev[(ev["op"] == trace.code("op", "allgather")) & (ev["rank"] == rank)]
        counts = [int((gathers["step"] == step).sum()) for step in range(3)]
        assert counts[0] == counts[1] == counts[2] > 0, counts
        starts = {int(s["step"]): int(s["start_ns"]) for s in trace.rank_steps[trace.rank_steps["rank"] == rank]}
        for step in range(3):
            mine = gathers[(gathers["step"] == step) & (gathers["layer"] == first)
                           & (gathers["phase"] == trace.code("phase", "forward"))]
            assert len(mine) == 1
            assert (mine["issue_ns"][0] < starts[step]) == (step > 0), (rank, step)


@pytest.mark.mpi
def test_oup_on_every_grid_of_three_ranks(run_mpi):
    """An odd rank count: every grid of 3 ranks, OUP alone and in ``all``, against the serial reference."""
    proc = run_mpi(3, ["verify", "--dtype", "float64", "--steps", "3", "--batch", "6", "--hidden", "48",
                       "--ffn-hidden", "192", "--heads", "3", "--all-grids", "--overlap", "oup", "--overlap", "all",
                       "--check-buffers", "--poll-flops", "3000"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 passed, 0 failed, 0 skipped" in proc.stdout


@pytest.mark.mpi
def test_inapplicable_overlap_is_a_noop_said_once(run_mpi, tmp_path):
    proc = run_mpi(8, ["run", "--gx", "2", "--gy", "4", "--overlap", "oag,ors,oar", "--steps", "2",
                       "--results-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: note:") and " on grid " in line]
    assert notes == [  # notes: on stderr, once (rank 0)
        "fourd-mpi: note: oag has no effect: G_z = 1, weights are not all-gathered on grid 1x1x4x2",
        "fourd-mpi: note: ors has no effect: G_z = 1, gradients are not reduce-scattered on grid 1x1x4x2",
    ]
    assert "overlap oag,ors,oar" in proc.stdout
