"""Exports of a trace to other tools' formats, one module per format, and their registry.

>>> from fourd_mpi.trace.read import load_trace
>>> from fourd_mpi.analysis.export import write_perfetto, write_perfetto_proto, write_caliper_json
>>> trace = load_trace("results/20261121-170926-7d02bf.h5")
>>> write_perfetto(trace, "run.json.gz", steps=[1, 2])     # open in ui.perfetto.dev
>>> write_perfetto_proto(trace, "run.pftrace")               # the same, Perfetto's protobuf (pip install perfetto)
>>> write_caliper_json(trace, "run.cali.json")               # hatchet / thicket

===================  ========================================  ===========================================
format               module                                    read by
===================  ========================================  ===========================================
``perfetto-json``    :mod:`~fourd_mpi.analysis.export.perfetto`  Perfetto UI, chrome://tracing (``.json[.gz]``)
``perfetto-proto``   :mod:`~fourd_mpi.analysis.export.pftrace`   Perfetto UI and trace processor (``.pftrace``)
``thicket``          :mod:`~fourd_mpi.analysis.export.thicket`   ``hatchet.GraphFrame.from_caliper``, Thicket
===================  ========================================  ===========================================

:data:`FORMATS` is the registry: ``fourd-mpi export FORMAT`` names a :attr:`ExportFormat.command`, and
:func:`format_for` picks among that command's formats by the output file's suffix (``perfetto``: JSON or
protobuf). A new format is one module and one record here. What the formats share (op labels, the streaming
JSON writer) is :mod:`~fourd_mpi.analysis.export.common`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from fourd_mpi.analysis.export.perfetto import (
    JSON_SUFFIXES,
    collective_instances,
    perfetto_ids,
    rank_coordinates,
    to_perfetto,
    write_perfetto,
)
from fourd_mpi.analysis.export.pftrace import PROTO_SUFFIXES, require_perfetto, write_perfetto_proto
from fourd_mpi.analysis.export.thicket import adiak_cluster, to_caliper_json, write_caliper_json

#: the registry, and the writers' names as they were when this package was one module (tests, docs and bench
#: import them from here)
__all__ = ["ExportFormat", "FORMATS", "FORMATS_BY_NAME", "COMMANDS", "format_for",
           "to_perfetto", "write_perfetto", "write_perfetto_proto", "collective_instances", "rank_coordinates",
           "perfetto_ids", "to_caliper_json", "write_caliper_json", "adiak_cluster"]


def _available(path: str) -> None:
    """A format the base install writes: nothing to check."""


@dataclass(frozen=True)
class ExportFormat:
    """One file format a trace is exported to."""

    name: str
    #: the ``export`` command's FORMAT that writes it
    command: str
    #: what it holds, in the command's messages ("timeline", "profile")
    kind: str
    #: what the file is, for people
    title: str
    #: ``write(trace, path, **options)``, the file written a chunk at a time
    write: Callable[..., object]
    #: the keyword options :attr:`write` takes, of ``steps``, ``ranks``, ``include_warmup``
    options: Tuple[str, ...]
    #: the file names it is picked by among its command's formats (lower case; empty: the only one)
    suffixes: Tuple[str, ...] = ()
    #: ``require(path)``: a one-line :class:`~fourd_mpi.errors.ConfigError` when a package it needs is missing
    require: Callable[[str], None] = _available

    def export(self, trace, path: str, **given) -> None:
        """Write ``trace`` to ``path`` with the options of ``given`` this format takes."""
        self.write(trace, path, **{key: given[key] for key in self.options if key in given})


FORMATS: Tuple[ExportFormat, ...] = (
    ExportFormat("perfetto-json", "perfetto", "timeline", "Chrome trace-event JSON", write_perfetto,
                 ("steps", "ranks"), JSON_SUFFIXES),
    ExportFormat("perfetto-proto", "perfetto", "timeline", "Perfetto protobuf", write_perfetto_proto,
                 ("steps", "ranks"), PROTO_SUFFIXES, require_perfetto),
    ExportFormat("thicket", "thicket", "profile", "Caliper JSON-split", write_caliper_json, ("include_warmup",)),
)
#: the ``export`` command's FORMAT choices, in registry order
COMMANDS: Tuple[str, ...] = tuple(dict.fromkeys(f.command for f in FORMATS))
FORMATS_BY_NAME: Dict[str, ExportFormat] = {f.name: f for f in FORMATS}


def format_for(command: str, path: str) -> ExportFormat:
    """The format ``fourd-mpi export COMMAND -o PATH`` writes: the command's only format, or the one whose suffix
    ends ``path``; ``ValueError`` (one line, naming the suffixes) when none does."""
    candidates = [f for f in FORMATS if f.command == command]
    if not candidates:
        raise ValueError(f"unknown export format {command!r}: choose one of {', '.join(COMMANDS)}")
    if len(candidates) == 1:
        return candidates[0]
    name = str(path).lower()
    for candidate in candidates:
        if name.endswith(candidate.suffixes):
            return candidate
    choices = " or ".join(f"{', '.join(f.suffixes)} ({f.title})" for f in candidates)
    raise ValueError(f"{path}: the {candidates[0].kind}'s format comes from its suffix: {choices}")
