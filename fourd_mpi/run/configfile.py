"""Config files for ``fourd-mpi run``: TOML, YAML or JSON, keys are the long option names.

.. code-block:: toml

    model = "gpt-small"
    steps = 20
    overlap = "all"
    [grid]          # tables only group keys; names must still be option names
    gx = 2
    gy = 2

Keys may use ``-`` or ``_``. Names and values are checked against the option table
(:data:`fourd_mpi.run.options.RUN_OPTIONS`); the file becomes command-line tokens
placed before the real ones, so the command line wins. An error names the file, the
line (TOML and YAML; JSON: the line of the key's first occurrence) and the key, e.g.
``config file run.toml:3: steps: --steps: expected a positive integer, got 'many'``.
Files are bounded before they are parsed: at most :data:`~fourd_mpi.util.yamlspec.MAX_FILE_BYTES`
bytes and :data:`~fourd_mpi.util.yamlspec.MAX_DEPTH` levels of nesting (YAML: also the node
count and alias expansion of :mod:`fourd_mpi.util.yamlspec`). The resolved configuration is
written back in the same format (:func:`dump_toml`), so a printed or stored config can be fed
to ``--config``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import OPTIONS
from fourd_mpi.util.yamlspec import MAX_DEPTH, MAX_FILE_BYTES

FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class ConfigValues(dict):
    """``{option: value}`` from a config file, plus where each option was written:
    ``where[option]`` is ``(line or None, key path as written, e.g. "grid.gx")``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.where: Dict[str, Tuple[Optional[int], str]] = {}


def load_config_file(path: str) -> ConfigValues:
    """A flat ``{option: value}`` dict from a ``.toml``/``.yaml``/``.yml``/``.json`` file."""
    ext = os.path.splitext(path)[1].lower()
    fmt = FORMATS.get(ext)
    if fmt is None:
        raise ConfigError(f"config file {path}: unknown format {ext or '(no extension)'}; use .toml, .yaml or .json")
    from fourd_mpi.util.files import read_regular_file

    try:  # a FIFO or device is refused, not waited on
        raw = read_regular_file(path, MAX_FILE_BYTES + 1, "config file")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"config file {path}: more than {MAX_FILE_BYTES:,} bytes (a config is a few lines)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    doc = None
    try:
        if fmt == "toml":
            try:
                import tomllib
            except ImportError:  # Python < 3.11
                import tomli as tomllib
            _check_brackets(text, path)  # tomllib recurses per nested array or inline table
            data = tomllib.loads(text)
        elif fmt == "yaml":
            from fourd_mpi.util.yamlspec import YamlDocument  # line numbers, duplicate keys, alias bombs

            doc = YamlDocument(text, path)
            data = doc.data if doc.data is not None else {}
        else:
            _check_brackets(text, path)
            data = json.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError:
        raise
    except Exception as exc:  # parser errors of either library (RecursionError included)
        raise ConfigError(f"config file {path} is malformed: {' '.join(str(exc).split())[:300]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option names to values")
    _check_depth(data, path)
    flat = ConfigValues()
    _flatten(data, path, (), flat)
    for key, (_, parts) in list(flat.where.items()):
        line = doc.line(list(parts)) if doc is not None else _text_line(text, parts, fmt)
        flat.where[key] = (line, ".".join(map(str, parts)))
    return flat


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"key {key!r} given twice")
    return dict(pairs)


def _check_brackets(text: str, path: str) -> None:
    """Refuse text nested deeper than :data:`MAX_DEPTH` ``[``/``{`` levels (strings not excluded:
    a config has no reason to hold many brackets in its values either)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_DEPTH + 1:  # + 1: a TOML table header is one bracket level
        raise ConfigError(f"config file {path}: nested more than {MAX_DEPTH} levels deep")


def _check_depth(data, path: str) -> None:
    """Refuse parsed data nested deeper than :data:`MAX_DEPTH` (TOML dotted keys nest without brackets)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"config file {path}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _flatten(data: Dict, path: str, parts: Tuple, flat: ConfigValues) -> None:
    for key, value in data.items():
        if isinstance(value, dict):
            _flatten(value, path, (*parts, key), flat)
            continue
        name = str(key).replace("_", "-")
        if name in flat:
            raise ConfigError(f"config file {path}: {name} given twice")
        flat[name] = value
        flat.where[name] = (None, (*parts, key))


_TOML_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_TOML_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\.\"' ]+?)\s*=")


def _toml_parts(text: str) -> List[str]:
    return [p.strip().strip("\"'") for p in text.split(".")]


def _text_line(text: str, parts: Sequence, fmt: str) -> Optional[int]:
    """The 1-based line where the key path ``parts`` is written (TOML: tables, dotted keys; JSON:
    the first line naming the last key), or None when it cannot be told."""
    want = [str(p) for p in parts]
    if fmt == "json":
        needle = json.dumps(want[-1])
        for number, line in enumerate(text.splitlines(), 1):
            if needle in line:
                return number
        return None
    table: List[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        header = _TOML_TABLE.match(line)
        if header:
            table = _toml_parts(header.group(1))
            continue
        key = _TOML_KEY.match(line)
        if key and table + _toml_parts(key.group(1)) == want:
            return number
    return None


def config_tokens(config: Dict, path: str) -> List[str]:
    """Command-line tokens of ``fourd-mpi run`` equivalent to ``config`` (names and values checked
    against :data:`fourd_mpi.run.options.RUN_OPTIONS`; argparse parses the tokens again). Errors name
    the file, the line (where known: ``config.where``) and the key as written."""
    where = getattr(config, "where", {})
    tokens: List[str] = []
    for key, value in config.items():
        line, written = where.get(key, (None, key))
        at = f"config file {path}:{line}: {written}" if line else f"config file {path}: {written}"
        option = OPTIONS.get(key)
        if option is None:
            raise ConfigError(f"{at}: unknown option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        try:
            tokens += option.tokens(option.parse(value))
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
    return tokens


def dump_toml(config: Dict) -> str:
    """``key = value`` lines (flat: strings, numbers, booleans; None is left out)."""
    lines = []
    for key, value in config.items():
        if hasattr(value, "item"):  # NumPy scalars
            value = value.item()
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))
        lines.append(f"{key} = {text}")
    return "\n".join(lines)
