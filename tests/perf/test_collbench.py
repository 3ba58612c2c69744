"""``fourd-mpi bench collectives``: pure helpers, and the calibration end to end under mpiexec."""


import pytest

from fourd_mpi.perf.collbench import (bus_factor, default_grids, fit_alpha_beta, imb_overlap, message_sizes,
                                 osu_overlap)
from fourd_mpi.errors import ConfigError
from fourd_mpi.core.grid import GridShape


def test_message_sizes_are_whole_elements_per_rank():
    assert message_sizes(8, 4096, 8, 4 * 3) == [12, 72, 516, 4104]
    assert message_sizes(8, 64, 2, 4) == [8, 16, 32, 64]
    with pytest.raises(ConfigError, match="larger than --max-size"):
        message_sizes(64, 8, 2, 4)


def test_formulas():
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert osu_overlap(t_ovrl=1.0, t_cpu=1.0, t_pure=1.0) == 100.0  # fully hidden
    assert osu_overlap(t_ovrl=2.0, t_cpu=1.0, t_pure=1.0) == 0.0    # serialized
    assert imb_overlap(t_ovrl=1.5, t_cpu=1.0, t_pure=1.0) == 50.0
    assert imb_overlap(t_ovrl=3.0, t_cpu=1.0, t_pure=1.0) == 0.0


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 5e-6, 2e-10
    pts = []
    for kind in ("allreduce",):
        for p in (2, 4, 8):
            for s in (8, 1024, 65536, 1 << 20):
                k = 2
                pts.append((kind, p, s, k * (p - 1) * alpha + k * (p - 1) / p * s * beta))
    fit = fit_alpha_beta(pts)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["rms_rel_error"] < 1e-9
    assert fit_alpha_beta([]) is None


def test_default_grids_cover_every_group_size():
    assert [str(g) for g in default_grids(12)] == ["6x1x1x2", "4x1x1x3", "3x1x1x4", "2x1x1x6"]
    assert default_grids(5) == []


@pytest.mark.mpi
@pytest.mark.parametrize("nranks, flags", [(3, []), (4, ["--gx", "2", "--gy", "2"])])
def test_calibration_end_to_end(run_mpi, tmp_path, nranks, flags):
    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.perf.predict import predict
    from fourd_mpi.step.presets import resolve_model

    out = tmp_path / "prof.yaml"
    table = tmp_path / "table.txt"
    proc = run_mpi(nranks, ["bench", "collectives", *flags, "--max-size", "4K", "--factor", "8", "--iters", "3",
                            "--warmup", "1", "--overlap-sizes", "1", "--gemm-size", "64", "--dtypes", "float32",
                            "-o", out, "--table", table, "--name", "t"], timeout=240)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for word in ("iallgather", "ireduce_scatter", "iallreduce", "allgather", "reduce_scatter", "allreduce",
                 "busbw", "OSU%", "IMB%", "OSU overlap % = max(0, 100 - 100*(t_ovrl - t_cpu)/t_pure)",
                 "no inter-node level"):
        assert word in text, word
    assert "world" in text
    prof = load_profile(str(out))
    assert prof.name == "t" and prof.ranks_per_node == nranks
    assert set(prof.data["levels"]) == {"intra"}
    assert prof.gemm_tflops("float32") > 0 and prof.data["compute"]["oversubscription"] >= 1
    # the model can use it for grids on this node, and says what is missing beyond it
    cfg = resolve_model("mlp-tiny", batch=12, hidden=12 * 4, ffn_hidden=24 * 4)
    grid = GridShape(1, 1, 1, nranks) if nranks == 3 else GridShape(1, 1, 2, 2)
    assert predict(cfg, grid, prof).step_s > 0
    with pytest.raises(ConfigError, match="no 'inter' level"):
        predict(cfg, GridShape(2, 1, 1, nranks), prof)
    assert table.read_text().startswith("comm")


@pytest.mark.mpi
def test_bad_input_is_one_line_on_every_rank(run_mpi, tmp_path):
    for args, message in ((["--grid", "1x1x2x2"], "product is not the world size 3"),
                          (["--ops", "alltoall"], "--ops: unknown alltoall"),
                          (["--min-size", "1M", "--max-size", "8"], "larger than --max-size")):
        proc = run_mpi(3, ["bench", "collectives", "-o", tmp_path / "x.yaml", *args], timeout=60)
        assert proc.returncode == 2, proc.stderr
        errors = [l for l in proc.stderr.splitlines() if l.startswith("fourd-mpi: error:")]
        assert len(errors) == 3 and len(set(errors)) == 1 and message in errors[0], proc.stderr
        assert not (tmp_path / "x.yaml").exists()
