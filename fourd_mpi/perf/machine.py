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
  group size ``p`` (used when present: calibrated profiles), and ``sync_s`` per group size the
  extra time of a collective issued right after compute rather than after a barrier (ranks
  arriving apart; large on oversubscribed nodes), added once per message.

Built-in profiles are ``fourd_mpi/perf/profiles/<name>.yaml``: ``perlmutter``, ``frontier`` (from
published figures, cited in the files) and ``laptop`` (a generic CPU default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from fourd_mpi.core.colltable import COLLECTIVES, collective
from fourd_mpi.errors import ConfigError

PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")
LEVELS = ("intra", "inter")
KINDS = tuple(COLLECTIVES)  # allgather, reduce_scatter, allreduce
#: the model's terms; ``step_fit.weights`` (``fourd-mpi model calibrate``) scales each one
TERMS = ("gemm", "attention", "elementwise", "calls", "comm", "sync")
#: site names that map to a built-in machine profile
SITE_PROFILES = {"perlmutter": "perlmutter", "frontier": "frontier", "local": "laptop", "laptop": "laptop"}

_pos = {"type": "number", "exclusiveMinimum": 0}
_nonneg = {"type": "number", "minimum": 0}
_fit = {"type": "object", "additionalProperties": False, "required": ["alpha_s", "beta_s_per_byte"],
        "properties": {"alpha_s": _nonneg, "beta_s_per_byte": _nonneg, "points": {"type": "integer"},
                       "rms_rel_error": _nonneg}}
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
        "backend": {"enum": ["numpy", "cupy"]},
        "fallback": {"type": "string", "description": "built-in profile for the levels this one lacks"},
        "calibration": {"type": "object"},
        "node": {"type": "object", "additionalProperties": False, "required": ["ranks_per_node"],
                 "properties": {"ranks_per_node": {"type": "integer", "minimum": 1},
                                "cores_per_node": {"type": "integer", "minimum": 0},
                                "nics_per_node": {"type": "integer", "minimum": 0},
                                "hostname": {"type": "string"}}},
        "compute": {"type": "object", "additionalProperties": False, "required": ["gemm_tflops"],
                    "properties": {
                        "gemm_tflops": {"type": "object", "minProperties": 1,
                                        "propertyNames": {"enum": ["float16", "float32", "float64"]},
                                        "additionalProperties": _pos},
                        "peak_tflops": {"type": "object", "additionalProperties": _pos},
                        "mem_bandwidth_gbs": _pos,
                        "device_memory_gib": _pos,
                        "op_overhead_s": _nonneg,
                        "oversubscription": {"type": "number", "minimum": 1},
                        "gemm_tflops_alone": {"type": "object", "additionalProperties": _pos}}},
        "progress": {"type": "object", "additionalProperties": False, "required": ["overlap_efficiency"],
                     "properties": {"overlap_efficiency": {"type": "number", "minimum": 0, "maximum": 1},
                                    "host_driven": {"type": "boolean"},
                                    "description": {"type": "string"}}},
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

    def gemm_tflops(self, dtype: str) -> float:
        rates = self.data["compute"]["gemm_tflops"]
        if dtype in rates:
            return float(rates[dtype])
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

    def missing_fits(self) -> List[str]:
        """``level:op`` of every collective fit this profile's own levels lack."""
        return [f"{lv}:{k}" for lv, entry in self.data["levels"].items() for k in KINDS if k not in entry]

    def describe(self) -> str:
        levels = ", ".join(self.data["levels"])
        rates = ", ".join(f"{k} {v:g}" for k, v in self.data["compute"]["gemm_tflops"].items())
        text = (f"machine profile {self.name} ({self.data.get('source', 'file')}): {self.ranks_per_node} ranks/node, "
                f"levels {levels}; GEMM TFLOP/s per rank {rates}")
        missing = self.missing_fits()
        if missing:
            text += f"; no fit of {', '.join(missing)}"
        if self.fallback is not None:
            text += f"; missing levels{' and fits' if missing else ''} from {self.fallback.name}"
        return text


def builtin_profiles() -> List[str]:
    return sorted(os.path.splitext(f)[0] for f in os.listdir(PROFILES_DIR) if f.endswith(".yaml"))


def load_profile(name_or_path: Optional[str] = None, fallback: Optional[str] = None) -> MachineProfile:
    """A built-in profile by name (``perlmutter``, ``frontier``, ``laptop``; None = ``laptop``) or a
    YAML file. ``fallback``: a profile name or file for missing levels (else the file's own
    ``fallback`` key). Raises :class:`ConfigError` naming the file, line and key of a problem."""
    from fourd_mpi.util.yamlspec import load_yaml

    name_or_path = name_or_path or "laptop"
    if os.path.exists(name_or_path) or name_or_path.endswith((".yaml", ".yml", ".json")):
        path = name_or_path
    elif name_or_path in builtin_profiles():
        path = os.path.join(PROFILES_DIR, name_or_path + ".yaml")
    else:
        raise ConfigError(f"unknown machine profile {name_or_path!r}: give a built-in "
                          f"({', '.join(builtin_profiles())}) or a profile file written by "
                          f"fourd-mpi bench collectives")
    doc = load_yaml(path, "machine profile", PROFILE_SCHEMA)
    profile = MachineProfile(doc.data["name"], doc.data, path)
    fb = fallback or doc.data.get("fallback")
    if fb:
        if fb == name_or_path or fb == profile.name:
            raise ConfigError(f"{path}: profile {profile.name} cannot be its own fallback")
        profile.fallback = load_profile(fb)
    return profile


def profile_for_site(site: Optional[str], profile: Optional[str] = None,
                     fallback: Optional[str] = None) -> MachineProfile:
    """``--profile`` wins; else the built-in profile of ``--site`` (perlmutter, frontier; local -> laptop)."""
    if profile:
        return load_profile(profile, fallback)
    if site is None:
        return load_profile("laptop", fallback)
    if site not in SITE_PROFILES:
        raise ConfigError(f"no machine profile for site {site!r}: sites with one are "
                          f"{', '.join(sorted(SITE_PROFILES))}; pass --profile FILE (from fourd-mpi bench "
                          f"collectives) or a built-in ({', '.join(builtin_profiles())})")
    return load_profile(SITE_PROFILES[site], fallback)


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


def ranks_sharing_link(grid, axis: str, ranks_per_node: int) -> int:
    """How many ranks of a node send over the node's links at once for an inter-node ``axis``: every
    rank of the node takes part in its own instance of the collective (SPMD), so all of them."""
    return min(ranks_per_node, grid.size)
