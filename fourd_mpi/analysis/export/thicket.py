"""A trace as a Caliper JSON-split profile, for Hatchet and Thicket.

Caliper JSON-split is what ``hatchet.GraphFrame.from_caliper`` and
``thicket.Thicket.from_caliper`` read: a tree ``step > phase > layer > op`` with one row
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
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from fourd_mpi.algorithms.registry import display_name, of_metadata
from fourd_mpi.analysis.export.common import CHUNK, op_labels, write_json
from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST, LANE_LAYER, LANE_STEP

_NS_PER_S = 1e9

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
    write_json(path, profile, "data", (rows[i:i + CHUNK] for i in range(0, len(rows), CHUNK)))


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
        op_label = op_labels(trace, events)
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
        "algorithm": of_metadata(meta), "algorithm_name": display_name(of_metadata(meta)),
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
