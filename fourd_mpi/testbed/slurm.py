"""A real multi-node Slurm on a test bed (Debian's slurmctld/slurmd 22.05, no munge, no systemd).

``slurmctld`` runs in the root namespace at the bed's bridge address
(``SlurmctldHost=<this host>(<bridge address>)``); one ``slurmd -D -N NODE`` runs in each node's
namespaces (network, UTS, mount: :func:`fourd_mpi.testbed.bed.node_argv`), declared
``NodeName=NODE NodeAddr=<its address>``, with per-node spool, pid and log files (``%n``). All files live
in the bed's directory; the daemons are recorded in the bed's state (PID and start time) and carry the bed's
id in their environment (``FOURD_TESTBED_ID``), so ``testbed down`` stops them and no other process. The
configuration is that of DESIGN section 5 (``auth/none``, ``proctrack/linuxproc``, ``task/none``,
``MpiDefault=pmi2``); ``srun --mpi=pmi2`` starts the ``mpich`` wheel's ranks.

:func:`slurm_conf` writes the same configuration for any list of nodes; the one-node Slurm of the
tests (``tests/helpers/localslurm.py``) uses it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.testbed import bed

PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "srun")
SLURMD_PORT = 6818


class DaemonEnded(ConfigError):
    """A Slurm daemon this command started ended (or lost the bed's mark) before every node was idle; the message
    names it, how it ended and its own last output."""


def missing_programs() -> List[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(root: str, cluster: str, ctld_host: str, nodes: Sequence[Tuple[str, str]], cpus: int,
               ctld_port: int, slurmd_port: int, ctld_addr: str = "", first_job_id: int = 0) -> str:
    """The text of a slurm.conf for ``nodes`` (``(name, address)``; address ``""``: none) with every file
    under ``root``; per-node files carry ``%n`` when there is more than one node; ``first_job_id`` > 0
    sets ``FirstJobId`` (see :func:`random_first_job_id`)."""
    per = ".%n" if len(nodes) > 1 else ""
    spool = f"{root}/spool/%n" if len(nodes) > 1 else f"{root}/spool"
    host = f"{ctld_host}({ctld_addr})" if ctld_addr else ctld_host
    lines = [f"ClusterName={cluster}", f"SlurmctldHost={host}", f"SlurmctldPort={ctld_port}",
             f"SlurmdPort={slurmd_port}", "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root",
             "SlurmdUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
             "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=pmi2",
             "SlurmdParameters=config_overrides", "ReturnToService=2", "MinJobAge=3600",
             *([f"FirstJobId={first_job_id}"] if first_job_id > 0 else []), "JobCompType=jobcomp/none",
             "AccountingStorageType=accounting_storage/none", f"StateSaveLocation={root}/state",
             f"SlurmdSpoolDir={spool}", f"SlurmctldPidFile={root}/slurmctld.pid",
             f"SlurmdPidFile={root}/slurmd{per}.pid",
             f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd{per}.log"]
    for name, addr in nodes:
        lines.append(f"NodeName={name}" + (f" NodeAddr={addr}" if addr else "") + f" CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(n for n, _ in nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def random_first_job_id() -> int:
    """A random first job id: MPICH names its shared-memory segment after the PMI job (``mpich_shm_<world id>_<node>``,
    the world id from the job id under ``srun --mpi=pmi2``), so two Slurm instances on one machine that both run
    their job 2 at once attach to one segment and both hang. Distinct job ids keep them apart."""
    import random

    return random.SystemRandom().randrange(1000, 60_000_000)


def slurm_dir(state: dict) -> str:
    return os.path.join(bed.run_dir(state["name"]), "slurm")


def conf_path(state: dict) -> str:
    return os.path.join(slurm_dir(state), "slurm.conf")


def env(state: dict) -> dict:
    return {**os.environ, "SLURM_CONF": conf_path(state)}


def sinfo_states(state: dict) -> List[str]:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env(state), capture_output=True, text=True,
                          timeout=30)
    return done.stdout.split("\n") if done.returncode == 0 else []


def running(state: dict) -> bool:
    """The bed's Slurm daemons are alive and every node is idle, mixed or allocated."""
    daemons = state.get("daemons", [])
    if not daemons or not all(bed.daemon_is_ours(state, d) for d in daemons):
        return False
    nodes = [line.split() for line in sinfo_states(state) if line.strip()]
    return len(nodes) == len(state["nodes"]) and all(w[1].rstrip("*") in ("idle", "mixed", "allocated")
                                                         for w in nodes)


#: the longest path a Unix socket can have (``sun_path`` holds 108 bytes with the terminating NUL)
SOCKET_PATH_MAX = 107


def longest_socket_path(state: dict) -> str:
    """The longest path of the sockets slurmstepd makes for a job step in a node's spool directory,
    ``SPOOL/NODE_JOBID.STEPID`` (job and step ids up to 10 digits each)."""
    spool = os.path.join(slurm_dir(state), "spool")
    return max((os.path.join(spool, n.name, f"{n.name}_{'9' * 10}.{'9' * 10}") for n in bed.nodes_of(state)), key=len)


def start(state: dict, cpus: int = 4, timeout: float = 60) -> bool:
    """Start slurmctld and one slurmd per node (idempotent: False when they already run); wait until
    every node is idle. A one-line :class:`ConfigError` with the daemons' last log lines otherwise."""
    missing = missing_programs()
    if missing:
        raise ConfigError(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld "
                          f"slurmd slurm-client")
    socket_path = longest_socket_path(state)
    if len(socket_path) > SOCKET_PATH_MAX:  # slurmstepd could not start a job step: jobs held for ever
        raise ConfigError(f"--slurm: the bed's directory {bed.run_dir(state['name'])} is too long for Slurm: a job "
                          f"step's socket would be {socket_path} ({len(socket_path)} characters, at most "
                          f"{SOCKET_PATH_MAX}): set FOURD_TESTBED_STATE to a shorter directory, or use shorter "
                          f"node names")
    if running(state):
        return False
    if state.get("daemons"):
        raise ConfigError(f"the Slurm of test bed {state['name']} is half up: fourd-mpi testbed down --name "
                          f"{state['name']}, then up again")
    root = slurm_dir(state)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    nodes = bed.nodes_of(state)
    for node in nodes:
        os.makedirs(os.path.join(root, "spool", node.name), exist_ok=True)
    with open(conf_path(state), "w") as fh:
        fh.write(slurm_conf(root, f"fourd{state['name']}", socket.gethostname().split(".")[0],
                            [(n.name, n.addr) for n in nodes], cpus, free_port(), SLURMD_PORT,
                            ctld_addr=state["bridge_addr"], first_job_id=random_first_job_id()))
    state["slurm"] = {"conf": conf_path(state), "cpus": cpus}
    state.setdefault("daemons", [])
    daemon_env = {**env(state), bed.ID_ENV: state["id"]}  # the mark down checks before it signals a daemon
    commands = [("slurmctld", ["slurmctld", "-D", "-f", conf_path(state)])]
    commands += [(f"slurmd.{n.name}", bed.node_argv(state, n.name, ["slurmd", "-D", "-N", n.name, "-f",
                                                                      conf_path(state)])) for n in nodes]
    started = []
    for label, argv in commands:
        log = open(os.path.join(root, f"{label}.out"), "w")
        proc = subprocess.Popen(argv, env=daemon_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # outlives the command that started it
        log.close()
        record = bed.daemon_record(proc.pid)
        state["daemons"].append(record)
        started.append((label, proc, record))
        bed.save_state(state)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for label, proc, record in started:
            if proc.poll() is not None or not bed.daemon_is_ours(state, record):
                raise DaemonEnded(f"{label} of test bed {state['name']} {ended(proc)}: {daemon_output(root, label)}")
        if running(state):
            return True
        time.sleep(0.5)
    raise ConfigError(f"the Slurm of test bed {state['name']} is not idle after {timeout:.0f} s: "
                      f"{last_log_line(state)}")


def ended(proc: subprocess.Popen) -> str:
    """How a daemon this command started ended: its exit status or signal; or, still running, that it no longer
    carries the bed's mark (PID, start time and environment: :func:`~fourd_mpi.testbed.bed.daemon_is_ours`)."""
    code = proc.poll()
    if code is None:
        return f"(PID {proc.pid}) runs without the bed's mark"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _is_error(line: str) -> bool:
    """An error-looking log line, less the one Debian's Slurm 22.05 logs at every start where libpmix is not
    installed (it loads every MPI plugin; the bed uses pmi2): quoted, it reads like the cause of any failure."""
    return ("error" in line.lower() or "fatal" in line.lower()) and "for mpi/pmix" not in line


def _last_line(path: str, pick=None) -> Optional[str]:
    """The last non-empty line of ``path`` (that ``pick`` accepts), stripped; None where there is none or no file."""
    with contextlib.suppress(OSError), open(path, errors="replace") as fh:
        lines = [ln.strip() for ln in fh if ln.strip() and (pick is None or pick(ln))]
        return lines[-1] if lines else None
    return None


def daemon_output(root: str, label: str) -> str:
    """The last line of a daemon's own output (``LABEL.out``: the namespace wrapper's and the daemon's) and the
    last error of its log (``LABEL.log``), for the one-line message."""
    found = [f"{label}{suffix}: {line}" for suffix, pick in ((".out", None), (".log", _is_error))
             if (line := _last_line(os.path.join(root, label + suffix), pick)) is not None]
    return "; ".join(found) or f"no output in {root}/{label}.out"


def last_log_line(state: dict) -> str:
    """The last error-looking line of the daemons' logs (for the one-line message)."""
    root = slurm_dir(state)
    names = sorted(n for n in os.listdir(root) if n.endswith((".out", ".log"))) if os.path.isdir(root) else []
    found = [f"{name}: {line}" for name in names if (line := _last_line(os.path.join(root, name), _is_error))]
    return "; ".join(found[-2:]) or f"no error in the logs under {root}"
