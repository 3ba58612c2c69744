"""Config files for ``fourd-mpi run``: YAML or TOML, keys are the long option names.

.. code-block:: toml

    model = "gpt-small"
    steps = 20
    overlap = "all"
    [grid]          # tables only group keys; names must still be option names
    gx = 2
    gy = 2

Keys may use ``-`` or ``_``. The file becomes command-line tokens placed before
the real ones, so argparse validates them like typed options and the command
line wins. The resolved configuration is written back in the same format
(:func:`dump_toml`), so a printed or stored config can be fed to ``--config``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List

from fourd_mpi.errors import ConfigError


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
            import yaml

            data = yaml.safe_load(raw) or {}
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


def config_tokens(config: Dict, parser: argparse.ArgumentParser, path: str) -> List[str]:
    """Command-line tokens equivalent to ``config`` for ``parser`` (a subcommand's parser)."""
    actions = {opt[2:]: action for action in parser._actions for opt in action.option_strings
               if opt.startswith("--")}
    tokens: List[str] = []
    for key, value in config.items():
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            known = ", ".join(sorted(k for k in actions if k not in ("config", "help")))
            raise ConfigError(f"config file {path}: unknown option {key!r} (known: {known})")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"config file {path}: {key} must be true or false, got {value!r}")
            tokens += [f"--{key}"] if value else []
        elif isinstance(value, (list, dict)) or value is None:
            raise ConfigError(f"config file {path}: {key} must be a single value, got {value!r}")
        else:
            # "--key=value": a value starting with "-" must not be taken for an option
            tokens.append(f"--{key}=" + (str(value).lower() if isinstance(value, bool) else str(value)))
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
