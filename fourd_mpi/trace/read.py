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
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from fourd_mpi.errors import DamagedTraceError, TraceError
from fourd_mpi.trace.store import RANK_DTYPE, STEP_DTYPE
from fourd_mpi.trace.events import (AXES, COLLECTIVE_OPS, COPY_OPS, EVENT_DTYPE, LANE_COMM0, LANE_HOST, LANE_LAYER,
                                   LANE_STEP, LEVELS, OPS, P2P_OPS, PHASES, RANK_STEP_DTYPE, SCHEMA, SCHEMA_VERSION, lane_name)

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
    from fourd_mpi.trace.store import open_h5_read

    try:
        return open_h5_read(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
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
            "harness_share", "model_tflops_per_rank", "peak_tflops", "tokens_per_s", "percent_of_peak")}},
        "failures": {"type": "array"}, "command": {"type": "array"},
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

    problems = schema_violations(metadata, METADATA_SCHEMA)
    if problems:
        where, message = problems[0]
        raise _Invalid(f"metadata {key_path(where)}: {message}")
    if "world_size" in metadata and metadata["world_size"] != world:
        raise _Invalid(f"metadata world_size {metadata['world_size']} != the {world} rows of /ranks")
    return metadata


def _check_ranges(events, rank_steps, ranks, vocab, world: int) -> None:
    """Codes within their vocabularies, ranks within the world, the per-rank event ranges of
    ``/ranks`` monotonic and covering ``/events`` exactly (what indexing and decoding rely on)."""
    if not np.array_equal(ranks["rank"], np.arange(world)):
        raise _Invalid(f"/ranks does not list ranks 0..{world - 1} in order")
    for column, table in (("rank", events), ("rank", rank_steps)):
        bad = np.nonzero(table[column] >= world)[0]
        if len(bad):
            name = "events" if table is events else "rank_steps"
            raise _Invalid(f"/{name} row {bad[0]}: rank {table[column][bad[0]]} outside the world of {world}")
    for column, words in _VOCAB_OF.items():
        codes = events[column].astype(np.int64)
        bad = np.nonzero((codes < 0) | (codes >= len(vocab[words])))[0]
        if len(bad):
            raise _Invalid(f"/events row {bad[0]}: {column} code {codes[bad[0]]} outside its vocabulary of "
                           f"{len(vocab[words])} words ({len(bad)} such rows)")
    _check_rank_ranges(ranks, world, len(events))
    count = ranks["event_count"]
    held = count > 0
    owner = np.repeat(ranks["rank"][held], count[held])
    if len(events) and not np.array_equal(events["rank"], owner):
        first = int(np.nonzero(events["rank"] != owner)[0][0])
        raise _Invalid(f"/events row {first} (rank {events['rank'][first]}) lies outside that rank's "
                       "event_offset/event_count range")


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
                from fourd_mpi.trace.merge import read_parts

                arrays["events"] = read_parts(path, h5, str(attrs.get("run_id", "")), n_events, read=events)
            if events:
                _check_ranges(arrays["events"], arrays["rank_steps"], arrays["ranks"], vocab, world)
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
    trace.damage = damage(trace) if events else []
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


def damage(trace: Trace) -> List[str]:
    """Why a structurally valid trace cannot be analysed as it is (empty: it can).

    - NaN, infinite or negative times: every ``*_ns`` column but ``clock_offset_ns``, ``bytes``,
      ``wire_bytes``, ``flops`` and the ``seconds`` of steps and rank-steps; an event, step or
      rank-step that ends before it starts; a collective that completes before its issue;
    - per-rank completeness against the trace level: every step has one record per rank, every
      event belongs to a recorded (rank, step), each rank-step's ``events`` count equals its events
      in ``/events``, and each holds exactly one step span; level ``step`` keeps step spans only,
      ``layer`` step and layer spans only, ``op`` at least one host-lane event per rank-step.
    """
    out: List[str] = []
    tables = {"events": trace.events, "rank_steps": trace.rank_steps, "steps": trace.steps, "ranks": trace.ranks}
    for name, columns in _NONNEGATIVE.items():
        table = tables[name]
        for column in columns:
            bad = np.nonzero(table[column] < 0)[0]
            if len(bad):
                out.append(f"/{name}: {len(bad)} row(s) with negative {column} (first: row {bad[0]})")
        if "end_ns" in table.dtype.names:
            bad = np.nonzero(table["end_ns"] < table["start_ns"])[0]
            if len(bad):
                out.append(f"/{name}: {len(bad)} row(s) ending before they start (first: row {bad[0]})")
    for name, column in (("events", "flops"), ("rank_steps", "seconds"), ("steps", "seconds")):
        values = tables[name][column]
        bad = np.nonzero(~np.isfinite(values) | (values < 0))[0]
        if len(bad):
            out.append(f"/{name}: {len(bad)} row(s) with NaN, infinite or negative {column} (first: row {bad[0]})")
    ev = trace.events
    comm = ev["lane"] >= LANE_COMM0
    bad = np.nonzero(comm & ((ev["complete_ns"] < ev["issue_ns"]) | (ev["issue_ns"] < 0)))[0]
    if len(bad):
        out.append(f"/events: {len(bad)} collective(s) completing before their issue (first: row {bad[0]})")
    out += _completeness(trace)
    return out


def _completeness(trace: Trace) -> List[str]:
    """The completeness part of :func:`damage` (vectorised: sorts, no loop over ranks or steps)."""
    out: List[str] = []
    ev, rs, world = trace.events, trace.rank_steps, trace.world_size
    steps = np.unique(rs["step"])
    n_steps = max(len(steps), 1)
    rs_key = rs["rank"].astype(np.int64) * n_steps + np.searchsorted(steps, rs["step"])
    keys, first = np.unique(rs_key, return_index=True)
    if len(keys) != len(rs):
        out.append(f"/rank_steps: {len(rs) - len(keys)} duplicate (rank, step) record(s)")
    if len(keys) != world * len(steps):
        per_step = np.bincount(np.searchsorted(steps, rs["step"]), minlength=len(steps))
        short = np.nonzero(per_step < world)[0]
        if len(short):
            out.append(f"step {steps[short[0]]}: records from {per_step[short[0]]} of {world} ranks"
                       + (f" ({len(short)} such steps)" if len(short) > 1 else ""))
    index = np.searchsorted(steps, ev["step"]) if len(steps) else np.zeros(len(ev), dtype=np.int64)
    known = (index < len(steps)) & (steps[np.minimum(index, len(steps) - 1)] == ev["step"]) if len(steps) \
        else np.zeros(len(ev), dtype=bool)
    if not known.all():
        out.append(f"/events: {int((~known).sum())} event(s) of steps without a step record")
    ev_key = ev["rank"].astype(np.int64)[known] * n_steps + index[known]
    lanes = ev["lane"][known]
    where = np.searchsorted(keys, ev_key)
    matched = (where < len(keys)) & (keys[np.minimum(where, max(len(keys) - 1, 0))] == ev_key) if len(keys) \
        else np.zeros(len(ev_key), dtype=bool)
    if not matched.all():
        out.append(f"/events: {int((~matched).sum())} event(s) of a rank in a step it has no record for")
    where, lanes = where[matched], lanes[matched]
    held = np.bincount(where, minlength=len(keys))
    expected = rs["events"][first]
    bad = np.nonzero(held != expected)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {held[bad[0]]} events in /events, its record says "
                   f"{rs['events'][i]} (truncated?; {len(bad)} such rank-steps)")
    spans = np.bincount(where[lanes == LANE_STEP], minlength=len(keys))
    bad = np.nonzero(spans != 1)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {spans[bad[0]]} step spans, expected 1 "
                   f"({len(bad)} such rank-steps)")
    level = trace.metadata.get("level")
    allowed = {"step": LANE_STEP, "layer": LANE_LAYER}.get(level)
    if allowed is not None and (lanes > allowed).any():
        out.append(f"level {level}: {int((lanes > allowed).sum())} event(s) of a finer level")
    if level == "op":
        host = np.bincount(where[lanes == LANE_HOST], minlength=len(keys))
        bad = np.nonzero(host == 0)[0]
        if len(bad):
            i = first[bad[0]]
            out.append(f"level op: rank {rs['rank'][i]} step {rs['step'][i]} has no host-lane event "
                       f"({len(bad)} such rank-steps)")
    return out


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
    return problems


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
