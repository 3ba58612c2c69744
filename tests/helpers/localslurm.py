"""A one-node Slurm on localhost for tests (docs/design.md section 5): Debian's slurmctld/slurmd, no munge.

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

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "srun")


def missing_programs():
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _first_job_id() -> int:
    """A random first job id: MPICH names its shared-memory segment after the PMI job (``mpich_shm_<world id>_<node>``,
    the world id from the job id under ``srun --mpi=pmi2``), so two Slurm instances on one machine that both run
    their job 2 at once attach to one segment and both hang. Distinct job ids keep them apart."""
    import random

    return random.SystemRandom().randrange(1000, 60_000_000)


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
        r = self.root
        self.conf.write_text(f"""ClusterName=fourdtest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
FirstJobId={_first_job_id()}
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
NodeName={host} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")

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
