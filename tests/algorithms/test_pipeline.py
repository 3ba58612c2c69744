"""``--algorithm pipeline`` under real mpiexec: every gradient and the losses against the serial
single-rank reference (float64, 1e-10), both schedules, 2, 3 and 4 stages, odd world sizes, micro-batch
counts 1, 2 and 4; bad input as one line on every rank; the trace's point-to-point bytes equal the
performance model's, and its bubbles are their own category."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

CASES = [  # ranks, options: 8 = 2 stages x 2x1x2x1, 8 = 4 stages x 2, 6 = 3 stages x 2 (odd stages)
    (8, ["--ginter", "2", "--gdata", "2", "--gy", "2", "--microbatches", "4", "--layers", "3"]),
    (8, ["--ginter", "4", "--gx", "2", "--microbatches", "2", "--layers", "4", "--overlap", "all"]),
    (6, ["--ginter", "3", "--gz", "2", "--microbatches", "1", "--layers", "4"]),
]


@pytest.mark.parametrize("schedule", ["axonn", "1f1b"])
@pytest.mark.parametrize("nranks, args", CASES, ids=["8=2x(2x1x2x1)", "8=4x(1x1x1x2)", "6=3x(1x2x1x1)"])
def test_pipeline_matches_one_rank(run_mpi, tmp_path, nranks, args, schedule):
    report = tmp_path / "verify.json"
    proc = run_mpi(nranks, ["verify", "--algorithm", "pipeline", "--pipeline-schedule", schedule, *args,
                            "--batch", "16", "--dtype", "float64", "--steps", "2", "--json", report], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["algorithm"] == "pipeline" and len(data["results"]) == 1
    r = data["results"][0]
    assert r["ok"] and r["tolerance"] == 1e-10
    assert max(r["output_error"], r["grad_error"], r["loss_error"]) <= 1e-10, r


def test_pipeline_float32_matches_one_rank(run_mpi, tmp_path):
    report = tmp_path / "verify.json"
    proc = run_mpi(6, ["verify", "--algorithm", "pipeline", "--ginter", "3", "--gx", "2", "--microbatches", "2",
                       "--layers", "3", "--batch", "8", "--dtype", "float32", "--steps", "2", "--json", report],
                   timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(report.read_text())["results"][0]
    assert r["ok"] and r["tolerance"] == 1e-4


BAD = [
    (["--ginter", "3"], "--ginter 3 does not divide the world size 8"),
    (["--ginter", "4"], "--ginter 4: more pipeline stages than blocks (gpt-tiny has 2 block(s))"),
    (["--ginter", "2", "--microbatches", "3"], "--microbatches 3 does not divide the batch shard of 2 sequence(s)"),
]


@pytest.mark.parametrize("args, message", BAD + [(["--ginter", "2", "--algorithm", "fsdp"], "--ginter 2: "
                                                  "--algorithm fsdp")], ids=lambda v: str(v)[:30])
def test_bad_pipeline_input_is_one_line_on_every_rank(run_mpi, args, message):
    full = args if "--algorithm" in args else ["--algorithm", "pipeline", *args]
    proc = run_mpi(8, ["run", *full, "--steps", "2"], timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == 8 and len(set(errors)) == 1, proc.stderr
    assert message in errors[0]


def test_trace_p2p_bytes_equal_the_model_and_bubbles_are_a_category(run_mpi, tmp_path):
    from fourd_mpi.analysis.tables import breakdown
    from fourd_mpi.perf.pipeline import p2p_volumes, pipeline_collectives
    from fourd_mpi.perf.volumes import totals
    from fourd_mpi.run.options import resolve_values
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    args = {"algorithm": "pipeline", "ginter": 3, "gx": 2, "microbatches": 2, "layers": 3, "batch": 8,
            "pipeline_schedule": "axonn"}
    cli = [a for k, v in args.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    steps = 3
    proc = run_mpi(6, ["run", *cli, "--steps", str(steps), "--results-dir", tmp_path, "--run-id", "pipe",
                       "--display", "quiet", "--dtype", "float64"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipeline bubbles" in proc.stdout
    trace = load_trace(str(tmp_path / "pipe.h5"))
    assert check_invariants(trace) == []
    assert trace.metadata["grid5d"] == "3x1x1x1x2" and trace.metadata["pipeline"]["schedule"] == "axonn"
    # the node-local rank (which GPU a rank takes) counts over the whole run, not within a stage: 6 ranks on
    # one node are 0..5 (counted within a stage, the 3 stages' ranks would all be 0 and 1 and share 2 GPUs)
    assert sorted(int(r["local_rank"]) for r in trace.ranks) == list(range(6))
    options = resolve_values(args, 6)
    model = p2p_volumes(options.model, options.grid, 3, 2, "float64")
    ev, ops = trace.events, trace.vocab["ops"]
    stage_of = {int(r["rank"]): (int(r["rank"]) // 2) % 3 for r in trace.ranks}
    for rank, stage in stage_of.items():
        mine = ev[ev["rank"] == rank]
        for op in ("send", "recv"):
            picked = mine[mine["op"] == ops.index(op)]
            assert len(picked) == steps * model[stage][f"{op}_messages"], (rank, op)
            assert int(picked["bytes"].sum()) == steps * model[stage][f"{op}_bytes"], (rank, op)
        sends = mine[mine["op"] == ops.index("send")]
        assert np.array_equal(sends["wire_bytes"], sends["bytes"])
        assert (mine["axis"][np.isin(mine["op"], [ops.index("send"), ops.index("recv")])]
                == trace.vocab["axes"].index("inter")).all()
    # the 4D collectives of each stage: per micro-batch, and the gradient synchronization once
    for rank, stage in stage_of.items():
        expected = totals(pipeline_collectives(options.model, options.grid, 3, 2, stage, dtype="float64"))
        mine = ev[(ev["rank"] == rank) & (ev["lane"] >= 3)]
        for (op, axis), want in expected.items():
            got = mine[(mine["op"] == ops.index(op)) & (mine["axis"] == trace.vocab["axes"].index(axis))]
            assert (len(got), int(got["bytes"].sum())) == (steps * want["messages"], steps * want["bytes"]), \
                (rank, op, axis)
    bubbles = ev[ev["op"] == ops.index("bubble")]
    assert len(bubbles) and set(np.unique(bubbles["rank"])) == set(range(6))  # every stage waits for messages
    table = breakdown(trace)
    assert "bubble" in set(table["category"]) and table["share"].sum() == pytest.approx(1.0)
    assert trace.metadata["summary"]["bubble_share"] > 0


def test_a_run_without_stages_reports_no_bubble(run_mpi, tmp_path):
    """The bubble metric's known answer: the same model on the same 6 ranks without a pipeline (axonn4d,
    3x1x1x2) has no ``bubble`` events, a bubble share of exactly 0 and no bubble line or category."""
    from fourd_mpi.analysis.tables import breakdown
    from fourd_mpi.trace.read import load_trace

    proc = run_mpi(6, ["run", "--gx", "2", "--layers", "3", "--batch", "6", "--steps", "2", "--results-dir",
                       tmp_path, "--run-id", "flat", "--display", "quiet", "--dtype", "float64"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipeline bubbles" not in proc.stdout
    trace = load_trace(str(tmp_path / "flat.h5"))
    assert not (trace.events["op"] == trace.vocab["ops"].index("bubble")).any()
    assert trace.metadata["summary"]["bubble_share"] == 0
    assert "bubble" not in set(breakdown(trace)["category"])
