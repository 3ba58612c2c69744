"""Rendering the frames of the tables: aligned text, csv, json, markdown."""

from __future__ import annotations

import io
import json
from typing import List

import numpy as np
import pandas as pd

from fourd_mpi.util.table import render
from fourd_mpi.util.text import format_number

FORMATS = ("table", "csv", "json", "markdown")


def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return format_number(float(value))
    return format_number(value) if value is None else str(value)


def _is_numeric(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


def _cells(df: pd.DataFrame) -> List[List[str]]:
    return [[_cell(v) for v in row] for row in df.itertuples(index=False, name=None)]


def format_table(df: pd.DataFrame, fmt: str = "table") -> str:
    """Render a frame of this module: ``table`` (aligned plain text), ``csv``, ``json`` (a list of
    records; NaN -> null) or ``markdown`` (a GitHub pipe table), the tables by
    :func:`fourd_mpi.util.table.render` (numeric columns aligned right). ``table`` and ``markdown``
    round floats to about 4 significant digits and show NaN as ``-``; ``csv`` and ``json`` keep full
    precision."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "csv":
        buf = io.StringIO()
        df.to_csv(buf, index=False)
        return buf.getvalue()
    if fmt == "json":
        records = json.loads(df.to_json(orient="records", double_precision=15))
        return json.dumps(records, indent=1)
    headers = [str(c) for c in df.columns]
    if not headers:
        return "(no columns)"
    align = ["right" if _is_numeric(df[c]) else "left" for c in df.columns]
    text = render(_cells(df), headers, "markdown" if fmt == "markdown" else "table", align)
    return text if len(df) or fmt == "markdown" else text + "\n(no rows)"
