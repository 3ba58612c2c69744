"""``FOURD_CI_HOGS=N bash .ci/run``: the test stage with N CPU hogs beside it.

The hogs (``.ci/hogs.sh``) are busy loops pinned to no core; ``stop_hogs`` ends them, ``.ci/run`` calls
it after the tests and on any exit (trap), and a hog ends by itself when the shell that started it is
killed without running its trap. A value that is not a number of hogs stops ``.ci/run`` with one line
before anything runs.
"""

import os
import re
import signal
import subprocess
import time

import pytest
from conftest import REPO


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_until(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize("value", ["two", "-1", "65", "2.5", " 2"])
def test_a_bad_number_of_hogs_is_one_line_before_anything_runs(tmp_path, value):
    env = {**os.environ, "FOURD_CI_HOGS": value}
    proc = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"FOURD_CI_HOGS={value}: expected a number of CPU hogs from 0 (the default: "
                                   "none) to 64")
    assert "==" not in proc.stdout  # stopped before the first step


def test_hogs_burn_cpu_and_end_with_stop_hogs_or_with_their_shell():
    start = "source .ci/hogs.sh && start_hogs 2 && "
    # stop_hogs: both end, and it says so
    proc = subprocess.run(["bash", "-c", start + "stop_hogs && stop_hogs && echo left ${#HOG_PIDS[@]}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pids = [int(p) for p in re.search(r"pids ([\d ]+)\)", lines[0]).group(1).split()]
    assert len(pids) == 2 and lines[0].startswith("started 2 CPU hog(s) (busy loops, pinned to no core; ")
    assert lines[1].startswith(f"stopped 2 CPU hog(s) (pids {pids[0]} {pids[1]}); load average ")
    assert lines[2:] == ["left 0"]  # a second stop_hogs has nothing to stop and says nothing
    assert not any(_alive(p) for p in pids)
    # a shell killed with SIGKILL runs no trap: its hogs notice that their parent is gone and end
    shell = subprocess.Popen(["bash", "-c", start + "exec sleep 600"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(p) for p in re.search(r"pids ([\d ]+)\)", shell.stdout.readline()).group(1).split()]
        _wait_until(lambda: all(_cpu_ticks(p) > 0 for p in pids), "the hogs used no CPU")
        assert all(_alive(p) for p in pids)
    finally:
        shell.send_signal(signal.SIGKILL)
        shell.wait()
    _wait_until(lambda: not any(_alive(p) for p in pids), f"hogs {pids} outlived their killed shell")


def test_ci_starts_the_hogs_right_before_the_tests_and_stops_them_on_any_exit():
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert "trap stop_hogs EXIT" in lines
    tests = next(i for i, line in enumerate(lines) if line.endswith(".venv/bin/python -m pytest -q"))
    assert lines[tests - 2:tests] == ['start_hogs "$HOGS"', "SECONDS_BEFORE_TESTS=$SECONDS"]
    assert "stop_hogs" in lines[tests + 1:tests + 3]
