"""Every table a command prints, through one formatter: `tabulate <https://github.com/astanin/python-tabulate>`_.

Two renderings:

- ``table``: aligned plain text, tabulate's ``simple`` format (the header, a row of dashes under each
  column, columns two spaces apart; trailing spaces removed);
- ``markdown``: a GitHub pipe table (tabulate's ``pipe`` format: the header, a separator row whose colons
  align numbers right, one row per line; ``|`` inside a cell escaped as ``\\|``), the one Markdown dialect
  of every ``--format markdown``.

Cells are printed as given: the callers format their numbers first (:func:`fourd_mpi.util.text.format_number`
and their own units), and tabulate never parses them again (``disable_numparse``), so a table shows the
digits its command computed. A column whose cells are all numbers (``-`` for a missing one) is aligned
right, any other left, unless the caller says otherwise; a cell None is shown as ``-``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

#: the renderings of :func:`render`
STYLES = ("table", "markdown")
#: cells that stand for a missing number in a numeric column
MISSING = frozenset({"", "-", "n/a"})


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def numeric_column(cells: Iterable[str]) -> bool:
    """True if every cell is a number or :data:`MISSING`, and at least one is a number."""
    seen = False
    for cell in cells:
        if cell.strip() in MISSING:
            continue
        if not _is_number(cell):
            return False
        seen = True
    return seen


def markdown_escape(text: str) -> str:
    """``text`` safe inside a Markdown table cell or beside one: ``|`` as ``\\|``."""
    return str(text).replace("|", "\\|")


def render(rows: Iterable[Sequence[Any]], headers: Sequence[Any], style: str = "table",
           align: Optional[Sequence[str]] = None, indent: str = "") -> str:
    """``rows`` under ``headers`` as one table (no final newline).

    ``align``: ``"left"`` or ``"right"`` per column (None: numbers right, text left). ``indent``: a
    prefix of every line of a plain table (a table inside a report)."""
    if style not in STYLES:
        raise ValueError(f"unknown table style {style!r}: choose one of {', '.join(STYLES)}")
    from tabulate import tabulate

    headers = [str(h) for h in headers]
    body = [["-" if c is None else str(c) for c in row] for row in rows]
    if any(len(row) != len(headers) for row in body):
        raise ValueError(f"every row needs {len(headers)} cells (the headers)")
    if align is None:
        align = ["right" if numeric_column(row[i] for row in body) else "left" for i in range(len(headers))]
    elif len(align) != len(headers) or set(align) - {"left", "right"}:
        raise ValueError(f"align: one of left, right for each of the {len(headers)} columns")
    if style == "markdown":
        esc = markdown_escape
        return tabulate([[esc(c) for c in row] for row in body], [esc(h) for h in headers], tablefmt="pipe",
                        disable_numparse=True, colalign=tuple(align))
    text = tabulate(body, headers, tablefmt="simple", disable_numparse=True, colalign=tuple(align))
    return "\n".join(indent + line.rstrip() for line in text.splitlines())


def render_records(records: Sequence[dict], style: str = "table", columns: Optional[Sequence[str]] = None,
                   align: Optional[Sequence[str]] = None) -> str:
    """Dicts with the same keys (``columns``: these, in this order; default the first record's) as a table."""
    keys = list(columns if columns is not None else (records[0] if records else []))
    return render([[r.get(k) for k in keys] for r in records], keys, style, align)
