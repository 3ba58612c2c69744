"""Activation recompute (``--recompute none|selective|full``): memory kept, FLOPs, trace.

Correctness against the serial reference is in ``test_parallel.py`` (mpiexec, several grids and world
sizes) and ``test_gradcheck.py`` (bit-identical on one rank). Here: the activation bytes a step keeps
(measured from the arrays held) on a case with a known answer, the FLOP conventions, and what a traced
run records: the recompute work in its own phase, its GEMM FLOPs equal to the formula's extra, the weight
all-gathers of the recompute forward (or none with the weight cache), both FLOP rates in the summary.
"""

import numpy as np
import pytest

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve
from fourd_mpi.step.presets import PRESETS, resolve_model

MODES = ("none", "selective", "full")


def _held(mode, dtype="float64"):
    from mpi4py import MPI

    run = Run.build(MPI.COMM_SELF, resolve(1, "gpt-tiny", {}, {}, dtype=dtype, backend="numpy", recompute=mode))
    result = run.trainer.step(0)
    run.close()
    return result.saved_activation_bytes, result.peak_activation_bytes


def test_saved_activation_bytes_known_answer():
    """gpt-tiny on one rank (L=2, h=64, 8 heads, s=16, B=8: m = 128 tokens), float64 (8 bytes).

    full keeps each block's input ``[m, h]``: L*m*h*8. selective drops per block the probabilities
    ``[B, heads, s, s]`` and the context ``[m, h]``. During a full-recompute backward the most held at once
    is the inputs of the other L-1 blocks plus one rebuilt block (what ``none`` keeps per block)."""
    cfg = PRESETS["gpt-tiny"]
    L, h, s, B, heads = cfg.layers, cfg.hidden, cfg.seq, cfg.batch, cfg.heads
    m = B * s
    held = {mode: _held(mode) for mode in MODES}
    none_saved, full_saved, sel_saved = held["none"][0], held["full"][0], held["selective"][0]
    assert full_saved == L * m * h * 8
    assert none_saved - sel_saved == L * (B * heads * s * s + m * h) * 8
    assert full_saved < sel_saved < none_saved
    assert held["full"][1] == (L - 1) * m * h * 8 + none_saved // L
    assert held["none"][1] == none_saved and held["selective"][1] == sel_saved
    assert _held("full", "float32")[0] == L * m * h * 4  # measured from the arrays: half the bytes


def test_flop_conventions():
    cfg = resolve_model("gpt-80b", batch=8)
    B, s, L, h = cfg.batch, cfg.seq, cfg.layers, cfg.hidden
    assert cfg.flops_per_step() == pytest.approx(72 * B * s * L * h ** 2 * (1 + s / (6 * h)), rel=1e-12)
    assert cfg.hardware_flops_per_step("full") == pytest.approx(96 * B * s * L * h ** 2 * (1 + s / (6 * h)),
                                                                rel=1e-12)
    assert cfg.hardware_flops_per_step("full") / cfg.flops_per_step() == pytest.approx(4 / 3, rel=1e-15)
    assert cfg.hardware_flops_per_step("selective") - cfg.flops_per_step() == 4 * B * s * s * h * L
    assert cfg.hardware_flops_per_step("none") == cfg.flops_per_step()
    mlp = PRESETS["mlp-tiny"]
    assert mlp.hardware_flops_per_step("selective") == mlp.flops_per_step()  # no attention to recompute
    with pytest.raises(ValueError):
        cfg.hardware_flops_per_step("some")


@pytest.mark.mpi
def test_traced_recompute_phase_flops_gathers_and_memory(run_mpi, tmp_path):
    """4 ranks, grid 1x2x2x1 (G_x = 1: no rank repeats another's GEMM, so the ranks' FLOPs add up to the
    model's), gpt-tiny float64, every overlap; full recompute with and without the weight cache."""
    from fourd_mpi.analysis.tables import breakdown, breakdown_wide, runs_table
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    cases = {"none": "all", "selective": "all", "full": "all", "full-cache": "all,cache"}
    traces = {}
    for name, overlap in cases.items():
        proc = run_mpi(4, ["run", "--gz", "2", "--gy", "2", "--gx", "1", "--dtype", "float64", "--steps", "2",
                           "--warmup", "0", "--recompute", name.split("-")[0], "--overlap", overlap,
                           "--poll-flops", "3000", "--results-dir", tmp_path, "--run-id", name, "--display", "quiet",
                           "--peak-tflops", "1"], timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if name == "full":
            assert "hardware FLOP/s per rank" in proc.stdout and "96 B s l h^2 (1 + s/6h)" in proc.stdout
            assert "activations kept from forward for backward" in proc.stdout
        traces[name] = load_trace(tmp_path / f"{name}.h5")
    cfg = PRESETS["gpt-tiny"]
    for name, trace in traces.items():
        assert check_invariants(trace) == [], name
        mode = name.split("-")[0]
        assert trace.metadata["recompute"] == mode
        ev = trace.events
        recompute = ev[(ev["phase"] == trace.code("phase", "recompute")) & (ev["lane"] == 2)]
        for step in (0, 1):
            flops = recompute["flops"][recompute["step"] == step].sum()
            assert flops == cfg.hardware_flops_per_step(mode) - cfg.flops_per_step(), (name, step)
        gathers = trace.select(op="allgather", rank=0)
        phases = trace.decode("phase", gathers["phase"])
        per_step = {p: int((phases == p).sum()) // 2 for p in ("forward", "backward", "recompute")}
        fc_layers = 4 * cfg.layers
        expect = {"none": (fc_layers, fc_layers, 0), "selective": (fc_layers, fc_layers, 0),
                  "full": (fc_layers, 0, fc_layers), "full-cache": (fc_layers, 0, 0)}[name]
        assert (per_step["forward"], per_step["backward"], per_step["recompute"]) == expect, (name, per_step)
        summary = trace.metadata["summary"]
        ratio = summary["hardware_tflops_per_rank"] / summary["model_tflops_per_rank"]
        assert ratio == pytest.approx(cfg.hardware_flops_per_step(mode) / cfg.flops_per_step(), rel=1e-12)
    saved = {n: traces[n].metadata["activations"]["saved_bytes_max"] for n in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"]
    runs = runs_table(list(traces.values())).set_index("recompute", drop=False)
    assert (runs["hardware_tflops_per_rank"] / runs["tflops_per_rank"]).loc["full"].tolist() == \
        pytest.approx([4 / 3, 4 / 3], rel=1e-12)
    wide = breakdown_wide(breakdown(traces["full"])).iloc[0]
    assert 0 < wide["recompute_%"] < 100
    assert breakdown_wide(breakdown(traces["none"])).iloc[0]["recompute_%"] == 0


def test_summary_reports_both_flop_rates_with_formulas():
    """Known answer: 2 ranks, every step's slowest rank takes 1 s, 4e12 model FLOPs per step and 4/3 of
    that executed (full recompute): 2 and 2.667 TFLOP/s per rank, 20 % and 26.7 % of a 10 TFLOP/s peak."""
    from fourd_mpi.trace.events import RANK_STEP_DTYPE
    from fourd_mpi.trace.summary import summarize

    rows = np.zeros(6, dtype=RANK_STEP_DTYPE)
    rows["rank"] = [0, 1] * 3
    rows["step"] = [0, 0, 1, 1, 2, 2]
    rows["end_ns"] = [10 ** 9, 5 * 10 ** 8] * 3
    cfg = PRESETS["gpt-tiny"]
    s = summarize(rows, 2, 4e12, 128, 10.0, "--peak-tflops", hardware_flops_per_step=4e12 * 4 / 3,
                  recompute="full", formulas=(cfg.flops_formula(), cfg.hardware_flops_formula("full")))
    assert s.model_tflops_per_rank == pytest.approx(2.0) and s.hardware_tflops_per_rank == pytest.approx(8 / 3)
    assert s.mfu_pct == pytest.approx(20.0) and s.hfu_pct == pytest.approx(80 / 3)
    model, hardware = [line for line in s.lines() if line.startswith(("model FLOP/s", "hardware FLOP/s"))]
    assert model.startswith("model FLOP/s per rank: 2000.000 GFLOP/s  [") and "72 B s l h^2 (1 + s/6h)" in model
    assert hardware.startswith("hardware FLOP/s per rank: 2666.667 GFLOP/s  [")
    assert "recompute full" in hardware and "96 B s l h^2 (1 + s/6h)" in hardware
    assert [line[:11] for line in s.lines() if line.startswith(("MFU", "HFU"))] == ["MFU: 20.00%", "HFU: 26.67%"]
    old = summarize(rows, 2, 4e12, 128, 10.0, "--peak-tflops")  # traces before schema 5: HFU = MFU
    assert old.hfu_pct == old.mfu_pct == pytest.approx(20.0)
