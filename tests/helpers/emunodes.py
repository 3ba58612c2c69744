"""Emulated nodes on one machine for the cross-node tests (docs/placement.md section 4).

A small stand-in for the issue-29 test bed: one Linux network namespace per node (``h2n1``,
``h2n2``, ...), each with a veth link onto one bridge (``h2br``) and an address ``10.77.0.K/24``
(the bridge holds ``10.77.0.254``), and the ``mpich`` wheel's launcher starting ranks in them:

    mpiexec -launcher ssh -launcher-exec tests/helpers/netns_shim.sh -iface h2br \\
            -hosts h2n1,h2n2 -ppn 4 -n 8 CMD

The shim runs ``ip netns exec NODE unshare --uts sh -c "hostname NODE; CMD"``, so each node has its
own host name. Ranks of one node share memory (MPICH's shared-memory transport); across nodes
``UCX_TLS=tcp,self`` makes UCX use TCP over the veth links (without it UCX finds the other
namespaces' ranks on this machine and uses its own shared memory).

Only addresses on the bridge this module creates are used. ``down`` removes the namespaces, the
links and the bridge and kills the processes left in the namespaces (by PID, all started here).

Command line (as root)::

    python tests/helpers/emunodes.py up 2            # 2 nodes (idempotent: a leftover bed is torn down first)
    python tests/helpers/emunodes.py status
    python tests/helpers/emunodes.py run 2 4 -- fourd-mpi verify --all-grids   # up, launch 2 x 4 ranks, down
    python tests/helpers/emunodes.py down
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

PREFIX = os.environ.get("FOURD_EMU_PREFIX", "h2n")
BRIDGE = os.environ.get("FOURD_EMU_BRIDGE", "h2br")
SUBNET = os.environ.get("FOURD_EMU_SUBNET", "10.77.0")
SHIM = Path(__file__).with_name("netns_shim.sh")
MAX_NODES = 16


def unavailable_reason() -> Optional[str]:
    """Why emulated nodes cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated nodes need the {tool!r} program"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class EmulatedNodes:
    """A bed of emulated nodes named ``PREFIX1..PREFIXn`` on bridge ``bridge`` with addresses ``SUBNET.k/24``
    (the bridge ``SUBNET.254``). Two beds with different prefixes, bridges and subnets coexist."""

    def __init__(self, prefix: str = PREFIX, bridge: str = BRIDGE, subnet: str = SUBNET):
        self.prefix, self.bridge, self.subnet = prefix, bridge, subnet

    def node_names(self, n: int) -> List[str]:
        return [f"{self.prefix}{k}" for k in range(1, n + 1)]

    def existing_nodes(self) -> List[str]:
        out = _ip("netns", "list", check=False).stdout.split("\n")
        names = [line.split()[0] for line in out if line.strip()]
        p = self.prefix
        return sorted((n for n in names if n.startswith(p) and n[len(p):].isdigit()), key=lambda n: int(n[len(p):]))

    def link(self, node: str) -> str:
        """The host-side end of ``node``'s link (its byte counters: /sys/class/net/LINK/statistics)."""
        return f"{node}h"

    def down(self) -> None:
        """Kill what runs in our namespaces, delete them, their links and the bridge (idempotent)."""
        for name in self.existing_nodes():
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "delete", name, check=False)
            _ip("link", "delete", self.link(name), check=False)
        _ip("link", "delete", self.bridge, check=False)

    def up(self, n: int) -> List[str]:
        """Make ``n`` emulated nodes (tearing down a leftover bed first); returns their names."""
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"emulated nodes: {n} nodes asked, 1 to {MAX_NODES} possible")
        self.down()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        names = self.node_names(n)
        try:
            for k, name in enumerate(names, start=1):
                _ip("netns", "add", name)
                _ip("link", "add", self.link(name), "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", self.link(name), "master", self.bridge)
                _ip("link", "set", self.link(name), "up")
                _ip("-n", name, "addr", "add", f"{self.subnet}.{k}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except Exception:
            self.down()
            raise
        return names

    def status(self) -> str:
        nodes = self.existing_nodes()
        if not nodes:
            return "no emulated nodes"
        return f"{len(nodes)} emulated node(s): {', '.join(nodes)} on bridge {self.bridge} ({self.subnet}.0/24)"

    def link_bytes(self, node: str) -> int:
        """Bytes sent plus received on ``node``'s link so far."""
        base = Path("/sys/class/net") / self.link(node) / "statistics"
        return sum(int((base / f).read_text()) for f in ("rx_bytes", "tx_bytes"))

    def mpiexec_prefix(self, mpiexec: str, nodes: int, ppn: int) -> List[str]:
        """The launcher words that put ``ppn`` consecutive ranks on each of ``nodes`` emulated nodes."""
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(SHIM), "-iface", self.bridge,
                "-hosts", ",".join(self.node_names(nodes)), "-ppn", str(ppn), "-n", str(nodes * ppn)]

    @contextlib.contextmanager
    def running(self, n: int) -> Iterator[List[str]]:
        """``with bed.running(2) as names:`` the bed is up inside and always torn down after."""
        try:
            yield self.up(n)
        finally:
            self.down()


DEFAULT = EmulatedNodes()
node_names, existing_nodes, down, up, status = (DEFAULT.node_names, DEFAULT.existing_nodes, DEFAULT.down, DEFAULT.up,
                                                DEFAULT.status)
mpiexec_prefix, emulated_nodes = DEFAULT.mpiexec_prefix, DEFAULT.running


def environment(base: Optional[dict] = None) -> dict:
    """The environment for a cross-node launch: UCX over TCP between namespaces."""
    env = dict(os.environ if base is None else base)
    env["UCX_TLS"] = "tcp,self"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def main(argv: List[str]) -> int:
    usage = "usage: emunodes.py up N | down | status | run NODES PPN -- CMD ..."
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"emunodes: {reason}", file=sys.stderr)
        return 2
    what = argv[0]
    try:
        if what == "up" and len(argv) == 2:
            print(status() if up(int(argv[1])) else "")
            return 0
        if what == "down" and len(argv) == 1:
            down()
            return 0
        if what == "status" and len(argv) == 1:
            print(status())
            return 0
        if what == "run" and len(argv) > 4 and argv[3] == "--":
            nodes, ppn = int(argv[1]), int(argv[2])

            def stop(signum, frame):  # a killed run still tears the bed down (the finally of emulated_nodes)
                raise KeyboardInterrupt

            signal.signal(signal.SIGTERM, stop)
            mpiexec = str(Path(sys.executable).parent / "mpiexec")
            with emulated_nodes(nodes):
                return subprocess.run(mpiexec_prefix(mpiexec, nodes, ppn) + argv[4:], env=environment()).returncode
    except ValueError as exc:
        print(f"emunodes: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emunodes: interrupted; the emulated nodes are torn down", file=sys.stderr)
        return 130
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
