"""``-v`` / ``-q`` and the ``fourd_mpi`` loggers (``util/log.py``): ``-q`` removes the info lines, ``-v`` adds the
debug lines, errors print whatever the verbosity; under MPI rank 0 alone says what is not a warning; ``run``
prints a short header by default, the full configuration with ``--show-config`` or ``-v``, results only with
``-q`` (the trace keeps the whole configuration in every case)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.trace.read import load_trace
from fourd_mpi.util.log import level_of

SAMPLE = REPO / "results" / "samples" / "grid-1x1x2x4.h5"


def fourd(*args):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=mpi_env(), cwd=REPO)


def test_levels_by_verbosity_and_rank():
    assert [level_of(v) for v in (-2, -1, 0, 1, 2)] == [logging.WARNING] * 2 + [logging.INFO] + [logging.DEBUG] * 2
    # the other ranks: one step quieter (a job of many ranks says an info line once)
    assert [level_of(v, first_rank=False) for v in (-1, 0, 1, 2)] == [logging.WARNING, logging.WARNING, logging.INFO,
                                                                       logging.DEBUG]


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_removes_info_verbose_adds_debug_errors_print_regardless(tmp_path, where):
    out = tmp_path / "runs.md"

    def analyze(flag, target):
        flags = [flag] if flag else []
        args = ["analyze", SAMPLE, "--what", "runs", "--format", "markdown", "-o", target]
        return fourd(*(flags + args if where == "before" else args + flags))

    plain = analyze(None, out)
    assert plain.returncode == 0 and plain.stderr == f"wrote {out} (markdown: 1 table(s))\n", plain.stderr
    quiet = analyze("-q", tmp_path / "q.md")
    assert quiet.returncode == 0 and quiet.stderr == "" and (tmp_path / "q.md").read_text() == out.read_text()
    loud = analyze("-v", tmp_path / "v.md")
    debug = [line for line in loud.stderr.splitlines() if line.startswith("fourd-mpi: debug: ")]
    assert loud.returncode == 0 and debug and "command: " in debug[0], loud.stderr
    assert f"wrote {tmp_path / 'v.md'}" in loud.stderr
    for flag in ("-q", "-qq", "-v"):  # an error: its one line whatever the verbosity
        bad = analyze(flag, tmp_path / "none" / "x.md")
        errors = [line for line in bad.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
        assert bad.returncode == 2 and len(errors) == 1, bad.stderr


@pytest.mark.mpi
def test_run_header_short_full_or_none(run_mpi, tmp_path):
    base = ["run", "--gx", "2", "--steps", "2", "--results-dir", tmp_path, "--display", "lines"]
    default = run_mpi(2, base + ["--run-id", "d"], timeout=120)
    assert default.returncode == 0, default.stderr
    head = default.stdout.split("  step ")[0].splitlines()
    assert 4 <= len(head) <= 5 and head[0].startswith("fourd-mpi ") and "on grid 1x1x1x2" in head[0], head
    assert head[-1].startswith(f"output: {tmp_path / 'd.h5'}") and "--show-config" in head[-1]
    assert "resolved configuration" not in default.stdout and "fourd-mpi: debug:" not in default.stderr
    assert default.stdout.splitlines()[-1] == f"trace: {tmp_path / 'd.h5'}"

    quiet = run_mpi(2, base + ["--run-id", "q", "-q"], timeout=120)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert quiet.stdout.startswith("step time: median ") and "  step " not in quiet.stdout  # the results only

    loud = run_mpi(2, ["-v"] + base + ["--run-id", "v"], timeout=120)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout.startswith("resolved configuration (reusable as --config FILE.toml):\n")
    assert "  axis " in loud.stdout and "activations between blocks" in loud.stdout  # the full header
    debug = [line for line in loud.stderr.splitlines() if line.startswith("fourd-mpi: debug: ")]
    assert sum("built the run" in line for line in debug) == 1, loud.stderr  # rank 0 only: -vv for every rank

    for run_id in "dqv":  # the trace stores the whole configuration whatever was printed
        config = load_trace(str(tmp_path / f"{run_id}.h5"), events=False).metadata["config"]
        assert config["gx"] == 2 and config["steps"] == 2 and config["model"] and "poll-flops" in config
