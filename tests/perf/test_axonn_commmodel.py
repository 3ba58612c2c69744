"""AxoNN's published communication model next to ours (``fourd-mpi model compare-axonn``; pure, no MPI)."""

import math

import pytest

from fourd_mpi.cli.main import main
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.axonn_commmodel import axonn_comm_time, axonn_terms, compare, explain_grid, our_comm_time, our_terms
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.volumes import step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import resolve_model
from fourd_mpi.util.units import GIB


def published_get_bw(ip, group, machine):
    """AxoNN's get_bw as published (examples/comm_model.py, REFERENCES.md section 3), for the check."""
    if machine == "perlmutter":
        if ip == 1:
            return {2: 76, 4: 225}.get(group, 80 if group >= 8 else None)
        if ip == 2:
            return 76 if group == 2 else 40
        return 20
    if ip == 1:
        return {2: 129, 4: 52, 8: 135}.get(group, 40)
    if ip == 2:
        return {2: 50, 4: 72}.get(group, 20)
    if ip == 4:
        return 36 if group == 2 else 10
    return 5


@pytest.mark.parametrize("machine", ["perlmutter", "frontier"])
def test_profile_placement_table_is_axonns_get_bw(machine):
    profile = load_profile(machine)
    powers = [2 ** i for i in range(11)]
    for ip in powers:
        for group in powers[1:]:
            assert profile.placement_gbs(ip, group) == published_get_bw(ip, group, machine), (ip, group)


# [computed] in REFERENCES.md section 3: the published code run unchanged, D x Z x Y x X
AXONN_TOP8 = {
    1024: ["1x1024x1x1", "2x512x1x1", "4x256x1x1", "8x128x1x1", "16x64x1x1", "1x128x2x4", "2x64x2x4", "4x32x2x4"],
    2048: ["1x1024x1x1", "2x512x1x1", "4x256x1x1", "8x128x1x1", "16x64x1x1", "1x512x2x1", "1x256x4x1", "2x128x4x1"],
}
# our step's volumes (perf/volumes.py, no overlap, bf16) costed with the same table
OURS_TOP8 = {
    1024: ["16x8x8x1", "16x8x2x4", "8x16x8x1", "4x32x8x1", "8x16x2x4", "2x64x8x1", "1x128x8x1", "4x32x2x4"],
    2048: ["16x8x8x1", "1x1024x1x1", "2x512x1x1", "4x256x1x1", "8x16x8x1", "16x8x2x4", "8x128x1x1", "4x32x8x1"],
}


@pytest.mark.parametrize("batch", [1024, 2048])
def test_rankings_gpt80b_1024_gpus(batch):
    cfg = resolve_model("gpt-80b", batch=batch, seq=2048)
    comp = compare(cfg, 1024, 64, load_profile("perlmutter").placement_gbs)
    assert [str(g) for g, _ in comp.axonn[:8]] == AXONN_TOP8[batch]
    assert [str(g) for g, _ in comp.ours[:8]] == OURS_TOP8[batch]
    # 230 candidates; 35 put more than 32 on Y, which our step cannot run (96 heads split whole over Y)
    assert len(comp.axonn) == 230 and len(comp.dropped) == 35
    assert all(g.y > 32 for g, _ in comp.dropped)


def test_axonn_terms_by_hand_and_explained_for_1x128x2x4():
    cfg = resolve_model("gpt-80b", batch=1024, seq=2048)
    g = GridShape(1, 128, 2, 4)
    H, L, m = 12288, 42, 1024 // 128 * 2048
    ax = axonn_terms(cfg, g)
    # depth of QKV: 3 (G_z-1)/G_z * K H^2/(G_x G_y) * 2 B, K = 3
    assert ax[("qkv", "z")] == pytest.approx(3 * 127 / 128 * 3 * H * H / 8 * 2 * L / GIB)
    # FC2 (transposed, K = 4): AxoNN's Y term 4 (G_y-1)/G_y * m K H/G_x, X term 2 (G_x-1)/G_x * m H/G_y
    assert ax[("fc2", "y")] == pytest.approx(4 * 1 / 2 * m * 4 * H / 4 * 2 * L / GIB)
    assert ax[("fc2", "x")] == pytest.approx(2 * 3 / 4 * m * H / 2 * 2 * L / GIB)
    rows = {r["term"]: r for r in explain_grid(cfg, g, load_profile("perlmutter").placement_gbs)}
    # depth and backward all-reduces agree; forward all-reduces are half of AxoNN's (run once, not twice);
    # FC2: AxoNN's K on the wrong all-reduce (ours: forward m H/G_x over Y, backward m K H/G_y over X)
    expected = {"qkv z": 1.0, "qkv y": 1.0, "qkv x": 0.5, "proj y": 0.5, "proj x": 1.0, "fc1 x": 0.5,
                "fc2 y": 0.125, "fc2 x": 4.0, "fc2 z": 1.0}
    for term, ratio in expected.items():
        assert rows[term]["ratio"] == pytest.approx(ratio), term
    assert "full recompute" in rows["fc1 x"]["why"] and "m*K*H/G_y" in rows["fc2 x"]["why"]
    assert rows["ln_allreduce x"]["axonn_gib"] == 0 and rows["ln_allreduce x"]["ours_gib"] > 0
    # our side of the table is exactly the step's wire bytes
    total = sum(c.wire_bytes for c in step_collectives(cfg, g, OverlapConfig(), "bfloat16")) / GIB
    assert sum(r["ours_gib"] for r in rows.values()) == pytest.approx(total)
    # the times are the table's: volume / get_bw(ip, group); X (ip 1, group 4) at 225, Y (ip 4) and Z at 20
    assert rows["fc2 x"]["gbs"] == 225 and rows["fc2 y"]["gbs"] == 20 and rows["qkv z"]["gbs"] == 20
    bw = load_profile("perlmutter").placement_gbs
    assert our_comm_time(cfg, g, bw) == pytest.approx(sum(r["ours_s"] for r in rows.values()))
    assert axonn_comm_time(cfg, g, bw) == pytest.approx(sum(r["axonn_s"] for r in rows.values()))


def test_data_term_and_cache():
    cfg = resolve_model("gpt-80b", batch=1024, seq=2048)
    g = GridShape(16, 8, 8, 1)
    ax, ours = axonn_terms(cfg, g), our_terms(cfg, g)
    # AxoNN: 4 (p-1)/p at 2 bytes (= fp32 gradients); ours: the ring all-reduce 2 (p-1)/p in bf16
    assert ours[("qkv", "data", "grad_allreduce")] == pytest.approx(ax[("qkv", "data")] / 2, rel=1e-6)
    cached = our_terms(cfg, g, cache=True)
    z = sum(v for (k, a, _), v in ours.items() if a == "z" and k == "qkv")
    zc = sum(v for (k, a, _), v in cached.items() if a == "z" and k == "qkv")
    assert zc == pytest.approx(z * 2 / 3)  # two passes (forward gather, dW reduce-scatter) instead of three


def test_no_table_leaves_a_grid_out():
    cfg = resolve_model("gpt-80b", batch=1024, seq=2048)
    assert axonn_comm_time(cfg, GridShape(1, 128, 2, 4), lambda ip, group: None) is None
    assert math.isfinite(axonn_comm_time(cfg, GridShape(1, 1024, 1, 1), lambda ip, group: 10.0))


def test_compare_axonn_cli(capfd):
    assert main(["model", "compare-axonn", "--batch", "2048", "--top", "8", "--explain", "16x8x8x1"]) == 0
    out = capfd.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 7]
    assert [row[1] for row in lines] == AXONN_TOP8[2048]
    assert [row[3] for row in lines] == OURS_TOP8[2048]
    assert "grid 16x8x8x1" in out and "volume[GiB] / get_bw(ip, group)" in out
    assert main(["model", "compare-axonn", "--profile", "laptop"]) == 2
    assert "no network.placement_gbs" in capfd.readouterr().err
