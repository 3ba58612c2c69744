"""What a test bed is made of, pure (no system calls): the names and limits of a bed (:data:`NAME_PATTERN`,
:data:`MAX_NODES`), link rates and burst sizes as tc(8) writes them (:func:`parse_rate`, :func:`parse_size`,
:func:`rate_text`), and the spec of a bed from the command line (:class:`Node`, :class:`BedSpec`,
:func:`make_spec`). :mod:`fourd_mpi.testbed.bed` makes and removes beds from these and imports them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import byte_size

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
    """Bytes of a burst (``64kb`` = ``64k`` = ``64kib`` = 65536 as tc reads it, ``1mb``, ``4000``): :func:`byte_size`
    with bare numbers as bytes and ``KB`` = 1024; from 2 KiB to 2 GiB."""
    value = byte_size(text, decimal=False, bare=True, what="burst")
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
    check_name(name)
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


NAME_RULE = ("use a lowercase letter then up to 9 lowercase letters or digits (it names the bed's directory and "
             "prefixes interface names, which Linux limits to 15 characters)")


def check_name(name, source: str = "") -> str:
    """``name`` when it follows :data:`NAME_RULE`, a one-line :class:`ConfigError` otherwise (``source``: where it
    came from, e.g. ``--name`` or ``FOURD_TESTBED``)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"bed name {name!r}{f' (from {source})' if source else ''}: {NAME_RULE}")
    return name
