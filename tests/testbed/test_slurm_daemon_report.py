"""The one line ``testbed up --slurm`` prints when a Slurm daemon it started ends during start-up: which daemon,
how it ended (exit status or signal) and its own last output, not another daemon's log (a CI run once reported
slurmctld's harmless pmix line while a daemon had ended). Real processes, real files; no Slurm needed."""

from __future__ import annotations

import signal
import subprocess
import sys

from fourd_mpi.testbed.slurm import daemon_output, ended


def test_an_exit_status_and_a_signal_are_named():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert ended(proc) == "exited with status 3"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ended(proc) == "was killed by SIGKILL"


def test_a_running_daemon_without_the_mark_is_named():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ended(proc) == f"(PID {proc.pid}) runs without the bed's mark"
    finally:
        proc.kill()
        proc.wait()


def test_the_daemons_own_output_and_last_log_error_are_quoted(tmp_path):
    (tmp_path / "slurmd.b-n1.out").write_text("nsenter: cannot open /var/run/netns/b-n1: No such file or directory\n\n")
    (tmp_path / "slurmd.b-n1.log").write_text("[t] error: first\n[t] info: fine\n[t] fatal: last one\n[t] done\n")
    (tmp_path / "slurmctld.log").write_text("[t] error: MPI: Cannot create context for mpi/pmix_v4\n")
    line = daemon_output(str(tmp_path), "slurmd.b-n1")
    assert line == ("slurmd.b-n1.out: nsenter: cannot open /var/run/netns/b-n1: No such file or directory; "
                    "slurmd.b-n1.log: [t] fatal: last one")
    assert daemon_output(str(tmp_path), "slurmd.b-n2") == f"no output in {tmp_path}/slurmd.b-n2.out"
    (tmp_path / "slurmctld.out").write_text("slurmctld: started\n")
    assert daemon_output(str(tmp_path), "slurmctld") == "slurmctld.out: slurmctld: started"  # the pmix line: no cause
