"""``--format json``: one JSON document on standard output and nothing else there, its keys declared once per
command (:class:`JsonDoc`), listed in the command's ``--help`` (:func:`add_json_format`) and checked when the
document is written (:func:`emit_json`), so the help and the output cannot drift apart.

The schema is stable: a key is added, never renamed or removed, without a deprecation; values are JSON
(NaN and infinities as ``null``, NumPy scalars as numbers, anything else as its text). Lines that are not the
result (notes, ``wrote FILE``, progress) go to standard error. ``tests/cli/test_json_output.py`` runs every command
that has the format and ``json.loads`` its standard output.
"""

from __future__ import annotations

import json
import math
from typing import Dict, Optional, Sequence

from fourd_mpi.cli.args import add_format, write_output

#: every declared document, by command (the tests check each command's help against its keys)
DOCUMENTS: Dict[str, "JsonDoc"] = {}


class JsonDoc:
    """The top-level keys of one command's JSON document, each with what it holds; ``optional``: keys present only
    in some documents (the help says when)."""

    def __init__(self, command: str, keys: Dict[str, str], optional: Sequence[str] = ()):
        self.command, self.keys, self.optional = command, dict(keys), frozenset(optional)
        DOCUMENTS[command] = self

    def help(self) -> str:
        """The sentence ``--help`` shows: ``json: one document on standard output, keys a (...); b (...)``."""
        return "json: one document on standard output, keys " + "; ".join(f"{k} ({v})" for k, v in self.keys.items())

    def check(self, doc: Dict) -> None:
        """A document without a declared key (optional ones aside), or with one not declared, is a bug of the
        command."""
        missing = set(self.keys) - self.optional - set(doc)
        unknown = set(doc) - set(self.keys)
        if missing or unknown:
            raise ValueError(f"{self.command} --format json: keys {sorted(missing | unknown)} differ from the "
                             f"declared schema")


def add_json_format(parser, doc: JsonDoc, supported: Sequence[str] = ("table", "json"), default: str = "table",
                    help: str = "") -> None:
    """``--format`` of a command that prints a result (:func:`~fourd_mpi.cli.args.add_format`), its help ending
    with the JSON document's keys."""
    text = help or f"output format: {', '.join(supported)} (default {default})"
    add_format(parser, supported, default, help=text + "; " + doc.help().replace("%", "%%"))


def plain(value):
    """``value`` as JSON can hold it: NaN and infinities as None, NumPy scalars and arrays as Python numbers and
    lists, tuples as lists, mapping keys as text, anything else unknown as its ``str``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # NumPy scalars and arrays
        return plain(value.tolist())
    return str(value)


def json_text(doc: Dict) -> str:
    return json.dumps(plain(doc), indent=1, allow_nan=False) + "\n"


def emit_json(schema: JsonDoc, doc: Dict, output: Optional[str] = None) -> None:
    """Write ``doc`` (checked against ``schema``) as the command's one JSON document: to standard output, or to
    ``output`` (``-o FILE``: ``wrote FILE`` on standard error)."""
    schema.check(doc)
    write_output(output, json_text(doc), f"json: {schema.command}")
