"""The H100 cluster on 400 Gb/s RoCE: a built-in profile on dgx-h100's node with Llama 3's fabric,
its inter-node time by hand."""

import pytest

from fourd_mpi.perf.machine import builtin_profiles, load_profile


def test_roce_profile_is_built_in_and_cites_its_fabric():
    assert "h100-roce" in builtin_profiles()
    prof = load_profile("h100-roce")
    assert prof.ranks_per_node == 8 and prof.peak_tflops("bfloat16") == 989.0 and prof.peak_tflops("float8") == 1979.0
    assert "RoCE" in prof.data["levels"]["inter"]["description"]
    assert "allgather" in prof.data["levels"]["inter"]  # the base's fits, merged key by key
    assert "2407.21783" in open(prof.path).read()


def test_inter_node_all_gather_by_hand():
    # 16 ranks across 16 nodes, the 8 ranks of a node each in another group (ip = 8): latency 9 us x 16 and 15/16 S
    # at 8 x 50 GB/s x 0.9 = 360 GB/s per node shared by min(ip, 8) = 8 groups: 45 GB/s each
    prof = load_profile("h100-roce")
    S = 64 * 2 ** 20
    expected = 16 * 9e-6 + 15 / 16 * S / 45e9
    assert prof.network_time("allgather", 16, S, 8, "inter", 8) == pytest.approx(expected, rel=1e-12)
    # a ring all-reduce: both latencies, twice the wire bytes
    assert prof.network_time("allreduce", 16, S, 8, "inter", 8) == pytest.approx(
        2 * 16 * 9e-6 + 2 * 15 / 16 * S / 45e9, rel=1e-12)
