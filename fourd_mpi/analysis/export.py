"""Export a trace to other tools' formats: Perfetto / chrome://tracing, and Hatchet / Thicket.

>>> from fourd_mpi.trace.read import load_trace
>>> from fourd_mpi.analysis.export import write_perfetto, write_caliper_json
>>> trace = load_trace("results/20261121-170926-7d02bf.h5")
>>> write_perfetto(trace, "run.json.gz", steps=[1, 2])     # open in ui.perfetto.dev
>>> write_caliper_json(trace, "run.cali.json")               # hatchet / thicket

**Perfetto** (Chrome trace-event JSON): one process per rank (``pid`` = rank), one thread
per lane (``step``, ``layer``, ``host``, ``comm0`` ...). Step spans, layer spans and
host-lane events (compute ops, waits) are complete (``"X"``) events; they never overlap
within a lane, so they nest. Collectives are async (``"b"``/``"e"``) events of category
``comm``: nonblocking collectives are in flight while the host computes, and several at
once. Times are microseconds (floats) on the trace's aligned clock: ``ts = start_ns / 1000``.

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
(``run_id``, ``grid``, ``world_size``, ``model``, ``overlap``, ``summary.*`` ...) are
scalar top-level keys, which Thicket turns into its ``metadata`` table.

Collectives and waits are labelled with their axis (``allgather z``, ``wait z``) so that
traffic over different communicators stays apart. A layer's ops are those attributed to
it in the trace: with overlap, waits and collectives serving a layer may happen outside
its span (see docs/trace-format.md, section 6).
"""

from __future__ import annotations

import gzip
import json
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST, LANE_LAYER, LANE_STEP, lane_name

__all__ = ["to_perfetto", "write_perfetto", "to_caliper_json", "write_caliper_json"]

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


def _perfetto_event_chunks(trace, steps, ranks) -> Iterator[List[Dict]]:
    """Lists of trace events: process and thread names, then X events, then async pairs."""
    steps = None if steps is None else list(steps)  # iterated twice below
    ranks = None if ranks is None else list(ranks)
    events = _select_events(trace, steps, ranks)
    yield _process_metadata(trace, _kept_ranks(trace, ranks)) + _thread_metadata(events)
    on_comm = events["lane"] >= LANE_COMM0
    blocking = events[~on_comm]
    end_ns = _clip_to_successor(blocking)
    for start in range(0, len(blocking), _CHUNK):
        part = slice(start, start + _CHUNK)
        yield _complete_events(trace, blocking[part], end_ns[part])
    collectives = events[on_comm]
    for start in range(0, len(collectives), _CHUNK):
        yield _async_events(trace, collectives[start:start + _CHUNK], first_id=start)


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
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} ({host})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
    return out


def _thread_metadata(events: np.ndarray) -> List[Dict]:
    """Name and order every (rank, lane) thread that has events: step < layer < host < comm<i>."""
    pairs = np.unique(events["rank"].astype(np.int64) * 256 + events["lane"])
    out = []
    for pair in pairs.tolist():
        rank, lane = divmod(pair, 256)
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane, "args": {"name": lane_name(lane)}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": lane, "args": {"sort_index": lane}})
    return out


def _complete_events(trace, events: np.ndarray, end_ns: np.ndarray) -> List[Dict]:
    """Step, layer and host-lane events as "X" events, ending at ``end_ns``."""
    names = _complete_event_names(trace, events)
    layers = trace.decode("layer", events["layer"]).tolist()
    phases = trace.decode("phase", events["phase"]).tolist()
    axes = trace.decode("axis", events["axis"]).tolist()
    columns = zip(names, events["rank"].tolist(), events["lane"].tolist(), (events["start_ns"] / _NS_PER_US).tolist(),
                  ((end_ns - events["start_ns"]) / _NS_PER_US).tolist(), events["step"].tolist(), layers, phases,
                  axes, events["bytes"].tolist(), events["flops"].tolist())
    out = []
    for name, rank, lane, ts, dur, step, layer, phase, axis, nbytes, flops in columns:
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
        out.append({"ph": "X", "name": name, "cat": _LANE_NAMES[lane], "pid": rank, "tid": lane,
                    "ts": ts, "dur": dur, "args": args})
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
    """"step N" for step spans, the layer name for layer spans, the op for host events."""
    names = trace.decode("op", events["op"])
    on_layer = events["lane"] == LANE_LAYER
    names[on_layer] = trace.decode("layer", events["layer"][on_layer])
    on_step = events["lane"] == LANE_STEP
    names[on_step] = [f"step {s}" for s in events["step"][on_step].tolist()]
    return names.tolist()


def _async_events(trace, events: np.ndarray, first_id: int = 0) -> List[Dict]:
    """Collectives as async begin/end pairs (category ``comm``, ids ``first_id``, ``first_id + 1``, ...)."""
    names = _op_labels(trace, events).tolist()
    layers = trace.decode("layer", events["layer"]).tolist()
    phases = trace.decode("phase", events["phase"]).tolist()
    columns = zip(names, events["rank"].tolist(), events["lane"].tolist(), (events["start_ns"] / _NS_PER_US).tolist(),
                  (events["end_ns"] / _NS_PER_US).tolist(), events["step"].tolist(), layers, phases,
                  events["bytes"].tolist(), events["wire_bytes"].tolist(), events["wait_ns"].tolist())
    out = []
    for event_id, (name, rank, lane, ts, te, step, layer, phase, nbytes, wire, wait_ns) in enumerate(columns, first_id):
        args = {"step": step, "layer": layer, "phase": phase, "bytes": nbytes, "wire_bytes": wire,
                "wait_ns": wait_ns, "lane": _LANE_NAMES[lane]}
        out.append({"ph": "b", "name": name, "cat": "comm", "id": event_id, "pid": rank, "tid": lane,
                    "ts": ts, "args": args})
        out.append({"ph": "e", "name": name, "cat": "comm", "id": event_id, "pid": rank, "tid": lane, "ts": te})
    return out


def _perfetto_metadata(trace) -> Dict:
    meta = trace.metadata
    return {"run_id": meta.get("run_id", trace.attrs.get("run_id", "")), "grid": meta.get("grid", ""),
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
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
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
        "grid": meta.get("grid", ""), "world_size": int(meta.get("world_size", trace.world_size)),
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
    for key, value in (meta.get("summary") or {}).items():
        out[f"summary.{key}"] = value
    return {key: value for key, value in out.items() if _is_scalar(value)}


def _is_scalar(value) -> bool:
    """Strings, bools and finite numbers: what a flat metadata table (and strict JSON) holds."""
    if isinstance(value, float):
        return bool(np.isfinite(value))
    return isinstance(value, (str, int))
