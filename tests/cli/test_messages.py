"""The command line's unclear messages, reworded and pinned: encoding errors and Ctrl-C handled once for the whole
command line; empty values and paths refused; repeated sweep values refused; ``trace check`` sees a ``/steps`` time
that disagrees with the per-rank maximum; ``--help``/``--version`` print with a lone launcher rank variable;
``sweep render --out ""`` and ``results list --grid 1x1x`` are refused in one line.

Each test names what the command said before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest
from conftest import REPO, caught_signals, mpi_env

from fourd_mpi.cli.main import main

SAMPLES = REPO / "results" / "samples"
TRACE = SAMPLES / "weak-1.h5"
SPEC = REPO / "jobscripts" / "weak-gpt-tiny.yaml"


def fourd(*args, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or mpi_env(), cwd=cwd or REPO)


def one_error(argv, capfd, status=2) -> str:
    assert main([str(a) for a in argv]) == status
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    return lines[0]


def one_error_besides_warnings(argv, capfd) -> str:
    """The one error line of ``main(argv)`` (status 2), warning lines aside."""
    assert main(argv) == 2
    err = capfd.readouterr().err
    lines = [l for l in err.strip().splitlines() if "warning" not in l]
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_symbolic_link_loop_is_named_as_one(tmp_path, capfd):
    """Before: "no such file or directory" (analyze), "not a readable HDF5 file (truncated or corrupted?)
    ... errno = 40" (trace show), "loop is a file, not a directory" (run --results-dir)."""
    loop = tmp_path / "loop"
    os.symlink("loop", loop)
    assert main(["analyze", str(loop)]) == 2
    err = capfd.readouterr().err
    assert f"skipped {loop}: a symbolic link in a loop (too many levels of symbolic links)" in err, err
    line = one_error(["trace", "show", loop], capfd)
    assert line == f"fourd-mpi: error: {loop} is a symbolic link in a loop (too many levels of symbolic links), " \
                   "not a trace file"
    proc = fourd("run", "--steps", "2", "--results-dir", loop, "--display", "quiet")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"fourd-mpi: error: cannot create the results directory {loop}: {loop} is a symbolic link in a loop (too many "
        "levels of symbolic links), not a directory (give --results-dir a directory)"), proc.stderr


def test_a_short_wait_is_said_with_its_digits():
    """Before: "rank 1 waited 0 s in ..., longer than --step-timeout 0.001 s"."""
    from fourd_mpi.core.watchdog import seconds_text

    assert seconds_text(0.00105) == "0.00105 s" and seconds_text(2.5) == "2.5 s" and seconds_text(42.4) == "42 s"


def test_a_fraction_option_names_itself(capfd):
    """Before: "argument --alpha: invalid _fraction value: 'x'"."""
    for value in ("x", "2"):
        line = one_error(["compare", TRACE, "--baseline", TRACE, "--alpha", value], capfd)
        assert line == (f"fourd-mpi: error: argument --alpha: expected a number between 0 and 1 (both excluded), e.g. "
                        f"0.05, got '{value}' (see fourd-mpi compare --help)")


def test_unit_run_help_and_message_agree():
    """Before: the help said 4 runs per side, the message 'fewer than 3 runs on a side'. Now both say the
    number the test itself uses: the fewest runs whose exact Mann-Whitney p can fall below alpha."""
    from fourd_mpi.analysis.compare import Settings, min_runs
    from fourd_mpi.cli.args import walk_parsers
    from fourd_mpi.cli.main import build_parser

    parser = dict(walk_parsers(build_parser()))[("compare",)]
    text = next(a.help for a in parser._actions if "--unit" in a.option_strings)
    assert min_runs(0.05) == 4 and "at least 4 runs (at --alpha 0.05" in text
    said = Settings(threshold=0.05, alpha=0.05, confidence=0.95, resamples=100, seed=0, unit="auto").statistics_text()
    assert f"at least {min_runs(0.05)} runs" in said


def test_a_directory_that_is_not_a_sweep_says_so(tmp_path, capfd):
    """Before: "no rendered sweep in d (No such file or directory)" for an existing directory."""
    line = one_error(["sweep", "status", tmp_path], capfd)
    assert line == (f"fourd-mpi: error: {tmp_path} is a directory but not a rendered sweep "
                    "(it holds no manifest.json): "
                    "give the directory 'fourd-mpi sweep render' wrote (results/SWEEP/SITE/jobs or its --out)")


def test_spaces_in_a_value_are_echoed_as_given(capfd):
    """Before: three spaces were echoed as ' ' (the error line collapsed every run of whitespace)."""
    line = one_error(["tune", "--ranks", "8", "--model", "   "], capfd)
    assert "got '   '" in line


@pytest.mark.parametrize("option", ["--config", "--inject-fault", "--results-dir", "--run-id", "--label", "--model"])
def test_an_empty_value_is_refused(option, capfd):
    """Before: --config "" and --inject-fault '' were silently ignored; --results-dir "" said "cannot create the
    results directory : No such file or directory" (after MPI started)."""
    line = one_error(["run", option, ""], capfd)
    assert line == (f"fourd-mpi: error: argument {option}: expected a value, got '' (leave the option out for its "
                    "default) (see fourd-mpi run --help)")


def test_a_baseline_of_another_grid_says_why_hidden_is_missing(capfd):
    """Before: hidden_pct '-' without a word."""
    base, other = SAMPLES / "grid-1x1x2x4.h5", SAMPLES / "grid-1x2x2x2-overlap.h5"
    assert main(["analyze", str(base), str(other), "--what", "comm", "--baseline", str(base)]) == 0
    err = capfd.readouterr().err
    assert err.strip() == (f"fourd-mpi: note: {other} is model gpt-tiny on grid 1x2x2x2, "
                           f"the --baseline {base} is model "
                           "gpt-tiny on grid 1x1x2x4: its hidden_pct is '-' (the baseline must be a run of the same "
                           "model and grid without overlap)")


def test_a_non_ascii_path_on_an_ascii_terminal(tmp_path):
    """Before: PYTHONIOENCODING=ascii fourd-mpi trace show of a non-ASCII path: UnicodeEncodeError."""
    path = tmp_path / "tr\u00e9.h5"
    shutil.copy(TRACE, path)
    proc = fourd("trace", "show", path, env=dict(mpi_env(), PYTHONIOENCODING="ascii"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "tr\\xe9.h5: schema v" in proc.stdout




def _handlers_installed(proc, timeout: float = 60) -> bool:
    """Wait until the project's handlers are in place: the child catches SIGTERM, which ``fourd_mpi.cli``
    installs just after its SIGINT handler (Python itself catches SIGINT from before its site imports, so
    SIGINT's bit says nothing; before this point, Ctrl-C is the interpreter's own start-up, where no code of
    this project has run). False if the child ended first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):
            return True
        assert time.monotonic() < deadline, "the child never installed its SIGINT handler"
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("moment", range(8))
def test_ctrl_c_at_any_moment_is_one_line(tmp_path, moment):
    """Before: Ctrl-C while 'trace recover' imported printed a KeyboardInterrupt traceback. Then: with a fixed
    delay after start, a fast machine sent it before Python's own handler was in place (rc -2, no output).
    Now the signal goes once the child catches SIGINT, then ``moment`` further waits of 5 ms each (a spread
    over the imports and the command; the child may also end first)."""
    spool = tmp_path / "run.ranks"
    spool.mkdir()
    (spool / "run.json").write_text('{"run_id": "run", "world_size": 1}')
    proc = subprocess.Popen([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool), "-o",
                             str(tmp_path / "t.h5")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(), cwd=REPO)
    if _handlers_installed(proc):
        for _ in range(moment):
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 1, err
    if proc.returncode == 130:
        assert "interrupted (Ctrl-C)" in err
    else:  # it ended before the signal came
        assert proc.returncode in (0, 1, 2), (proc.returncode, err)


def test_repeated_sweep_values_are_refused(tmp_path, capfd):
    """Before: a value given twice ran the same configuration twice, without a word."""
    text = SPEC.read_text()
    spec = tmp_path / "dup.yaml"
    spec.write_text(text.replace("overlap: [none]", 'overlap: [none, all, "none"]'))
    line = one_error(["sweep", "plan", spec], capfd)
    assert line.endswith("matrix.overlap[2]: 'none' repeats item 0 of the list: give each value once (repeats: N "
                         "runs every configuration N times)"), line
    spec.write_text(text.replace("8: [1x2x2x2]", "8: [1x2x2x2, 1x2x2x2]"))
    assert "grids.8[1]: '1x2x2x2' repeats item 0" in one_error(["sweep", "plan", spec], capfd)


def test_trace_check_sees_a_step_time_that_is_not_the_per_rank_maximum(tmp_path, capfd):
    """Before: trace check passed it, and trace show printed the stored (wrong) time."""
    path = tmp_path / "t.h5"
    shutil.copy(TRACE, path)
    with h5py.File(path, "r+") as h5:
        steps = h5["steps"][()]
        right = float(steps["seconds"][1])
        steps["seconds"][1] *= 3
        h5["steps"][...] = steps
    assert main(["trace", "check", str(path)]) == 1
    out = capfd.readouterr().out
    assert f"violation: step 1: /steps says {3 * right:.9g} s, the max over ranks of the step spans is" in out, out
    assert main(["trace", "show", str(path)]) == 0
    out = capfd.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert f"{right:.4f}" in row and "(/steps says" in row, row


@pytest.mark.parametrize("env", [{"PMI_RANK": "3"}, {"SLURM_PROCID": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "1"}])
@pytest.mark.parametrize("flag, words", [("--version", "fourd-mpi "), ("--help", "usage: fourd-mpi")])
def test_help_and_version_print_with_a_lone_rank_variable(env, flag, words, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0 and words in capsys.readouterr().out


def test_help_prints_once_per_launch(monkeypatch, capsys):
    # before MPI starts (as a launched command): an initialized MPI in this pytest process would decide instead
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == ""


def test_an_empty_out_is_refused(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    line = one_error_besides_warnings(["sweep", "render", str(REPO / "jobscripts" / "weak-gpt-tiny.yaml"), "--out", ""],
                                      capfd)
    assert "argument --out: expected a value, got ''" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--grid", "1x1x"], ["grid=2x4"]])
def test_a_malformed_grid_filter_is_a_format_error(argv, tmp_path, monkeypatch, capfd):
    import shutil

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    shutil.copy(REPO / "results" / "samples" / "weak-1.h5", tmp_path / "a")
    assert main(["results", "reindex", "a"]) == 0
    capfd.readouterr()
    line = one_error_besides_warnings(["results", "list", "--index", "a", *argv], capfd)
    assert "is not four positive sizes G_data x G_z x G_y x G_x" in line




@pytest.mark.parametrize("grid, words", [
    ("9x9x9x9", "--explain 9x9x9x9: 6,561 ranks, not the --ranks 1,024 compared (G_data*G_z*G_y*G_x must equal "
                "--ranks)"),
    ("1024x1x1x1", "--explain 1024x1x1x1: G_data*G_z = 1,024 does not divide --batch 1,000"),
])
def test_compare_axonn_explain_is_a_grid_of_the_run(grid, words, capfd):
    line = one_error_besides_warnings(["model", "compare-axonn", "--batch", "1000", "--explain", grid], capfd)
    assert words in line


@pytest.mark.parametrize("argv", [
    ["export", "perfetto", "t.h5", "-o", ""], ["results", "list", "--index", ""], ["compare", "a", "--baseline", ""],
    ["tune", "--ranks", "8", "--profile", ""], ["analyze", ""], ["trace", "recover", "x", "-o", ""],
    ["model", "predict", "--config", ""], ["sweep", "plan", "s.yaml", "--results-dir", ""],
    ["bench", "collectives", "--report", ""], ["tune", "--ranks", "8", "--emit-sweep", ""]])
def test_an_empty_path_is_refused_by_every_command(argv, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_besides_warnings(argv, capfd)
    assert "expected a value, got ''" in line
    assert list(tmp_path.iterdir()) == []
