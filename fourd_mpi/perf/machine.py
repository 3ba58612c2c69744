"""Machine profiles: the numbers the performance model needs, per machine.

A profile (YAML, validated with JSON Schema, see :data:`PROFILE_SCHEMA`) holds

- ``node``: ranks per node the values assume, cores per node, NICs per node;
- ``compute``: sustained GEMM TFLOP/s per rank and dtype (``gemm_tflops``), memory bandwidth for
  element-wise work (GB/s), the memory of a rank's device (``device_memory_gib``, GPUs only),
  a fixed cost per kernel / NumPy call (s), and the oversubscription
  factor (how much slower a rank computes when all ranks of a node compute at once: 1 on
  GPUs and when every rank has its own core; measured by ``fourd-mpi bench collectives``);
- ``progress``: which share of an overlappable collective is hidden behind compute when
  something drives MPI during compute (``poll``: Testsome between GEMM chunks; ``gpu``: the host
  polls while the GPU computes). Without polling on a CPU nothing is hidden (docs/design.md section 3);
- ``levels``: alpha-beta parameters per placement level, ``intra`` (the axis stays in a node)
  and ``inter`` (it crosses nodes), per collective (``allgather``, ``reduce_scatter``,
  ``allreduce``; a calibration of a subset has only those, the others come from the fallback
  profile): time of one message of ``S`` bytes on ``p`` ranks =
  ``k*(p-1)*alpha + k*(p-1)/p*S*beta`` (k = 2 for all-reduce, else 1), with ``shared_by`` = how
  many ranks of a node were communicating at once over that level when beta was measured
  (beta scales with the ranks that share the link in a run). Optional ``by_size`` holds fits per
  group size ``p``, ``measured`` per collective and group size the benchmark's ``[bytes, seconds]``
  points (calibrated profiles: the model interpolates them, :func:`interpolate_measured`, before it
  falls back to the per-size fit, then the level's fit), and ``sync_s`` per group size the
  extra time of a collective issued right after compute rather than after a barrier (ranks
  arriving apart; large on oversubscribed nodes), added once per message.

Optional, for machines with published network measurements (the built-in GPU profiles):

- ``network``: replaces the levels' alpha-beta for the model's collectives when present
  (:meth:`MachineProfile.network_time`). ``placement_gbs``: AxoNN's ``get_bw(ip, group)`` as rows
  (``ip``/``ip_min``/``ip_max``, ``group``/``group_min``/``group_max``, ``gbs``; first match wins),
  ``ip`` being the product of the axes placed inside the collective's axis (X, Y, Z, data from
  inside out, :func:`axis_inner_products`); ``busbw_by_size``: published bus bandwidth (GB/s) per
  output size (rows, bytes) and GPU count (columns) per collective, or the name of another
  collective's table; ``inter_node_gbs`` and ``latency_s_per_rank`` per collective (an all-reduce
  without its own value is a reduce-scatter plus an all-gather); ``use``: ``measured`` (default:
  groups inside a node take the placement table, groups across nodes the size table divided by
  ``min(ip, ranks per node)``) or ``placement`` (AxoNN's table for every group);
- ``sources``: the citation of each constant (key = its path in the file);
- ``compute.training_dtype``: the dtype the site trains in (default bfloat16 on cupy profiles,
  float32 on numpy ones); ``tune`` uses it when ``--dtype`` is not given.

Built-in profiles are ``fourd_mpi/perf/profiles/<name>.yaml``: ``perlmutter``, ``frontier`` (from
published figures, each constant cited in the file's ``sources``) and ``laptop`` (a generic CPU default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fourd_mpi.core.backend import DTYPES
from fourd_mpi.core.colltable import COLLECTIVES, collective
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import peaks

PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")
LEVELS = ("intra", "inter")
KINDS = tuple(COLLECTIVES)  # allgather, reduce_scatter, allreduce
#: the model's terms; ``step_fit.weights`` (``fourd-mpi model calibrate``) scales each one
#: how a ``network`` section costs a collective (:meth:`MachineProfile.network_time`)
NETWORK_RULES = ("measured", "placement")
TERMS = ("gemm", "attention", "elementwise", "calls", "comm", "sync")

_pos = {"type": "number", "exclusiveMinimum": 0}
_nonneg = {"type": "number", "minimum": 0}
_fit = {"type": "object", "additionalProperties": False, "required": ["alpha_s", "beta_s_per_byte"],
        "properties": {"alpha_s": _nonneg, "beta_s_per_byte": _nonneg, "points": {"type": "integer"},
                       "rms_rel_error": _nonneg}}
_points = {"type": "array", "minItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                    "items": _pos}}
_level = {
    # a calibration of a subset of the collectives (bench collectives --ops) has only their fits
    "type": "object", "additionalProperties": False, "required": ["shared_by"],
    "anyOf": [{"required": [k]} for k in KINDS],
    "description": f"a level needs shared_by and the fit of at least one of {', '.join(KINDS)}",
    "properties": {
        "shared_by": {"type": "integer", "minimum": 1},
        "description": {"type": "string"},
        "sync_s": {"type": "object", "propertyNames": {"pattern": r"^[0-9]+$"}, "additionalProperties": _nonneg,
                   "description": "per group size: extra seconds of a collective issued right after compute"},
        **{k: _fit for k in KINDS},
        "by_size": {"type": "object", "additionalProperties": False,
                    "properties": {k: {"type": "object", "propertyNames": {"pattern": r"^[0-9]+$"},
                                       "additionalProperties": _fit} for k in KINDS}},
        "measured": {"type": "object", "additionalProperties": False,
                     "description": "per collective and group: [message bytes, seconds] pairs measured by "
                                    "bench collectives (the median over iterations, max over ranks); the key is "
                                    "the group size p, or 'p@g' for a group of p ranks with g of them on each "
                                    "node (inter-node groups: the placement changes the bytes a node's link "
                                    "carries)",
                     "properties": {k: {"type": "object", "propertyNames": {"pattern": r"^[0-9]+(@[0-9]+)?$"},
                                        "additionalProperties": _points} for k in KINDS}},
        "measured_runs": {"type": "object", "additionalProperties": False,
                          "description": "as measured, seconds per message of a run of messages issued back to "
                                         "back (each waited before the next; bench collectives: 4 per run): the "
                                         "step's data all-reduces at the end of the backward pass",
                          "properties": {k: {"type": "object", "propertyNames": {"pattern": r"^[0-9]+(@[0-9]+)?$"},
                                             "additionalProperties": _points} for k in KINDS}},
    },
}
_count = {"type": "integer", "minimum": 1}
_rule = {
    # one row of AxoNN's get_bw(ip, group): the first row whose bounds hold gives the bandwidth
    "type": "object", "additionalProperties": False, "required": ["gbs"],
    "properties": {"ip": _count, "ip_min": _count, "ip_max": _count, "group": _count, "group_min": _count,
                   "group_max": _count, "gbs": _pos, "source": {"type": "string"}},
}
_size_table = {
    "type": "object", "additionalProperties": False, "required": ["gpus", "bytes", "busbw_gbs"],
    "properties": {"gpus": {"type": "array", "minItems": 1, "items": _count},
                   "bytes": {"type": "array", "minItems": 1, "items": _pos},
                   "busbw_gbs": {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                                            "items": _pos}},
                   "source": {"type": "string"}},
    "description": "bus bandwidth (GB/s) measured per output size (rows, bytes) and GPU count (columns)",
}
_per_op = {"type": "object", "additionalProperties": False, "minProperties": 1,
           "properties": {k: _nonneg for k in KINDS}}
_network = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "description": {"type": "string"},
        "use": {"enum": list(NETWORK_RULES)},
        "placement_gbs": {"type": "array", "minItems": 1, "items": _rule},
        "inter_node_gbs": _per_op,
        "latency_s_per_rank": _per_op,
        "busbw_by_size": {"type": "object", "additionalProperties": False,
                          "properties": {k: {"oneOf": [_size_table, {"enum": list(KINDS)}]} for k in KINDS}},
    },
}
PROFILE_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "node", "compute", "progress", "levels"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                 "description": "a profile name uses letters, digits and . _ -"},
        "description": {"type": "string"},
        "source": {"type": "string"},
        "sources": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "citation per constant (key: the constant's path in the file)"},
        "backend": {"enum": ["numpy", "cupy"]},
        "fallback": {"type": "string", "description": "built-in profile for the levels this one lacks"},
        "base": {"type": "string", "description": "a profile (built-in name or file) this one starts from: its "
                                                 "keys are merged over the base's, mappings key by key"},
        "calibration": {"type": "object"},
        "node": {"type": "object", "additionalProperties": False, "required": ["ranks_per_node"],
                 "properties": {"ranks_per_node": {"type": "integer", "minimum": 1},
                                "cores_per_node": {"type": "integer", "minimum": 0},
                                "nics_per_node": {"type": "integer", "minimum": 0},
                                "hostname": {"type": "string"}}},
        "compute": {"type": "object", "additionalProperties": False, "required": ["gemm_tflops"],
                    "properties": {
                        "gemm_tflops": {"type": "object", "minProperties": 1,
                                        "propertyNames": {"enum": list(DTYPES) + [peaks.FP8]},
                                        "additionalProperties": _pos},
                        "device": {"enum": list(peaks.BY_NAME),
                                   "description": "the device a rank drives: its data-sheet peaks come from "
                                                  "fourd_mpi/perf/peaks.py"},
                        "peak_tflops": {"type": "object", "propertyNames": {"enum": list(DTYPES) + [peaks.FP8]},
                                        "additionalProperties": _pos,
                                        "description": "a device the peak table lacks: its data-sheet peaks"},
                        "training_dtype": {"enum": list(DTYPES)},
                        "mem_bandwidth_gbs": _pos,
                        "device_memory_gib": _pos,
                        "op_overhead_s": _nonneg,
                        "oversubscription": {"type": "number", "minimum": 1},
                        "gemm_tflops_alone": {"type": "object", "additionalProperties": _pos}}},
        "progress": {"type": "object", "additionalProperties": False, "required": ["overlap_efficiency"],
                     "properties": {"overlap_efficiency": {"type": "number", "minimum": 0, "maximum": 1},
                                    "host_driven": {"type": "boolean"},
                                    "description": {"type": "string"}}},
        "network": _network,
        "levels": {"type": "object", "additionalProperties": False, "minProperties": 1,
                   "properties": {lv: _level for lv in LEVELS}},
        "step_fit": {"type": "object", "additionalProperties": False, "required": ["weights"],
                     "properties": {"weights": {"type": "object", "additionalProperties": False,
                                                "properties": {t: _nonneg for t in TERMS}},
                                    "traces": {"type": "array", "items": {"type": "string"}},
                                    "median_abs_rel_error": _nonneg, "description": {"type": "string"}}},
    },
}


@dataclass(frozen=True)
class Fit:
    """``t = k*(p-1)*alpha + k*(p-1)/p*S*beta`` seconds (k = 2 all-reduce, 1 otherwise)."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, op: str, p: int, message_bytes: float, link_share: float = 1.0) -> float:
        return collective(op).ring_time(p, message_bytes, self.alpha_s, self.beta_s_per_byte, link_share)


def monotone(values: Sequence[float]) -> List[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (isotonic regression by
    pool-adjacent-violators: a run that decreases is replaced by its mean). [3, 1, 2] -> [2, 2, 2]."""
    blocks: List[List[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def interpolate_measured(points: Sequence[Sequence[float]], message_bytes: float) -> float:
    """Seconds at ``message_bytes`` from measured ``[bytes, seconds]`` points: linear between the two
    measured sizes around it; below the smallest, the smallest's time (latency-bound); above the
    largest, the largest's time plus the extra bytes at the slope of the last two points (the
    bandwidth of the largest messages). The times are first made non-decreasing in bytes
    (:func:`monotone`: a larger message never costs less; on an oversubscribed node a median can
    say otherwise by noise). Piecewise linear in bytes, so a monotone measurement is reproduced
    exactly, unlike an alpha-beta fit through a link whose small messages pass in a burst."""
    pts = sorted((float(b), float(t)) for b, t in points)
    pts = list(zip([b for b, _ in pts], monotone([t for _, t in pts])))
    if message_bytes <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if message_bytes <= b1:
            return t0 + (t1 - t0) * (message_bytes - b0) / (b1 - b0) if b1 > b0 else t1
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    slope = max(0.0, (t1 - t0) / (b1 - b0)) if b1 > b0 else 0.0
    return t1 + slope * (message_bytes - b1)


@dataclass
class MachineProfile:
    """A loaded profile (see the module docstring); ``data`` is the validated YAML mapping."""

    name: str
    data: Dict[str, Any]
    path: str = ""
    fallback: Optional["MachineProfile"] = None
    notes: List[str] = field(default_factory=list)

    @property
    def ranks_per_node(self) -> int:
        return int(self.data["node"]["ranks_per_node"])

    @property
    def cores_per_node(self) -> int:
        return int(self.data["node"].get("cores_per_node", 0))

    @property
    def backend(self) -> str:
        return self.data.get("backend", "numpy")

    @property
    def training_dtype(self) -> str:
        """The dtype a site trains in: ``compute.training_dtype``, else bfloat16 on GPU (cupy) profiles
        and float32 on CPU (numpy) ones (NumPy has no bfloat16 arithmetic)."""
        return str(self.data["compute"].get("training_dtype", "bfloat16" if self.backend == "cupy" else "float32"))

    @property
    def device(self) -> Optional[peaks.Device]:
        """The entry of the one peak table (:mod:`fourd_mpi.perf.peaks`) that ``compute.device`` names."""
        name = self.data["compute"].get("device")
        return peaks.device(name) if name else None

    def peak_tflops(self, dtype: str) -> Optional[float]:
        """The data-sheet peak per rank for ``dtype``: from the peak table for the profile's ``compute.device``,
        else from the profile's own ``compute.peak_tflops`` (a device the table lacks); None when neither has
        one (CPU profiles). bfloat16 falls back to float16 (same tensor-core peak)."""
        dev = self.device
        table = dict(dev.peaks) if dev is not None else dict(self.data["compute"].get("peak_tflops") or {})
        if dtype == "bfloat16" and dtype not in table and "float16" in table:
            dtype = "float16"
        return float(table[dtype]) if dtype in table else None

    def gemm_tflops(self, dtype: str) -> float:
        """Sustained GEMM TFLOP/s per rank. A profile without a bfloat16 rate (calibrated before bf16
        existed) uses its float16 rate, noted: both run on the same tensor cores at the same
        data-sheet peak on A100, H100 and MI250X."""
        rates = self.data["compute"]["gemm_tflops"]
        if dtype in rates:
            return float(rates[dtype])
        if dtype == "bfloat16" and "float16" in rates:
            note = (f"profile {self.name} has no bfloat16 GEMM rate: using its float16 rate "
                    f"({float(rates['float16']):g} TFLOP/s; same tensor-core peak)")
            if note not in self.notes:
                self.notes.append(note)
            return float(rates["float16"])
        raise ConfigError(f"machine profile {self.name} has no GEMM rate for {dtype} (it has "
                          f"{', '.join(rates)}): add compute.gemm_tflops.{dtype} or calibrate with "
                          f"fourd-mpi bench collectives --dtypes {dtype}")

    @property
    def mem_bandwidth(self) -> float:
        """Bytes/s for element-wise work."""
        return float(self.data["compute"].get("mem_bandwidth_gbs", 10.0)) * 1e9

    @property
    def device_memory_gib(self) -> Optional[float]:
        """Memory of the device one rank uses (GiB; a GPU's HBM), or None when the profile has none
        (CPU profiles: ranks share the host's memory)."""
        value = self.data["compute"].get("device_memory_gib")
        return None if value is None else float(value)

    @property
    def op_overhead_s(self) -> float:
        return float(self.data["compute"].get("op_overhead_s", 0.0))

    def oversubscription(self, ranks_on_node: int) -> float:
        """Compute-time multiplier for ``ranks_on_node`` ranks of a run on one node.

        The profile's measured factor applies at its own ``ranks_per_node``; for another count it
        scales with ranks per core (``max(1, ranks/cores)``), or stays 1 where cores are unknown.
        """
        measured = float(self.data["compute"].get("oversubscription", 1.0))
        cores = self.cores_per_node
        if ranks_on_node == self.ranks_per_node or not cores:
            return measured
        nominal_here = max(1.0, ranks_on_node / cores)
        nominal_there = max(1.0, self.ranks_per_node / cores)
        return measured * nominal_here / nominal_there

    @property
    def term_weights(self) -> Dict[str, float]:
        """Multipliers of the model's terms fitted to measured steps (all 1 when not calibrated)."""
        fitted = (self.data.get("step_fit") or {}).get("weights", {})
        return {t: float(fitted.get(t, 1.0)) for t in TERMS}

    @property
    def overlap_efficiency(self) -> float:
        return float(self.data["progress"]["overlap_efficiency"])

    @property
    def host_driven(self) -> bool:
        """True on CPUs: a collective progresses during compute only if the rank polls."""
        return bool(self.data["progress"].get("host_driven", self.backend == "numpy"))

    def has_level(self, level: str) -> bool:
        return level in self.data["levels"]

    def level(self, level: str) -> Tuple["MachineProfile", Dict[str, Any]]:
        """``(profile that holds it, level mapping)``; falls back explicitly or raises."""
        if self.has_level(level):
            return self, self.data["levels"][level]
        if self.fallback is not None and self.fallback.has_level(level):
            note = (f"profile {self.name} has no {level}-node level: using {self.fallback.name}'s "
                    f"(fallback: {self.fallback.name})")
            if note not in self.notes:
                self.notes.append(note)
            return self.fallback, self.fallback.data["levels"][level]
        have = ", ".join(self.data["levels"]) or "none"
        raise ConfigError(
            f"machine profile {self.name} has no '{level}' level (it has: {have}); a grid whose axes "
            f"{'cross nodes' if level == 'inter' else 'stay inside a node'} needs it: calibrate with "
            f"fourd-mpi bench collectives on {'2 or more nodes' if level == 'inter' else 'one node'}, add "
            f"'fallback: perlmutter' (or another built-in) to the profile, or choose --profile perlmutter|frontier"
        )

    def sync_s(self, level: str, p: int) -> float:
        """Extra seconds per collective message on ``p`` ranks when ranks arrive apart (measured by the
        benchmark; 0 when absent). The nearest measured group size is used."""
        _, lv = self.level(level)
        table = lv.get("sync_s") or {}
        if not table:
            return 0.0
        nearest = min(table, key=lambda k: (abs(int(k) - p), int(k)))
        return float(table[nearest])

    def fit(self, level: str, op: str, p: int) -> Tuple[Fit, int]:
        """The alpha-beta fit for ``op`` on ``p`` ranks at ``level`` and the level's ``shared_by``.

        A level calibrated without ``op`` (``bench collectives --ops`` a subset) takes the
        fallback profile's fit of ``op`` at that level (noted), or raises saying what to do."""
        owner, lv = self.level(level)
        if op not in lv:
            fb = owner.fallback
            if fb is not None and fb.has_level(level) and op in fb.data["levels"][level]:
                note = (f"profile {owner.name} has no {op} fit at the {level}-node level: using "
                        f"{fb.name}'s (fallback: {fb.name})")
                if note not in self.notes:
                    self.notes.append(note)
                lv = fb.data["levels"][level]
            else:
                have = ", ".join(k for k in KINDS if k in lv)
                raise ConfigError(
                    f"machine profile {owner.name} has no {op} fit at the '{level}' level (it has: {have}): "
                    f"calibrate with fourd-mpi bench collectives --ops including i{op}, or add "
                    f"'fallback: perlmutter' (or another built-in) to the profile")
        by_size = (lv.get("by_size") or {}).get(op) or {}
        entry = by_size.get(str(p)) or lv[op]
        return Fit(float(entry["alpha_s"]), float(entry["beta_s_per_byte"])), int(lv["shared_by"])

    def measured_source(self, level: str, op: str, p: int, per_node: Optional[int] = None,
                        run: bool = False) -> Optional[Tuple[str, str, float]]:
        """``(table, key, scale)``: which of the level's measured point sets prices ``op`` on ``p`` ranks with
        ``per_node`` of them on each node: the table (``measured``, or ``measured_runs`` for a message of a
        back-to-back run, ``run``, where that table has points of ``p`` ranks), the key, and the factor its
        part above the smallest size's time is scaled by (1, or ``g'/g`` for the nearest other placement
        ``g'``, see :meth:`measured_time`); None without points of ``p`` ranks. E.g. ``("measured", "4@1",
        1.0)``: single messages measured with one rank of each group on each node."""
        _, lv = self.level(level)
        names = (["measured_runs"] if run else []) + ["measured"]
        for name in names:
            table = (lv.get(name) or {}).get(op) or {}
            by_g = {int(k.split("@")[1]): k for k in table if k.startswith(f"{p}@")}
            if per_node and per_node in by_g:
                return name, by_g[per_node], 1.0
            if str(p) in table:
                return name, str(p), 1.0
            if per_node and by_g:
                g_measured = min(by_g, key=lambda g: (abs(g - per_node), g))
                return name, by_g[g_measured], g_measured / per_node
        return None

    def measured_time(self, level: str, op: str, p: int, message_bytes: float,
                      link_share: float = 1.0, per_node: Optional[int] = None, run: bool = False) -> Optional[float]:
        """Seconds of one ``op`` of ``message_bytes`` on ``p`` ranks at ``level`` from the level's
        ``measured`` points (None without points of ``p`` ranks): :func:`interpolate_measured`. The part
        above the smallest size's time scales with ``link_share`` (ranks of a node in the run /
        ``shared_by``), as beta does in the fit.

        ``per_node`` (g): the group's ranks on one node. Points of the same placement (key ``"p@g"``)
        come first, then points of unknown placement (key ``"p"``), then those of the nearest other
        ``g'``, whose part above the smallest size scales by ``g'/g`` besides: while every group of the
        axis communicates at once, a node's link carries the traffic of ``ranks/g`` groups, and a ring
        (or a node-aware algorithm) sends about the same bytes per group through each node's link
        whatever ``g`` is, so the link's bytes, and the bandwidth-bound time, go as ``1/g``
        (:func:`group_per_node`; :meth:`measured_source` says which points).

        ``run``: the message is one of a run issued back to back (the step's data all-reduces): the
        ``measured_runs`` points of ``p`` ranks price it where the profile has them (a shaped link passes a
        single message after an idle link faster than its rate, messages back to back at the rate), else
        the single-message points."""
        source = self.measured_source(level, op, p, per_node, run)
        if source is None:
            return None
        table, key, scale = source
        points = self.level(level)[1][table][op][key]
        t = interpolate_measured(points, message_bytes)
        floor = min(pt[1] for pt in points)
        return floor + (t - floor) * link_share * scale if t > floor else t

    # -- the network section: published bandwidths by placement and message size ------------------

    @property
    def has_network(self) -> bool:
        return bool(self.data.get("network"))

    def placement_gbs(self, ip: int, group: int) -> Optional[float]:
        """AxoNN's ``get_bw(ip, group)``: GB/s of a collective over ``group`` ranks whose axis has the
        product ``ip`` of the axes placed inside it (X, Y, Z, data from inside out); the first
        ``network.placement_gbs`` row whose bounds hold, or None (no row: AxoNN leaves the grid out)."""
        for row in (self.data.get("network") or {}).get("placement_gbs", []):
            if "ip" in row and ip != row["ip"] or "group" in row and group != row["group"]:
                continue
            if ip < row.get("ip_min", 0) or ip > row.get("ip_max", ip) or group < row.get("group_min", 0) \
                    or group > row.get("group_max", group):
                continue
            return float(row["gbs"])
        return None

    def _per_op(self, key: str, op: str) -> Optional[float]:
        """``network.<key>[op]``; an all-reduce without its own value is a ring reduce-scatter plus
        all-gather: latencies add, bandwidths combine harmonically (``2 / (1/b_rs + 1/b_ag)``)."""
        table = (self.data.get("network") or {}).get(key) or {}
        if op in table:
            return float(table[op])
        if op == "allreduce" and "allgather" in table and "reduce_scatter" in table:
            ag, rs = float(table["allgather"]), float(table["reduce_scatter"])
            return ag + rs if key == "latency_s_per_rank" else 2.0 / (1.0 / ag + 1.0 / rs)
        return None

    def busbw_by_size(self, op: str, p: int, message_bytes: float) -> Optional[Tuple[float, bool]]:
        """``(GB/s, below_range)`` interpolated in the published table of bus bandwidth by output size and
        GPU count (``network.busbw_by_size``): linear in ``log(bytes)`` and ``log(p)``, clamped to the
        table's ends (``below_range``: the message is smaller than the smallest measured). An
        all-reduce without a table combines the reduce-scatter and all-gather ones as :meth:`_per_op`.
        None when the profile has no table for ``op``."""
        import numpy as np

        tables = (self.data.get("network") or {}).get("busbw_by_size") or {}
        entry = tables.get(op)
        if isinstance(entry, str):
            entry = tables.get(entry)
        if entry is None:
            if op == "allreduce" and "allgather" in tables and "reduce_scatter" in tables:
                ag = self.busbw_by_size("allgather", p, message_bytes)
                rs = self.busbw_by_size("reduce_scatter", p, message_bytes)
                return 2.0 / (1.0 / ag[0] + 1.0 / rs[0]), ag[1] or rs[1]
            return None
        arrays = self.__dict__.setdefault("_busbw_arrays", {})  # the table's logs, once per profile and op
        if op not in arrays:
            arrays[op] = (np.log(np.asarray(entry["bytes"], dtype=float)),
                          np.log(np.asarray(entry["gpus"], dtype=float)), np.asarray(entry["busbw_gbs"], dtype=float))
        lb, lg, bw = arrays[op]
        x = float(np.log(max(message_bytes, 1.0)))
        per_gpus = np.array([np.interp(x, lb, bw[:, j]) for j in range(len(lg))])
        return float(np.interp(np.log(p), lg, per_gpus)), bool(x < lb[0])

    def network_time(self, op: str, p: int, message_bytes: float, ip: int, level: str,
                     ranks_on_node: Optional[int] = None) -> float:
        """Seconds of one ``op`` message of ``message_bytes`` (nccl-tests size) on ``p`` ranks whose axis
        has inner product ``ip``, from the ``network`` section (docs/guide/model-and-tuning.md, "Built-in profiles").

        ``wire = k(p-1)/p * S`` (k = 2 all-reduce), ``lat = latency_s_per_rank * p`` (AxoNN's
        latency-aware model), ``share = min(ip, ranks per node)`` (groups placed with stride share
        the node's NICs). Rule ``placement``: ``lat + wire / placement_gbs(ip, p)``. Rule
        ``measured`` (default): a group inside a node (``level == "intra"``) with a placement row
        takes ``lat + wire / placement_gbs(ip, p)``; otherwise ``wire / (busbw(S, p) / share)`` from the
        published size table (measured times include latency; below the smallest measured size at
        least ``lat``), else ``lat + wire / (inter_node_gbs / share)``. Memoized per profile (a search
        prices the same message many times; the profile's data are not changed after loading)."""
        memo = self.__dict__.setdefault("_network_memo", {})
        key = (op, p, message_bytes, ip, level, ranks_on_node)
        if key not in memo:
            memo[key] = self._network_time(op, p, message_bytes, ip, level, ranks_on_node)
        return memo[key]

    def _network_time(self, op: str, p: int, message_bytes: float, ip: int, level: str,
                      ranks_on_node: Optional[int] = None) -> float:
        """:meth:`network_time`, not memoized."""
        net = self.data["network"]
        kind = collective(op)
        if p <= 1:
            return 0.0
        wire = kind.wire_factor(p) * message_bytes
        lat = (self._per_op("latency_s_per_rank", op) or 0.0) * p
        rule = net.get("use", "measured")
        bw = self.placement_gbs(ip, p)
        if rule == "placement" or (level == "intra" and bw is not None):
            if bw is None:
                raise ConfigError(f"machine profile {self.name}: network.placement_gbs has no row for ip={ip}, "
                                  f"group={p} ({op}): add one (ip/ip_min/ip_max, group/group_min/group_max, gbs)")
            return lat + wire / (bw * 1e9)
        share = float(min(ip, ranks_on_node or self.ranks_per_node))
        sized = self.busbw_by_size(op, p, message_bytes)
        if sized is not None:
            t = wire / (sized[0] * 1e9 / share)
            return max(t, lat) if sized[1] else t
        inter = self._per_op("inter_node_gbs", op)
        if inter is None:
            raise ConfigError(f"machine profile {self.name}: network has neither busbw_by_size nor "
                              f"inter_node_gbs for {op} (needed for a group of {p} crossing nodes)")
        return lat + wire / (inter * 1e9 / share)

    def missing_fits(self) -> List[str]:
        """``level:op`` of every collective fit this profile's own levels lack."""
        return [f"{lv}:{k}" for lv, entry in self.data["levels"].items() for k in KINDS if k not in entry]

    def level_owners(self) -> Dict[str, "MachineProfile"]:
        """The profile that gives each placement level's figures: this one, else the first of its fallbacks."""
        owners: Dict[str, MachineProfile] = {}
        profile: Optional[MachineProfile] = self
        while profile is not None:
            for level in profile.data.get("levels", {}):
                owners.setdefault(level, profile)
            profile = profile.fallback
        return owners

    def origin(self) -> str:
        """One line: where this profile's figures come from (its ``source``, else its file), and each placement
        level whose figures are another profile's (a fallback), with that profile's source."""
        text = f"machine profile {self.name}: figures {self.data.get('source') or 'from ' + (self.path or 'a file')}"
        borrowed = [(level, owner) for level, owner in self.level_owners().items() if owner is not self]
        if borrowed:
            text += "; " + "; ".join(f"{level}-node level from profile {owner.name} "
                                     f"({owner.data.get('source', 'file')})" for level, owner in borrowed)
        return text

    def describe(self) -> str:
        levels = ", ".join(self.data["levels"])
        rates = ", ".join(f"{k} {v:g}" for k, v in self.data["compute"]["gemm_tflops"].items())
        text = (f"machine profile {self.name} ({self.data.get('source', 'file')}): {self.ranks_per_node} ranks/node, "
                f"levels {levels}; GEMM TFLOP/s per rank {rates}")
        if self.has_network:
            text += ("; network: published bandwidths by placement and size "
                     f"({self.data['network'].get('use', 'measured')} rule)")
        missing = self.missing_fits()
        if missing:
            text += f"; no fit of {', '.join(missing)}"
        borrowed = any(owner is not self for owner in self.level_owners().values())
        if self.fallback is not None and (borrowed or missing):
            text += f"; missing levels{' and fits' if missing else ''} from {self.fallback.name}"
        return text


def builtin_profiles() -> List[str]:
    return sorted(os.path.splitext(f)[0] for f in os.listdir(PROFILES_DIR) if f.endswith(".yaml"))


#: the longest chain of profiles one profile may pull in through ``base:`` and ``fallback:`` (each
#: link a file read and merged; a real chain has two or three)
MAX_PROFILE_CHAIN = 16


def _follow(chain: Tuple[Tuple[str, str], ...], key: str, name: str, path: str) -> Tuple[Tuple[str, str], ...]:
    """``chain`` (``(file identity, name as written)`` of each profile followed so far, through
    ``base:`` and ``fallback:``) with ``name`` added; a cycle or a chain longer than
    :data:`MAX_PROFILE_CHAIN` is one :class:`ConfigError` line naming the chain."""
    names = [n for _, n in chain] + [name]
    if any(k == key for k, _ in chain):
        raise ConfigError(f"machine profile {path}: base:/fallback: chain is a cycle: {' -> '.join(names)}; "
                          "remove one of its links")
    if len(chain) >= MAX_PROFILE_CHAIN:
        shown = names if len(names) <= 6 else names[:3] + ["..."] + names[-2:]
        raise ConfigError(f"machine profile {path}: base:/fallback: chain longer than {MAX_PROFILE_CHAIN} profiles "
                          f"({' -> '.join(shown)}); merge the profiles into fewer files")
    return chain + ((key, name),)


def load_profile(name_or_path: Optional[str] = None, fallback: Optional[str] = None,
                 _bases: Tuple[Tuple[str, str], ...] = ()) -> MachineProfile:
    """A built-in profile by name (``perlmutter``, ``frontier``, ``laptop``; None = ``laptop``) or a
    YAML file. ``fallback``: a profile name or file for missing levels (else the file's own
    ``fallback`` key). A file's ``base:`` names the profile it starts from (:func:`merged`; ``_bases``:
    the chain so far, so that a cycle is one line). Raises :class:`ConfigError` naming the file, line and
    key of a problem."""
    from fourd_mpi.util.yamlspec import YamlDocument

    name_or_path = name_or_path or "laptop"
    shipped = False
    if os.path.exists(name_or_path) or name_or_path.endswith((".yaml", ".yml", ".json")):
        path = name_or_path
    elif name_or_path in builtin_profiles():
        path, shipped = os.path.join(PROFILES_DIR, name_or_path + ".yaml"), True
    else:
        raise ConfigError(f"unknown machine profile {name_or_path!r}: give a built-in "
                          f"({', '.join(builtin_profiles())}) or a profile file written by "
                          f"fourd-mpi bench collectives")
    # a built-in's schema check is a test's (tests/perf/test_perfmodel.py); a file's is made on every load,
    # after its base is merged in
    # identity: the file and the fallback given for it (only the top-level load may be given one)
    chain = _follow(_bases, f"{os.path.realpath(path)}\0{fallback or ''}", name_or_path, path)
    doc = YamlDocument.read(path, "machine profile")
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{path}: a machine profile must be a YAML mapping (key: value lines)")
    base = doc.data.get("base")
    if base is not None:
        if not isinstance(base, str) or not base.strip() or base == doc.data.get("name"):
            raise ConfigError(f"{path}: base must name another profile (a built-in or a file), got {base!r}")
        doc.data = merged(load_profile(base, _bases=chain).data, doc.data)
    if not shipped:
        doc.validate(PROFILE_SCHEMA)
    _check_size_tables(doc.data, path)
    profile = MachineProfile(doc.data["name"], doc.data, path)
    fb = fallback or doc.data.get("fallback")
    if fb:
        if fb == name_or_path or fb == profile.name:
            raise ConfigError(f"{path}: profile {profile.name} cannot be its own fallback")
        profile.fallback = load_profile(fb, _bases=chain)
    return profile


def merged(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """``over`` merged over ``base`` (a profile's ``base:``): mappings key by key, anything else replaced.
    Known answer: ``merged({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}})`` is
    ``{"a": {"x": 1, "y": 3}, "b": 1}``. Neither argument is changed."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_size_tables(data: Dict[str, Any], path: str) -> None:
    """``network.busbw_by_size`` tables: one row per size, one column per GPU count, both ascending,
    and a name (``reduce_scatter: allgather``) points at a table."""
    tables = (data.get("network") or {}).get("busbw_by_size") or {}
    for op, entry in tables.items():
        where = f"{path}: network.busbw_by_size.{op}"
        if isinstance(entry, str):
            if not isinstance(tables.get(entry), dict):
                raise ConfigError(f"{where} names {entry!r}, which has no table of its own")
            continue
        rows, cols = entry["bytes"], entry["gpus"]
        if list(rows) != sorted(set(rows)) or list(cols) != sorted(set(cols)):
            raise ConfigError(f"{where}: bytes and gpus must be strictly increasing, got {rows} and {cols}")
        shape = [len(r) for r in entry["busbw_gbs"]]
        if len(shape) != len(rows) or any(n != len(cols) for n in shape):
            raise ConfigError(f"{where}: busbw_gbs must have {len(rows)} rows (one per size) of {len(cols)} "
                              f"values (one per GPU count), got rows of {shape}")


def group_per_node(p: int, stride: int, ranks_per_node: int) -> int:
    """Ranks of one group on one node: a group of ``p`` ranks ``stride`` apart in rank order, placed in
    order on nodes of ``ranks_per_node`` consecutive ranks (block placement), has
    ``min(p, ceil(ranks_per_node / stride))`` of them on a node: X (stride 1) of 4 on nodes of 2 -> 2;
    a data axis of stride 2 on nodes of 2 -> 1 (one rank per node)."""
    return max(1, min(p, -(-ranks_per_node // max(1, stride))))


def axis_inner_products(grid) -> Dict[str, int]:
    """``axis -> ip``, the product of the sizes of the axes placed inside it (order X, Y, Z, data from
    inside out): AxoNN's ``ip`` (X: 1, Y: G_x, Z: G_x G_y, data: G_x G_y G_z)."""
    out, ip = {}, 1
    for axis in ("x", "y", "z", "data"):
        out[axis] = ip
        ip *= grid[axis]
    return out


def axis_placement(grid, ranks_per_node: int) -> Dict[str, str]:
    """``axis -> "intra" | "inter" | "-"`` for a :class:`~fourd_mpi.core.grid.GridShape` with ranks placed
    in order (X innermost) on nodes of ``ranks_per_node`` ranks. An axis is intra-node when its
    span (stride x size) fits in a node and tiles it; otherwise its ring crosses nodes."""
    out, stride = {}, 1
    for axis in ("x", "y", "z", "data"):
        size = grid[axis]
        span = stride * size
        if size == 1:
            out[axis] = "-"
        elif span <= ranks_per_node and ranks_per_node % span == 0:
            out[axis] = "intra"
        else:
            out[axis] = "inter"
        stride = span
    return out


def world_levels(grid, stages: int, ranks_per_node: int) -> Dict[str, str]:
    """``axis -> "intra" | "inter" | "-"`` of the pipeline's world, rank order data, inter, z, y, x (X
    innermost) on nodes of ``ranks_per_node`` consecutive ranks: an axis is intra-node when its span
    (stride x size) fits in a node and tiles it. The data axis' stride is ``G_z G_y G_x x stages``, not
    a stage grid's ``G_z G_y G_x``: with 2 stages of 2x1x2x1 on nodes of 4, the stages share a node
    and the data all-reduce crosses nodes."""
    out, stride = {}, 1
    for axis, size in (("x", grid.x), ("y", grid.y), ("z", grid.z), ("inter", stages), ("data", grid.data)):
        span = stride * size
        out[axis] = "-" if size == 1 else ("intra" if span <= ranks_per_node and ranks_per_node % span == 0
                                           else "inter")
        stride = span
    return out


def world_strides(grid, stages: int) -> Dict[str, int]:
    """``{"data": G_z G_y G_x x stages}``: the data axis' stride in the pipeline's world order (data,
    inter, z, y, x); the stage grid's other axes keep their strides."""
    return {"data": grid.z * grid.y * grid.x * stages}


def inter_placement(grid, stages: int, ranks_per_node: int) -> str:
    """``intra`` when a rank and its stage neighbours (``G_z G_y G_x`` world ranks apart, rank order data, inter,
    z, y, x) share a node, ``inter`` otherwise, ``-`` for one stage (:func:`world_levels`)."""
    return world_levels(grid, stages, ranks_per_node)["inter"]


def message_time(profile: MachineProfile, level: str, nbytes: int, senders: Optional[int] = None) -> float:
    """Seconds of one point-to-point message: a 2-rank all-gather of a gathered buffer of ``2 * nbytes``
    (its ring moves exactly one message each way). Across nodes, from a calibrated profile's measured
    points of 2 ranks on 2 nodes (``2@1``) when it has them, with ``senders`` ranks of a node sending at
    once (the link share of :meth:`~fourd_mpi.perf.machine.MachineProfile.measured_time`: a stage's
    ranks all send their micro-batch through the node's link together); otherwise the level's
    all-gather fit on 2 ranks (``alpha + nbytes * beta``)."""
    if level == "-":
        return 0.0
    fit, shared_by = profile.fit(level, "allgather", 2)
    if level == "inter" and senders:
        measured = profile.measured_time(level, "allgather", 2, 2 * nbytes, senders / shared_by, per_node=1)
        if measured is not None:
            return measured
    return fit.time("allgather", 2, 2 * nbytes)


def ranks_sharing_link(grid, axis: str, ranks_per_node: int) -> int:
    """How many ranks of a node send over the node's links at once for an inter-node ``axis``: every
    rank of the node takes part in its own instance of the collective (SPMD), so all of them."""
    return min(ranks_per_node, grid.size)
