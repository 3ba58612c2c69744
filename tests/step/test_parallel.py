"""Distributed correctness under real mpiexec, against serial references.

* ``mpi_layer_check.py``: one normal and one transposed 4D layer against plain
  NumPy on the global tensors (forward Y, dX, dW), for every factorization.
* ``fourd-mpi verify``: the GPT and MLP stacks against the same model on one rank
  (forward output, every gradient, five training steps' losses).

Tolerances (norm-wise relative error): float64 1e-10, float32 1e-4.
"""

import json

import pytest

pytestmark = pytest.mark.mpi

GPT_SMALL_WORLDS = ["--hidden", "48", "--heads", "6", "--ffn-hidden", "96", "--seq", "8"]


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("nranks", [8, 6, 5, 3])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_single_layer_every_factorization(run_mpi, nranks, dtype):
    out = _ok(run_mpi(nranks, ["--dtype", dtype], script="tests/helpers/mpi_layer_check.py"))
    lines = out.strip().splitlines()
    assert len(lines) == 2 * sum(
        1 for _ in __import__("fourd_mpi.core.grid", fromlist=["x"]).grid_factorizations(nranks))
    assert all(line.endswith("ok") for line in lines)


def test_single_layer_12_ranks(run_mpi):
    grids = ["2x3x2x1", "1x1x3x4", "12x1x1x1", "1x2x2x3", "1x12x1x1", "1x1x1x12"]
    args = [a for g in grids for a in ("--grid", g)]
    out = _ok(run_mpi(12, args, script="tests/helpers/mpi_layer_check.py"))
    assert out.count(" ok") == 2 * len(grids)


def _verify(run_mpi, tmp_path, nranks, args):
    report = tmp_path / "verify.json"
    out = _ok(run_mpi(nranks, ["verify", *args, "--json", report]))
    data = json.loads(report.read_text())
    assert data["results"], out
    for r in data["results"]:
        assert r["ok"], r
        assert max(r["output_error"], r["grad_error"], r["loss_error"]) <= r["tolerance"]
    return data, out


@pytest.mark.parametrize("model, dtype", [("gpt-tiny", "float64"), ("gpt-tiny", "float32"),
                                          ("mlp-tiny", "float64")])
def test_every_factorization_of_8_matches_one_rank(run_mpi, tmp_path, model, dtype):
    data, out = _verify(run_mpi, tmp_path, 8, ["--all-grids", "--model", model, "--dtype", dtype])
    assert len(data["results"]) == 20 and not data["skipped"]
    assert "20 passed, 0 failed" in out


@pytest.mark.parametrize("nranks, extra", [
    (6, ["--batch", "6"]),
    (3, ["--batch", "6"]),
    (5, ["--hidden", "40", "--heads", "5", "--ffn-hidden", "80", "--batch", "5"]),
])
def test_odd_and_non_power_of_two_worlds(run_mpi, tmp_path, nranks, extra):
    args = ["--all-grids", "--dtype", "float64", *GPT_SMALL_WORLDS, *extra]
    data, _ = _verify(run_mpi, tmp_path, nranks, args)
    grids = {r["grid"] for r in data["results"]}
    if nranks == 6:
        assert {"3x2x1x1", "1x1x2x3", "2x1x3x1", "1x3x1x2", "1x1x6x1"} <= grids


def test_twelve_ranks_selected_grids(run_mpi, tmp_path):
    grids = ["3x2x1x2", "1x1x3x4", "2x3x2x1", "1x2x2x3", "12x1x1x1", "1x1x6x2"]
    args = ["--dtype", "float64", "--hidden", "48", "--heads", "12", "--ffn-hidden", "96",
            "--seq", "4", "--batch", "12", *[a for g in grids for a in ("--grid", g)]]
    data, _ = _verify(run_mpi, tmp_path, 12, args)
    assert [r["grid"] for r in data["results"]] == grids


def test_sgd_and_weight_caching_match_too(run_mpi, tmp_path):
    args = ["--dtype", "float64", "--optimizer", "sgd", "--cache-weights",
            "--grid", "1x2x2x2", "--grid", "2x2x1x2", "--grid", "1x4x2x1"]
    _verify(run_mpi, tmp_path, 8, args)


def test_run_prints_loss_and_step_time(run_mpi, tmp_path):
    out = _ok(run_mpi(8, ["run", "--gx", "2", "--gy", "2", "--gz", "2", "--model", "gpt-tiny", "--steps", "4",
                          "--results-dir", tmp_path, "--display", "lines"]))
    assert "1x2x2x2" in out and "step time: median" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    steps = [r for r in rows if len(r) >= 3 and r[0] in {"0", "1", "2", "3"}]
    assert [int(r[0]) for r in steps] == [0, 1, 2, 3]
    losses = [float(r[1]) for r in steps]
    assert all(0 < loss < 10 for loss in losses)


@pytest.mark.parametrize("nranks", [8, 6, 7])
def test_grid_rank_order_and_axis_communicators(run_mpi, nranks):
    out = _ok(run_mpi(nranks, [], script="tests/helpers/mpi_grid_check.py"))
    assert f"grid ok for {nranks} ranks" in out


def test_info_describes_grid_and_layouts(run_mpi):
    out = _ok(run_mpi(8, ["info", "--gx", "2", "--gy", "2", "--gz", "2"]))
    assert "G_data x G_z x G_y x G_x = 1x2x2x2 on 8 ranks" in out
    assert "block0.qkv.weight" in out and "[out/y, in/x] flat/z rep(data)" in out
    assert "block0.proj.weight" in out and "[out/x, in/y] flat/z rep(data)" in out


@pytest.mark.parametrize("nranks, args", [
    (8, ["--grid", "1x2x2x2", "--grid", "2x2x1x2", "--overlap", "all", "--overlap", "all,cache",
         "--chunks", "3", "--prefetch-depth", "2", "--check-buffers"]),
    (3, ["--all-grids", "--overlap", "all", *GPT_SMALL_WORLDS, "--batch", "6"]),
])
def test_recompute_matches_one_rank(run_mpi, tmp_path, nranks, args):
    """Selective and full activation recompute against the blocking reference without recompute, with
    every overlap (prefetched re-gathers, weight cache, token chunks), data and Z axes, odd world size."""
    data, out = _verify(run_mpi, tmp_path, nranks, ["--dtype", "float64", "--steps", "2", "--poll-flops", "3000",
                                                    "--recompute", "selective", "--recompute", "full", *args])
    assert {r["recompute"] for r in data["results"]} == {"selective", "full"}
    assert len(data["results"]) == (8 if nranks == 8 else 2 * 4) and not data["skipped"]
    for r in data["results"]:  # the same arithmetic as without recompute: near bit-identical
        assert max(r["output_error"], r["grad_error"], r["loss_error"]) <= 1e-13, r
