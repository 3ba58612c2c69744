"""Bad input: every rank exits non-zero with the same one-line message, within seconds."""

import pytest
from conftest import mpi_flavor, rank_stderr

pytestmark = pytest.mark.mpi

CASES = [
    (["--gx", "2", "--gy", "2", "--gz", "2", "--gdata", "2"], "product 16 but the world size is 8"),
    (["--gx", "3"], "does not divide the world size 8"),
    (["--gx", "8", "--hidden", "60", "--heads", "4"], "hidden size 60 is not divisible by 8"),
    (["--gy", "4", "--gx", "2", "--heads", "6", "--hidden", "48"], "head count 6 is not divisible by 4"),
    (["--gdata", "8", "--batch", "4"], "global batch 4 is not divisible by 8"),
    (["--gz", "8", "--hidden", "2", "--heads", "1", "--ffn-hidden", "2"], "not divisible by G_z = 8"),
    (["--model", "gpt-6b"], "unknown model preset 'gpt-6b'"),
    (["--model", "gpt-5b"], "needs the global batch"),
    (["--hidden", "0"], "--hidden: expected a positive integer, got 0"),
    (["--batch", "-8"], "--batch: expected a positive integer, got -8"),
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--overlap", "oag,prefetch"], "unknown overlap 'prefetch'"),
    (["--progress", "async"], "--progress: invalid choice: 'async'"),
    # accepted before (losses nan, or every step a warm-up, trace "complete")
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
    (["--steps", "2", "--warmup", "2"], "--warmup 2 leaves no measured step of --steps 2"),
    (["--step-timeout", "-1"], "--step-timeout must be zero (off) or a positive number of seconds, got -1.0"),
    # accepted silently before
    (["--overlap", "oag", "--gz", "2", "--prefetch-depth", "100"], "--prefetch-depth 100 reaches beyond the model: "
     "gpt-tiny has 8 weight layers (2 blocks x 4), so at most 7 can be fetched ahead"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[c[1][:40] for c in CASES])
def test_every_rank_reports_the_same_line(run_mpi, args, message):
    proc = run_mpi(8, ["run", *args], timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in rank_stderr(proc.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("fourd-mpi: error: ")]
    if mpi_flavor() == "openmpi":
        # Open MPI ends the job at the first non-zero exit: a rank still starting then gets its SIGTERM and says
        # so in its one line; every rank that got as far as the check reports the same line
        errors = [line for line in errors if line != "fourd-mpi: error: interrupted (SIGTERM)"]
        assert 1 <= len(errors) <= 8, proc.stderr
    else:
        assert len(errors) == 8, proc.stderr
    assert len(set(errors)) == 1, proc.stderr
    assert message in errors[0], errors[0]
    assert proc.stdout.strip() == ""


def test_a_results_dir_that_is_a_file_is_named(run_mpi, tmp_path):
    """Before: "cannot create the results directory ...: File exists" (or "Not a directory")."""
    (tmp_path / "afile").write_text("")
    for target in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        proc = run_mpi(2, ["run", "--results-dir", target, "--steps", "2", "--display", "quiet"], timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.count(f"{tmp_path / 'afile'} is a file, not a directory (give --results-dir a "
                                 "directory)") == 2, proc.stderr


def test_verify_rejects_a_grid_of_the_wrong_size(run_mpi):
    proc = run_mpi(4, ["verify", "--grid", "1x2x2x2"], timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("grid 1x2x2x2 has 8 ranks but the world size is 4") == 4


def test_a_config_alias_bomb_fails_on_every_rank_at_once(run_mpi, tmp_path):
    """A few hundred bytes of nested YAML aliases (9^6 values) end in one line per rank, not a hang."""
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for prev, name in zip("abcde", "bcdef"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines + ["steps: *f"]) + "\n")
    proc = run_mpi(4, ["run", "--config", bomb], timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "alias bomb" in line]
    assert len(errors) == 4, proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("command, left, right, option", [
    ("run", ["--steps", "3"], ["--steps", "4"], "--steps"),            # hung forever before
    ("run", ["--model", "gpt-tiny"], ["--model", "mlp-tiny"], "--model"),
    ("run", ["--seed", "0"], ["--seed", "1"], "--seed"),                # went undetected before
    ("run", ["--trace-level", "op"], ["--trace-level", "step"], "--trace-level"),
    ("verify", ["--steps", "2"], ["--steps", "3"], "--steps"),
    ("bench", ["--iters", "2"], ["--iters", "3"], "--iters"),
])
def test_ranks_started_with_different_arguments_fail_at_once(tmp_path, command, left, right, option):
    """MPMD launch with a different option on half the ranks: the same one-line error on every
    rank (bench: on rank 0 only), naming the option and which ranks have which value, before any other collective."""
    import subprocess
    import sys

    from conftest import REPO, find_mpiexec, mpi_env

    base = {"run": ["run", "--gx", "2", "--gy", "2", "--results-dir", str(tmp_path), "--display", "quiet"],
            "verify": ["verify", "--gx", "2", "--gy", "2"],
            "bench": ["bench", "collectives", "--max-size", "64", "-o", str(tmp_path / "p.yaml")]}[command]
    half = [sys.executable, "-m", "fourd_mpi", *base]
    cmd = [find_mpiexec(), "-n", "2", *half, *left, ":", "-n", "2", *half, *right]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error:")]
    # bench prints its errors on rank 0 only; the others on every rank
    assert len(errors) == (1 if command == "bench" else 4) and len(set(errors)) == 1, proc.stderr
    assert f"different arguments: {option} is" in errors[0] and "on ranks 0-1" in errors[0] \
        and "on ranks 2-3" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*.h5"))
