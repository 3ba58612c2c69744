"""Export a trace to other tools' formats: Perfetto / chrome://tracing, and Hatchet / Thicket.

>>> from fourd_mpi.trace.read import load_trace
>>> from fourd_mpi.analysis.export import write_perfetto, write_perfetto_proto, write_caliper_json
>>> trace = load_trace("results/20261121-170926-7d02bf.h5")
>>> write_perfetto(trace, "run.json.gz", steps=[1, 2])     # open in ui.perfetto.dev
>>> write_perfetto_proto(trace, "run.pftrace")               # the same, Perfetto's protobuf (pip install perfetto)
>>> write_caliper_json(trace, "run.cali.json")               # hatchet / thicket

**Perfetto** (Chrome trace-event JSON): one process per rank, one named thread per lane:
``step``, ``phase``, ``layer``, ``host``, ``comm0``, ``comm1`` ... (in that order). Every event
is a complete (``"X"``) event: step spans ("step 5"), phase spans ("step 5 backward", derived
from the layer events of the phase), layer spans ("layer 3 backward (block0.fc2)": Perfetto's
search finds "layer 3 backward"), host-lane events (compute ops, waits: "wait x") and
collectives with their staging copies on their comm lane ("allreduce x", "d2h x"), from the
``MPI_I*`` call to the observed completion, with their accounting in ``args`` (``bytes``,
``wire_bytes``, ``wait_ns``, ``mpi_ns``, ``overlap_ns``, ``call_return_ns``). Events never
overlap within a thread (the recorder packs collectives in flight together onto separate comm
lanes). Flow events (``"s"``/``"t"``/``"f"``, category ``collective``) link the pieces of one
collective instance across its ranks (:func:`collective_instances`).

Ids: ``pid = rank + 1`` and ``tid = 1000 * pid + k`` (``k`` = 1 step, 2 phase, 3 layer, 4 host,
5 + i comm<i>): Perfetto reserves pid/tid 0 for the kernel's idle task, and a tid equal to its
pid would make that lane the process's "main thread"; names (``rank 3 (host)``, ``comm0``) and
sort indices carry the meaning. Times are microseconds (floats) on the trace's aligned clock,
``ts = start_ns / 1000``, written so that Perfetto's reading (``int(ts * 1000)``, truncated)
gives back the exact nanoseconds of the trace: the no-overlap guarantee survives the import.
Flow points of one instance are strictly increasing in time (Perfetto drops a flow step or end
read before its start), each strictly inside the slice it binds to.

**Perfetto protobuf** (``.pftrace``; :func:`write_perfetto_proto`, needs the ``perfetto`` package): the
same slices, names, categories, args, processes and threads as TrackEvent begin/end packets, one packet
sequence per rank with its strings interned, times in integer ns; about 40 % of the JSON's bytes
(``bench/timeline_formats.py``). :func:`timeline_format` picks the format from a file name.

**Caliper JSON-split** (what ``hatchet.GraphFrame.from_caliper`` and
``thicket.Thicket.from_caliper`` read): a tree ``step > phase > layer > op`` with one row
per (node, rank), averaged per measured step (warm-up steps left out unless asked):

- ``sum#time.duration`` (hatchet: ``time``): exclusive seconds of host-lane events, i.e.
  the main thread's time in compute ops and in waits (exposed communication). Only op
  nodes have exclusive time, so the tree's total per rank is the rank's host-lane time
  per step. Collectives have 0 here: they run behind the host's back, their blocked time
  is in the ``wait <axis>`` node next to them.
- ``inclusive#sum#time.duration`` (hatchet: ``time (inc)``): the same summed over the subtree.
- ``comm.inflight``: seconds collectives were in flight (``complete_ns - issue_ns``),
  an upper bound of their duration; overlapping collectives add up.
- ``count``: events per step (op nodes: ops; layer nodes: layer visits; root: step spans).
- ``bytes``, ``wire_bytes``: message and ring-model bytes of collectives (waits do not
  repeat them); ``flops``: FLOPs of ``gemm`` and ``attention``.

The rows also carry ``Node order`` (the node's index, parents first), without which
Hatchet's default ``node_ordering=True``, the only mode Thicket uses, fails. Run metadata
(``run_id``, ``algorithm`` and its usual name ``algorithm_name``, ``grid``, ``world_size``, ``model``,
``overlap``, ``summary.*`` ...) are scalar top-level keys, which Thicket turns into its ``metadata``
table; the Perfetto export carries the same ``algorithm`` keys in its ``metadata``.

Collectives and waits are labelled with their axis (``allgather z``, ``wait z``) so that
traffic over different communicators stays apart. A layer's ops are those attributed to
it in the trace: with overlap, waits and collectives serving a layer may happen outside
its span (see docs/trace-format.md, section 6).
"""

from __future__ import annotations

import json
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.algorithms.registry import display_name, of_metadata
from fourd_mpi.core.grid import AXES as GRID_AXES
from fourd_mpi.util.files import open_output
from fourd_mpi.trace.events import COLLECTIVE_OPS, LANE_COMM0, LANE_HOST, LANE_LAYER, LANE_STEP, lane_name

__all__ = ["to_perfetto", "write_perfetto", "write_perfetto_proto", "timeline_format", "collective_instances",
           "rank_coordinates", "perfetto_ids",
           "to_caliper_json", "write_caliper_json"]

_NS_PER_US = 1000.0
_CHUNK = 1 << 16  # events converted (and written) at a time
_COMPACT = (",", ":")
_LANE_NAMES = [lane_name(code) for code in range(256)]
_NS_PER_S = 1e9


# ----------------------------------------------------------------------------- Perfetto

def to_perfetto(trace, steps: Optional[Iterable[int]] = None, ranks: Optional[Iterable[int]] = None) -> Dict:
    """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...], ...}``).

    ``steps``, ``ranks``: keep only these steps / ranks (all when ``None``); a value not in
    the trace raises ``ValueError``.
    """
    events = [e for chunk in _perfetto_event_chunks(trace, steps, ranks) for e in chunk]
    return {"traceEvents": events, **_perfetto_header(trace)}


def write_perfetto(trace, path: str, steps: Optional[Iterable[int]] = None,
                   ranks: Optional[Iterable[int]] = None) -> None:
    """Write :func:`to_perfetto` to ``path`` (gzip-compressed when it ends with ``.gz``).

    Events are converted and written a chunk at a time, so memory stays bounded for
    large traces.
    """
    _write_json(path, _perfetto_header(trace), "traceEvents", _perfetto_event_chunks(trace, steps, ranks))


def _perfetto_header(trace) -> Dict:
    return {"displayTimeUnit": "ns", "metadata": _perfetto_metadata(trace)}


#: position of the derived phase thread among a rank's threads (step 1, phase 2, layer 3, host 4, comm<i> 5 + i)
_PHASE_POS = 2
_TIDS_PER_PID = 1000


def perfetto_ids(rank, lane=None, phase_thread: bool = False):
    """``pid`` of ``rank`` (``lane`` None) or ``tid`` of its ``lane`` (or of its phase thread); arrays or ints.

    ``pid = rank + 1``, ``tid = 1000 * pid + k`` with ``k`` = 1 step, 2 phase, 3 layer, 4 host,
    5 + i comm<i>: never 0, never equal to a pid, in the threads' display order.
    """
    pid = rank + 1
    if phase_thread:
        return _TIDS_PER_PID * pid + _PHASE_POS
    if lane is None:
        return pid
    # lanes step 0, layer 1, host 2, comm<i> 3 + i -> positions 1, 3, 4, 5 + i
    return _TIDS_PER_PID * pid + np.where(lane == LANE_STEP, 1, lane + 2)


def _us(ns) -> np.ndarray:
    """Nanoseconds as float microseconds that Perfetto reads back exactly: ``int(us * 1000) == ns``.

    ``ns / 1000`` times 1000 can round to just below ``ns`` in binary floating point, and
    Perfetto's JSON importer truncates; the next float up fixes that.
    """
    ns = np.asarray(ns, dtype=np.int64)
    us = ns / _NS_PER_US
    return np.where(np.trunc(us * _NS_PER_US) < ns, np.nextafter(us, np.inf), us)


def _perfetto_event_chunks(trace, steps, ranks) -> Iterator[List[Dict]]:
    """Lists of trace events: process and thread names, X events of every lane, phase spans, flows."""
    steps = None if steps is None else list(steps)  # iterated twice below
    ranks = None if ranks is None else list(ranks)
    events = _select_events(trace, steps, ranks)
    yield _process_metadata(trace, _kept_ranks(trace, ranks)) + _thread_metadata(events)
    end_ns = _clip_to_successor(events)
    for start in range(0, len(events), _CHUNK):
        part = slice(start, start + _CHUNK)
        yield _complete_events(trace, events[part], end_ns[part])
    yield _phase_events(trace, events)
    yield _flow_events(trace, events, end_ns)


def _select_events(trace, steps, ranks) -> np.ndarray:
    ev = trace.events
    mask = np.ones(len(ev), dtype=bool)
    for column, wanted, known in (("step", steps, trace.rank_steps["step"]), ("rank", ranks, trace.ranks["rank"])):
        if wanted is None:
            continue
        wanted = np.unique(np.asarray(list(wanted), dtype=np.int64))
        unknown = np.setdiff1d(wanted, np.unique(known))
        if len(unknown):
            raise ValueError(f"{column}s {unknown.tolist()} are not in the trace "
                             f"(it has {column}s {np.unique(known).tolist()})")
        mask &= np.isin(ev[column], wanted)
    return ev[mask]


def _kept_ranks(trace, ranks) -> np.ndarray:
    rows = trace.ranks
    if ranks is not None:
        rows = rows[np.isin(rows["rank"], np.asarray(list(ranks), dtype=np.int64))]
    return rows


def _process_metadata(trace, rank_rows: np.ndarray) -> List[Dict]:
    out = []
    for rank, host in zip(rank_rows["rank"].tolist(), rank_rows["hostname"].tolist()):
        host = host.decode(errors="replace") if isinstance(host, bytes) else str(host)
        pid = perfetto_ids(rank)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {rank} ({host})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rank}})
    return out


def _thread_metadata(events: np.ndarray) -> List[Dict]:
    """Name and order every (rank, lane) thread that has events: step < phase < layer < host < comm<i>."""
    pairs = np.unique(events["rank"].astype(np.int64) * 256 + events["lane"])
    threads = [(rank, int(perfetto_ids(rank, lane)), lane_name(lane)) for rank, lane in
               (divmod(pair, 256) for pair in pairs.tolist())]
    threads += [(rank, int(perfetto_ids(rank, phase_thread=True)), "phase")
                for rank in np.unique(events["rank"][events["lane"] == LANE_LAYER]).tolist()]
    out = []
    for rank, tid, name in sorted(threads, key=lambda t: t[1]):
        pid = perfetto_ids(rank)
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": tid - _TIDS_PER_PID * pid}})
    return out


def _complete_events(trace, events: np.ndarray, end_ns: np.ndarray) -> List[Dict]:
    """Step, layer and host-lane events as "X" events, ending at ``end_ns``."""
    names = _complete_event_names(trace, events)
    layers = trace.decode("layer", events["layer"]).tolist()
    phases = trace.decode("phase", events["phase"]).tolist()
    axes = trace.decode("axis", events["axis"]).tolist()
    columns = zip(names, perfetto_ids(events["rank"].astype(np.int64)).tolist(),
                  perfetto_ids(events["rank"].astype(np.int64), events["lane"].astype(np.int64)).tolist(),
                  _us(events["start_ns"]).tolist(), _us(end_ns - events["start_ns"]).tolist(), events["step"].tolist(),
                  layers, phases, axes, events["bytes"].tolist(), events["flops"].tolist())
    out = []
    comm = {"wire_bytes": events["wire_bytes"].tolist(), "wait_ns": events["wait_ns"].tolist(),
            "mpi_ns": events["mpi_ns"].tolist(), "overlap_ns": events["overlap_ns"].tolist(),
            "call_ns": events["call_ns"].tolist(), "issue_ns": events["issue_ns"].tolist()}
    lanes = events["lane"].tolist()
    for i, (name, pid, tid, ts, dur, step, layer, phase, axis, nbytes, flops) in enumerate(columns):
        lane = lanes[i]
        args = {"step": step}
        if lane != LANE_STEP:
            args["phase"] = phase
            if layer:
                args["layer"] = layer
        if axis != "none":
            args["axis"] = axis
            args["bytes"] = nbytes
        if flops:
            args["flops"] = flops
        if lane >= LANE_COMM0 and comm["issue_ns"][i]:  # a collective: its accounting (ns)
            args.update(wire_bytes=comm["wire_bytes"][i], wait_ns=comm["wait_ns"][i], mpi_ns=comm["mpi_ns"][i],
                        overlap_ns=comm["overlap_ns"][i], call_return_ns=comm["call_ns"][i])
        out.append({"ph": "X", "name": name, "cat": "comm" if lane >= LANE_COMM0 else _LANE_NAMES[lane],
                    "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args})
    return out


def _clip_to_successor(events: np.ndarray) -> np.ndarray:
    """``end_ns``, lowered to the next event's start on the same rank and lane where it overlaps it.

    Within a lane events may overlap by 1 ns of rounding slack (docs section 8); cutting
    such an event at its successor's start makes the X events of a thread strictly nest.
    """
    end_ns = events["end_ns"].copy()
    if len(events) < 2:
        return end_ns
    order = np.lexsort((events["start_ns"], events["lane"], events["rank"]))
    start, end = events["start_ns"][order], events["end_ns"][order]
    same_thread = (events["rank"][order][1:] == events["rank"][order][:-1]) & \
                  (events["lane"][order][1:] == events["lane"][order][:-1])
    clipped = end.copy()
    clipped[:-1] = np.where(same_thread, np.minimum(end[:-1], start[1:]), end[:-1])
    clipped = np.maximum(clipped, start)
    end_ns[order] = clipped
    return end_ns


def _complete_event_names(trace, events: np.ndarray) -> List[str]:
    """"step N" for step spans, "layer L PHASE (NAME)" for layer spans (L: the layer's index in
    the trace's layer vocabulary), the op with its axis for host and comm events ("wait x")."""
    names = _op_labels(trace, events)
    on_layer = events["lane"] == LANE_LAYER
    layer_names = trace.decode("layer", events["layer"][on_layer]).tolist()
    phases = trace.decode("phase", events["phase"][on_layer]).tolist()
    names[on_layer] = [f"layer {code} {phase} ({name})" for code, phase, name
                       in zip(events["layer"][on_layer].tolist(), phases, layer_names)]
    on_step = events["lane"] == LANE_STEP
    names[on_step] = [f"step {s}" for s in events["step"][on_step].tolist()]
    return names.tolist()


def _phase_events(trace, events: np.ndarray) -> List[Dict]:
    """Per rank and step, one X event per run of consecutive layer-lane events of one phase on the
    ``phase`` thread, from its first to its last event ("step 5 forward"); phases without layer spans
    are left out. A phase is one run unless it is interleaved with another: with activation recompute
    each block's ``recompute`` run sits between two ``backward`` runs (X events must not overlap)."""
    layer = events[events["lane"] == LANE_LAYER]
    if not len(layer):
        return []
    phases = trace.vocab["phases"]
    out = []
    layer = layer[np.lexsort((layer["start_ns"], layer["step"], layer["rank"]))]
    key = (layer["rank"].astype(np.int64) * (1 << 32) + layer["step"].astype(np.int64)) * 16 + layer["phase"]
    starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    for first, stop in zip(starts.tolist(), np.append(starts[1:], len(layer)).tolist()):
        sel = layer[first:stop]
        rank, step, phase = int(sel["rank"][0]), int(sel["step"][0]), int(sel["phase"][0])
        t0, t1 = int(sel["start_ns"].min()), int(sel["end_ns"].max())
        out.append({"ph": "X", "name": f"step {step} {phases[phase]}", "cat": "phase", "pid": perfetto_ids(rank),
                    "tid": int(perfetto_ids(rank, phase_thread=True)), "ts": float(_us(t0)), "dur": float(_us(t1 - t0)),
                    "args": {"step": step, "phase": phases[phase]}})
    return out


def rank_coordinates(trace) -> Dict[str, np.ndarray]:
    """``{"data", "z", "y", "x"} -> coordinate of every rank`` (arrays indexed by rank).

    From the grid in the trace's metadata (``run_options.grid``, else the ``grid`` string
    ``GdataxGzxGyxGx``): the Cartesian communicator is built without reordering, so rank ``r``
    sits at ``unravel_index(r, (G_data, G_z, G_y, G_x))`` (row-major, ``x`` fastest). A trace
    whose grid is missing or does not match its world size falls back to the coordinates each
    rank recorded (ranks table).
    """
    meta = trace.metadata
    options = meta.get("run_options") or {}
    grid = options.get("grid") if isinstance(options, dict) else None
    dims = None
    if isinstance(grid, dict) and all(a in grid for a in GRID_AXES):
        dims = tuple(int(grid[a]) for a in GRID_AXES)
    else:
        try:
            dims = tuple(int(v) for v in str(meta.get("grid", "")).split("x"))
        except ValueError:
            dims = None
    world = int(trace.world_size)
    if dims is not None and len(dims) == len(GRID_AXES) and min(dims) >= 1 and int(np.prod(dims)) == world:
        return dict(zip(GRID_AXES, np.unravel_index(np.arange(world), dims)))
    ranks = trace.ranks
    out = {}
    for axis in GRID_AXES:
        coord = np.zeros(max(world, int(ranks["rank"].max()) + 1 if len(ranks) else 0), dtype=np.int64)
        coord[ranks["rank"].astype(np.int64)] = ranks[f"coord_{axis}"]
        out[axis] = coord
    return out


def collective_instances(trace, events: np.ndarray) -> np.ndarray:
    """An instance id per event (-1 for events that are not collectives): the same id for the pieces
    of one collective on the ranks of one axis communicator.

    Key: (step, op, axis, communicator, sequence). The communicator of a collective over
    ``axis`` is the set of ranks with equal coordinates on the other three axes
    (:func:`rank_coordinates`); the sequence is the collective's position among this rank's
    collectives on that communicator in the step, by issue time (MPI matches collectives on a
    communicator by issue order, the same on every rank). The op is part of the key only as a
    check: ranks that disagree on it get different ids (no flow), instead of a wrong link.
    """
    ids = np.full(len(events), -1, dtype=np.int64)
    names = trace.vocab["ops"]
    codes = [names.index(o) for o in COLLECTIVE_OPS if o in names]
    coll = np.flatnonzero(np.isin(events["op"], codes) & (events["lane"] >= LANE_COMM0))
    if not len(coll):
        return ids
    coords = rank_coordinates(trace)
    axes = trace.vocab["axes"]
    keys: Dict[Tuple, int] = {}
    per_stream: Dict[Tuple, int] = {}
    order = coll[np.lexsort((events["issue_ns"][coll], events["axis"][coll], events["step"][coll],
                             events["rank"][coll]))]
    for i in order.tolist():
        rank, step, axis = int(events["rank"][i]), int(events["step"][i]), axes[int(events["axis"][i])]
        group = tuple(int(coords[a][rank]) for a in GRID_AXES if a != axis)
        seq = per_stream.get((rank, step, axis), 0)
        per_stream[rank, step, axis] = seq + 1
        ids[i] = keys.setdefault((step, int(events["op"][i]), axis, group, seq), len(keys))
    return ids


def _flow_points(start: np.ndarray, end: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Chain order and time points (ns) for flow events through the slices ``[start, end]`` of one instance.

    Perfetto reads flow events in time order and drops a step or end that comes before its
    start, and binds each to the slice open on its thread at that time. So: slices in order of
    their middles, points strictly increasing, each strictly inside its slice (at its middle,
    pushed 1 ns later past the previous point where needed); a slice that cannot take a point
    after the previous one (too short) is left out. Returns (indices into the slices, points).
    """
    mid = start + (end - start) // 2
    lo = np.where(end - start >= 2, start + 1, start)  # strictly inside where there is room
    hi = np.where(end - start >= 2, end - 1, end)
    picked, points = [], []
    for j in np.lexsort((np.arange(len(mid)), mid)).tolist():
        point = max(int(mid[j]), int(lo[j]), points[-1] + 1 if points else int(lo[j]))
        if point <= hi[j]:
            picked.append(j)
            points.append(point)
    return np.asarray(picked, dtype=np.int64), np.asarray(points, dtype=np.int64)


def _flow_events(trace, events: np.ndarray, end_ns: np.ndarray) -> List[Dict]:
    """Flow arrows through the pieces of each collective instance in time order: "s" on the first,
    "t" on the middle ones, "f" on the last (bound to its enclosing slice: ``"bp": "e"``)."""
    ids = collective_instances(trace, events)
    picked = np.flatnonzero(ids >= 0)
    picked = picked[np.argsort(ids[picked], kind="stable")]
    labels = _op_labels(trace, events)
    bounds = np.flatnonzero(np.diff(ids[picked])) + 1
    out = []
    for members in np.split(picked, bounds):
        if len(members) < 2:
            continue
        chain, points = _flow_points(events["start_ns"][members], end_ns[members])
        if len(chain) < 2:
            continue
        members = members[chain]
        ranks = events["rank"][members].astype(np.int64)
        pids, tids = perfetto_ids(ranks), perfetto_ids(ranks, events["lane"][members].astype(np.int64))
        for j, (i, pid, tid, ts) in enumerate(zip(members.tolist(), pids.tolist(), tids.tolist(), _us(points).tolist())):
            ph = "s" if j == 0 else ("f" if j == len(members) - 1 else "t")
            flow = {"ph": ph, "name": str(labels[i]), "cat": "collective", "id": int(ids[i]),
                    "pid": pid, "tid": tid, "ts": ts}
            if ph == "f":
                flow["bp"] = "e"  # bind to the enclosing slice (not the next one)
            out.append(flow)
    return out


#: file suffixes of the two timeline formats (``fourd-mpi export perfetto`` picks the format by them)
PROTO_SUFFIXES = (".pftrace", ".perfetto-trace", ".pftrace.gz", ".perfetto-trace.gz")
JSON_SUFFIXES = (".json", ".json.gz")


def timeline_format(path: str) -> str:
    """``"proto"`` for a Perfetto protobuf name (:data:`PROTO_SUFFIXES`), ``"json"`` for a JSON one
    (:data:`JSON_SUFFIXES`); ``ValueError`` (one line) for any other suffix."""
    name = str(path).lower()
    if name.endswith(PROTO_SUFFIXES):
        return "proto"
    if name.endswith(JSON_SUFFIXES):
        return "json"
    raise ValueError(f"{path}: the timeline's format comes from its suffix: {', '.join(JSON_SUFFIXES)} "
                     f"(Chrome trace-event JSON) or {', '.join(PROTO_SUFFIXES)} (Perfetto protobuf)")


def write_perfetto_proto(trace, path: str, steps: Optional[Iterable[int]] = None,
                         ranks: Optional[Iterable[int]] = None) -> int:
    """Write the events of :func:`to_perfetto` as a Perfetto protobuf trace (``.pftrace``); returns the
    number of slices written.

    Needs the ``perfetto`` package (``pip install 'fourd_mpi[perfetto]'``): its generated
    ``perfetto_trace_pb2`` classes build every packet (``ModuleNotFoundError`` without it).

    Layout: one packet sequence per rank (``trusted_packet_sequence_id = rank + 1``, as if each rank wrote its
    own), opened by the track descriptors of the rank: a process track (``pid``, the process name ``rank R
    (host)``, uuid ``1000 * pid``) and one thread track per lane (uuid = ``tid`` of :func:`perfetto_ids`, the
    lane's name), the ids and names of the JSON export. Every X event of the JSON export (step, phase, layer,
    host and comm slices, the same names, categories and ``args``) becomes a ``TYPE_SLICE_BEGIN`` packet at
    ``start_ns`` and a ``TYPE_SLICE_END`` packet at ``start_ns + dur_ns`` on its thread's track: TrackEvent
    times in integer ns of the trace's aligned clock, the same ns the JSON's µs read back as. Event names,
    categories, argument names and string argument values are interned per sequence (``InternedData`` in the
    sequence's first event packet, ``SEQ_INCREMENTAL_STATE_CLEARED``; the events refer to them by ``name_iid``,
    ``category_iids``, ``name_iid``/``string_value_iid``), arguments are debug annotations (``int_value``,
    ``double_value`` for ``flops``, ``string_value_iid``). The JSON export's flow arrows become ``flow_ids``
    (every piece of a collective instance but its last, in start order) and ``terminating_flow_ids`` (the last),
    id = instance + 1: every piece is linked, where the JSON leaves out a piece too short to hold a flow point.
    The run metadata of the JSON's ``metadata`` object has no place in a TrackEvent trace and is left out.

    Packets of one sequence are in time order, a track's begin/end strictly alternating (a
    slice's end is lowered to the next slice's begin on its track where it would pass it, as
    :func:`_clip_to_successor` does for the JSON). The file is a ``Trace`` message written a
    chunk of packets at a time (concatenated ``Trace`` messages are one ``Trace``), so memory
    stays bounded. ``path`` ending in ``.gz`` is gzip-compressed (Perfetto's trace processor and UI open
    gzip-compressed traces as they are).

    Reference: Perfetto's "Converting arbitrary timestamped data to Perfetto" (synthetic TrackEvent)
    and its interning section, https://perfetto.dev/docs/reference/synthetic-track-event.
    """
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    steps = None if steps is None else list(steps)
    ranks = None if ranks is None else list(ranks)
    events = _select_events(trace, steps, ranks)
    end_ns = _clip_to_successor(events)
    flow_next, flow_last = _proto_flow_ids(trace, events, end_ns)
    threads: Dict[int, List[Dict]] = {}
    for meta in _thread_metadata(events):
        if meta["name"] == "thread_name":
            threads.setdefault(meta["pid"], []).append(meta)
    by_rank = np.argsort(events["rank"], kind="stable")
    rows = _kept_ranks(trace, ranks)
    lo = np.searchsorted(events["rank"][by_rank], rows["rank"], side="left")
    hi = np.searchsorted(events["rank"][by_rank], rows["rank"], side="right")
    written = 0
    with open_output(path, "wb") as f:
        for row, first, stop in zip(rows, lo.tolist(), hi.tolist()):
            rank = int(row["rank"])
            mine = np.sort(by_rank[first:stop])
            host = row["hostname"]
            host = host.decode(errors="replace") if isinstance(host, bytes) else str(host)
            seq = _ProtoSequence(pb, f, sequence_id=rank + 1)
            pid = perfetto_ids(rank)
            seq.process(pid, f"rank {rank} ({host})", sort_index=rank)
            for meta in threads.get(pid, []):
                seq.thread(pid, meta["tid"], meta["args"]["name"], sort_index=meta["tid"] - _TIDS_PER_PID * pid)
            slices = _complete_events(trace, events[mine], end_ns[mine]) + _phase_events(trace, events[mine])
            n_phase = len(slices) - len(mine)
            flows = (np.concatenate([flow_next[mine], np.zeros(n_phase, np.int64)]),
                     np.concatenate([flow_last[mine], np.zeros(n_phase, np.int64)]))
            written += seq.slices(slices, *flows)
            seq.flush()
    return written


class _ProtoSequence:
    """The packets of one Perfetto packet sequence (one rank), written to ``f`` a chunk at a time."""

    def __init__(self, pb, f, sequence_id: int):
        self.pb, self.f, self.sequence_id = pb, f, sequence_id
        self.trace = pb.Trace()

    def _packet(self):
        packet = self.trace.packet.add()
        packet.trusted_packet_sequence_id = self.sequence_id
        return packet

    def process(self, pid: int, name: str, sort_index: int) -> None:
        track = self._packet().track_descriptor
        track.uuid = _TIDS_PER_PID * pid  # never a tid (tids are 1000 * pid + k, k >= 1)
        track.process.pid = pid
        track.process.process_name = name
        track.process.legacy_sort_index = sort_index

    def thread(self, pid: int, tid: int, name: str, sort_index: int) -> None:
        track = self._packet().track_descriptor
        track.uuid = tid
        track.thread.pid = pid
        track.thread.tid = tid
        track.thread.thread_name = name
        track.thread.legacy_sort_index = sort_index

    def slices(self, slices: List[Dict], flow_next: np.ndarray, flow_last: np.ndarray) -> int:
        """Begin and end packets of the X events ``slices`` (JSON dicts), in time order; flow ids per slice
        (0: none)."""
        if not slices:
            return 0
        pb = self.pb
        begin = np.asarray([_ns(e["ts"]) for e in slices], dtype=np.int64)
        end = begin + np.asarray([_ns(e["dur"]) for e in slices], dtype=np.int64)
        track = np.asarray([e["tid"] for e in slices], dtype=np.int64)
        along = np.lexsort((np.arange(len(slices)), begin, track))  # each track's slices in start order
        same = track[along][1:] == track[along][:-1]
        end[along[:-1]] = np.where(same, np.minimum(end[along[:-1]], begin[along[1:]]), end[along[:-1]])
        end = np.maximum(end, begin)
        position = np.empty(len(slices), dtype=np.int64)
        position[along] = np.arange(len(slices))
        times = np.concatenate([begin, end])
        key = np.concatenate([2 * position, 2 * position + 1])  # begin, end, next begin ... on a track
        order = np.lexsort((key, times))
        names, categories, arg_names, strings = {}, {}, {}, {}
        for e in slices:
            names.setdefault(e["name"], len(names) + 1)
            categories.setdefault(e["cat"], len(categories) + 1)
            for arg, value in e["args"].items():
                arg_names.setdefault(arg, len(arg_names) + 1)
                if isinstance(value, str):
                    strings.setdefault(value, len(strings) + 1)
        SLICE_BEGIN, SLICE_END = pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END
        needs_state = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        n = len(slices)
        for count, k in enumerate(order.tolist()):
            packet = self._packet()
            packet.timestamp = int(times[k])
            packet.sequence_flags = needs_state
            event = packet.track_event
            if k >= n:  # an end
                event.type = SLICE_END
                event.track_uuid = int(track[k - n])
            else:
                e = slices[k]
                event.type = SLICE_BEGIN
                event.track_uuid = e["tid"]
                event.name_iid = names[e["name"]]
                event.category_iids.append(categories[e["cat"]])
                for arg, value in e["args"].items():
                    annotation = event.debug_annotations.add()
                    annotation.name_iid = arg_names[arg]
                    if isinstance(value, str):
                        annotation.string_value_iid = strings[value]
                    elif isinstance(value, float):
                        annotation.double_value = value
                    else:
                        annotation.int_value = value
                if flow_next[k]:
                    event.flow_ids.append(int(flow_next[k]))
                if flow_last[k]:
                    event.terminating_flow_ids.append(int(flow_last[k]))
            if count == 0:  # the sequence's first event packet: resets and fills the interning tables
                packet.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED | needs_state
                interned = packet.interned_data
                for table, entries in ((interned.event_names, names), (interned.event_categories, categories),
                                       (interned.debug_annotation_names, arg_names)):
                    for text, iid in entries.items():
                        table.add(iid=iid, name=text)
                for text, iid in strings.items():
                    interned.debug_annotation_string_values.add(iid=iid, str=text.encode())
            if len(self.trace.packet) >= _CHUNK:
                self.flush()
        return n

    def flush(self) -> None:
        if len(self.trace.packet):
            self.f.write(self.trace.SerializeToString())
            self.trace = self.pb.Trace()


def _ns(us: float) -> int:
    """A JSON time (µs) as the integer ns it stands for (:func:`_us` makes the truncation exact)."""
    return int(us * _NS_PER_US)


def _proto_flow_ids(trace, events: np.ndarray, end_ns: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per event, the flow id it passes on (``flow_ids``) and the one it ends (``terminating_flow_ids``);
    0 = none. A collective instance of n >= 2 pieces (:func:`collective_instances`) is one flow,
    id = instance + 1, through its pieces in start order (ties: end, then event order)."""
    ids = collective_instances(trace, events)
    flow_next = np.zeros(len(events), dtype=np.int64)
    flow_last = np.zeros(len(events), dtype=np.int64)
    picked = np.flatnonzero(ids >= 0)
    if not len(picked):
        return flow_next, flow_last
    picked = picked[np.lexsort((picked, end_ns[picked], events["start_ns"][picked], ids[picked]))]
    members = ids[picked]
    last = np.append(members[1:] != members[:-1], True)
    first = np.insert(members[1:] != members[:-1], 0, True)
    shared = ~(first & last)  # instances of one piece carry no flow
    flow_next[picked[~last & shared]] = members[~last & shared] + 1
    flow_last[picked[last & shared]] = members[last & shared] + 1
    return flow_next, flow_last


def _perfetto_metadata(trace) -> Dict:
    meta = trace.metadata
    return {"run_id": meta.get("run_id", trace.attrs.get("run_id", "")), "algorithm": of_metadata(meta),
            "algorithm_name": display_name(of_metadata(meta)), "grid": meta.get("grid", ""),
            "world_size": int(meta.get("world_size", trace.world_size)), "status": trace.status,
            "level": meta.get("level", ""), "overlap": meta.get("overlap", ""), "clock": "aligned ns / 1000"}


def _op_labels(trace, events: np.ndarray) -> np.ndarray:
    """The op name, with the axis for events that have one: ``gemm``, ``allgather z``, ``wait x``."""
    ops = trace.decode("op", events["op"])
    axes = trace.decode("axis", events["axis"])
    with_axis = events["axis"] != trace.code("axis", "none")
    labels = ops.copy()
    labels[with_axis] = [f"{o} {a}" for o, a in zip(ops[with_axis].tolist(), axes[with_axis].tolist())]
    return labels


def _write_json(path: str, header: Dict, list_key: str, chunks: Iterable[List]) -> None:
    """Write ``{**header, list_key: [*chunk0, *chunk1, ...]}`` as compact JSON, a chunk at a time.

    ``json.dumps`` of each piece uses the C encoder (``json.dump`` to a file does not).
    ``path`` ending in ``.gz`` is gzip-compressed.
    """
    with open_output(path, "wt", encoding="utf-8") as f:
        f.write("{")
        for key, value in header.items():
            f.write(f"{json.dumps(key)}:{json.dumps(value, separators=_COMPACT)},")
        f.write(f"{json.dumps(list_key)}:[")
        first = True
        for chunk in chunks:
            if chunk:
                f.write(("" if first else ",") + json.dumps(chunk, separators=_COMPACT)[1:-1])
                first = False
        f.write("]}")


# ----------------------------------------------------------------------------- Caliper

#: metric columns of the Caliper profile, in order (after ``Node order``, ``path`` and ``mpi.rank``)
CALIPER_METRICS = ("sum#time.duration", "inclusive#sum#time.duration", "comm.inflight", "count",
                   "bytes", "wire_bytes", "flops")


def to_caliper_json(trace, include_warmup: bool = False) -> Dict:
    """The trace as a Caliper JSON-split profile (``step > phase > layer > op``), per rank.

    Metrics are per measured step (warm-up steps excluded unless ``include_warmup``; when
    every step is warm-up, all are used, as in the run's summary). Needs a trace at level
    ``op`` (``ValueError`` otherwise): at lower levels there are no host-lane events to time.
    """
    level = trace.metadata.get("level", "op")
    if level != "op":
        raise ValueError(f"the Caliper export needs a trace at level 'op' (this one is {level!r}): "
                         "only op-level traces time the compute ops and waits")
    steps = _profiled_steps(trace, include_warmup)
    events = trace.events[np.isin(trace.events["step"], steps)]
    tree = _CallTree(trace, events)
    metrics = tree.metrics(events, trace.world_size) / max(len(steps), 1)
    # "Node order" and "path" index into "nodes"; mpi.rank is a value, as Caliper writes it
    columns = ["Node order", "path", "mpi.rank", *CALIPER_METRICS]
    is_value = [False, False] + [True] * (len(columns) - 2)
    return {"data": _caliper_rows(metrics), "columns": columns,
            "column_metadata": [{"is_value": flag} for flag in is_value],
            "nodes": tree.nodes, **_caliper_run_metadata(trace, steps)}


def write_caliper_json(trace, path: str, include_warmup: bool = False) -> None:
    """Write :func:`to_caliper_json` to ``path`` (e.g. ``RUN.json``; read it with ``from_caliper``).

    Hatchet opens the path with plain ``open``: do not compress it.
    """
    profile = to_caliper_json(trace, include_warmup=include_warmup)
    rows = profile.pop("data")
    _write_json(path, profile, "data", (rows[i:i + _CHUNK] for i in range(0, len(rows), _CHUNK)))


def _profiled_steps(trace, include_warmup: bool) -> np.ndarray:
    table = trace.steps
    measured = table["step"] if include_warmup else table["step"][table["warmup"] == 0]
    return np.asarray(measured if len(measured) else table["step"], dtype=np.int64)


class _CallTree:
    """The nodes ``step > phase > layer > op`` that the events fall in, in Caliper's ``nodes`` form."""

    ROOT = 0

    def __init__(self, trace, events: np.ndarray):
        self.trace = trace
        self.nodes: List[Dict] = [{"label": "step", "column": "path"}]
        self.parents: List[int] = [-1]
        self._index: Dict[Tuple, int] = {}
        self.event_node = self._assign(events)

    def _node(self, key: Tuple, label: str, parent: int) -> int:
        if key not in self._index:
            self._index[key] = len(self.nodes)
            self.nodes.append({"label": label, "column": "path", "parent": parent})
            self.parents.append(parent)
        return self._index[key]

    def _assign(self, events: np.ndarray) -> np.ndarray:
        """The node of every event (tree built in phase, layer, op vocabulary order)."""
        trace = self.trace
        on_step = events["lane"] == LANE_STEP
        on_layer = events["lane"] == LANE_LAYER
        op_label = _op_labels(trace, events)
        label_codes, label_of_event = np.unique(op_label, return_inverse=True)
        label_rank = self._op_label_order(label_codes)
        # key per event: (phase, layer, op label); -1 where the level does not apply
        layer_key = np.where(on_step, -1, events["layer"].astype(np.int64))
        op_key = np.where(on_step | on_layer, -1, label_rank[label_of_event])
        phase_key = np.where(on_step, -1, events["phase"].astype(np.int64))
        keys = np.stack([phase_key, layer_key, op_key], axis=1)
        unique_keys, event_key = np.unique(keys, axis=0, return_inverse=True)
        phases, layers = trace.vocab["phases"], trace.vocab["layers"]
        ordered_labels = label_codes[np.argsort(label_rank)]
        node_of_key = np.empty(len(unique_keys), dtype=np.int64)
        for i, (phase, layer, op) in enumerate(unique_keys.tolist()):  # sorted: parents first
            node = self.ROOT
            if phase >= 0:
                node = self._node((phase,), phases[phase], node)
                if layer > 0:
                    node = self._node((phase, layer), layers[layer], node)
                if op >= 0:
                    node = self._node((phase, layer, op), ordered_labels[op], node)
            node_of_key[i] = node
        return node_of_key[event_key.reshape(-1)]

    def _op_label_order(self, labels: np.ndarray) -> np.ndarray:
        """Rank of each op label in (op vocabulary, axis vocabulary) order."""
        ops, axes = self.trace.vocab["ops"], self.trace.vocab["axes"]

        def sort_key(label: str) -> Tuple[int, int]:
            op, _, axis = label.partition(" ")
            return ops.index(op), axes.index(axis) if axis else 0

        order = sorted(range(len(labels)), key=lambda i: sort_key(labels[i]))
        rank = np.empty(len(labels), dtype=np.int64)
        rank[order] = np.arange(len(labels))
        return rank

    def metrics(self, events: np.ndarray, world_size: int) -> np.ndarray:
        """Array [node, rank, metric] of the totals of :data:`CALIPER_METRICS` over ``events``."""
        out = np.zeros((len(self.nodes), world_size, len(CALIPER_METRICS)))
        node, rank = self.event_node, events["rank"].astype(np.int64)
        host = events["lane"] == LANE_HOST
        comm = events["lane"] >= LANE_COMM0
        duration_s = (events["end_ns"] - events["start_ns"]) / _NS_PER_S
        column = {name: i for i, name in enumerate(CALIPER_METRICS)}
        np.add.at(out[:, :, column["sum#time.duration"]], (node, rank), np.where(host, duration_s, 0.0))
        np.add.at(out[:, :, column["comm.inflight"]], (node, rank), np.where(comm, duration_s, 0.0))
        np.add.at(out[:, :, column["count"]], (node, rank), 1.0)
        np.add.at(out[:, :, column["bytes"]], (node, rank), np.where(comm, events["bytes"], 0).astype(float))
        np.add.at(out[:, :, column["wire_bytes"]], (node, rank), np.where(comm, events["wire_bytes"], 0).astype(float))
        np.add.at(out[:, :, column["flops"]], (node, rank), events["flops"])
        inclusive = out[:, :, column["sum#time.duration"]].copy()
        for child in range(len(self.nodes) - 1, 0, -1):  # children come after their parents
            inclusive[self.parents[child]] += inclusive[child]
        out[:, :, column["inclusive#sum#time.duration"]] = inclusive
        return out


def _caliper_rows(metrics: np.ndarray) -> List[List]:
    """One ``[node order, node, rank, metrics...]`` row per rank and node, rank-major.

    Hatchet's reader (with ``node_ordering``, the default, and the only mode Thicket uses)
    takes node ``i``'s order from the first column of data row ``i``: rank 0's rows come
    first, in node order, and a node's order is its index (parents before children).
    """
    nodes, ranks, _ = metrics.shape
    node_ids = np.tile(np.arange(nodes), ranks).tolist()
    rank_ids = np.repeat(np.arange(ranks), nodes).tolist()
    values = metrics.transpose(1, 0, 2).reshape(nodes * ranks, -1).tolist()
    return [[n, n, r, *v] for n, r, v in zip(node_ids, rank_ids, values)]


def _caliper_run_metadata(trace, steps: Sequence[int]) -> Dict:
    """Scalar run metadata for the profile's top level (Thicket's ``metadata`` table)."""
    meta = trace.metadata
    options = meta.get("run_options") or {}
    model = options.get("model") or {}
    grid = options.get("grid") or {}
    out = {
        "run_id": meta.get("run_id", trace.attrs.get("run_id", "")), "status": trace.status,
        "algorithm": of_metadata(meta), "algorithm_name": display_name(of_metadata(meta)), "grid": meta.get("grid", ""), "world_size": int(meta.get("world_size", trace.world_size)),
        "num_nodes": meta.get("num_nodes"), "model": model.get("name"), "model_kind": model.get("kind"),
        "model_layers": model.get("layers"), "hidden": model.get("hidden"), "heads": model.get("heads"),
        "ffn_hidden": model.get("ffn_hidden"), "seq": model.get("seq"), "batch": model.get("batch"),
        "gdata": grid.get("data"), "gz": grid.get("z"), "gy": grid.get("y"), "gx": grid.get("x"),
        "dtype": options.get("dtype"), "optimizer": options.get("optimizer"), "backend": meta.get("backend"),
        "overlap": meta.get("overlap"), "progress": meta.get("progress"), "level": meta.get("level"),
        "start_time": meta.get("start_time"), "end_time": meta.get("end_time"),
        "launch_host": meta.get("launch_host"), "git_commit": meta.get("git_commit"),
        "fourd_mpi": (meta.get("packages") or {}).get("fourd_mpi"),
        "mpi_library": ((meta.get("mpi") or {}).get("library_version") or "").strip().split("\n")[0],
        "warmup_steps": meta.get("warmup_steps"), "profiled_steps": len(steps),
        "model_flops_per_step": meta.get("model_flops_per_step"), "tokens_per_step": meta.get("tokens_per_step"),
    }
    out.update(adiak_metadata(meta, out["world_size"]))
    for key, value in (meta.get("summary") or {}).items():
        out[f"summary.{key}"] = value
    return {key: value for key, value in out.items() if _is_scalar(value)}


def adiak_metadata(meta: Dict, world_size: int) -> Dict:
    """The run's facts under the names Adiak's ``adiak_collect_all`` gives them (as benchpark's
    Caliper profiles carry them), so that Thicket lines our profiles up with theirs: ``jobsize``
    (MPI ranks), ``numhosts`` (nodes), ``hostname`` (rank 0's host), ``cluster`` (Adiak's rule: the
    host name up to the first '.', digits dropped), ``user``, ``launchdate`` (start, seconds since
    the Unix epoch). A fact the trace did not record is left out."""
    import datetime

    host = str(meta.get("launch_host") or "")
    launch = None
    try:
        launch = int(datetime.datetime.fromisoformat(str(meta.get("start_time"))).timestamp())
    except ValueError:
        pass
    user = meta.get("user") or (meta.get("environment") or {}).get("SLURM_JOB_USER")
    out = {"jobsize": int(world_size), "numhosts": meta.get("num_nodes"), "hostname": host or None,
           "cluster": adiak_cluster(host) or None, "user": user, "launchdate": launch}
    return {key: value for key, value in out.items() if value is not None}


def adiak_cluster(hostname: str) -> str:
    """Adiak's ``adiak_clustername``: the characters of the host name before the first '.', digits
    dropped (``quartz1234.llnl.gov`` -> ``quartz``)."""
    return "".join(c for c in hostname.split(".", 1)[0] if not c.isdigit())


def _is_scalar(value) -> bool:
    """Strings, bools and finite numbers: what a flat metadata table (and strict JSON) holds."""
    if isinstance(value, float):
        return bool(np.isfinite(value))
    return isinstance(value, (str, int))
