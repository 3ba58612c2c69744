"""One run's collectives: the comm table (per op and axis), its split by placement (intra- or
inter-node) and the hidden share against a baseline run."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from fourd_mpi.analysis.tables.runs import algorithm_of, grid_of, measured_select, run_id_of
from fourd_mpi.core.colltable import BUSBW_FORMULA, wire_factor
from fourd_mpi.trace.events import COPY_OPS, LANE_COMM0, P2P_OPS
from fourd_mpi.trace.read import Trace
from fourd_mpi.trace.scan import gather_columns, in_codes
from fourd_mpi.trace.summary import measured_records

COMM_COLUMNS = [
    "run_id", "op", "axis", "placement", "node_span", "group_size", "messages_per_step", "bytes_per_step",
    "wire_bytes_per_step", "bytes_per_message", "inflight_median_s", "inflight_s_per_step", "wait_s_per_step",
    "peer_wait_s_per_step", "transfer_wait_s_per_step", "mpi_s_per_step", "exposed_s_per_step", "algbw_gbps",
    "busbw_gbps", "overlap_pct", "outside_mpi_pct", "formula",
    "algorithm",
]
OVERLAP_FORMULA = ("overlap_pct = 100 * sum(overlap_ns) / sum(complete_ns - call_ns)  [in flight: from the "
                   "return of the MPI_I* call to its first observed completion; overlap_ns: host compute (GEMMs, "
                   "attention, elementwise, optimizer; MPI polls inside them excluded) in that window]")
EXPOSED_FORMULA = ("exposed_s_per_step = sum((call_ns - issue_ns) + mpi_ns) / (ranks * steps)  [host time in MPI for "
                   "the collective: its own I* call, then tests and waits while it was in flight]")
HIDDEN_FORMULA = ("hidden_pct = 100 * clip(1 - exposed_s_per_step / exposed_s_per_step of the baseline run, 0, 1)  "
                  "[OSU's overlap with the baseline (a run without overlap) as t_pure: the communication time that "
                  "stopped being exposed]")
OUTSIDE_MPI_FORMULA = ("outside_mpi_pct = 100 * (1 - sum(mpi_ns) / sum(complete_ns - call_ns))  [mpi_ns: host time "
                       "inside MPI calls (I*, Test/Testsome, Wait) in the window; the rest is compute or harness]")
PEER_WAIT_FORMULA = ("peer_wait_s_per_step = sum(clip(last_issue_ns - (complete_ns - wait_ns), 0, wait_ns)) / "
                     "(ranks * steps)  [the part of a wait spent before the last rank of the collective's "
                     "communicator had issued it (load imbalance: no progress strategy can hide it); "
                     "last_issue_ns: the latest issue_ns of the same collective (the k-th on that communicator in "
                     "the step) over the communicator's ranks, on the trace's aligned clock; collectives only: "
                     "NaN for a pipeline's sends and receives and for staging copies]")
TRANSFER_WAIT_FORMULA = ("transfer_wait_s_per_step = wait_s_per_step - peer_wait_s_per_step  [waiting after every "
                         "rank had issued: the transfer (and the progress it lacked) that overlap can hide]")
COMM_FORMULAS = {
    "peer_wait_s_per_step": PEER_WAIT_FORMULA,
    "transfer_wait_s_per_step": TRANSFER_WAIT_FORMULA,
    "overlap_pct": OVERLAP_FORMULA,
    "outside_mpi_pct": OUTSIDE_MPI_FORMULA,
    "exposed_s_per_step": EXPOSED_FORMULA,
    "algbw_gbps": "algbw = sum(bytes) / sum(complete_ns - issue_ns)  [bytes/ns = GB/s; nccl-tests size / time]",
    "busbw_gbps": BUSBW_FORMULA,
    "per_step": "messages/bytes/wire_bytes/inflight/wait/mpi per step = sum over measured steps and ranks "
                "/ (ranks * measured steps)",
    "placement": "inter-node when the issuing rank's communicator along the axis spans more than one node "
                 "(node_span > 1; the run's node assignment, trace metadata placement.node_span), else intra-node; "
                 "node_span = the most nodes one such communicator spans",
}
#: columns of :func:`comm_placement_table`
COMM_PLACEMENT_COLUMNS = ["run_id", "placement", "messages_per_step", "bytes_per_step", "bytes_pct",
                          "wire_bytes_per_step", "inflight_s_per_step", "inflight_pct", "exposed_s_per_step",
                          "exposed_pct", "axes", "algorithm"]
COMM_PLACEMENT_FORMULAS = {
    "per_step": "the comm table's per-step sums (per rank and step) added over its rows of that placement",
    "*_pct": "100 * the placement's sum / the sum over both placements",
    "placement": COMM_FORMULAS["placement"],
}


_COMM_BY = ("op", "axis", "phase", "layer")


def _groups(key: np.ndarray, span: int):
    """``np.unique(key, return_inverse=True)`` for keys in ``[0, span)``: by counting when ``span`` is
    small (at most the number of keys, or 2**16), instead of sorting."""
    if not len(key) or span > max(len(key), 1 << 16) or int(key.min()) < 0:
        return np.unique(key, return_inverse=True)
    present = np.bincount(key, minlength=span) > 0
    return np.flatnonzero(present), (np.cumsum(present) - 1)[key]


def _group_medians(values: np.ndarray, inverse: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per group ``j`` of ``inverse`` (``count[j]`` members, every group non-empty): the median of its
    ``values``, the mean of its two middle order statistics (``(count - 1) // 2`` and ``count // 2``,
    as the median of the sorted group). A stable sort by group, then a selection per group."""
    narrow = inverse.astype(np.uint16) if len(count) <= 1 << 16 else inverse  # 16-bit keys: radix sort
    grouped = values[np.argsort(narrow, kind="stable")]
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    median = np.empty(len(count))
    for j, (start, n) in enumerate(zip(starts.tolist(), count.tolist())):
        lo, hi = (n - 1) // 2, n // 2
        part = np.partition(grouped[start:start + n], (lo, hi))
        median[j] = 0.5 * (part[lo] + part[hi])
    return median


def comm_table(trace: Trace, by: Sequence[str] = ("op", "axis")) -> pd.DataFrame:
    """Collectives of the measured steps per ``(op, axis)``: columns :data:`COMM_COLUMNS`.

    ``by`` may add ``"phase"`` and/or ``"layer"`` (extra columns after ``axis``). Collectives are
    the events on ``comm<i>`` lanes (the blocking loss all-reduces included: 8 bytes, all wait).
    In staged runs the comm lanes also hold the staging copies (ops ``d2h``, ``h2d``): they get
    their own rows, with ``algbw_gbps`` the copy bandwidth and NaN bus bandwidth and overlap.

    - ``messages_per_step``, ``bytes_per_step``, ``wire_bytes_per_step``, ``inflight_s_per_step``,
      ``wait_s_per_step``: sums over the measured steps and all ranks / (ranks * steps), i.e. per
      rank and step. ``bytes`` is the message size in the nccl-tests "size" convention;
      ``wire_bytes`` the ring-model volume a rank sends.
    - ``bytes_per_message`` = total bytes / messages; ``inflight_median_s``: median over the
      messages of the in-flight time ``complete_ns - issue_ns``.
    - ``algbw_gbps`` = sum(bytes) / sum(complete_ns - issue_ns) (GB/s = bytes/ns): the nccl-tests
      algorithm bandwidth, aggregated as total bytes / total in-flight time (a message-weighted
      harmonic mean, not the mean of per-message bandwidths).
    - ``busbw_gbps`` = algbw * (n-1)/n for allgather and reduce_scatter, * 2(n-1)/n for allreduce,
      ``n`` = ``group_size``, the size of the axis (metadata ``run_options.grid``).
    - ``overlap_pct`` = 100 * sum(overlap_ns) / sum(complete_ns - call_ns): the part of the
      in-flight time (from the return of the ``MPI_I*`` call to the first observed completion)
      during which the host computed (compute ops; MPI polls made inside them excluded): 100 = fully
      hidden behind compute, 0 = nothing computed while it was in flight. Work done inside the
      collective's own ``I*`` call is not in its window. An upper bound of the communication
      hidden: the trace cannot see whether MPI progressed the collective during that compute
      (OSU's formula, which needs the collective's standalone time, can; bench/overlap_probe.py).
    - ``outside_mpi_pct`` = 100 * (1 - sum(mpi_ns) / sum(complete_ns - call_ns)): the part of the
      window in which the host was not inside an MPI call (the ``I*`` calls of other collectives,
      ``Test``/``Testsome`` polls, ``Wait``); it exceeds ``overlap_pct`` by the harness's own Python
      between calls. ``mpi_s_per_step``: the ``mpi_ns`` sum per rank and step.
    - Traces of schema <= 3 have no ``call_ns``/``mpi_ns``/``overlap_ns`` (:func:`load_trace` fills
      them with ``issue_ns``, ``wait_ns`` and the not-waited time): both percentages then equal
      their old ``1 - wait / (complete - issue)``.
    - ``placement``: ``intra-node`` or ``inter-node``, a grouping key after ``by``: a collective is inter-node
      when the issuing rank's communicator along its axis spans more than one node (metadata
      ``placement.node_span[axis][rank]`` > 1: the launcher's node assignment recorded by the run,
      :meth:`~fourd_mpi.trace.read.Trace.placement`); ``node_span`` the most nodes one such communicator spans.
      An axis whose communicators all lie on one node has only intra-node rows; one that crosses nodes
      everywhere only inter-node rows; an uneven placement both. :func:`comm_placement_table` sums them.
    - ``formula`` repeats the overlap formula; ``df.attrs["formulas"]`` has all of them.

    In-flight times are observed (section 13 of docs/trace-format.md): the bandwidths are lower
    bounds. Empty frame for traces below level ``op``.

    Long: one vectorized group-by: each column is a bincount over the same groups and masks.
    """
    by = list(by)
    bad = [c for c in by if c not in _COMM_BY]
    if bad or "op" not in by or "axis" not in by:
        raise ValueError(f"comm_table: by must contain 'op' and 'axis' and only {', '.join(_COMM_BY)}")
    columns = COMM_COLUMNS[:3] + [c for c in by if c not in ("op", "axis")] + COMM_COLUMNS[3:]
    run_id = run_id_of(trace)
    measured = measured_records(trace.rank_steps)
    n_records = len(measured)
    ev = trace.events
    wanted = set(by) | {"op", "axis", "rank", "step", "issue_ns", "complete_ns", "start_ns", "end_ns", "bytes",
                        "wire_bytes", "wait_ns", "call_ns", "mpi_ns", "overlap_ns"}
    # the comm-lane events of the measured steps, block by block (see breakdown)
    coll = gather_columns(ev, wanted, measured_select(measured, lambda lane: lane >= LANE_COMM0)) if n_records \
        else {c: ev[c][:0] for c in wanted}
    if not len(coll["bytes"]):
        out = pd.DataFrame(columns=columns)
        out.attrs["formulas"] = dict(COMM_FORMULAS)
        return out
    vocab_of = {"op": "ops", "axis": "axes", "phase": "phases", "layer": "layers"}
    placement = trace.placement()  # read once: the node spans and the wait split's communicators
    span = _event_node_span(placement, trace.vocab["axes"], coll["axis"], coll["rank"])
    codes = [coll[c].astype(np.int64) for c in by] + [(span > 1).astype(np.int64)]
    radices = [max(len(trace.vocab[vocab_of[c]]), int(k.max()) + 1) for c, k in zip(by, codes)] + [2]
    key = np.zeros(len(coll["bytes"]), dtype=np.int64)
    for k, r in zip(codes, radices):
        key = key * r + k
    uniq, inverse = _groups(key, math.prod(radices))
    g = len(uniq)
    copy_codes = [trace.vocab["ops"].index(o) for o in COPY_OPS if o in trace.vocab["ops"]]
    is_copy = in_codes(coll["op"], copy_codes)  # copies: their own duration (no issue/completion)
    inflight = np.where(is_copy, coll["end_ns"] - coll["start_ns"],
                        coll["complete_ns"] - coll["issue_ns"]).astype(np.float64)
    count = np.bincount(inverse, minlength=g)
    nbytes = np.bincount(inverse, weights=coll["bytes"].astype(np.float64), minlength=g)
    wire = np.bincount(inverse, weights=coll["wire_bytes"].astype(np.float64), minlength=g)
    tflight = np.bincount(inverse, weights=inflight, minlength=g)
    twait = np.bincount(inverse, weights=coll["wait_ns"].astype(np.float64), minlength=g)
    # the split matches collectives only: a pipeline's sends and receives (and staging copies) have no k-th peer
    p2p_codes = [trace.vocab["ops"].index(o) for o in P2P_OPS if o in trace.vocab["ops"]]
    matched = ~is_copy & ~in_codes(coll["op"], p2p_codes)
    peer = np.zeros(len(matched), dtype=np.int64)
    if matched.any():
        needed = ("rank", "step", "axis", "issue_ns", "complete_ns", "wait_ns")
        peer[matched] = peer_wait_ns({c: coll[c][matched] for c in needed}, placement, trace.vocab["axes"])
    tpeer = np.bincount(inverse, weights=peer.astype(np.float64), minlength=g)
    window = np.where(is_copy, 0, coll["complete_ns"] - np.maximum(coll["call_ns"], coll["issue_ns"]))
    twindow = np.bincount(inverse, weights=window.astype(np.float64), minlength=g)
    tmpi = np.bincount(inverse, weights=np.where(is_copy, 0, coll["mpi_ns"]).astype(np.float64), minlength=g)
    tover = np.bincount(inverse, weights=np.where(is_copy, 0, coll["overlap_ns"]).astype(np.float64), minlength=g)
    own_call = np.maximum(coll["call_ns"] - coll["issue_ns"], 0)
    texposed = np.bincount(inverse, weights=np.where(is_copy, 0, own_call + coll["mpi_ns"]).astype(np.float64),
                           minlength=g)
    median = _group_medians(inflight, inverse, count)
    # decode the group keys back into codes
    decoded = []
    rest = uniq.copy()
    for r in reversed(radices):
        decoded.append(rest % r)
        rest = rest // r
    decoded = dict(zip(by + ["placement"], reversed(decoded)))
    grid = grid_of(trace)
    out = pd.DataFrame(index=pd.RangeIndex(g))
    for c in by:
        words = trace.vocab[vocab_of[c]]
        out[c] = [words[i] if i < len(words) else str(i) for i in decoded[c]]
    out["placement"] = np.where(decoded["placement"] == 1, "inter-node", "intra-node")
    widest = np.ones(g, dtype=np.int64)
    np.maximum.at(widest, inverse, span)
    out["node_span"] = widest
    out["run_id"] = run_id
    sizes = np.array([grid.get(a, 0) for a in out["axis"]], dtype=np.int64)
    # staging copies (d2h, h2d) share the comm lanes: copy bandwidth, but no bus bandwidth or overlap
    copy = out["op"].isin(COPY_OPS).to_numpy()
    factor = np.array([wire_factor(o, int(s)) if s > 0 and o not in COPY_OPS else float("nan")
                       for o, s in zip(out["op"], sizes)])
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(tflight > 0, nbytes / tflight, np.nan)
        out["group_size"] = sizes
        out["messages_per_step"] = count / n_records
        out["bytes_per_step"] = nbytes / n_records
        out["wire_bytes_per_step"] = wire / n_records
        out["bytes_per_message"] = nbytes / count
        out["inflight_median_s"] = median * 1e-9
        out["inflight_s_per_step"] = tflight / n_records * 1e-9
        out["wait_s_per_step"] = twait / n_records * 1e-9
        unsplit = copy | out["op"].isin(P2P_OPS).to_numpy()  # no split: NaN, as the copies' bus bandwidth
        out["peer_wait_s_per_step"] = np.where(unsplit, np.nan, tpeer / n_records * 1e-9)
        out["transfer_wait_s_per_step"] = np.where(unsplit, np.nan, (twait - tpeer) / n_records * 1e-9)
        out["mpi_s_per_step"] = tmpi / n_records * 1e-9
        out["exposed_s_per_step"] = np.where(copy, np.nan, texposed / n_records * 1e-9)
        out["algbw_gbps"] = algbw
        out["busbw_gbps"] = algbw * factor
        out["overlap_pct"] = np.where((twindow > 0) & ~copy, 100.0 * tover / twindow, np.nan)
        out["outside_mpi_pct"] = np.where((twindow > 0) & ~copy, 100.0 * (1.0 - tmpi / twindow), np.nan)
    out["formula"] = OVERLAP_FORMULA
    out["algorithm"] = algorithm_of(trace)
    out = out[columns]
    out.attrs["formulas"] = dict(COMM_FORMULAS)
    return out


def peer_wait_ns(coll, placement, axis_words) -> np.ndarray:
    """Per collective: the nanoseconds of its wait spent before the last rank of its communicator issued it
    (:data:`PEER_WAIT_FORMULA`).

    ``coll``: columns ``rank``, ``step``, ``axis`` (codes into ``axis_words``), ``issue_ns``, ``complete_ns``,
    ``wait_ns`` of the collectives (one row each, any order). ``placement``: the run's
    :class:`~fourd_mpi.core.placement.NodePlacement` (its ``dims``, in axis order: world ranks row-major over
    them). The communicator of rank ``r`` along axis ``a`` is the ranks that share every coordinate of ``r``
    but ``a``'s (axis ``none``: the world). MPI starts the collectives of one communicator in the same order
    on every member, so the ``k``-th collective of rank ``r`` over ``a`` in a step (by ``issue_ns``) is the
    ``k``-th of each member; ``last_issue`` is the latest of their ``issue_ns``. A wait ends at the observed
    completion, so it spans ``[complete_ns - wait_ns, complete_ns]``; the part before ``last_issue`` is the
    peer wait. An axis the placement does not name: no peers (0). No MPI: arrays only.
    """
    n = len(coll["rank"])
    if not n:
        return np.zeros(0, dtype=np.int64)
    rank = coll["rank"].astype(np.int64)
    axis = coll["axis"].astype(np.int64)
    axes = list(placement.dims)
    dims = [int(placement.dims[a]) for a in axes]
    world = int(math.prod(dims))
    if not dims or world <= 0:  # no usable grid in the placement: nothing to match
        return np.zeros(n, dtype=np.int64)
    coords = np.unravel_index(np.clip(rank, 0, world - 1), dims)
    group = np.full(n, -1, dtype=np.int64)
    for code, word in enumerate(axis_words):
        here = axis == code
        if not here.any():
            continue
        if word == "none":
            group[here] = 0
        elif word in axes:
            i = axes.index(word)
            others = [c[here] if j != i else np.zeros(int(here.sum()), dtype=np.int64) for j, c in enumerate(coords)]
            group[here] = np.ravel_multi_index(others, dims)
    issue = coll["issue_ns"].astype(np.int64)
    step = coll["step"].astype(np.int64)
    order = np.lexsort((issue, axis, step, rank))  # each rank's collectives per (step, axis) in issue order
    first = np.ones(n, dtype=bool)
    first[1:] = (np.diff(rank[order]) != 0) | (np.diff(step[order]) != 0) | (np.diff(axis[order]) != 0)
    starts = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    ordinal = np.empty(n, dtype=np.int64)
    ordinal[order] = np.arange(n) - starts
    known = group >= 0
    key = np.stack([step, axis, group, ordinal])[:, known]
    _, inverse = np.unique(key, axis=1, return_inverse=True)
    last = np.full(int(inverse.max()) + 1 if len(inverse) else 0, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last, inverse.reshape(-1), issue[known])
    wait = coll["wait_ns"].astype(np.int64)
    start = coll["complete_ns"].astype(np.int64) - wait
    out = np.zeros(n, dtype=np.int64)
    out[known] = np.clip(last[inverse.reshape(-1)] - start[known], 0, wait[known])
    return out


def _event_node_span(placement, words, axis_codes: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Per event: the nodes spanned by its rank's communicator along its axis (``placement``: the trace's
    :meth:`Trace.placement`; ``words``: its axis vocabulary; axis ``none``, the world-wide loss all-reduce: the
    run's node count; an axis the placement lacks: 1)."""
    if not len(axis_codes):
        return np.ones(0, dtype=np.int64)
    world = max(len(placement.nodes), int(ranks.max()) + 1)
    table = np.ones((max(len(words), int(axis_codes.max()) + 1), world), dtype=np.int64)
    for code, word in enumerate(words):
        spans = placement.spans.get(word)
        if spans:
            spans = spans[:world]
            table[code, :len(spans)] = spans
    return table[axis_codes.astype(np.int64), ranks.astype(np.int64)]


def comm_placement_table(comm: pd.DataFrame) -> pd.DataFrame:
    """The comm table (:func:`comm_table`, one or more runs) split into intra- and inter-node: per run and
    placement the per-step sums of its rows (messages, bytes, wire bytes, in-flight and exposed seconds), each
    with its share of the run's total (``*_pct``), and the axes involved. Columns :data:`COMM_PLACEMENT_COLUMNS`."""
    if not len(comm):
        out = pd.DataFrame(columns=COMM_PLACEMENT_COLUMNS)
        out.attrs["formulas"] = dict(COMM_PLACEMENT_FORMULAS)
        return out
    rows = comm[~comm["op"].isin(COPY_OPS)]
    sums = ["messages_per_step", "bytes_per_step", "wire_bytes_per_step", "inflight_s_per_step", "exposed_s_per_step"]
    grouped = rows.groupby(["run_id", "placement"], sort=True)
    out = grouped[sums].sum().reset_index()
    out["axes"] = grouped["axis"].agg(lambda a: ",".join(dict.fromkeys(a))).to_numpy()
    out["algorithm"] = grouped["algorithm"].first().to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for col, pct in (("bytes_per_step", "bytes_pct"), ("inflight_s_per_step", "inflight_pct"),
                         ("exposed_s_per_step", "exposed_pct")):
            total = out.groupby("run_id")[col].transform("sum")
            out[pct] = np.where(total > 0, 100.0 * out[col] / total, np.nan)
    out = out[COMM_PLACEMENT_COLUMNS]
    out.attrs["formulas"] = dict(COMM_PLACEMENT_FORMULAS)
    return out


def hidden_vs_baseline(comm: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """``comm`` with a ``hidden_pct`` column: the share of each collective's exposed time in
    ``baseline`` (the comm table of a run without overlap, same model and grid) that is no longer
    exposed: ``100 * clip(1 - exposed / exposed_baseline, 0, 1)`` (:data:`HIDDEN_FORMULA`), i.e.
    OSU's overlap with the baseline as ``t_pure``. Rows are matched on every key column both
    tables share (op, axis, and phase/layer where both have them); unmatched rows get NaN.
    """
    keys = [c for c in ("op", "axis", "placement", "phase", "layer") if c in comm.columns and c in baseline.columns]
    ref = baseline[keys + ["exposed_s_per_step"]].rename(columns={"exposed_s_per_step": "_baseline"})
    out = comm.merge(ref, on=keys, how="left")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["hidden_pct"] = 100.0 * np.clip(1.0 - out["exposed_s_per_step"] / out["_baseline"], 0.0, 1.0)
    out = out.drop(columns=["_baseline"])
    out.attrs["formulas"] = dict(comm.attrs.get("formulas", COMM_FORMULAS), hidden_pct=HIDDEN_FORMULA)
    return out
