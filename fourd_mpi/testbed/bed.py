"""Emulated nodes on one machine: a network namespace per node, veth pairs on a bridge, ``tbf`` links.

A bed is named (``--name``, letters and digits, at most 10): its bridge is ``NAME-br``, its host-side
veth ends ``NAME-v1 ... NAME-vN``, its nodes (namespace = host name = Slurm node name) ``NAME-n1 ...``
unless named explicitly, and its /24 subnet ``10.A.B.0/24`` is derived from the name and moved on
until it overlaps no address or route of this machine and no other bed. So two beds (two tests, two
sessions) never collide.

Everything a bed creates is written to its state file (``/run/fourd-testbed/NAME/state.json``, or under
``$FOURD_TESTBED_STATE``) *before* it is created, and carries a marker right after: the state holds a random
bed id (``up`` draws a new one), bridges and veths have the link alias ``fourd-testbed:<id>``, each namespace
has that alias on its ``lo`` and its file's inode is recorded, and each daemon the bed starts is recorded by
PID and start time and has ``FOURD_TESTBED_ID=<id>`` in its environment. :func:`down` (and ``up``, when it
redoes a half-made bed) removes only what the state records *and* carries the marker, so it removes all of
the bed even after ``up`` or a test was killed half-way, and nothing else: a missing, corrupt or foreign state
removes nothing (one line names what to check), a name taken by an object that is not the bed's is refused
before anything is removed, processes are never picked by their command line, and ``down --all`` (the CI-start
check) acts only on directories holding a valid state of this tool. Bed names follow one rule
(:data:`NAME_RULE`), wherever they come from.

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
import secrets
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.testbed.procs import (  # noqa: F401 (re-exported, as below)
    SHM_DIR,
    SHM_PREFIX,
    _in_netns,
    _kill,
    _netns_members,
    daemon_record,
    pid_alive,
    proc_start,
    stale_shm_segments,
)
from fourd_mpi.testbed.spec import (  # noqa: F401 (re-exported: the command and tests use them from here)
    DEFAULT_NAME,
    LATENCY_MS,
    NAME_PATTERN,
    NAME_RULE,
    NODE_PATTERN,
    PROGRAMS,
    UCX_ENV,
    BedSpec,
    Node,
    check_name,
    default_burst,
    make_spec,
    parse_rate,
    parse_size,
    rate_text,
)
from fourd_mpi.util.files import open_no_follow

#: where beds keep their state, shim and Slurm files (one directory per bed)
STATE_ROOT = os.environ.get("FOURD_TESTBED_STATE", "/run/fourd-testbed")




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


# -- names, markers, state -----------------------------------------------------------------------

#: the one rule for bed names, everywhere (``--name``, ``$FOURD_TESTBED``, the library): it prefixes
#: interface names (Linux: 15 characters) and names the bed's directory under :data:`STATE_ROOT`
#: what every object a bed makes carries: ``fourd-testbed:<bed id>`` (a random id per ``up``, kept in the state)
MARKER_PREFIX = "fourd-testbed:"
#: the state file's format tag: a state without it (or with another) was not written by this tool
STATE_FORMAT = "fourd-testbed/2"
#: a daemon the bed starts has this variable (= the bed id) in its environment: checked before it is signalled
ID_ENV = "FOURD_TESTBED_ID"
_ID = re.compile(r"[0-9a-f]{16}")
_LINK = re.compile(r"[a-z][a-z0-9-]{0,14}")
#: a path hydra can pass on to its proxies and sh can read back unquoted (hydra splits -launcher-exec at spaces)
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9_./+-]*")
NETNS_DIR = "/var/run/netns"


def state_root() -> str:
    root = STATE_ROOT
    if not root or not os.path.isabs(root) or os.path.normpath(root) in ("/", "//"):
        raise ConfigError(f"FOURD_TESTBED_STATE={root!r}: give an absolute directory for the test beds' state "
                          f"(default /run/fourd-testbed), not the file system's root")
    return os.path.normpath(root)


def bed_dir(name: str) -> str:
    return os.path.join(state_root(), check_name(name))


def state_path(name: str) -> str:
    return os.path.join(bed_dir(name), "state.json")


def alias_path(name: str) -> Optional[str]:
    """Where a bed whose directory's path holds spaces or shell characters has a plain symbolic link to it
    (``/run/fourd-testbed-<hash of the directory>``: hydra passes the launcher's path to its proxies unquoted), or
    None when the directory's own path is plain."""
    directory = bed_dir(name)
    if _PLAIN_PATH.fullmatch(directory):
        return None
    base = next((b for b in ("/run", "/tmp") if os.path.isdir(b)), "/tmp")
    return os.path.join(base, "fourd-testbed-" + hashlib.sha256(directory.encode()).hexdigest()[:16])


def run_dir(name: str) -> str:
    """The bed's directory by a plain path (:func:`alias_path` when there is one): the shim and Slurm's files."""
    return alias_path(name) or bed_dir(name)


def shim_path(name: str) -> str:
    return os.path.join(run_dir(name), "shim")


def marker(state: dict) -> str:
    return MARKER_PREFIX + state["id"]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One ``up``/``down`` at a time on this machine (subnets and names are chosen under the lock)."""
    root = state_root()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def state_problem(state, name: str) -> str:
    """Why ``state`` is not a valid state of bed ``name`` written by this tool ("" when it is): the format tag,
    the bed id, the name, and every object name it lists (so nothing it says can point outside the bed)."""
    if not isinstance(state, dict):
        return "not a JSON object"
    if state.get("format") != STATE_FORMAT:
        return f"no {STATE_FORMAT!r} format tag (not written by this version of fourd-mpi testbed)"
    if not isinstance(state.get("id"), str) or not _ID.fullmatch(state["id"]):
        return "no valid bed id"
    if state.get("name") != name:
        return f"it names bed {state.get('name')!r}, not {name!r}"
    created = state.get("created")
    if not isinstance(created, list):
        return "no list of created objects"
    alias = alias_path(name)
    for entry in created:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)
        ok = ok and ((entry[0] == "link" and _LINK.fullmatch(entry[1])) or
                     (entry[0] == "netns" and NODE_PATTERN.fullmatch(entry[1])) or
                     (entry[0] == "alias" and entry[1] == alias))
        if not ok:
            return f"an unknown created object {entry!r}"
    netns = state.get("netns", {})
    if not isinstance(netns, dict) or not all(
            NODE_PATTERN.fullmatch(k) and isinstance(v, list) and len(v) == 2 and all(map(_is_int, v))
            for k, v in netns.items()):
        return "a bad namespace record"
    daemons = state.get("daemons", [])
    if not isinstance(daemons, list) or not all(
            isinstance(d, dict) and _is_int(d.get("pid")) and _is_int(d.get("start")) for d in daemons):
        return "a bad daemon record"
    try:
        nodes = nodes_of(state)
    except (TypeError, ValueError):
        return "a bad node list"
    if not all(NODE_PATTERN.fullmatch(str(n.name)) and _LINK.fullmatch(str(n.veth)) for n in nodes):
        return "a bad node list"
    if not isinstance(state.get("bridge", ""), str) or not _LINK.fullmatch(state.get("bridge") or "x"):
        return "a bad bridge name"
    return ""


def read_state(name: str) -> Tuple[Optional[dict], str]:
    """``(state, "")`` for a valid state; ``(None, "")`` when the bed has no directory (not up); ``(None, why)``
    when its directory holds no valid state (missing, unreadable, not this tool's, another bed's)."""
    directory = bed_dir(name)
    if not os.path.lexists(directory):
        return None, ""
    if os.path.islink(directory) or not os.path.isdir(directory):
        return None, f"{directory} is not a directory"
    try:
        with open(state_path(name)) as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return None, f"no state file in {directory}"
    except (OSError, ValueError) as exc:
        return None, f"state file {state_path(name)} is unreadable ({' '.join(str(exc).split())})"
    why = state_problem(state, name)
    if why:
        return None, f"state file {state_path(name)} is not a valid test bed state: {why}"
    return state, ""


def to_check(name: str, state=None) -> List[str]:
    """What a person should look at when a bed's state cannot be trusted: its directory and what exists under
    the names the bed would use (links and namespaces ``NAME-*``, and node names a parseable state lists)."""
    out = []
    with contextlib.suppress(ConfigError):
        if os.path.lexists(bed_dir(name)):
            out.append(f"directory {bed_dir(name)}")
    with contextlib.suppress(OSError):
        out += [f"link {d}" for d in sorted(os.listdir("/sys/class/net")) if d.startswith(name + "-")]
    nodes = set()
    with contextlib.suppress(OSError):
        nodes |= {d for d in os.listdir(NETNS_DIR) if d.startswith(name + "-")}
    if isinstance(state, dict) and isinstance(state.get("nodes"), list):
        nodes |= {n.get("name") for n in state["nodes"] if isinstance(n, dict) and isinstance(n.get("name"), str)
                  and NODE_PATTERN.fullmatch(n["name"]) and _netns_exists(n["name"])}
    out += [f"namespace {n} (and processes in it)" for n in sorted(nodes)]
    return out


def _untrusted(name: str, why: str) -> ConfigError:
    objects = to_check(name)
    return ConfigError(f"test bed {name}: {why}; removed nothing; check by hand: "
                       f"{', '.join(objects) if objects else 'nothing of that name exists'}")


def load_state(name: str) -> Optional[dict]:
    """The bed's valid state, or None when it is not up; a one-line :class:`ConfigError` naming what to check
    when its directory holds no valid state."""
    state, why = read_state(name)
    if why:
        raise _untrusted(name, why)
    return state


def save_state(state: dict) -> None:
    os.makedirs(bed_dir(state["name"]), exist_ok=True)
    tmp = state_path(state["name"]) + ".tmp"
    with open_no_follow(tmp) as fh:  # root: never through a link planted under the temporary name
        json.dump(state, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, state_path(state["name"]))


def list_beds() -> List[str]:
    """The beds of the state directory that hold a valid state of this tool."""
    root = state_root()
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if NAME_PATTERN.fullmatch(d) and read_state(d)[0] is not None)


def nodes_of(state: dict) -> List[Node]:
    return [Node(**n) for n in state.get("nodes", [])]


# -- markers on the objects ----------------------------------------------------------------------

def link_marker(link: str) -> Optional[str]:
    """A link's alias (``ip link set DEV alias ...``), None when the link does not exist."""
    try:
        with open(os.path.join("/sys/class/net", link, "ifalias")) as fh:
            return fh.read().strip()
    except OSError:
        return None


def link_is_ours(state: dict, link: str) -> bool:
    return _LINK.fullmatch(link) is not None and link_marker(link) == marker(state)


def _netns_inode(node: str) -> Optional[List[int]]:
    with contextlib.suppress(OSError):
        st = os.stat(os.path.join(NETNS_DIR, node))
        return [st.st_dev, st.st_ino]
    return None


def _netns_marker(node: str) -> Optional[str]:
    done = _sh(["ip", "-n", node, "-j", "link", "show", "dev", "lo"], check=False)
    with contextlib.suppress(ValueError, IndexError, TypeError, AttributeError):
        return json.loads(done.stdout)[0].get("ifalias")
    return None


def netns_is_ours(state: dict, node: str) -> bool:
    """The namespace file is the one ``up`` made (the inode recorded then) and its ``lo`` carries the marker."""
    recorded = state.get("netns", {}).get(node)
    return (NODE_PATTERN.fullmatch(node) is not None and recorded is not None and _netns_inode(node) == recorded
            and _netns_marker(node) == marker(state))


def alias_is_ours(state: dict) -> bool:
    path = alias_path(state["name"])
    return path is not None and os.path.islink(path) and os.readlink(path) == bed_dir(state["name"])


def daemon_is_ours(state: dict, record: dict) -> bool:
    """The recorded daemon still runs (same PID and start time) and has the bed's id in its environment."""
    pid = record.get("pid")
    if not _is_int(pid) or pid < 2 or proc_start(pid) != record.get("start"):
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return f"{ID_ENV}={state['id']}".encode() in fh.read().split(b"\0")
    except OSError:
        return False


def _netns_pids(node: str) -> List[int]:
    done = _sh(["ip", "netns", "pids", node], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


# -- up / down / status --------------------------------------------------------------------------

def _same(state: dict, spec: BedSpec) -> bool:
    return state.get("spec") == json.loads(json.dumps(asdict(spec)))


def up(spec: BedSpec) -> Tuple[dict, bool]:
    """Make the bed (or find it made): ``(state, created)``. Idempotent: a bed already up with the same
    settings is left as it is (``created`` False); one with other settings is refused; a half-made
    one (a killed ``up``) is removed and made again. Clashes with objects that are not the bed's are refused
    before anything is removed; a bed directory without a valid state is refused (nothing removed)."""
    require_machine()
    check_name(spec.name)
    with _locked():
        state, why = read_state(spec.name)
        if why and not (why.startswith("no state file") and not os.listdir(bed_dir(spec.name))):
            raise _untrusted(spec.name, why)
        if state is not None:
            if _same(state, spec) and not health(state):
                return state, False
            if not (_same(state, spec) or not state.get("complete")):
                raise ConfigError(f"test bed {spec.name} is up with other settings ({describe(state)}): "
                                  f"fourd-mpi testbed down --name {spec.name} first, or choose another --name")
        _check_clashes(spec, state)
        if state is not None:
            _, left = _down_state(state)
            if left:
                raise ConfigError(f"test bed {spec.name}: could not remove its earlier objects ({', '.join(left)})")
        subnet = choose_subnet(spec.name, _networks_in_use() + _other_subnets(spec.name))
        hosts = list(subnet.hosts())
        nodes = [Node(node, str(hosts[i]), f"{spec.name}-v{i + 1}", spec.rates[i], spec.bursts[i])
                 for i, node in enumerate(spec.nodes)]
        state = {"format": STATE_FORMAT, "name": spec.name, "id": secrets.token_hex(8),
                 "spec": json.loads(json.dumps(asdict(spec))), "subnet": str(subnet), "bridge": spec.bridge,
                 "bridge_addr": str(hosts[253]), "nodes": [asdict(n) for n in nodes], "created": [], "netns": {},
                 "daemons": [], "complete": False,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            _make(state, nodes, subnet)
        except BaseException:
            _down_state(state)
            raise
        return state, True


def _record(state: dict, kind: str, name: str) -> None:
    state["created"].append([kind, name])
    save_state(state)


def _make(state: dict, nodes: List[Node], subnet: ipaddress.IPv4Network) -> None:
    """Each object is recorded in the state before it is made and marked right after (links: alias; namespaces:
    the inode of their file and an alias on their ``lo``)."""
    save_state(state)
    mark = marker(state)
    alias = alias_path(state["name"])
    if alias:
        _record(state, "alias", alias)
        os.symlink(bed_dir(state["name"]), alias)
    br = state["bridge"]
    _record(state, "link", br)
    _sh(["ip", "link", "add", br, "type", "bridge"])
    _sh(["ip", "link", "set", br, "alias", mark])
    _sh(["ip", "addr", "add", f"{state['bridge_addr']}/{subnet.prefixlen}", "dev", br])
    _sh(["ip", "link", "set", br, "up"])
    for node in nodes:
        _record(state, "netns", node.name)
        _sh(["ip", "netns", "add", node.name])
        state["netns"][node.name] = _netns_inode(node.name)
        if state["netns"][node.name] is None:
            raise ConfigError(f"ip netns add {node.name} made no {NETNS_DIR}/{node.name}")
        save_state(state)
        _sh(["ip", "-n", node.name, "link", "set", "lo", "alias", mark])
        _record(state, "link", node.veth)
        _sh(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.name])
        _sh(["ip", "link", "set", node.veth, "alias", mark])
        _sh(["ip", "link", "set", node.veth, "master", br, "up"])
        _sh(["ip", "-n", node.name, "link", "set", "eth0", "alias", mark])
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


def _check_clashes(spec: BedSpec, own: Optional[dict]) -> None:
    """Refuse names taken by objects that are not this bed's (``own``: its valid state, or None), before anything
    is removed or made."""
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
        if _netns_exists(node) and not (own and netns_is_ours(own, node)):
            raise ConfigError(f"node name {node!r} clashes with an existing network namespace of this machine "
                              f"(ip netns list) that is not test bed {spec.name}'s: choose other node names or "
                              f"another --name")
    for link in [spec.bridge] + [f"{spec.name}-v{i + 1}" for i in range(len(spec.nodes))]:
        if _link_exists(link) and not (own and link_is_ours(own, link)):
            raise ConfigError(f"link {link!r} of test bed {spec.name} already exists on this machine and is not "
                              f"the bed's (alias {link_marker(link)!r}): choose another --name")
    alias = alias_path(spec.name)
    if alias and os.path.lexists(alias) and not (own and alias_is_ours(own)):
        raise ConfigError(f"{alias} (the plain path of test bed {spec.name}'s directory) exists and is not the "
                          f"bed's: remove it by hand or choose another state directory")


def _other_subnets(name: str) -> List[ipaddress.IPv4Network]:
    out = []
    for other in list_beds():
        st = load_state(other) or {}
        if other != name and st.get("subnet"):
            out.append(ipaddress.ip_network(st["subnet"]))
    return out


def health(state: dict) -> List[str]:
    """What is missing from a bed that says it is up (empty: healthy); an object of the bed's name without the
    bed's marker counts as missing."""
    missing = [] if state.get("complete") else ["up did not finish"]
    if not link_is_ours(state, state.get("bridge", "")):
        missing.append(f"bridge {state.get('bridge')}")
    for node in nodes_of(state):
        if not netns_is_ours(state, node.name):
            missing.append(f"namespace {node.name}")
        if not link_is_ours(state, node.veth):
            missing.append(f"link {node.veth}")
    if alias_path(state["name"]) and not alias_is_ours(state):
        missing.append(f"link {alias_path(state['name'])}")
    if not os.access(shim_path(state["name"]), os.X_OK):
        missing.append("launcher shim")
    return missing


def down(name: str) -> Tuple[List[str], List[str]]:
    """Remove a bed: its processes (Slurm daemons, ranks), namespaces, links and files, each only when the
    state records it and it carries the bed's marker. ``(removed, left)``: what was removed (empty when the bed
    was not up: idempotent) and what the state records that exists but is not the bed's (for a person to check).
    A directory without a valid state, or no state but objects of the bed's names: a one-line
    :class:`ConfigError` naming what to check; nothing removed."""
    require_machine()
    check_name(name)
    with _locked():
        state, why = read_state(name)
        if why:
            raise _untrusted(name, why)
        if state is None:
            objects = to_check(name)
            if objects:
                raise ConfigError(f"test bed {name} is not up (no state in {state_root()}); removed nothing; objects "
                                  f"of its names exist, not made by it (or its state is lost): check by hand: "
                                  f"{', '.join(objects)}")
            return [], []
        return _down_state(state)


def down_all() -> Tuple[Dict[str, Tuple[List[str], List[str]]], List[str]]:
    """Remove every bed of the state directory that holds a valid state of this tool (the CI-start check for
    leftovers of a killed run): ``({bed: (removed, left)}, problems)``. A directory that looks like a bed's (it
    has a state file) but holds no valid state is only named in ``problems``; anything else is not looked at."""
    require_machine()
    with _locked():
        root = state_root()
        done, problems = {}, []
        for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            if not NAME_PATTERN.fullmatch(entry):
                continue
            state, why = read_state(entry)
            if state is not None:
                done[entry] = _down_state(state)
            elif why and any(os.path.lexists(os.path.join(root, entry, f)) for f in ("state.json", "state.json.tmp")):
                problems.append(str(_untrusted(entry, why)))
        return done, problems


def _down_state(state: dict) -> Tuple[List[str], List[str]]:
    name = state["name"]
    removed, left, failed = [], [], []
    netns = [n for kind, n in state["created"] if kind == "netns"]
    ours = [n for n in dict.fromkeys(netns) if _netns_exists(n) and netns_is_ours(state, n)]
    # processes first (a namespace with processes in it outlives its name): the recorded daemons that are still
    # the same processes with the bed's id, and whatever runs in the bed's own (verified) namespaces
    targets = [(d["pid"], lambda p, d=d: daemon_is_ours(state, d)) for d in state.get("daemons", [])
               if daemon_is_ours(state, d)]
    for node in ours:
        inode = state["netns"][node]
        targets += [(p, lambda p, inode=inode: _in_netns(p, inode)) for p in _netns_members(inode)]
    if targets:
        count = _kill(targets)
        if count:
            removed.append(f"{count} process(es)")
    links = [n for kind, n in state["created"] if kind == "link"]
    for link in dict.fromkeys(reversed(links)):
        if not _link_exists(link):
            continue
        if not link_is_ours(state, link):
            left.append(f"link {link} (alias {link_marker(link)!r}, not {marker(state)!r})")
        elif _sh(["ip", "link", "del", link], check=False).returncode == 0 or not _link_exists(link):
            removed.append(f"link {link}")
        else:
            failed.append(f"link {link}")
    for node in dict.fromkeys(netns):
        if not _netns_exists(node):
            continue
        if node not in ours:
            left.append(f"namespace {node} (not the one test bed {name} made)")
        elif _sh(["ip", "netns", "del", node], check=False).returncode == 0 or not _netns_exists(node):
            removed.append(f"namespace {node}")
        else:
            failed.append(f"namespace {node}")
    alias = alias_path(name)
    if alias and ["alias", alias] in state["created"] and os.path.lexists(alias):
        if alias_is_ours(state):
            os.unlink(alias)
        else:
            left.append(f"{alias} (not a link to {bed_dir(name)})")
    if failed:  # the state stays, so that a later down finds them
        left += [f"{f} (could not remove it)" for f in failed]
    else:
        shutil.rmtree(bed_dir(name), ignore_errors=True)
    return removed, left


def status(name: str) -> Optional[dict]:
    """The bed's state with ``missing`` (what is gone) and ``counters`` (bytes on each link); None when
    the bed is not up."""
    state = load_state(name)
    if state is None:
        return None
    out = dict(state)
    out["missing"] = health(state)
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
    with open_no_follow(path + ".tmp", 0o755) as fh:
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


def clean_leftovers() -> List[str]:
    """The CI-start check: take down every bed of the state directory that holds a valid state of this tool (only
    what each state records and marks as the bed's) and remove stale MPI segments (MPICH's and Open MPI's).
    Lines saying what was removed, and what a person should check (nothing on a clean machine). Run without the
    package's dependencies: ``python3 -c 'import sys; sys.path.insert(0, "."); from fourd_mpi.testbed.bed import
    clean_leftovers; print(*clean_leftovers(), sep="\\n")'``."""
    lines = []
    if not why_unavailable():
        try:
            beds, problems = down_all()
        except ConfigError as exc:  # e.g. FOURD_TESTBED_STATE is not an absolute path
            beds, problems = {}, [str(exc)]
        for name, (removed, left) in beds.items():
            lines.append(f"test bed {name}: removed {', '.join(removed) or 'its state'}"
                         + (f"; not removed, not the bed's (check them): {', '.join(left)}" if left else ""))
        lines += problems
    for path in stale_shm_segments():
        with contextlib.suppress(OSError):
            os.remove(path)
            lines.append(f"removed stale MPI segment {path}")
    return lines
