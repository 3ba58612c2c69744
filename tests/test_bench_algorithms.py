"""bench/algorithms.py (``python -m bench.algorithms``): the cases it checks and skips (no MPI), and one small
alternating run under mpiexec.

A benchmark, not a timed test: these check what it runs and what it reports, never a time.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.algorithms.registry import ALGORITHMS


def bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bench.algorithms", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


def test_dry_run_lists_every_case_or_why_it_is_skipped():
    proc = bench("--dry-run", "--best-grid", "1x2x2x2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "best4d grid 1x2x2x2: given (--best-grid)" in out
    assert "case megatron1d: --algorithm megatron1d  -> grid 1x1x8x1" in out
    assert "case fsdp: --algorithm fsdp  -> grid 1x8x1x1" in out and "case dp: --algorithm dp  -> grid 8x1x1x1" in out
    for case, algorithm in (("optimus3d", "optimus3d"), ("pipeline2", "pipeline"), ("pipeline4", "pipeline")):
        if algorithm not in ALGORITHMS:
            assert f"skipped {case}: algorithm {algorithm} is not registered in this installation yet" in out
        else:
            assert f"case {case}: --algorithm {algorithm}" in out or f"skipped {case}: " in out


def test_a_case_the_run_refuses_is_skipped_with_the_run_s_own_words():
    proc = bench("--dry-run", "--cases", "megatron1d,dp", "--model", "gpt-tiny", "--heads", "3", "--hidden", "48")
    assert proc.returncode == 0, proc.stderr
    assert "skipped megatron1d: model gpt-tiny on grid 1x1x8x1" in proc.stdout and "--heads" in proc.stdout
    assert "case dp: --algorithm dp  -> grid 8x1x1x1" in proc.stdout
    proc = bench("--dry-run", "--cases", "megatron1d", "--model", "gpt-tiny", "--heads", "3", "--hidden", "48")
    assert proc.returncode == 2 and "no case can run: megatron1d: " in proc.stderr
    assert bench("--dry-run", "--cases", "megatron9").returncode == 2


@pytest.mark.mpi
def test_round_robin_launches_and_report(tmp_path):
    out = tmp_path / "bench.json"
    proc = bench("--ranks", 2, "--cases", "megatron1d,fsdp", "--model", "gpt-tiny", "--repeats", 2, "--steps", 2,
                 "--warmup", 1, "--json", out, "--plot", tmp_path / "bench.png", "--out", tmp_path / "traces")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rounds = [line.split()[2] for line in proc.stdout.splitlines() if line.strip().startswith("round ")]
    assert rounds == ["megatron1d", "fsdp", "megatron1d", "fsdp"]  # alternating, one launch each
    data = json.loads(out.read_text())
    by = {r["case"]: r for r in data["results"]}
    assert by["megatron1d"]["grid"] == "1x1x2x1" and by["fsdp"]["grid"] == "1x2x1x1"
    assert all(r["repeats"] == 2 and len(r["repeat_medians_s"]) == 2 for r in by.values())
    assert set(by["fsdp"]["exposed_s"]) >= {"allgather", "reduce_scatter"}
    assert "allgather" not in by["megatron1d"]["exposed_s"]
    assert min(r["vs_best"] for r in by.values()) <= 1.0 <= max(r["vs_best"] for r in by.values())
    assert by["megatron1d"]["activation_bytes"] > 0 and by["fsdp"]["wire_bytes"] > 0
    assert sorted(f for f in os.listdir(tmp_path / "traces") if f.endswith(".h5")) == [
        "fsdp-r0.h5", "fsdp-r1.h5", "megatron1d-r0.h5", "megatron1d-r1.h5"]
    assert (tmp_path / "bench.png").stat().st_size > 0
