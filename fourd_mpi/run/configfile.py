"""Config files for ``fourd-mpi run``: YAML or TOML, keys are the long option names.

.. code-block:: toml

    model = "gpt-small"
    steps = 20
    overlap = "all"
    [grid]          # tables only group keys; names must still be option names
    gx = 2
    gy = 2

Keys may use ``-`` or ``_``. Names and values are checked against the option table
(:data:`fourd_mpi.run.options.RUN_OPTIONS`); the file becomes command-line tokens
placed before the real ones, so the command line wins. The resolved configuration is written back in the same format
(:func:`dump_toml`), so a printed or stored config can be fed to ``--config``.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import OPTIONS


def load_config_file(path: str) -> Dict:
    """A flat ``{option: value}`` dict from a ``.yaml``/``.yml``/``.toml`` file."""
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if ext == ".toml":
            try:
                import tomllib
            except ImportError:  # Python < 3.11
                import tomli as tomllib
            data = tomllib.loads(raw.decode())
        elif ext in (".yaml", ".yml"):
            from fourd_mpi.util.yamlspec import YamlDocument  # line numbers, duplicate keys, alias bombs

            data = YamlDocument(raw.decode(), path).data or {}
        else:
            raise ConfigError(f"config file {path}: unknown format {ext or '(no extension)'}; use .toml or .yaml")
    except ConfigError:
        raise
    except Exception as exc:  # parser errors of either library
        raise ConfigError(f"config file {path} is malformed: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of option names to values")
    return _flatten(data, path)


def _flatten(data: Dict, path: str, section: str = "") -> Dict:
    flat: Dict = {}
    for key, value in data.items():
        if isinstance(value, dict):
            inner = _flatten(value, path, f"{section}{key}.")
            clash = set(inner) & set(flat)
        else:
            inner = {str(key).replace("_", "-"): value}
            clash = set(inner) & set(flat)
        if clash:
            raise ConfigError(f"config file {path}: {', '.join(sorted(clash))} given twice")
        flat.update(inner)
    return flat


def config_tokens(config: Dict, path: str) -> List[str]:
    """Command-line tokens of ``fourd-mpi run`` equivalent to ``config`` (names and values checked
    against :data:`fourd_mpi.run.options.RUN_OPTIONS`; argparse parses the tokens again)."""
    tokens: List[str] = []
    for key, value in config.items():
        option = OPTIONS.get(key)
        if option is None:
            raise ConfigError(f"config file {path}: unknown option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        try:
            tokens += option.tokens(option.parse(value))
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
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
