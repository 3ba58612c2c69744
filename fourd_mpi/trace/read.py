"""Reading traces: :func:`load_trace` gives NumPy structured arrays (or pandas frames).

>>> trace = load_trace("results/20261121-170000-demo-a1b2c3.h5")
>>> trace.status, trace.metadata["grid"], len(trace.events)
>>> df = trace.events_frame()            # pandas, codes decoded to categories
>>> df[df.op == "allgather"].groupby("layer").wire_bytes.sum()

The reader trusts nothing it has not checked (see :func:`load_trace`): every problem
with the file (missing, truncated, corrupted, another schema, a newer schema version,
a column of the wrong type or shape, a code outside its vocabulary, a header that does
not match the datasets, malformed or oversized JSON attributes) raises
:class:`~fourd_mpi.errors.TraceError` with the path and the reason, in one line. A
file that is sound but holds impossible values (NaN or negative times, events missing
for the trace level) is *damaged* (:func:`damage`): :class:`~fourd_mpi.errors.DamagedTraceError`
unless ``allow_damaged``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.errors import DamagedTraceError, TraceError
from fourd_mpi.trace.events import (AXES, COLLECTIVE_OPS, COPY_OPS, EVENT_DTYPE, LANE_COMM0, LANE_HOST, LANE_LAYER,
                                   LANE_STEP, LEVELS, OPS, P2P_OPS, PHASES, RANK_STEP_DTYPE, SCHEMA, SCHEMA_VERSION, lane_name)
from fourd_mpi.trace.files import RANK_DTYPE, STEP_DTYPE, open_h5_read
from fourd_mpi.trace.parts import read_parts

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
    #: why the trace cannot be analysed as it is (:func:`damage`); empty for a sound trace
    damage: List[str] = field(default_factory=list)

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

    def placement(self) -> NodePlacement:
        """Where the ranks ran and each axis' node span per rank (:mod:`fourd_mpi.core.placement`).

        Schema 7: metadata ``placement`` (the launcher's node assignment, recorded by the run). Older
        traces: derived from ``/ranks``: a node per distinct ``hostname`` (the ``node`` column where host
        names are missing), the axes ``data, z, y, x`` (pipeline: ``data, inter, z, y, x`` from metadata
        ``pipeline.grid5d``) with world ranks row-major over them."""
        recorded = self.metadata.get("placement")
        if isinstance(recorded, dict) and recorded.get("node_span"):
            return NodePlacement.from_dict(recorded)
        ranks = np.sort(self.ranks, order="rank")
        hosts = [h.decode("utf-8", "replace") if isinstance(h, bytes) else str(h) for h in ranks["hostname"]]
        labels = hosts if all(hosts) else [int(n) for n in ranks["node"]]
        grid = self.metadata.get("run_options", {}).get("grid") or {}
        dims = {a: int(grid.get(a, 1) or 1) for a in ("data", "z", "y", "x")}
        g5 = (self.metadata.get("pipeline") or {}).get("grid5d") if isinstance(self.metadata.get("pipeline"), dict) else None
        if isinstance(g5, dict) and "inter" in g5:
            dims = {"data": dims["data"], "inter": int(g5["inter"]), "z": dims["z"], "y": dims["y"], "x": dims["x"]}
        if int(np.prod(list(dims.values()))) != len(labels):  # no usable grid: every rank its own axis-less world
            dims = {"world": len(labels)}
        names = list(dict.fromkeys(labels))
        return NodePlacement.from_nodes(labels, dims, [str(n) for n in names],
                                        source="derived from /ranks (hostname, else node) of a trace without "
                                               "metadata placement (schema < 7)")

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


# ---------------------------------------------------------------------------
# bounds: what a file may ask the reader to parse or hold
# ---------------------------------------------------------------------------

#: longest string attribute read (a JSON metadata value or a vocabulary), in bytes
MAX_ATTR_BYTES = 16 << 20
#: deepest nesting of a JSON attribute (the writer's deepest is 3: run_options.model.name)
MAX_JSON_DEPTH = 32
#: most words in a vocabulary (layer codes are int16)
MAX_VOCAB_WORDS = 1 << 15
#: most rows of ``/ranks`` (and so the world size)
MAX_RANKS = 1 << 22
#: gzip (the writer's filter) compresses at most about 1032:1; a dataset whose logical size
#: exceeds its stored bytes by more than this is declared larger than what was written
MAX_COMPRESSION = 1100


def _memory_budget() -> int:
    """Bytes the reader may allocate for the datasets: half the available memory (Linux:
    ``MemAvailable``), else 16 GiB."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return 16 << 30


def _open(path: str):
    try:
        return open_h5_read(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
        from fourd_mpi.util.files import missing_reason

        if os.path.islink(path) and not os.path.exists(path):
            raise TraceError(f"{path} is {missing_reason(path)}, not a trace file") from None
        raise TraceError(f"{path} is not a readable HDF5 file (truncated or corrupted?): {_first_line(exc)}") from None


class _Invalid(Exception):
    """A structural problem of the file (raised as :class:`TraceError` by :func:`load_trace`)."""


def _int_attr(attrs, name: str, default=None) -> int:
    value = attrs.get(name, default)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _Invalid(f"root attribute {name!r} is {_short(value)}, not an integer")
    return int(value)


def _str_attr(attrs, name: str, default=None) -> str:
    value = attrs.get(name, default)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        raise _Invalid(f"attribute {name!r} is {_short(value)}, not a string")
    if len(value) > MAX_ATTR_BYTES:
        raise _Invalid(f"attribute {name!r} holds {len(value):,} characters (more than {MAX_ATTR_BYTES:,})")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _header(path: str, h5) -> Tuple[Dict, int]:
    """The root attributes and schema version of an open trace; raises unless it is one we can read."""
    attrs = dict(h5.attrs)
    schema = attrs.get("schema")
    schema = schema.decode("utf-8", "replace") if isinstance(schema, bytes) else schema
    if not isinstance(schema, str) or schema != SCHEMA:
        raise TraceError(f"{path} is not a fourd-mpi trace (schema attribute {_short(schema)})")
    try:
        version = _int_attr(attrs, "schema_version", 0)
    except _Invalid as exc:
        raise TraceError(f"{path}: invalid trace: {exc}") from None
    if version > SCHEMA_VERSION:
        raise TraceError(f"{path} uses trace schema v{version}; this fourd_mpi reads up to "
                         f"v{SCHEMA_VERSION} (upgrade fourd_mpi)")
    if version < 0:
        raise TraceError(f"{path}: invalid trace: schema_version {version} < 0")
    return attrs, version


def read_status(path: str) -> str:
    """A trace's status (one of :data:`STATUSES`) from its header, without reading the events."""
    h5 = _open(path)
    try:
        with h5:
            attrs, _ = _header(path, h5)
            status = _str_attr(attrs, "status", "")
    except TraceError:
        raise
    except _Invalid as exc:
        raise TraceError(f"{path}: invalid trace: {exc}") from None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise TraceError(f"{path} is unreadable: {_first_line(exc)}") from None
    if status not in STATUSES:
        raise TraceError(f"{path}: invalid trace: status {_short(status)} is not one of {', '.join(STATUSES)}")
    return status


#: the values of the root attribute ``status``
STATUSES = ("complete", "partial", "failed", "interrupted")

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


def _dataset(h5, name: str, dtype: np.dtype, version: int):
    """The dataset ``name`` if its shape and column dtypes fit ``dtype``: one dimension, a compound
    type holding every column (schema <= 3: all but the version-4 ones), each stored in a type that
    converts to the expected one without loss (``numpy.can_cast(..., "safe")``). Returns
    ``(dataset, missing v4 columns)``; reads no data."""
    import h5py

    if name not in h5:
        raise _Invalid(f"no /{name} dataset (incomplete file)")
    dset = h5[name]
    if not isinstance(dset, h5py.Dataset):
        raise _Invalid(f"/{name} is a {type(dset).__name__}, not a dataset")
    if dset.ndim != 1:
        raise _Invalid(f"/{name} has shape {dset.shape}, expected one dimension")
    names = dset.dtype.names or ()
    missing = [f for f in dtype.names if f not in names]
    if missing and not (version < 4 and set(missing) <= V4_COLUMNS.get(name, set())):
        raise _Invalid(f"/{name} lacks the columns {', '.join(missing)}")
    for f in dtype.names:
        if f in names:
            stored, wanted = dset.dtype[f], dtype[f]
            if stored.names is not None or stored.subdtype is not None or not np.can_cast(stored, wanted, "safe"):
                raise _Invalid(f"column /{name}.{f} is stored as {stored}, expected {wanted}")
    return dset, missing


def _check_storage(name: str, dset) -> None:
    """Refuse a dataset declared (much) larger than the bytes stored for it: reading it would
    allocate its declared size, filled with fill values (a hostile or half-written file)."""
    nbytes = dset.shape[0] * dset.dtype.itemsize
    if nbytes <= (1 << 20) or dset.is_virtual:  # virtual datasets: their sources are read, bounded below
        return
    stored = dset.id.get_storage_size()
    ratio = MAX_COMPRESSION if dset.compression else 1
    if nbytes > stored * ratio:
        raise _Invalid(f"/{name} declares {dset.shape[0]:,} rows ({nbytes:,} bytes) but stores {stored:,} bytes "
                       "(truncated write?)")


def _read_dataset(name: str, dset, dtype: np.dtype, missing) -> np.ndarray:
    data = dset[()]
    if missing:
        return _upgrade_v3(name, data, dtype)
    if data.dtype != dtype:  # another column order, a narrower or big-endian type, extra columns
        out = np.zeros(len(data), dtype=dtype)
        for f in dtype.names:
            out[f] = data[f]
        data = out
    return data


def _json_attr(attrs, name: str, where: str):
    """A JSON attribute, bounded in size and depth."""
    text = _str_attr(attrs, name)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _Invalid(f"{where} {name!r} is not valid JSON ({_first_line(exc)[:80]})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise _Invalid(f"{where} {name!r} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth(value) -> int:
    """Nesting depth of a decoded JSON value (iterative)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _vocabulary(h5) -> Dict[str, List[str]]:
    """``/vocab``: JSON lists of strings. ``ops``, ``phases`` and ``axes`` only ever grew by appending
    (section 1 of docs/trace-format.md), so each must be a prefix of this version's list, long
    enough to hold the words the analysis looks up (``ops`` up to ``wait``: version 1; ``phases`` up to
    ``opt``: ``recompute`` was appended in version 5; ``axes`` up to ``x``: ``inter`` was appended in version 6)."""
    if "vocab" not in h5:
        raise _Invalid("no /vocab group")
    attrs = dict(h5["vocab"].attrs)
    vocab: Dict[str, List[str]] = {}
    for key, known, shortest in (("ops", OPS, OPS.index("wait") + 1), ("phases", PHASES, PHASES.index("recompute")),
                                 ("axes", AXES, AXES.index("x") + 1), ("layers", None, 1)):
        if key not in attrs:
            raise _Invalid(f"no {key} vocabulary")
        words = _json_attr(attrs, key, "vocabulary")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise _Invalid(f"vocabulary {key!r} is not a JSON list of strings")
        if not shortest <= len(words) <= MAX_VOCAB_WORDS:
            raise _Invalid(f"vocabulary {key!r} has {len(words)} words")
        if known is not None and words != list(known[:len(words)]):
            raise _Invalid(f"vocabulary {key!r} is {_short(words)}, not a version of {list(known)}")
        vocab[key] = words
    for key, value in attrs.items():
        if key not in vocab:  # e.g. levels: kept when it is a list of strings
            words = _json_attr(attrs, key, "vocabulary")
            if isinstance(words, list) and all(isinstance(w, str) for w in words):
                vocab[key] = words
    return vocab


_NUMBER = {"type": "number"}
_COUNT = {"type": "integer", "minimum": 0}
#: types of the metadata keys the readers use (others are kept as they are)
METADATA_SCHEMA = {
    "type": "object",
    "properties": {
        "run_id": {"type": "string"}, "grid": {"type": "string"}, "level": {"enum": list(LEVELS)},
        "world_size": {"type": "integer", "minimum": 1}, "num_nodes": _COUNT, "warmup_steps": _COUNT,
        "tokens_per_step": _COUNT, "model_flops_per_step": {"type": "number", "minimum": 0},
        "ranks_per_node": {"type": "array", "items": _COUNT},
        "layers": {"type": "array", "items": {"type": "string"}},
        "config": {"type": "object"}, "packages": {"type": "object"}, "environment": {"type": "object"},
        "mpi": {"type": "object", "properties": {"library_version": {"type": "string"}}},
        "run_options": {"type": "object", "properties": {
            "model": {"type": "object"},
            "grid": {"type": "object", "properties": {a: {"type": "integer", "minimum": 1}
                                                      for a in ("data", "z", "y", "x")}}}},
        "summary": {"type": "object", "properties": {k: {"type": ["number", "null"]} for k in (
            "steps", "median_s", "min_s", "max_s", "q1_s", "q3_s", "compute_share", "wait_share", "other_share",
            "harness_share", "model_tflops_per_rank", "peak_tflops", "tokens_per_s", "percent_of_peak", "gemm_tflops",
            "mfu_pct", "hfu_pct", "gemm_pct")}},
        "failures": {"type": "array"}, "command": {"type": "array"},
        "placement": {"type": "object", "properties": {
            "num_nodes": _COUNT, "nodes": {"type": "array", "items": _COUNT},
            "hosts": {"type": "array", "items": {"type": "string"}},
            "dims": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
            "node_span": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer",
                                                                                                "minimum": 1}}},
            "inter_node_axes": {"type": "array", "items": {"type": "string"}}}},
        "binding": {"type": ["object", "null"], "properties": {
            "pinned": {"type": "boolean"}, "num_cpus": {"type": "array", "items": _COUNT},
            "cpus": {"type": "array", "items": {"type": "string", "pattern": r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$"}},
            "node_cpus": {"type": "array", "items": _COUNT}, "shared_ranks": _COUNT, "free_ranks": _COUNT,
            "summary": {"type": "string"}}},
    },
}


def _metadata(h5, world: int) -> Dict:
    """``/metadata`` decoded: ``json_keys`` names the JSON-encoded values (parsed with bounds), the
    known keys' types checked (:data:`METADATA_SCHEMA`), ``world_size`` equal to the ranks present."""
    attrs = dict(h5["metadata"].attrs) if "metadata" in h5 else {}
    json_keys = _json_attr(attrs, "json_keys", "metadata") if "json_keys" in attrs else []
    if not isinstance(json_keys, list) or not all(isinstance(k, str) for k in json_keys):
        raise _Invalid("metadata 'json_keys' is not a JSON list of strings")
    metadata = {}
    for key, value in attrs.items():
        if key == "json_keys":
            continue
        if key in json_keys:
            value = _json_attr(attrs, key, "metadata")
        elif isinstance(value, (bytes, str)):
            value = _str_attr(attrs, key)
        elif isinstance(value, np.generic):
            value = value.item()
        elif isinstance(value, np.ndarray) and value.size <= 4096:
            value = value.tolist()
        elif isinstance(value, np.ndarray):
            raise _Invalid(f"metadata {key!r} is an array of {value.size:,} values")
        metadata[key] = value
    from fourd_mpi.util.yamlspec import key_path, schema_violations

    problems = schema_violations(metadata, METADATA_SCHEMA, finite=False)  # NaN: not measured
    if problems:
        where, message = problems[0]
        raise _Invalid(f"metadata {key_path(where)}: {message}")
    if "world_size" in metadata and metadata["world_size"] != world:
        raise _Invalid(f"metadata world_size {metadata['world_size']} != the {world} rows of /ranks")
    return metadata


def _check_ranges(events, rank_steps, ranks, vocab, world: int) -> "_Scan":
    """Codes within their vocabularies, ranks within the world, the per-rank event ranges of
    ``/ranks`` monotonic and covering ``/events`` exactly (what indexing and decoding rely on).

    The event checks run in the one pass of :func:`_scan_events`, which also gathers what
    :func:`damage` needs (returned); problems are raised in the order: ``/ranks`` rows, event ranks,
    rank-step ranks, codes (op, phase, axis, layer), ``/ranks`` event ranges, rows outside their rank's
    range."""
    if not np.array_equal(ranks["rank"], np.arange(world)):
        raise _Invalid(f"/ranks does not list ranks 0..{world - 1} in order")
    try:
        _check_rank_ranges(ranks, world, len(events))
        ranges = None
    except _Invalid as exc:
        ranges = exc
    scan = _scan_events(events, rank_steps, world, vocab, None if ranges is not None else ranks["event_count"])
    found = scan["rank"]
    if found.count:
        raise _Invalid(f"/events row {found.first}: rank {found.value} outside the world of {world}")
    bad = np.nonzero(rank_steps["rank"] >= world)[0]
    if len(bad):
        raise _Invalid(f"/rank_steps row {bad[0]}: rank {rank_steps['rank'][bad[0]]} outside the world of {world}")
    for column, words in _VOCAB_OF.items():
        found = scan[column]
        if found.count:
            raise _Invalid(f"/events row {found.first}: {column} code {found.value} outside its vocabulary of "
                           f"{len(vocab[words])} words ({found.count} such rows)")
    if ranges is not None:
        raise ranges
    found = scan["owner"]
    if found.count:
        raise _Invalid(f"/events row {found.first} (rank {events['rank'][found.first]}) lies outside that rank's "
                       "event_offset/event_count range")
    return scan


def _check_rank_ranges(ranks: np.ndarray, world: int, n_events: int) -> None:
    """``/ranks`` lists ranks 0..world-1 in order, and their event ranges are monotonic and cover
    ``n_events`` rows exactly."""
    if not np.array_equal(ranks["rank"], np.arange(world)):
        raise _Invalid(f"/ranks does not list ranks 0..{world - 1} in order")
    offset, count = ranks["event_offset"], ranks["event_count"]
    if (count < 0).any() or (offset < 0).any():
        raise _Invalid("/ranks: a negative event_offset or event_count")
    if int(count.sum()) != n_events:
        raise _Invalid(f"/ranks event_count sums to {int(count.sum())}, /events has {n_events} rows")
    held = count > 0
    ends = offset[held] + count[held]
    if len(ends) and (ends.max() > n_events or (offset[held][1:] < ends[:-1]).any()):
        raise _Invalid("/ranks event_offset ranges are not monotonic within /events")


def load_trace(path: str, allow_damaged: bool = False, events: bool = True) -> Trace:
    """Read a trace file written by ``fourd-mpi run`` or ``fourd-mpi trace recover``.

    Everything is checked before use: the header, the shape and column types of each dataset (and
    that it stores the bytes it declares), the vocabularies, codes and ranks within range, the
    per-rank event ranges, and the JSON attributes (parsed with size and depth bounds). A file that
    fails any of this raises :class:`TraceError`. A file that passes but holds impossible values
    (NaN or negative times, a rank's events missing for its trace level: :func:`damage`) is
    *damaged*: it raises :class:`DamagedTraceError` unless ``allow_damaged``; ``Trace.damage``
    lists the reasons.

    ``events=False``: everything but the events themselves (``Trace.events`` is empty): the header,
    the tables, the per-rank event ranges of ``/ranks`` against the event count, and of a multi-part
    trace every part file's identity and row count (what ``trace recover`` checks after its workers
    have read each part back); no damage check.
    """
    h5 = _open(path)
    try:
        with h5:
            attrs, version = _header(path, h5)
            status = _str_attr(attrs, "status", "")
            if status not in STATUSES:
                raise _Invalid(f"status {_short(status)} is not one of {', '.join(STATUSES)}")
            found = {name: _dataset(h5, name, dtype, version) for name, dtype in _DATASETS.items()}
            world = found["ranks"][0].shape[0]
            if not 1 <= world <= MAX_RANKS:
                raise _Invalid(f"/ranks has {world} rows")
            if "world_size" in attrs and _int_attr(attrs, "world_size") != world:
                raise _Invalid(f"header says world_size {_int_attr(attrs, 'world_size')} but /ranks holds {world} "
                               "ranks")
            n_events = found["events"][0].shape[0]
            parts = _int_attr(attrs, "parts", 0) if version >= 5 else 0
            if n_events != _int_attr(attrs, "events", -1):
                raise TraceError(f"{path} holds {n_events} events but its header says "
                                 f"{attrs.get('events')} (truncated write?)")
            need = sum(d.shape[0] * dtype.itemsize for (d, _), dtype in zip(found.values(), _DATASETS.values()))
            budget = _memory_budget()
            if need > budget:
                raise _Invalid(f"its datasets need {need / 2**30:.1f} GiB in memory, more than the "
                               f"{budget / 2**30:.1f} GiB this reader may use")
            for name, (dset, _) in found.items():
                _check_storage(name, dset)
            vocab = _vocabulary(h5)
            metadata = _metadata(h5, world)
            arrays = {name: _read_dataset(name, dset, _DATASETS[name], missing)
                      for name, (dset, missing) in found.items() if name != "events" or (not parts and events)}
            if parts:  # a multi-part trace: every part checked, then read one at a time (not through the VDS)
                arrays["events"] = read_parts(path, h5, str(attrs.get("run_id", "")), n_events, read=events)
            scan = None
            if events:
                scan = _check_ranges(arrays["events"], arrays["rank_steps"], arrays["ranks"], vocab, world)
            else:
                arrays["events"] = np.zeros(0, dtype=EVENT_DTYPE)
                _check_rank_ranges(arrays["ranks"], world, n_events)
                bad = np.nonzero(arrays["rank_steps"]["rank"] >= world)[0]
                if len(bad):
                    raise _Invalid(f"/rank_steps row {bad[0]}: rank {arrays['rank_steps']['rank'][bad[0]]} outside "
                                   f"the world of {world}")
    except TraceError:
        raise
    except _Invalid as exc:
        raise TraceError(f"{path}: invalid trace: {exc}") from None
    except MemoryError:
        raise TraceError(f"{path}: too large to load into this process's memory") from None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError) as exc:
        raise TraceError(f"{path} is unreadable: {_first_line(exc)}") from None
    trace = Trace(path=path, status=status, schema_version=version, metadata=metadata, vocab=vocab,
                  events=arrays["events"], steps=arrays["steps"], rank_steps=arrays["rank_steps"],
                  ranks=arrays["ranks"], attrs={k: (v.item() if isinstance(v, np.generic) else v)
                                                for k, v in attrs.items()})
    trace.damage = damage(trace, scan) if events else []
    if trace.damage and not allow_damaged:
        raise DamagedTraceError(f"{path} is damaged: {trace.damage[0]}"
                                + (f" (and {len(trace.damage) - 1} more problem(s))" if len(trace.damage) > 1 else "")
                                + "; --allow-damaged analyses it anyway")
    return trace


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


#: time columns that are never negative, per dataset (``clock_offset_ns`` may be)
_NONNEGATIVE = {
    "events": ("start_ns", "end_ns", "bytes", "wire_bytes", "wait_ns", "mpi_ns", "overlap_ns"),
    "rank_steps": ("start_ns", "end_ns", "compute_ns", "wait_ns", "mpi_ns"),
    "steps": ("start_ns", "end_ns", "compute_ns_max", "wait_ns_max"),
    "ranks": ("clock_uncertainty_ns", "clock_residual_ns"),
}


def damage(trace: Trace, scan: "_Scan" = None) -> List[str]:
    """Why a structurally valid trace cannot be analysed as it is (empty: it can).

    - NaN, infinite or negative times: every ``*_ns`` column but ``clock_offset_ns``, ``bytes``,
      ``wire_bytes``, ``flops`` and the ``seconds`` of steps and rank-steps; an event, step or
      rank-step that ends before it starts; a collective that completes before its issue;
    - per-rank completeness against the trace level: every step has one record per rank, every
      event belongs to a recorded (rank, step), each rank-step's ``events`` count equals its events
      in ``/events``, and each holds exactly one step span; level ``step`` keeps step spans only,
      ``layer`` step and layer spans only, ``op`` at least one host-lane event per rank-step.

    The event checks are those of :func:`_scan_events` (one pass over the records, block by block);
    ``scan``: its result for these events and rank-steps, when already made (:func:`load_trace`).
    """
    out: List[str] = []
    if scan is None:
        scan = _scan_events(trace.events, trace.rank_steps)
    tables = {"events": trace.events, "rank_steps": trace.rank_steps, "steps": trace.steps, "ranks": trace.ranks}

    def failing(name: str, check: str, bad) -> Tuple[int, int]:
        """(count, first row) of the rows of table ``name`` failing ``check`` (``bad()``: their mask)."""
        if name == "events":
            found = scan[check]
            return found.count, found.first
        rows = np.nonzero(bad())[0]
        return len(rows), (rows[0] if len(rows) else -1)

    for name, columns in _NONNEGATIVE.items():
        table = tables[name]
        for column in columns:
            count, first = failing(name, column, lambda: table[column] < 0)
            if count:
                out.append(f"/{name}: {count} row(s) with negative {column} (first: row {first})")
        if "end_ns" in table.dtype.names:
            count, first = failing(name, "end_ns<start_ns", lambda: table["end_ns"] < table["start_ns"])
            if count:
                out.append(f"/{name}: {count} row(s) ending before they start (first: row {first})")
    for name, column in (("events", "flops"), ("rank_steps", "seconds"), ("steps", "seconds")):
        values = tables[name][column]
        count, first = failing(name, column, lambda: ~np.isfinite(values) | (values < 0))
        if count:
            out.append(f"/{name}: {count} row(s) with NaN, infinite or negative {column} (first: row {first})")
    found = scan["issue"]
    if found.count:
        out.append(f"/events: {found.count} collective(s) completing before their issue (first: row {found.first})")
    out += _completeness(trace, scan)
    return out


def _completeness(trace: Trace, scan: "_Scan" = None) -> List[str]:
    """The completeness part of :func:`damage` (vectorised: sorts, no loop over ranks or steps; the
    events counted per rank-step and lane class by :func:`_scan_events`)."""
    out: List[str] = []
    if scan is None:
        scan = _scan_events(trace.events, trace.rank_steps)
    rs, world = trace.rank_steps, trace.world_size
    steps, keys, first = _record_keys(rs)
    if len(keys) != len(rs):
        out.append(f"/rank_steps: {len(rs) - len(keys)} duplicate (rank, step) record(s)")
    if len(keys) != world * len(steps):
        per_step = np.bincount(np.searchsorted(steps, rs["step"]), minlength=len(steps))
        short = np.nonzero(per_step < world)[0]
        if len(short):
            out.append(f"step {steps[short[0]]}: records from {per_step[short[0]]} of {world} ranks"
                       + (f" ({len(short)} such steps)" if len(short) > 1 else ""))
    if scan["unknown"].count:
        out.append(f"/events: {scan['unknown'].count} event(s) of steps without a step record")
    if scan["unmatched"].count:
        out.append(f"/events: {scan['unmatched'].count} event(s) of a rank in a step it has no record for")
    by_key = scan.by_key  # matched events per record key; columns: step span, layer span, host, comm lanes
    held = by_key.sum(axis=1)
    expected = rs["events"][first]
    bad = np.nonzero(held != expected)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {held[bad[0]]} events in /events, its record says "
                   f"{rs['events'][i]} (truncated?; {len(bad)} such rank-steps)")
    spans = by_key[:, LANE_STEP]
    bad = np.nonzero(spans != 1)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {spans[bad[0]]} step spans, expected 1 "
                   f"({len(bad)} such rank-steps)")
    level = trace.metadata.get("level")
    allowed = {"step": LANE_STEP, "layer": LANE_LAYER}.get(level)
    finer = int(by_key[:, allowed + 1:].sum()) if allowed is not None else 0
    if finer:
        out.append(f"level {level}: {finer} event(s) of a finer level")
    if level == "op":
        bad = np.nonzero(by_key[:, LANE_HOST] == 0)[0]
        if len(bad):
            i = first[bad[0]]
            out.append(f"level op: rank {rs['rank'][i]} step {rs['step'][i]} has no host-lane event "
                       f"({len(bad)} such rank-steps)")
    return out


# ---------------------------------------------------------------------------
# one pass over the events: every elementwise check of a block of rows while it is in cache
# ---------------------------------------------------------------------------

#: rows per block of :func:`_scan_events` and :func:`gather_columns` (8192 records of 102 bytes: 0.8 MiB,
#: within a core's L2): a column of a structured array is a strided view, so checking or copying the
#: columns one at a time over all rows would pull every record through memory once per column
SCAN_ROWS = 8192


def blocks(n: int, rows: int = None):
    """``(start, stop)`` of consecutive blocks of ``rows`` rows (default :data:`SCAN_ROWS`) covering
    ``range(n)``."""
    rows = max(int(SCAN_ROWS if rows is None else rows), 1)
    return ((a, min(a + rows, n)) for a in range(0, n, rows))


def gather_columns(events: np.ndarray, columns, select, rows: int = None) -> Dict[str, np.ndarray]:
    """``{column: events[column][mask]}`` (contiguous copies, rows in file order) for the rows where
    ``select(block)`` is true: ``select`` gets a block of ``events`` (a slice, ``rows`` rows at most) and
    returns its boolean mask. One pass through the records, block by block (instead of one strided
    pass per column)."""
    pieces: Dict[str, List[np.ndarray]] = {c: [] for c in columns}
    for a, b in blocks(len(events), rows):
        block = events[a:b]
        picked = np.flatnonzero(select(block))
        if len(picked):
            for c in columns:
                pieces[c].append(block[c][picked])
    out = {}
    for c in list(pieces):  # each column's pieces freed once joined
        p = pieces.pop(c)
        out[c] = np.concatenate(p) if p else np.zeros(0, dtype=events.dtype[c])
    return out


def in_codes(values: np.ndarray, codes) -> np.ndarray:
    """``np.isin(values, codes)``; for one-byte unsigned ``values`` (the op, phase, axis and lane
    columns) by a 256-entry lookup table instead of a sort."""
    if values.dtype != np.uint8:
        return np.isin(values, codes)
    table = np.zeros(256, dtype=bool)
    table[[int(c) for c in codes if 0 <= int(c) < 256]] = True
    return table[values]


class _Tally:
    """How many rows fail one check, the first of them, and its value (``values[row]`` at that row)."""

    __slots__ = ("count", "first", "value")

    def __init__(self):
        self.count, self.first, self.value = 0, -1, None

    def add(self, bad: np.ndarray, offset: int, values=None) -> None:
        n = int(np.count_nonzero(bad))
        if n:
            if not self.count:
                i = int(np.argmax(bad))
                self.first, self.value = offset + i, (values[i] if values is not None else None)
            self.count += n


class _Scan:
    """What :func:`_scan_events` found: one :class:`_Tally` per check, and per (rank, step) record key
    the matched events by lane class (columns: step span, layer span, host, comm lanes)."""

    def __init__(self):
        self.tally: Dict[str, _Tally] = {}
        self.by_key: np.ndarray = np.zeros((0, 4), dtype=np.int64)

    def __getitem__(self, name: str) -> _Tally:
        return self.tally.setdefault(name, _Tally())


def _record_keys(rank_steps: np.ndarray):
    """``(steps, keys, first)``: the distinct steps of ``/rank_steps``; the distinct record keys
    ``rank * max(len(steps), 1) + step index`` (sorted) and the first record of each."""
    steps = np.unique(rank_steps["step"])
    n_steps = max(len(steps), 1)
    rs_key = rank_steps["rank"].astype(np.int64) * n_steps + np.searchsorted(steps, rank_steps["step"])
    keys, first = np.unique(rs_key, return_index=True)
    return steps, keys, first


#: the event columns :func:`_scan_events` reads
_SCANNED = frozenset(("rank", "step", "lane", "start_ns", "end_ns", "flops", "issue_ns", "complete_ns")
                     + tuple(_VOCAB_OF) + _NONNEGATIVE["events"])


def _scan_events(events: np.ndarray, rank_steps: np.ndarray, world=None, vocab=None, counts=None,
                 rows: int = None) -> _Scan:
    """Every elementwise check of ``events`` in one pass, block by block (:data:`SCAN_ROWS`).

    Always (for :func:`damage`): negative values of the non-negative columns, rows ending before they
    start, NaN/infinite/negative ``flops``, collectives completing before their issue; events of a step
    without a record (``unknown``), of a rank-step without a record (``unmatched``), and the matched
    events counted per record key and lane class (:func:`_completeness`). With ``world`` and ``vocab``
    (for :func:`_check_ranges`): ranks outside the world, codes outside their vocabularies; with
    ``counts`` (``/ranks`` ``event_count``, already checked) rows outside their rank's range.
    """
    scan = _Scan()
    steps, keys, _ = _record_keys(rank_steps)
    n_steps, n_keys = max(len(steps), 1), len(keys)
    contiguous = len(steps) > 0 and int(steps[-1]) - int(steps[0]) + 1 == len(steps)
    dense = n_keys > 0 and int(keys[0]) == 0 and int(keys[-1]) == n_keys - 1  # keys == arange(n_keys)
    by_key = np.zeros((n_keys, 4), dtype=np.int64)
    codes = []
    if world is not None:
        for column, words in _VOCAB_OF.items():
            info = np.iinfo(events.dtype[column])
            codes.append((column, len(vocab[words]), info.min < 0, len(vocab[words]) <= info.max))
    if counts is not None:
        owners = np.arange(len(counts))[counts > 0]
        ends = np.cumsum(counts[counts > 0])
    columns = [c for c in events.dtype.names if c in _SCANNED]
    for a, b in blocks(len(events), rows):
        records = events[a:b]
        block = {c: np.ascontiguousarray(records[c]) for c in columns}  # each column read once, from cache
        rank, lane = block["rank"], block["lane"]
        if world is not None:
            scan["rank"].add(rank >= world, a, rank)
            for column, n_words, signed, bounded in codes:
                code = block[column]
                if signed and bounded:
                    scan[column].add((code < 0) | (code >= n_words), a, code)
                elif signed:
                    scan[column].add(code < 0, a, code)
                elif bounded:
                    scan[column].add(code >= n_words, a, code)
        if counts is not None:
            lo, hi = np.searchsorted(ends, a, side="right"), np.searchsorted(ends, b, side="left") + 1
            starts = np.concatenate([[a], ends[lo:hi - 1]])
            stops = np.minimum(ends[lo:hi], b)
            scan["owner"].add(rank != np.repeat(owners[lo:hi], stops - starts), a)
        for column in _NONNEGATIVE["events"]:
            scan[column].add(block[column] < 0, a)
        start, end = block["start_ns"], block["end_ns"]
        scan["end_ns<start_ns"].add(end < start, a)
        flops = block["flops"]
        scan["flops"].add(~np.isfinite(flops) | (flops < 0), a)
        issue = block["issue_ns"]
        scan["issue"].add((lane >= LANE_COMM0) & ((block["complete_ns"] < issue) | (issue < 0)), a)
        step = block["step"]
        if contiguous:
            known = (step >= steps[0]) & (step <= steps[-1])
            index = step.astype(np.int64) - int(steps[0])
        elif len(steps):
            index = np.searchsorted(steps, step)
            known = (index < len(steps)) & (steps[np.minimum(index, len(steps) - 1)] == step)
        else:
            known, index = np.zeros(b - a, dtype=bool), np.zeros(b - a, dtype=np.int64)
        scan["unknown"].add(~known, a)
        key = rank.astype(np.int64) * n_steps + index
        if dense:
            where, matched = key, known & (key >= 0) & (key < n_keys)
        elif n_keys:
            where = np.searchsorted(keys, key)
            matched = known & (where < n_keys) & (keys[np.minimum(where, n_keys - 1)] == key)
        else:
            where, matched = key, np.zeros(b - a, dtype=bool)
        scan["unmatched"].add(known & ~matched, a)
        where = where[matched]
        if len(where):
            low = int(where.min())
            cell = (where - low) * 4 + np.minimum(lane[matched], LANE_COMM0)
            part = np.bincount(cell, minlength=4 * (int(where.max()) - low + 1)).reshape(-1, 4)
            by_key[low:low + len(part)] += part
    scan.by_key = by_key
    return scan


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

    Vectorised (sorts and joins over all events, no loop over ranks or events): O(N log N) for N
    events. Per rank the problems come in the order lanes, waits, copies, step spans (at most one
    wait problem and one per copy op per rank: the first in file order).
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
    # what a wait can wait for: collectives, and (schema >= 6) point-to-point messages between pipeline stages
    collective_codes = [trace.code("op", name) for name in COLLECTIVE_OPS + P2P_OPS if name in trace.vocab["ops"]]
    index = np.nonzero(ev["rank"] < world)[0]  # events of ranks outside the world: not checked
    tab = _Columns(ev, index)  # positions below index the checked events; index[p] is the row in ev
    found: List[Tuple[int, int, int, str]] = []  # (rank, kind, order within kind, message)
    _lane_problems(tab, found)
    op = tab["op"]
    colls = np.nonzero(np.isin(op, collective_codes))[0]
    key_columns = ("rank", "axis", "step")

    def first_per_rank(rows: np.ndarray, kind: int, message) -> None:
        if len(rows):
            _, first = np.unique(tab["rank"][rows], return_index=True)  # rows in file order: the first per rank
            for i in rows[first]:
                found.append((int(tab["rank"][i]), kind, 0, message(ev[index[i]])))

    waits = np.nonzero(op == wait_code)[0]
    inside = _any_match(tab, waits, colls, key_columns, ("start_ns", "end_ns"), ("issue_ns", "complete_ns"),
                        lambda w, c: (c[0] <= w[0]) & (w[1] <= c[1]))
    first_per_rank(waits[~inside], 1, lambda w: f"rank {w['rank']} step {w['step']}: a wait [{w['start_ns']}, "
                                                f"{w['end_ns']}] lies outside every collective on its axis")
    for k, name in enumerate(COPY_OPS):  # staged mode: copies sit on their collective's lane, before / after it
        if name not in trace.vocab["ops"]:
            continue
        copies = np.nonzero(op == trace.code("op", name))[0]
        if name == "d2h":
            ordered = _any_match(tab, copies, colls, key_columns + ("lane",), ("end_ns",), ("issue_ns",),
                                 lambda x, c: x[0] <= c[0])
        else:
            ordered = _any_match(tab, copies, colls, key_columns + ("lane",), ("start_ns",), ("complete_ns",),
                                 lambda x, c: x[0] >= c[0])
        first_per_rank(copies[~ordered], 2 + k, lambda c, name=name: (
            f"rank {c['rank']} step {c['step']}: a {name} copy [{c['start_ns']}, {c['end_ns']}] is not "
            f"{'before' if name == 'd2h' else 'after'} any collective on its lane and axis"))
    _span_problems(tab, found)
    found.sort(key=lambda item: item[:3])
    problems += [message for *_, message in found]
    comm_lanes = ev["lane"] >= LANE_COMM0
    if (ev["bytes"][comm_lanes] <= 0).any():
        problems.append("a collective with no bytes")
    problems += step_time_problems(trace.steps, rs)
    return problems


#: how far ``/steps`` seconds may differ from the per-rank maximum it is computed from (float rounding)
STEP_TIME_SLACK_S = 2e-9


def rank_max_seconds(steps: np.ndarray, rank_steps: np.ndarray) -> np.ndarray:
    """Per row of ``steps``: the max over ranks of the step span (``end_ns - start_ns``, seconds) in
    ``rank_steps``, the definition of a step's time; NaN for a step no rank recorded."""
    out = np.full(len(steps), np.nan)
    if not len(steps) or not len(rank_steps):
        return out
    order = np.argsort(steps["step"], kind="stable")
    where = np.searchsorted(steps["step"][order], rank_steps["step"])
    known = where < len(steps)
    known[known] &= steps["step"][order][where[known]] == rank_steps["step"][known]
    spans = (rank_steps["end_ns"].astype(np.int64) - rank_steps["start_ns"].astype(np.int64)) * 1e-9
    best = np.full(len(steps), -np.inf)
    np.maximum.at(best, where[known], spans[known])
    out[order] = np.where(np.isfinite(best), best, np.nan)
    return out


def step_time_problems(steps: np.ndarray, rank_steps: np.ndarray) -> List[str]:
    """``/steps`` seconds that disagree with the max over ranks of their step spans (the first, and a count)."""
    expected = rank_max_seconds(steps, rank_steps)
    stored = steps["seconds"].astype(np.float64)
    bad = np.nonzero(~np.isnan(expected) & ~(np.abs(stored - expected) <= STEP_TIME_SLACK_S + 1e-9 * np.abs(expected)))[0]
    if not len(bad):
        return []
    i = int(bad[0])
    return [f"step {int(steps['step'][i])}: /steps says {stored[i]:.9g} s, the max over ranks of the step spans is "
            f"{expected[i]:.9g} s ({len(bad)} such step(s))"]


class _Columns:
    """Contiguous copies of the columns of ``events[index]``, made on first use (a column of a
    structured array is strided: sorting or gathering it directly is several times slower)."""

    def __init__(self, events: np.ndarray, index: np.ndarray):
        self.events, self.index, self._cache = events, index, {}
        self.full = len(index) == len(events)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            column = self.events[name]
            self._cache[name] = np.ascontiguousarray(column) if self.full else column[self.index]
        return self._cache[name]


def _lane_problems(tab: _Columns, found: list) -> None:
    """Per (rank, lane), events sorted by start (stable): one that ends before it starts, and
    overlaps of consecutive events beyond 1 ns. Events already in (rank, start) order (what the
    writers store) are taken lane by lane without sorting; others are sorted first."""
    if not len(tab):
        return
    rank, start, end, lanes = tab["rank"], tab["start_ns"], tab["end_ns"], tab["lane"]
    if ((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (start[1:] >= start[:-1]))).all():
        order = None
    else:
        order = np.lexsort((start, lanes, rank))  # stable: file order among equal starts
    for lane in np.nonzero(np.bincount(lanes, minlength=256))[0]:
        pick = np.nonzero(lanes == lane)[0] if order is None else order[lanes[order] == lane]
        r, s, e = rank[pick], start[pick], end[pick]
        bad = np.nonzero(e < s)[0]
        for i in np.unique(r[bad], return_index=True)[1]:
            found.append((int(r[bad[i]]), 0, 2 * int(lane), f"rank {r[bad[i]]} lane {lane_name(int(lane))}: an "
                                                             "event ends before it starts"))
        pair = np.nonzero((s[1:] < e[:-1] - 1) & (r[1:] == r[:-1]))[0]  # pair i: events i and i + 1
        if len(pair):
            ranks, first, counts = np.unique(r[pair], return_index=True, return_counts=True)
            for who, f, n in zip(ranks, first, counts):
                i = pair[f]
                found.append((int(who), 0, 2 * int(lane) + 1,
                              f"rank {who} lane {lane_name(int(lane))}: {n} overlapping events, first at "
                              f"{s[i + 1]} ns < previous end {e[i]} ns"))


def _keys(tab: _Columns, columns: Tuple[str, ...], *row_sets: np.ndarray) -> List[np.ndarray]:
    """One int64 key per event of each of ``row_sets``, equal iff the events agree in every column of
    ``columns``: the columns' offsets from their minimum in mixed radix, or (when that could
    overflow) dense codes combined column by column."""
    rows = np.concatenate(row_sets)
    values = [tab[column][rows].astype(np.int64) for column in columns]
    lows = [int(v.min(initial=0)) for v in values]
    radix = [int(v.max(initial=0)) - lo + 1 for v, lo in zip(values, lows)]
    key = np.zeros(len(rows), dtype=np.int64)
    if float(np.prod([float(r) for r in radix])) < 2.0 ** 62:
        for v, lo, r in zip(values, lows, radix):
            key = key * r + (v - lo)
    else:
        for v in values:
            _, codes = np.unique(v, return_inverse=True)
            key = np.unique(key * (int(codes.max(initial=0)) + 1) + codes.reshape(-1),
                            return_inverse=True)[1].reshape(-1)
    return np.split(key, np.cumsum([len(r) for r in row_sets])[:-1])


def _any_match(tab: _Columns, rows: np.ndarray, candidates: np.ndarray, columns: Tuple[str, ...],
               row_columns: Tuple[str, ...], candidate_columns: Tuple[str, ...], test,
               pairs_per_pass: int = 1 << 22) -> np.ndarray:
    """For each event of ``rows``: does ``test(row values, candidate values)`` hold for some event of
    ``candidates`` equal to it in every column of ``columns``? ``test`` gets the ``row_columns`` of
    the rows and the ``candidate_columns`` of the candidates, pair by pair (lists of arrays). Boolean
    array like ``rows``. A join: the candidates sorted by key, each row paired with every candidate of
    its key (at most about ``pairs_per_pass`` pairs in memory at a time)."""
    out = np.zeros(len(rows), dtype=bool)
    if not len(rows) or not len(candidates):
        return out
    key_rows, key_cands = _keys(tab, columns, rows, candidates)
    order = np.argsort(key_cands)
    candidates, key_cands = candidates[order], key_cands[order]
    lo = np.searchsorted(key_cands, key_rows, side="left")
    n = np.searchsorted(key_cands, key_rows, side="right") - lo
    row_values = [tab[c][rows] for c in row_columns]
    cand_values = [tab[c][candidates] for c in candidate_columns]
    done = 0
    while done < len(rows):
        stop = done + max(1, int(np.searchsorted(np.cumsum(n[done:]), pairs_per_pass, side="right")))
        counts = n[done:stop]
        who = np.repeat(np.arange(done, stop), counts)
        cand = np.arange(len(who)) + np.repeat(lo[done:stop] - (np.cumsum(counts) - counts), counts)
        hit = test([v[who] for v in row_values], [v[cand] for v in cand_values])
        out[who[hit]] = True
        done = stop
    return out


def _span_problems(tab: _Columns, found: list) -> None:
    """Per step span: the host-lane events of its rank and step sum to at most its length and lie
    inside it."""
    lane = tab["lane"]
    hosts, spans = np.nonzero(lane == LANE_HOST)[0], np.nonzero(lane == LANE_STEP)[0]
    if not len(spans):
        return
    key_hosts, key_spans = _keys(tab, ("rank", "step"), hosts, spans)
    if (key_hosts[1:] < key_hosts[:-1]).any():  # a trace in (rank, time) order needs no sort
        order = np.argsort(key_hosts, kind="stable")
        hosts, key_hosts = hosts[order], key_hosts[order]
    begin = np.concatenate([[0], np.nonzero(key_hosts[1:] != key_hosts[:-1])[0] + 1]) if len(hosts) \
        else np.zeros(0, dtype=np.int64)
    keys = key_hosts[begin]
    span_start, span_end = tab["start_ns"][spans], tab["end_ns"][spans]
    if len(keys):
        h_start, h_end = tab["start_ns"][hosts], tab["end_ns"][hosts]
        total = np.add.reduceat(h_end - h_start, begin)  # int64: exact
        lo, hi = np.minimum.reduceat(h_start, begin), np.maximum.reduceat(h_end, begin)
        pos = np.minimum(np.searchsorted(keys, key_spans), len(keys) - 1)
        has = keys[pos] == key_spans
        blocking = np.where(has, total[pos], 0)
        outside = has & ((lo[pos] < span_start) | (hi[pos] > span_end))
    else:
        blocking, outside = np.zeros(len(spans), dtype=np.int64), np.zeros(len(spans), dtype=bool)
    for j in np.nonzero((blocking > span_end - span_start) | outside)[0]:
        span = tab.events[tab.index[spans[j]]]
        if blocking[j] > span_end[j] - span_start[j]:
            found.append((int(span["rank"]), 10, 2 * int(spans[j]),
                          f"rank {span['rank']} step {span['step']}: blocking events sum to {blocking[j]} ns, more "
                          f"than the step's {span['end_ns'] - span['start_ns']} ns"))
        if outside[j]:
            found.append((int(span["rank"]), 10, 2 * int(spans[j]) + 1,
                          f"rank {span['rank']} step {span['step']}: host events outside the step span"))
