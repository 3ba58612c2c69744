"""Short forms of the descriptive strings stored in traces (for table columns and plot labels),
and rows of plain values in each ``--format`` (for commands without pandas)."""

from __future__ import annotations

import math
from typing import Dict, Sequence


def short_label(text, default: str = "") -> str:
    """The part before the first parenthesis: ``"oag,ors (prefetch depth 1)"`` -> ``"oag,ors"``,
    ``"poll (Testsome ...)"`` -> ``"poll"``. None, NaN (a missing cell of a table) and an empty
    string give ``default``."""
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return default
    return str(text).split(" (")[0].strip() or default


def int_ranges(values) -> str:
    """Integers as the kernel's cpulist writes them: ``[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"`` (sorted, each
    value once; ``""`` for none). Rank lists in messages and CPU lists in traces use it."""
    out, start, prev = [], None, None
    for v in sorted(set(int(v) for v in values)):
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


def human_bytes(count: float) -> str:
    """``21.3 GiB`` (binary units, three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(count) < 1024 or unit == "EiB":
            return f"{count:.0f} B" if unit == "B" else f"{count:.3g} {unit}"
        count /= 1024
    return ""  # pragma: no cover


def format_number(value) -> str:
    """A number as every table and summary prints it: integers as such, floats to about 4
    significant digits (``0.05739``, ``3891.6``, ``1.854``, ``0.0002989``, ``1.2e+07``), NaN as
    ``-``. One function, so that the run summary and ``fourd-mpi analyze`` agree digit for digit."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.4g}"
    if a >= 100:
        return f"{v:.1f}"
    return f"{v:.4g}" if a < 1 else f"{v:.3f}"


def format_rows(rows: Sequence[Dict], fmt: str = "table") -> str:
    """Rows (dicts with the same keys) as an aligned ``table``, ``csv``, ``json`` (a list of
    records) or a ``markdown`` table (:mod:`fourd_mpi.util.table`); the ``--format`` names of every
    command (``fourd_mpi.cli.args.FORMATS``) without pandas."""
    if fmt == "json":
        import json

        return json.dumps(list(rows), indent=1, default=str) + "\n"
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue()
    if not rows:
        return "(none)\n"
    if fmt not in ("table", "markdown"):
        raise ValueError(f"unknown format {fmt!r}: choose one of table, csv, json, markdown")
    from fourd_mpi.util.table import render_records

    return render_records(rows, fmt) + "\n"
