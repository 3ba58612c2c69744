"""What the export formats share: the op labels of events, and a JSON writer that streams.

Collectives and waits are labelled with their axis (``allgather z``, ``wait z``) so that
traffic over different communicators stays apart. A layer's ops are those attributed to
it in the trace: with overlap, waits and collectives serving a layer may happen outside
its span (see docs/trace-format.md, section 6).
"""

from __future__ import annotations

import json
from typing import Dict, Iterable, List

import numpy as np

from fourd_mpi.util.files import open_output

CHUNK = 1 << 16  # events converted (and written) at a time
_COMPACT = (",", ":")


def op_labels(trace, events: np.ndarray) -> np.ndarray:
    """The op name, with the axis for events that have one: ``gemm``, ``allgather z``, ``wait x``."""
    ops = trace.decode("op", events["op"])
    axes = trace.decode("axis", events["axis"])
    with_axis = events["axis"] != trace.code("axis", "none")
    labels = ops.copy()
    labels[with_axis] = [f"{o} {a}" for o, a in zip(ops[with_axis].tolist(), axes[with_axis].tolist())]
    return labels


def write_json(path: str, header: Dict, list_key: str, chunks: Iterable[List]) -> None:
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
