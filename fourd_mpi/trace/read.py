"""Reading traces: :func:`load_trace` gives NumPy structured arrays (or pandas frames).

>>> trace = load_trace("results/20261121-170000-demo-a1b2c3.h5")
>>> trace.status, trace.metadata["grid"], len(trace.events)
>>> df = trace.events_frame()            # pandas, codes decoded to categories
>>> df[df.op == "allgather"].groupby("layer").wire_bytes.sum()

Every problem with the file (missing, truncated, corrupted, another schema, a
newer schema version) raises :class:`~fourd_mpi.errors.TraceError` with the path
and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.store import RANK_DTYPE, STEP_DTYPE
from fourd_mpi.trace.events import (COLLECTIVE_OPS, COPY_OPS, EVENT_DTYPE, LANE_COMM0, LANE_HOST, LANE_STEP,
                      RANK_STEP_DTYPE, SCHEMA, SCHEMA_VERSION, lane_name)

_DATASETS = {"events": EVENT_DTYPE, "steps": STEP_DTYPE, "rank_steps": RANK_STEP_DTYPE, "ranks": RANK_DTYPE}


@dataclass
class Trace:
    """A loaded trace. Arrays are NumPy structured arrays with the dtypes of :mod:`fourd_mpi.trace.events`."""

    path: str
    status: str
    schema_version: int
    metadata: Dict
    vocab: Dict[str, List[str]]
    events: np.ndarray
    steps: np.ndarray
    rank_steps: np.ndarray
    ranks: np.ndarray
    attrs: Dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def code(self, column: str, name: str) -> int:
        """The integer code of ``name`` in ``column`` (op, phase, axis, layer)."""
        words = self.vocab[_VOCAB_OF[column]]
        try:
            return words.index(name)
        except ValueError:
            raise KeyError(f"{name!r} is not a known {column} ({', '.join(w or repr(w) for w in words)})") from None

    def select(self, **where) -> np.ndarray:
        """Events matching all of ``column=value`` (names for op/phase/axis/layer, ints otherwise)."""
        mask = np.ones(len(self.events), dtype=bool)
        for column, value in where.items():
            if column in _VOCAB_OF and isinstance(value, str):
                value = self.code(column, value)
            mask &= self.events[column] == value
        return self.events[mask]

    def decode(self, column: str, codes) -> np.ndarray:
        words = np.array(self.vocab[_VOCAB_OF[column]], dtype=object)
        return words[np.asarray(codes, dtype=np.int64)]

    def events_frame(self):
        """The events as a pandas DataFrame; op, phase, axis, layer and lane as categories."""
        import pandas as pd

        df = pd.DataFrame(self.events)
        for column in _VOCAB_OF:
            df[column] = pd.Categorical.from_codes(df[column].astype(np.int64), self.vocab[_VOCAB_OF[column]])
        lanes = sorted(set(df["lane"].tolist()))
        df["lane"] = pd.Categorical([lane_name(c) for c in df["lane"]], [lane_name(c) for c in lanes])
        return df

    def steps_frame(self):
        import pandas as pd

        return pd.DataFrame(self.steps)

    def rank_steps_frame(self):
        import pandas as pd

        return pd.DataFrame(self.rank_steps)


_VOCAB_OF = {"op": "ops", "phase": "phases", "axis": "axes", "layer": "layers"}


def _open(path: str):
    import h5py

    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise TraceError(f"{path} is not a readable HDF5 file (truncated or corrupted?): {_first_line(exc)}") from None


def _header(path: str, h5) -> Tuple[Dict, int]:
    """The root attributes and schema version of an open trace; raises unless it is one we can read."""
    attrs = dict(h5.attrs)
    if attrs.get("schema") != SCHEMA:
        raise TraceError(f"{path} is not a fourd-mpi trace (schema attribute {attrs.get('schema')!r})")
    version = int(attrs.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        raise TraceError(f"{path} uses trace schema v{version}; this fourd_mpi reads up to "
                         f"v{SCHEMA_VERSION} (upgrade fourd_mpi)")
    return attrs, version


def read_status(path: str) -> str:
    """A trace's status (``complete``, ``partial``, ``failed``) from its header, without reading the events."""
    h5 = _open(path)
    try:
        with h5:
            attrs, _ = _header(path, h5)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise TraceError(f"{path} is damaged: {_first_line(exc)}") from None
    return str(attrs.get("status"))


#: columns added by schema version 4, per dataset (filled by :func:`_upgrade_v3` for older traces)
V4_COLUMNS = {"events": {"call_ns", "mpi_ns", "overlap_ns"}, "rank_steps": {"mpi_ns"},
              "ranks": {"clock_drift_ppm", "clock_residual_ns"}}


def _upgrade_v3(name: str, data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A schema <= 3 array in the version-4 dtype.

    Older traces did not record when the ``MPI_I*`` call returned nor the host's tests: a
    collective's ``call_ns`` becomes its ``issue_ns`` (the call's entry) and its ``mpi_ns`` its
    ``wait_ns``, so their overlap is ``1 - wait / (complete - issue)`` as those versions computed
    it (work inside the ``I*`` call and the tests counts as overlap); a rank-step's ``mpi_ns`` is its
    ``wait_ns``, and its ``overlap_ns`` ``complete_ns - issue_ns - wait_ns`` (any time not blocked counted
    as overlap, as those versions did). Host compute events get ``mpi_ns = 0``.
    """
    out = np.zeros(len(data), dtype=dtype)
    for field_name in data.dtype.names:
        if field_name in dtype.names:
            out[field_name] = data[field_name]
    if name == "events":
        collective = data["lane"] >= LANE_COMM0
        out["call_ns"] = np.where(collective, data["issue_ns"], 0)
        out["mpi_ns"] = np.where(collective, data["wait_ns"], 0)
        out["overlap_ns"] = np.where(collective, np.maximum(data["complete_ns"] - data["issue_ns"] - data["wait_ns"], 0),
                                     0)
    elif name == "rank_steps":
        out["mpi_ns"] = data["wait_ns"]
    elif name == "ranks":  # no end alignment before schema 4: no drift model
        out["clock_drift_ppm"] = np.nan
        out["clock_residual_ns"] = data["clock_uncertainty_ns"]
    return out


def load_trace(path: str) -> Trace:
    """Read a trace file written by ``fourd-mpi run`` or ``fourd-mpi trace recover``."""
    h5 = _open(path)
    try:
        with h5:
            attrs, version = _header(path, h5)
            arrays = {}
            for name, dtype in _DATASETS.items():
                if name not in h5:
                    raise TraceError(f"{path} has no /{name} dataset (incomplete file)")
                if name == "events" and version >= 5 and int(attrs.get("parts", 0)) > 0:
                    from fourd_mpi.trace.merge import read_parts  # a multi-part trace: parts checked, then read

                    data = read_parts(path, h5, str(attrs.get("run_id", "")), int(attrs.get("events", -1)))
                else:
                    data = h5[name][()]
                missing = [f for f in dtype.names if f not in (data.dtype.names or ())]
                if missing and version < 4 and set(missing) <= V4_COLUMNS.get(name, set()):
                    data = _upgrade_v3(name, data, dtype)
                elif missing:
                    raise TraceError(f"{path}: /{name} lacks the columns {', '.join(missing)}")
                arrays[name] = data
            if len(arrays["events"]) != int(attrs.get("events", -1)):
                raise TraceError(f"{path} holds {len(arrays['events'])} events but its header says "
                                 f"{attrs.get('events')} (truncated write?)")
            meta_attrs = dict(h5["metadata"].attrs) if "metadata" in h5 else {}
            vocab = {k: json.loads(v) for k, v in h5["vocab"].attrs.items()} if "vocab" in h5 else {}
    except TraceError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise TraceError(f"{path} is damaged: {_first_line(exc)}") from None
    json_keys = set(json.loads(meta_attrs.pop("json_keys", "[]")))
    metadata = {}
    for key, value in meta_attrs.items():
        if isinstance(value, bytes):
            value = value.decode()
        if key in json_keys:
            value = json.loads(value)
        elif isinstance(value, np.generic):
            value = value.item()
        metadata[key] = value
    for key in ("layers", "phases", "ops", "axes"):
        if key not in vocab:
            raise TraceError(f"{path} has no {key} vocabulary")
    return Trace(path=path, status=str(attrs.get("status")), schema_version=version, metadata=metadata,
                 vocab=vocab, events=arrays["events"], steps=arrays["steps"], rank_steps=arrays["rank_steps"],
                 ranks=arrays["ranks"], attrs={k: (v.item() if isinstance(v, np.generic) else v)
                                               for k, v in attrs.items()})


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


def check_invariants(trace: Trace) -> List[str]:
    """Consistency checks a trace must pass; returns the violations (empty: all good).

    - every rank of the world is present, with one step record per step;
    - events of one rank on one lane do not overlap (1 ns slack for clock rounding);
    - every wait lies between the issue and the completion of some collective of that rank
      on that axis;
    - a rank's step span is at least the sum of its blocking (host-lane) events in that step,
      and contains them;
    - staging copies: every ``d2h`` ends before the issue, every ``h2d`` starts after the
      completion, of some collective of that rank, step and axis on the same lane.
    """
    problems: List[str] = []
    ev, rs = trace.events, trace.rank_steps
    world = int(trace.metadata.get("world_size", trace.world_size))
    present = set(np.unique(trace.ranks["rank"]).tolist())
    if present != set(range(world)):
        problems.append(f"ranks present {sorted(present)} != world of {world}")
    steps = np.unique(rs["step"])
    for step in steps:
        ranks_in_step = set(rs["rank"][rs["step"] == step].tolist())
        if ranks_in_step != set(range(world)):
            problems.append(f"step {step}: step records from ranks {sorted(ranks_in_step)} only")
    wait_code = trace.code("op", "wait")
    collective_codes = {trace.code("op", name) for name in COLLECTIVE_OPS}
    for rank in range(world):
        mine = ev[ev["rank"] == rank]
        for lane in np.unique(mine["lane"]):
            on_lane = mine[mine["lane"] == lane]
            order = np.argsort(on_lane["start_ns"], kind="stable")
            start, end = on_lane["start_ns"][order], on_lane["end_ns"][order]
            if (end < start).any():
                problems.append(f"rank {rank} lane {lane_name(lane)}: an event ends before it starts")
            overlap = np.nonzero(start[1:] < end[:-1] - 1)[0]
            if len(overlap):
                i = overlap[0]
                problems.append(f"rank {rank} lane {lane_name(lane)}: {len(overlap)} overlapping events, first at "
                                f"{start[i + 1]} ns < previous end {end[i]} ns")
        colls = mine[np.isin(mine["op"], list(collective_codes))]
        for w in mine[mine["op"] == wait_code]:
            same = colls[(colls["axis"] == w["axis"]) & (colls["step"] == w["step"])]
            inside = (same["issue_ns"] <= w["start_ns"]) & (w["end_ns"] <= same["complete_ns"])
            if not inside.any():
                problems.append(f"rank {rank} step {w['step']}: a wait [{w['start_ns']}, {w['end_ns']}] lies "
                                "outside every collective on its axis")
                break
        for name in COPY_OPS:  # staged mode: copies sit on their collective's lane, before / after it
            if name not in trace.vocab["ops"]:
                continue
            for c in mine[mine["op"] == trace.code("op", name)]:
                same = colls[(colls["axis"] == c["axis"]) & (colls["step"] == c["step"]) & (colls["lane"] == c["lane"])]
                ordered = (c["end_ns"] <= same["issue_ns"]) if name == "d2h" else (c["start_ns"] >= same["complete_ns"])
                if not ordered.any():
                    problems.append(f"rank {rank} step {c['step']}: a {name} copy [{c['start_ns']}, {c['end_ns']}] is "
                                    f"not {'before' if name == 'd2h' else 'after'} any collective on its lane and axis")
                    break
        host = mine[mine["lane"] == LANE_HOST]
        spans = mine[mine["lane"] == LANE_STEP]
        for span in spans:
            in_step = host[host["step"] == span["step"]]
            blocking = int((in_step["end_ns"] - in_step["start_ns"]).sum())
            if blocking > span["end_ns"] - span["start_ns"]:
                problems.append(f"rank {rank} step {span['step']}: blocking events sum to {blocking} ns, more than "
                                f"the step's {span['end_ns'] - span['start_ns']} ns")
            if len(in_step) and (in_step["start_ns"].min() < span["start_ns"]
                                 or in_step["end_ns"].max() > span["end_ns"]):
                problems.append(f"rank {rank} step {span['step']}: host events outside the step span")
    comm_lanes = ev["lane"] >= LANE_COMM0
    if (ev["bytes"][comm_lanes] <= 0).any():
        problems.append("a collective with no bytes")
    return problems
