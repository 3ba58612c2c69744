"""The Perfetto / chrome://tracing timeline of a trace, as Chrome trace-event JSON (``.json``, ``.json.gz``).

One process per rank, one named thread per lane: ``step``, ``phase``, ``layer``, ``host``, ``comm0``,
``comm1`` ... (in that order). Every event is a complete (``"X"``) event: step spans ("step 5"), phase
spans ("step 5 backward", derived from the layer events of the phase), layer spans ("layer 3 backward
(block0.fc2)": Perfetto's search finds "layer 3 backward"), host-lane events (compute ops, waits: "wait
x") and collectives with their staging copies on their comm lane ("allreduce x", "d2h x"), from the
``MPI_I*`` call to the observed completion, with their accounting in ``args`` (``bytes``, ``wire_bytes``,
``wait_ns``, ``mpi_ns``, ``overlap_ns``, ``call_return_ns``). Events never overlap within a thread (the
recorder packs collectives in flight together onto separate comm lanes). Flow events
(``"s"``/``"t"``/``"f"``, category ``collective``) link the pieces of one collective instance across its
ranks (:func:`collective_instances`).

Ids: ``pid = rank + 1`` and ``tid = 1000 * pid + k`` (``k`` = 1 step, 2 phase, 3 layer, 4 host,
5 + i comm<i>): Perfetto reserves pid/tid 0 for the kernel's idle task, and a tid equal to its
pid would make that lane the process's "main thread"; names (``rank 3 (host)``, ``comm0``) and
sort indices carry the meaning. Times are microseconds (floats) on the trace's aligned clock,
``ts = start_ns / 1000``, written so that Perfetto's reading (``int(ts * 1000)``, truncated)
gives back the exact nanoseconds of the trace: the no-overlap guarantee survives the import.
Flow points of one instance are strictly increasing in time (Perfetto drops a flow step or end
read before its start), each strictly inside the slice it binds to.

The protobuf encoding of the same slices is :mod:`fourd_mpi.analysis.export.pftrace`.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from fourd_mpi.algorithms.registry import display_name, of_metadata
from fourd_mpi.analysis.export.common import CHUNK, op_labels, write_json
from fourd_mpi.core.grid import AXES as GRID_AXES
from fourd_mpi.trace.events import COLLECTIVE_OPS, LANE_COMM0, LANE_LAYER, LANE_STEP, lane_name

NS_PER_US = 1000.0
_LANE_NAMES = [lane_name(code) for code in range(256)]
#: file suffixes of the JSON timeline (``fourd-mpi export perfetto`` picks the encoding by them)
JSON_SUFFIXES = (".json", ".json.gz")


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
    write_json(path, _perfetto_header(trace), "traceEvents", _perfetto_event_chunks(trace, steps, ranks))


def _perfetto_header(trace) -> Dict:
    return {"displayTimeUnit": "ns", "metadata": _perfetto_metadata(trace)}


#: position of the derived phase thread among a rank's threads (step 1, phase 2, layer 3, host 4, comm<i> 5 + i)
_PHASE_POS = 2
TIDS_PER_PID = 1000


def perfetto_ids(rank, lane=None, phase_thread: bool = False):
    """``pid`` of ``rank`` (``lane`` None) or ``tid`` of its ``lane`` (or of its phase thread); arrays or ints.

    ``pid = rank + 1``, ``tid = 1000 * pid + k`` with ``k`` = 1 step, 2 phase, 3 layer, 4 host,
    5 + i comm<i>: never 0, never equal to a pid, in the threads' display order.
    """
    pid = rank + 1
    if phase_thread:
        return TIDS_PER_PID * pid + _PHASE_POS
    if lane is None:
        return pid
    # lanes step 0, layer 1, host 2, comm<i> 3 + i -> positions 1, 3, 4, 5 + i
    return TIDS_PER_PID * pid + np.where(lane == LANE_STEP, 1, lane + 2)


def _us(ns) -> np.ndarray:
    """Nanoseconds as float microseconds that Perfetto reads back exactly: ``int(us * 1000) == ns``.

    ``ns / 1000`` times 1000 can round to just below ``ns`` in binary floating point, and
    Perfetto's JSON importer truncates; the next float up fixes that.
    """
    ns = np.asarray(ns, dtype=np.int64)
    us = ns / NS_PER_US
    return np.where(np.trunc(us * NS_PER_US) < ns, np.nextafter(us, np.inf), us)


def _perfetto_event_chunks(trace, steps, ranks) -> Iterator[List[Dict]]:
    """Lists of trace events: process and thread names, X events of every lane, phase spans, flows."""
    steps = None if steps is None else list(steps)  # iterated twice below
    ranks = None if ranks is None else list(ranks)
    events = select_events(trace, steps, ranks)
    yield _process_metadata(trace, kept_ranks(trace, ranks)) + thread_metadata(events)
    end_ns = clip_to_successor(events)
    for start in range(0, len(events), CHUNK):
        part = slice(start, start + CHUNK)
        yield complete_events(trace, events[part], end_ns[part])
    yield phase_events(trace, events)
    yield _flow_events(trace, events, end_ns)


def select_events(trace, steps, ranks) -> np.ndarray:
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


def kept_ranks(trace, ranks) -> np.ndarray:
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


def thread_metadata(events: np.ndarray) -> List[Dict]:
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
                    "args": {"sort_index": tid - TIDS_PER_PID * pid}})
    return out


def complete_events(trace, events: np.ndarray, end_ns: np.ndarray) -> List[Dict]:
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


def clip_to_successor(events: np.ndarray) -> np.ndarray:
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
    names = op_labels(trace, events)
    on_layer = events["lane"] == LANE_LAYER
    layer_names = trace.decode("layer", events["layer"][on_layer]).tolist()
    phases = trace.decode("phase", events["phase"][on_layer]).tolist()
    names[on_layer] = [f"layer {code} {phase} ({name})" for code, phase, name
                       in zip(events["layer"][on_layer].tolist(), phases, layer_names)]
    on_step = events["lane"] == LANE_STEP
    names[on_step] = [f"step {s}" for s in events["step"][on_step].tolist()]
    return names.tolist()


def phase_events(trace, events: np.ndarray) -> List[Dict]:
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
    labels = op_labels(trace, events)
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
        for j, (i, pid, tid, ts) in enumerate(zip(members.tolist(), pids.tolist(), tids.tolist(),
                                                  _us(points).tolist())):
            ph = "s" if j == 0 else ("f" if j == len(members) - 1 else "t")
            flow = {"ph": ph, "name": str(labels[i]), "cat": "collective", "id": int(ids[i]),
                    "pid": pid, "tid": tid, "ts": ts}
            if ph == "f":
                flow["bp"] = "e"  # bind to the enclosing slice (not the next one)
            out.append(flow)
    return out



def _perfetto_metadata(trace) -> Dict:
    meta = trace.metadata
    return {"run_id": meta.get("run_id", trace.attrs.get("run_id", "")), "algorithm": of_metadata(meta),
            "algorithm_name": display_name(of_metadata(meta)), "grid": meta.get("grid", ""),
            "world_size": int(meta.get("world_size", trace.world_size)), "status": trace.status,
            "level": meta.get("level", ""), "overlap": meta.get("overlap", ""), "clock": "aligned ns / 1000"}
