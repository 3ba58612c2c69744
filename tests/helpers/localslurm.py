"""A one-node Slurm on localhost for tests (docs/design.md section 5): Debian's slurmctld/slurmd, no munge.

The configuration is the test bed's (:func:`fourd_mpi.testbed.slurm.slurm_conf`) with one node, this
host; the multi-node Slurm of the test bed (``fourd-mpi testbed up --slurm``) uses the same writer.

The daemons run in the foreground (-D) as children of the test, with state, spool, logs
and pid files in a temporary directory and free ports, so they never touch a system
Slurm. :meth:`LocalSlurm.stop` kills them by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fourd_mpi.testbed.slurm import free_port, random_first_job_id, slurm_conf

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "srun")


def missing_programs():
    return [name for name in DAEMONS if shutil.which(name) is None]


class LocalSlurm:
    def __init__(self, root: Path, cpus: int = 8):
        self.root = Path(root)
        self.cpus = cpus
        self.conf = self.root / "slurm.conf"
        self.procs = []

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(slurm_conf(str(self.root), "fourdtest", host, [(host, "")], self.cpus, free_port(),
                                        free_port(), first_job_id=random_first_job_id()))

    def start(self, timeout: float = 60) -> None:
        self.write_conf()
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.root / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.conf)], env=self.env,
                                               stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {self.logs()}")
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"local Slurm not idle after {timeout} s: {self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text()[-2000:])
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
