"""Emulated nodes on one machine: a network namespace per node, veth pairs on a bridge, ``tbf`` links.

A bed is named (``--name``, letters and digits, at most 10): its bridge is ``NAME-br``, its host-side
veth ends ``NAME-v1 ... NAME-vN``, its nodes (namespace = host name = Slurm node name) ``NAME-n1 ...``
unless named explicitly, and its /24 subnet ``10.A.B.0/24`` is derived from the name and moved on
until it overlaps no address or route of this machine and no other bed. So two beds (two tests, two
sessions) never collide.

Everything a bed creates is written to its state file (``/run/fourd-testbed/NAME/state.json``)
*before* it is created, so :func:`down` removes all of it even after ``up`` or a test was killed
half-way; ``down --all`` (the CI-start check) removes every bed in the state directory.

Each node's link is shaped in both directions with ``tc qdisc ... tbf rate R burst B latency L`` (on the
host-side veth for traffic into the node, on the node's ``eth0`` for traffic out of it). ``netem`` is
not available on our machines: rate, burst and queue only, no delay emulation.

Processes reach a node through :data:`SHIM`, written into the bed's directory at ``up``: hydra's ssh
launcher calls it as ``SHIM [-x] HOST COMMAND...``; it runs COMMAND in HOST's network namespace with
its own UTS namespace (``hostname HOST``, so ``MPI_Get_processor_name`` and the suite's node detection
see distinct nodes) and its own mount namespace with a private tmpfs on ``/dev/shm`` (a real node's
``/dev/shm`` is its own: MPICH's shared-memory segments of one node are invisible to the others and
vanish with the node's last process). It execs, so the environment and the exit status pass through.
``nsenter --net`` rather than ``ip netns exec``: the latter remounts ``/sys`` and hides
``/sys/fs/cgroup``, which ``slurmd`` needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError

#: where beds keep their state, shim and Slurm files (one directory per bed)
STATE_ROOT = os.environ.get("FOURD_TESTBED_STATE", "/run/fourd-testbed")
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]{0,9}")
NODE_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,30}")
#: the most nodes one bed makes (addresses .1 to .N of its /24; every node is a namespace and two veths)
MAX_NODES = 32
DEFAULT_NAME = "fourd"
DEFAULT_RATE = "200mbit"
#: tbf's queue: a packet waits at most this long before it is dropped
LATENCY_MS = 50
#: what a cross-node MPI run needs in its environment: without it UCX finds the other "nodes" on the same
#: machine and silently uses its own shared-memory transports, so nothing crosses the shaped links
UCX_ENV = {"UCX_TLS": "tcp,self"}
PROGRAMS = ("ip", "tc", "nsenter", "unshare")

_RATE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?i?(?:bit|bps))?", re.I)
_RATE_FACTOR = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
                "ti": 2 ** 40}
_SIZE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmg]?i?b?)", re.I)
RATE_FORMS = "a number and a unit as tc(8) writes it: bit kbit mbit gbit tbit (SI), kibit mibit gibit (IEC), " \
             "bps kbps mbps gbps (bytes per second), e.g. 200mbit, 1gbit, 25mbps; or none (unshaped)"


def parse_rate(text: str) -> Optional[int]:
    """Bits per second of a tc(8) rate (``200mbit``, ``1gbit``, ``25mbps`` = 25 MB/s, ``100kibit``), or
    None for ``none`` (an unshaped link); a one-line :class:`ConfigError` otherwise."""
    text = str(text).strip()
    if text.lower() in ("none", "unshaped"):
        return None
    match = _RATE.fullmatch(text)
    if not match or not match.group("unit"):
        raise ConfigError(f"link rate {text!r} does not parse: use {RATE_FORMS}")
    unit = match.group("unit").lower()
    per_byte = unit.endswith("bps")
    prefix = unit[:-3]
    bits = float(match.group("num")) * _RATE_FACTOR[prefix] * (8 if per_byte else 1)
    if not 8000 <= bits <= 100e9:
        raise ConfigError(f"link rate {text!r} = {bits:.0f} bit/s: give 8kbit to 100gbit")
    return int(bits)


def parse_size(text: str) -> int:
    """Bytes of a size (``64kb`` = ``64k`` = ``64kib`` = 65536 as tc reads it, ``1mb``, ``4000``)."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ConfigError(f"burst {text!r} does not parse: give bytes, or a number with k, kb, m or mb "
                          f"(1024-based, as tc reads them), e.g. 64kb")
    unit = match.group("unit").lower().rstrip("b").rstrip("i")
    value = int(float(match.group("num")) * {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}[unit])
    if not 2048 <= value <= 2 ** 31:
        raise ConfigError(f"burst {text!r} = {value} bytes: give 2kb to 2gb")
    return value


def default_burst(bits: int) -> int:
    """10 ms of the rate, at least 64 KiB (tbf needs at least rate/HZ and one packet)."""
    return max(64 * 1024, bits // 8 // 100)


def rate_text(bits: Optional[int]) -> str:
    if bits is None:
        return "unshaped"
    for factor, unit in ((1e9, "gbit"), (1e6, "mbit"), (1e3, "kbit")):
        if bits >= factor:
            return f"{bits / factor:g}{unit}"
    return f"{bits}bit"


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace and host name, address, host-side veth, link shape."""

    name: str
    addr: str
    veth: str
    rate_bits: Optional[int]
    burst_bytes: Optional[int]


@dataclass(frozen=True)
class BedSpec:
    """What ``up`` makes: a named bed of nodes with their link shapes (addresses are chosen at ``up``)."""

    name: str
    nodes: Tuple[str, ...]
    rates: Tuple[Optional[int], ...]
    bursts: Tuple[Optional[int], ...]

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"


def make_spec(name: str = DEFAULT_NAME, nodes: int = 2, node_names: Optional[str] = None,
              rate: str = DEFAULT_RATE, burst: Optional[str] = None) -> BedSpec:
    """A validated :class:`BedSpec`; ``rate`` and ``burst`` are one value or one per node, comma-separated."""
    if not NAME_PATTERN.fullmatch(name or ""):
        raise ConfigError(f"bed name {name!r}: use a lowercase letter then up to 9 lowercase letters or digits "
                          f"(it prefixes interface names, which Linux limits to 15 characters)")
    if node_names:
        names = tuple(n.strip() for n in node_names.split(","))
        if nodes not in (None, len(names)):
            raise ConfigError(f"--nodes {nodes} but {len(names)} node names ({node_names})")
    else:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"--nodes {nodes!r}: give 1 to {MAX_NODES}")
        names = tuple(f"{name}-n{i}" for i in range(1, nodes + 1))
    if len(names) > MAX_NODES:
        raise ConfigError(f"{len(names)} nodes asked, a bed makes at most {MAX_NODES} (a /24 subnet, a namespace "
                          f"and a veth pair each, all on this machine's cores)")
    for node in names:
        if not NODE_PATTERN.fullmatch(node):
            raise ConfigError(f"node name {node!r}: use a lowercase letter then up to 30 lowercase letters, digits "
                              f"or '-' (it is a namespace, a host name and a Slurm node name)")
    seen = set()
    for node in names:
        if node in seen:
            raise ConfigError(f"node name {node!r} is given twice: node names must be distinct")
        seen.add(node)

    def per_node(text, parse, what):
        values = [v for v in str(text).split(",")]
        if len(values) not in (1, len(names)):
            raise ConfigError(f"{what} {text!r}: give one value or one per node ({len(names)})")
        parsed = tuple(parse(v) for v in values)
        return parsed * len(names) if len(parsed) == 1 else parsed

    rates = per_node(rate, parse_rate, "--rate")
    if burst is None:
        bursts = tuple(None if r is None else default_burst(r) for r in rates)
    else:
        bursts = tuple(None if r is None else b for r, b in zip(rates, per_node(burst, parse_size, "--burst")))
    return BedSpec(name, names, rates, bursts)


# -- the machine ---------------------------------------------------------------------------------

def why_unavailable() -> str:
    """Why this machine cannot host a bed (one line), or ``""`` when it can."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "the test bed needs Linux network namespaces (/proc/self/ns is missing)"
    if os.geteuid() != 0:
        return "the test bed makes network namespaces, a bridge and veth links: run it as root (not root here)"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"the test bed needs {', '.join(missing)} on PATH (iproute2 for ip and tc, util-linux for "
                f"nsenter and unshare)")
    return ""


def require_machine() -> None:
    why = why_unavailable()
    if why:
        raise ConfigError(why)


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise ConfigError(f"{' '.join(argv)} failed: {' '.join(done.stderr.split()) or done.returncode}")
    return done


def _netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/var/run/netns", name))


def _link_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/sys/class/net", name))


def _networks_in_use() -> List[ipaddress.IPv4Network]:
    out = []
    for line in _sh(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        match = re.search(r"\binet (\S+)", line)
        if match:
            out.append(ipaddress.ip_interface(match.group(1)).network)
    for line in _sh(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole") and len(line.split()) > 1:
            word = line.split()[1]
        with contextlib.suppress(ValueError):
            if word != "default":
                out.append(ipaddress.ip_network(word, strict=False))
    return out


def choose_subnet(name: str, taken: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """``10.A.B.0/24`` from the name's hash (A in 64..127), moved on past every network in ``taken``."""
    digest = hashlib.sha256(name.encode()).digest()
    start = (digest[0] % 64) * 256 + digest[1]
    for step in range(64 * 256):
        k = (start + step) % (64 * 256)
        net = ipaddress.ip_network(f"10.{64 + k // 256}.{k % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise ConfigError("no free /24 in 10.64.0.0/10 for a test bed: every one overlaps an address or route")


# -- state ---------------------------------------------------------------------------------------

def bed_dir(name: str) -> str:
    return os.path.join(STATE_ROOT, name)


def state_path(name: str) -> str:
    return os.path.join(bed_dir(name), "state.json")


def shim_path(name: str) -> str:
    return os.path.join(bed_dir(name), "shim")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One ``up``/``down`` at a time on this machine (subnets and names are chosen under the lock)."""
    os.makedirs(STATE_ROOT, exist_ok=True)
    with open(os.path.join(STATE_ROOT, ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def load_state(name: str) -> Optional[dict]:
    try:
        with open(state_path(name)) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except ValueError:  # killed while writing: down still removes what the name derives
        return {"name": name, "broken": True, "created": []}


def save_state(state: dict) -> None:
    os.makedirs(bed_dir(state["name"]), exist_ok=True)
    tmp = state_path(state["name"]) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, state_path(state["name"]))


def list_beds() -> List[str]:
    if not os.path.isdir(STATE_ROOT):
        return []
    return sorted(d for d in os.listdir(STATE_ROOT) if os.path.isfile(state_path(d)) or
                  (NAME_PATTERN.fullmatch(d) and os.path.isdir(bed_dir(d))))


def nodes_of(state: dict) -> List[Node]:
    return [Node(**n) for n in state.get("nodes", [])]


# -- up / down / status --------------------------------------------------------------------------

def _same(state: dict, spec: BedSpec) -> bool:
    return state.get("spec") == json.loads(json.dumps(asdict(spec)))


def up(spec: BedSpec) -> Tuple[dict, bool]:
    """Make the bed (or find it made): ``(state, created)``. Idempotent: a bed already up with the same
    settings is left as it is (``created`` False); one with other settings is refused; a half-made
    one (a killed ``up``) is removed and made again."""
    require_machine()
    with _locked():
        state = load_state(spec.name)
        if state is not None:
            if _same(state, spec) and not health(state):
                return state, False
            if _same(state, spec) or state.get("broken") or not state.get("complete"):
                _down_locked(spec.name)
            else:
                raise ConfigError(f"test bed {spec.name} is up with other settings ({describe(state)}): "
                                  f"fourd-mpi testbed down --name {spec.name} first, or choose another --name")
        _check_clashes(spec)
        subnet = choose_subnet(spec.name, _networks_in_use() + _other_subnets(spec.name))
        hosts = list(subnet.hosts())
        nodes = [Node(node, str(hosts[i]), f"{spec.name}-v{i + 1}", spec.rates[i], spec.bursts[i])
                 for i, node in enumerate(spec.nodes)]
        state = {"name": spec.name, "spec": json.loads(json.dumps(asdict(spec))), "subnet": str(subnet),
                 "bridge": spec.bridge, "bridge_addr": str(hosts[253]), "nodes": [asdict(n) for n in nodes],
                 "created": [], "complete": False, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            _make(state, nodes, subnet)
        except BaseException:
            _down_locked(spec.name)
            raise
        return state, True


def _record(state: dict, kind: str, name: str) -> None:
    state["created"].append([kind, name])
    save_state(state)


def _make(state: dict, nodes: List[Node], subnet: ipaddress.IPv4Network) -> None:
    save_state(state)
    br = state["bridge"]
    _record(state, "link", br)
    _sh(["ip", "link", "add", br, "type", "bridge"])
    _sh(["ip", "addr", "add", f"{state['bridge_addr']}/{subnet.prefixlen}", "dev", br])
    _sh(["ip", "link", "set", br, "up"])
    for node in nodes:
        _record(state, "netns", node.name)
        _sh(["ip", "netns", "add", node.name])
        _record(state, "link", node.veth)
        _sh(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.name])
        _sh(["ip", "link", "set", node.veth, "master", br, "up"])
        _sh(["ip", "-n", node.name, "addr", "add", f"{node.addr}/{subnet.prefixlen}", "dev", "eth0"])
        _sh(["ip", "-n", node.name, "link", "set", "eth0", "up"])
        _sh(["ip", "-n", node.name, "link", "set", "lo", "up"])
        if node.rate_bits is not None:
            shape = ["root", "tbf", "rate", f"{node.rate_bits}bit", "burst", str(node.burst_bytes),
                     "latency", f"{LATENCY_MS}ms"]
            _sh(["tc", "qdisc", "replace", "dev", node.veth, *shape])
            _sh(["tc", "-n", node.name, "qdisc", "replace", "dev", "eth0", *shape])
    write_shim(state)
    state["complete"] = True
    save_state(state)


def _check_clashes(spec: BedSpec) -> None:
    mine = set(spec.nodes)
    for other in list_beds():
        if other == spec.name:
            continue
        st = load_state(other) or {}
        clash = mine & {n["name"] for n in st.get("nodes", [])}
        if clash:
            raise ConfigError(f"node name {sorted(clash)[0]!r} clashes with a node of test bed {other}: "
                              f"choose other node names or another --name")
    for node in spec.nodes:
        if _netns_exists(node):
            raise ConfigError(f"node name {node!r} clashes with an existing network namespace of this machine "
                              f"(ip netns list): choose other node names or another --name")
    for link in [spec.bridge] + [f"{spec.name}-v{i + 1}" for i in range(len(spec.nodes))]:
        if _link_exists(link):
            raise ConfigError(f"link {link!r} of test bed {spec.name} already exists on this machine and is not "
                              f"the bed's: choose another --name")


def _other_subnets(name: str) -> List[ipaddress.IPv4Network]:
    out = []
    for other in list_beds():
        st = load_state(other) or {}
        if other != name and st.get("subnet"):
            out.append(ipaddress.ip_network(st["subnet"]))
    return out


def health(state: dict) -> List[str]:
    """What is missing from a bed that says it is up (empty: healthy)."""
    missing = [] if state.get("complete") else ["up did not finish"]
    if not _link_exists(state.get("bridge", "")):
        missing.append(f"bridge {state.get('bridge')}")
    for node in nodes_of(state):
        if not _netns_exists(node.name):
            missing.append(f"namespace {node.name}")
        if not _link_exists(node.veth):
            missing.append(f"link {node.veth}")
    if not os.access(shim_path(state["name"]), os.X_OK):
        missing.append("launcher shim")
    return missing


def down(name: str) -> List[str]:
    """Remove a bed: its processes (Slurm daemons, ranks), namespaces, links and files. What was removed;
    empty when the bed was not up (idempotent)."""
    require_machine()
    with _locked():
        return _down_locked(name)


def down_all() -> Dict[str, List[str]]:
    """Remove every bed of the state directory (the CI-start check for leftovers of a killed run)."""
    require_machine()
    with _locked():
        return {name: _down_locked(name) for name in list_beds()}


def _down_locked(name: str) -> List[str]:
    state = load_state(name)
    if state is None and not os.path.isdir(bed_dir(name)):
        return []
    state = state or {"name": name, "created": []}
    removed = []
    # processes first: a namespace with processes in it outlives its name
    pids = [p for p in state.get("pids", []) if runs_in_bed(p, name)]
    nodes = {kind_name[1] for kind_name in state.get("created", []) if kind_name[0] == "netns"}
    nodes |= {n["name"] for n in state.get("nodes", [])}
    for node in sorted(nodes):
        if _netns_exists(node):
            pids += _netns_pids(node)
    if pids:
        removed.append(f"{len(set(pids))} process(es)")
        _kill(sorted(set(pids)))
    links = [n for kind, n in state.get("created", []) if kind == "link"]
    links += [n["veth"] for n in state.get("nodes", [])] + [f"{name}-br"]
    for link in dict.fromkeys(reversed(links)):
        if _link_exists(link):
            _sh(["ip", "link", "del", link], check=False)
            removed.append(f"link {link}")
    for node in sorted(nodes):
        if _netns_exists(node):
            _sh(["ip", "netns", "del", node], check=False)
            removed.append(f"namespace {node}")
    shutil.rmtree(bed_dir(name), ignore_errors=True)
    return removed


def _netns_pids(node: str) -> List[int]:
    done = _sh(["ip", "netns", "pids", node], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def runs_in_bed(pid: int, name: str) -> bool:
    """Whether a recorded daemon PID still runs a command that names this bed's directory (not a reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return bed_dir(name).encode() in fh.read()
    except OSError:
        return False


def _kill(pids: Sequence[int], grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(pid_alive(p) for p in pids):
            return


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def status(name: str) -> Optional[dict]:
    """The bed's state with ``missing`` (what is gone) and ``counters`` (bytes on each link); None when
    the bed is not up."""
    state = load_state(name)
    if state is None:
        return None
    out = dict(state)
    out["missing"] = health(state) if not state.get("broken") else ["state file unreadable"]
    out["counters"] = link_counters(state)
    return out


def link_counters(state: dict) -> Dict[str, Dict[str, int]]:
    """Bytes on each node's link, from the host-side veth (``rx``: sent by the node, ``tx``: received)."""
    out = {}
    for node in nodes_of(state):
        stats = os.path.join("/sys/class/net", node.veth, "statistics")
        try:
            with open(os.path.join(stats, "rx_bytes")) as rx, open(os.path.join(stats, "tx_bytes")) as tx:
                out[node.name] = {"sent": int(rx.read()), "received": int(tx.read())}
        except OSError:
            continue
    return out


def describe(state: dict) -> str:
    nodes = nodes_of(state)
    rates = sorted({rate_text(n.rate_bits) for n in nodes})
    return (f"{len(nodes)} node(s) {','.join(n.name for n in nodes)} on {state.get('bridge')} "
            f"{state.get('subnet')}, links {'/'.join(rates)}")


# -- running on the nodes ------------------------------------------------------------------------

SHIM = """#!/bin/sh
# fourd-mpi test bed {name}: runs a command on an emulated node, as ssh would on a real one.
# Called by hydra's ssh launcher (mpiexec -launcher ssh -launcher-exec THIS) as: THIS [-x] HOST COMMAND...,
# and by Open MPI's (mpiexec --mca plm_rsh_agent THIS) as: THIS HOST ORTED-COMMAND...
# Leading options (ssh's, without arguments) are dropped; COMMAND is joined and parsed by sh, as ssh does.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1
[ $# -gt 1 ] || {{ echo "fourd-mpi testbed {name} shim: usage: $0 [-x] HOST COMMAND..." >&2; exit 255; }}
shift
case "$host" in
  {case}) ;;
  *) echo "fourd-mpi testbed {name} shim: no node $host in this bed (nodes: {nodes})" >&2; exit 255;;
esac
exec nsenter --net=/var/run/netns/"$host" unshare --uts --mount sh -c \\
  'hostname "$0" && mount -t tmpfs -o mode=1777 fourd-shm /dev/shm && eval "$*"' "$host" "$@"
"""


def write_shim(state: dict) -> str:
    names = [n.name for n in nodes_of(state)]
    path = shim_path(state["name"])
    with open(path + ".tmp", "w") as fh:
        fh.write(SHIM.format(name=state["name"], case="|".join(names), nodes=" ".join(names)))
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
    return path


def node_argv(state: dict, node: str, argv: Sequence[str], shell_exec: bool = True) -> List[str]:
    """``argv`` run on ``node`` (in its namespaces, as the shim does), for daemons: execs, so the PID is
    the program's."""
    if node not in {n.name for n in nodes_of(state)}:
        raise ConfigError(f"no node {node!r} in test bed {state['name']}")
    script = 'hostname "$0" && mount -t tmpfs -o mode=1777 fourd-shm /dev/shm && exec ' + shlex.join(argv)
    return ["nsenter", f"--net=/var/run/netns/{node}", "unshare", "--uts", "--mount", "sh", "-c", script, node]


def require_up(name: str) -> dict:
    require_machine()
    state = load_state(name)
    if state is None:
        raise ConfigError(f"test bed {name} is not up: fourd-mpi testbed up --name {name} --nodes N first")
    missing = health(state)
    if missing:
        raise ConfigError(f"test bed {name} is damaged ({', '.join(missing)}): fourd-mpi testbed down --name "
                          f"{name}, then up again")
    return state


#: how ranks are dealt to nodes: ``block`` (consecutive ranks on one node, as schedulers place them by
#: default) or ``cyclic`` (rank i on node i mod nodes: the innermost grid axis crosses nodes)
ORDERS = ("block", "cyclic")


def mpiexec_argv(state: dict, ranks: int, ppn: Optional[int] = None, mpiexec: str = "mpiexec",
                 order: str = "block", flavor: str = "mpich") -> List[str]:
    """``mpiexec`` launching ``ranks`` ranks, ``ppn`` per node, on the bed's first ``ceil(ranks / ppn)`` nodes,
    in :data:`ORDERS` ``order``; run it with :data:`UCX_ENV` in the environment. ``ppn`` defaults to spreading
    the ranks evenly over all nodes. ``flavor`` (:func:`fourd_mpi.core.launcher.flavor`):

    - ``mpich`` (Hydra, the ``mpich`` wheel): ``-launcher ssh -launcher-exec SHIM -iface BRIDGE -hosts n1,n2
      -ppn R`` (``-ppn 1``: cyclic);
    - ``openmpi``: ``--mca plm_rsh_agent SHIM`` (its ``orted`` is started through the shim, the node name its
      first argument; no tree spawn: the nodes' daemons all from mpirun), ``--host n1:R,n2:R`` (R slots each)
      with ``--map-by slot`` (block) or ``--map-by node`` (cyclic), TCP and the daemons' wire-up on the bed's
      subnet (``btl_tcp_if_include`` / ``oob_tcp_if_include``: the other interfaces of this machine are not
      reachable from the nodes), ``--allow-run-as-root`` (a bed needs root) and ``--bind-to none`` (a node's
      ranks share the machine's cores)."""
    if order not in ORDERS:
        raise ConfigError(f"rank order {order!r}: choose one of {', '.join(ORDERS)}")
    nodes = nodes_of(state)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"-n {ranks!r}: give a positive number of ranks")
    if ppn is None:
        ppn = -(-ranks // len(nodes))
    if ppn < 1:
        raise ConfigError(f"--ppn {ppn}: give a positive number of ranks per node")
    if ranks > ppn * len(nodes):
        raise ConfigError(f"{ranks} ranks at {ppn} per node need {-(-ranks // ppn)} nodes; test bed "
                          f"{state['name']} has {len(nodes)} (it holds {ppn * len(nodes)} ranks at {ppn} per node)")
    hosts = [n.name for n in nodes[: -(-ranks // ppn)]]
    if flavor == "openmpi":
        subnet = state["subnet"]
        return [mpiexec, "--allow-run-as-root", "--mca", "plm_rsh_agent", shim_path(state["name"]),
                "--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "btl_tcp_if_include", subnet,
                "--mca", "oob_tcp_if_include", subnet, "--host", ",".join(f"{h}:{ppn}" for h in hosts),
                "--map-by", "slot" if order == "block" else "node", "--bind-to", "none", "-n", str(ranks)]
    return [mpiexec, "-launcher", "ssh", "-launcher-exec", shim_path(state["name"]), "-iface", state["bridge"],
            "-hosts", ",".join(hosts), "-ppn", str(ppn if order == "block" else 1), "-n", str(ranks)]


# -- leftovers of a killed run --------------------------------------------------------------------

#: the shared-memory segments of MPICH (``mpich_shm_*``), Open MPI 4's vader BTL (``vader_segment.*``) and
#: Open MPI 5's sm BTL (``sm_segment.*``); a tuple for ``str.startswith``
SHM_DIR, SHM_PREFIX = "/dev/shm", ("mpich_shm_", "vader_segment.", "sm_segment.")


def stale_shm_segments(min_age_s: float = 60.0) -> List[str]:
    """MPI segments (:data:`SHM_PREFIX`) in this machine's ``/dev/shm`` that no process maps or holds open, older
    than ``min_age_s`` (a run killed outside a bed leaves them; a bed's nodes have their own ``/dev/shm``)."""
    try:
        names = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    except OSError:
        return []
    now = time.time()
    old = []
    for path in names:
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > min_age_s:
                old.append(path)
    if not old:
        return []
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as fh:
                held.update(line.split(None, 5)[-1].strip().removesuffix(" (deleted)") for line in fh
                            if SHM_DIR in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return [p for p in old if p not in held]


def clean_leftovers() -> List[str]:
    """The CI-start check: take down every bed of the state directory and remove stale MPI segments.
    Lines saying what was removed (nothing on a clean machine). Run without the package's dependencies:
    ``python3 -c 'import sys; sys.path.insert(0, "."); from fourd_mpi.testbed.bed import clean_leftovers;
    print(*clean_leftovers(), sep="\\n")'``."""
    lines = []
    if not why_unavailable():
        for name, removed in down_all().items():
            lines.append(f"test bed {name}: removed {', '.join(removed) or 'its state'}")
    for path in stale_shm_segments():
        with contextlib.suppress(OSError):
            os.remove(path)
            lines.append(f"removed stale MPI segment {path}")
    return lines
