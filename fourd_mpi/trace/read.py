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
for the trace level) is *damaged* (:func:`~fourd_mpi.trace.damage.damage`):
:class:`~fourd_mpi.errors.DamagedTraceError` unless ``allow_damaged``.

The event checks run in one pass over the records (:mod:`fourd_mpi.trace.scan`); what a sound trace of a run
satisfies beyond this (``fourd-mpi trace check``) is :mod:`fourd_mpi.trace.invariants`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from fourd_mpi.core.placement import NodePlacement
from fourd_mpi.errors import DamagedTraceError, TraceError
from fourd_mpi.trace.damage import damage
from fourd_mpi.trace.events import (
    AXES,
    EVENT_DTYPE,
    LANE_COMM0,
    LEVELS,
    OPS,
    PHASES,
    RANK_STEP_DTYPE,
    SCHEMA,
    SCHEMA_VERSION,
    VOCAB_OF,
    lane_name,
)
from fourd_mpi.trace.files import RANK_DTYPE, STEP_DTYPE, open_h5_read
from fourd_mpi.trace.parts import read_parts
from fourd_mpi.trace.scan import Scan, scan_events

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
        words = self.vocab[VOCAB_OF[column]]
        try:
            return words.index(name)
        except ValueError:
            raise KeyError(f"{name!r} is not a known {column} ({', '.join(w or repr(w) for w in words)})") from None

    def select(self, **where) -> np.ndarray:
        """Events matching all of ``column=value`` (names for op/phase/axis/layer, ints otherwise)."""
        mask = np.ones(len(self.events), dtype=bool)
        for column, value in where.items():
            if column in VOCAB_OF and isinstance(value, str):
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
        g5 = ((self.metadata.get("pipeline") or {}).get("grid5d")
              if isinstance(self.metadata.get("pipeline"), dict) else None)
        if isinstance(g5, dict) and "inter" in g5:
            dims = {"data": dims["data"], "inter": int(g5["inter"]), "z": dims["z"], "y": dims["y"], "x": dims["x"]}
        if int(np.prod(list(dims.values()))) != len(labels):  # no usable grid: every rank its own axis-less world
            dims = {"world": len(labels)}
        names = list(dict.fromkeys(labels))
        return NodePlacement.from_nodes(labels, dims, [str(n) for n in names],
                                        source="derived from /ranks (hostname, else node) of a trace without "
                                               "metadata placement (schema < 7)")

    def decode(self, column: str, codes) -> np.ndarray:
        words = np.array(self.vocab[VOCAB_OF[column]], dtype=object)
        return words[np.asarray(codes, dtype=np.int64)]

    def events_frame(self):
        """The events as a pandas DataFrame; op, phase, axis, layer and lane as categories."""
        import pandas as pd

        df = pd.DataFrame(self.events)
        for column in VOCAB_OF:
            df[column] = pd.Categorical.from_codes(df[column].astype(np.int64), self.vocab[VOCAB_OF[column]])
        lanes = sorted(set(df["lane"].tolist()))
        df["lane"] = pd.Categorical([lane_name(c) for c in df["lane"]], [lane_name(c) for c in lanes])
        return df

    def steps_frame(self):
        import pandas as pd

        return pd.DataFrame(self.steps)

    def rank_steps_frame(self):
        import pandas as pd

        return pd.DataFrame(self.rank_steps)


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
        out["overlap_ns"] = np.where(collective,
                                     np.maximum(data["complete_ns"] - data["issue_ns"] - data["wait_ns"], 0), 0)
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
            "cpus": {"type": "array",
                     "items": {"type": "string", "pattern": r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$"}},
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


def _check_ranges(events, rank_steps, ranks, vocab, world: int) -> Scan:
    """Codes within their vocabularies, ranks within the world, the per-rank event ranges of
    ``/ranks`` monotonic and covering ``/events`` exactly (what indexing and decoding rely on).

    The event checks run in the one pass of :func:`~fourd_mpi.trace.scan.scan_events`, which also gathers what
    :func:`~fourd_mpi.trace.damage.damage` needs (returned); problems are raised in the order: ``/ranks`` rows,
    event ranks, rank-step ranks, codes (op, phase, axis, layer), ``/ranks`` event ranges, rows outside their
    rank's range."""
    if not np.array_equal(ranks["rank"], np.arange(world)):
        raise _Invalid(f"/ranks does not list ranks 0..{world - 1} in order")
    try:
        _check_rank_ranges(ranks, world, len(events))
        ranges = None
    except _Invalid as exc:
        ranges = exc
    scan = scan_events(events, rank_steps, world, vocab, None if ranges is not None else ranks["event_count"])
    found = scan["rank"]
    if found.count:
        raise _Invalid(f"/events row {found.first}: rank {found.value} outside the world of {world}")
    bad = np.nonzero(rank_steps["rank"] >= world)[0]
    if len(bad):
        raise _Invalid(f"/rank_steps row {bad[0]}: rank {rank_steps['rank'][bad[0]]} outside the world of {world}")
    for column, words in VOCAB_OF.items():
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
    (NaN or negative times, a rank's events missing for its trace level:
    :func:`~fourd_mpi.trace.damage.damage`) is *damaged*: it raises :class:`DamagedTraceError` unless
    ``allow_damaged``; ``Trace.damage`` lists the reasons.

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
