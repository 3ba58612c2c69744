"""The Perfetto timeline of a trace as a Perfetto protobuf trace (``.pftrace``, ``.perfetto-trace``).

The slices, names, categories, args, processes and threads of :mod:`fourd_mpi.analysis.export.perfetto` (its
ids and flows too) as TrackEvent begin/end packets, one packet sequence per rank with its strings interned, times
in integer ns; about 40 % of the JSON's bytes (``bench/timeline_formats.py``). Needs the ``perfetto`` package
(:func:`require_perfetto`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from fourd_mpi.analysis.export.common import CHUNK
from fourd_mpi.analysis.export.perfetto import (
    NS_PER_US,
    TIDS_PER_PID,
    clip_to_successor,
    collective_instances,
    complete_events,
    kept_ranks,
    perfetto_ids,
    phase_events,
    select_events,
    thread_metadata,
)
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import open_output

#: file suffixes of the protobuf timeline (``fourd-mpi export perfetto`` picks the encoding by them)
PROTO_SUFFIXES = (".pftrace", ".perfetto-trace", ".pftrace.gz", ".perfetto-trace.gz")


def require_perfetto(path: str) -> None:
    """A :class:`ConfigError` (one line, with the install command) unless the ``perfetto`` package and protobuf,
    which :func:`write_perfetto_proto` needs, import."""
    try:
        import perfetto.protos.perfetto.trace.perfetto_trace_pb2  # noqa: F401
    except ImportError as exc:
        missing = "protobuf" if (exc.name or "").startswith("google") else "perfetto"
        raise ConfigError(f"{path}: the Perfetto protobuf timeline needs the perfetto package and "
                          f"protobuf ({missing} is missing): pip install 'fourd_mpi[perfetto]' "
                          "(or pip install perfetto)") from None


def write_perfetto_proto(trace, path: str, steps: Optional[Iterable[int]] = None,
                         ranks: Optional[Iterable[int]] = None) -> int:
    """Write the events of :func:`~fourd_mpi.analysis.export.perfetto.to_perfetto` as a Perfetto protobuf trace
    (``.pftrace``); returns the number of slices written.

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
    :func:`clip_to_successor` does for the JSON). The file is a ``Trace`` message written a
    chunk of packets at a time (concatenated ``Trace`` messages are one ``Trace``), so memory
    stays bounded. ``path`` ending in ``.gz`` is gzip-compressed (Perfetto's trace processor and UI open
    gzip-compressed traces as they are).

    Reference: Perfetto's "Converting arbitrary timestamped data to Perfetto" (synthetic TrackEvent)
    and its interning section, https://perfetto.dev/docs/reference/synthetic-track-event.
    """
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    steps = None if steps is None else list(steps)
    ranks = None if ranks is None else list(ranks)
    events = select_events(trace, steps, ranks)
    end_ns = clip_to_successor(events)
    flow_next, flow_last = _proto_flow_ids(trace, events, end_ns)
    threads: Dict[int, List[Dict]] = {}
    for meta in thread_metadata(events):
        if meta["name"] == "thread_name":
            threads.setdefault(meta["pid"], []).append(meta)
    by_rank = np.argsort(events["rank"], kind="stable")
    rows = kept_ranks(trace, ranks)
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
                seq.thread(pid, meta["tid"], meta["args"]["name"], sort_index=meta["tid"] - TIDS_PER_PID * pid)
            slices = complete_events(trace, events[mine], end_ns[mine]) + phase_events(trace, events[mine])
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
        track.uuid = TIDS_PER_PID * pid  # never a tid (tids are 1000 * pid + k, k >= 1)
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
            if len(self.trace.packet) >= CHUNK:
                self.flush()
        return n

    def flush(self) -> None:
        if len(self.trace.packet):
            self.f.write(self.trace.SerializeToString())
            self.trace = self.pb.Trace()


def _ns(us: float) -> int:
    """A JSON time (µs) as the integer ns it stands for (:func:`~fourd_mpi.analysis.export.perfetto._us` makes
    the truncation exact)."""
    return int(us * NS_PER_US)


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
