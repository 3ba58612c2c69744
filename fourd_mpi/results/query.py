"""Selecting runs: index entries by field or configuration value, and the runs a command-line
argument names (a trace file, a directory or glob of traces, a run id, or an index query).

A filter term is ``KEY=VALUE``. ``KEY`` is a field of the index line (``model``, ``grid``,
``status``, ``algorithm``, ``world_size``, ``label``, ``level``, ``host``, ``run_id``; ``git_commit``
and ``config_key`` match by prefix), ``since``/``until`` (ISO dates or times, compared with the
run's start time; a date or time without a zone is UTC), or any option of the resolved
configuration by its long name (``dtype=float64``, ``overlap=none``, ``steps=10``). Numbers compare
as numbers, ``true``/``false`` as booleans, ``none`` matches an unset option.
"""

from __future__ import annotations

import datetime
import glob
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.results.index import expand_traces, read_index_tree, trace_of

#: fields matched by prefix rather than equality
PREFIX_FIELDS = ("git_commit", "config_key")
TIME_FILTERS = ("since", "until")


def parse_terms(terms: Iterable[str]) -> List[Tuple[str, str]]:
    """``["model=gpt-tiny", "since=2026-11-01"]`` -> ``[("model", "gpt-tiny"), ("since", "2026-11-01")]``;
    a term may hold several, comma-separated (``model=gpt-tiny,grid=1x1x1x2``)."""
    out = []
    for term in terms:
        for part in (p.strip() for p in term.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"filter {part!r}: expected KEY=VALUE (e.g. model=gpt-tiny, grid=1x1x1x2, "
                                  "since=2026-11-01, dtype=float64)")
            out.append((key.strip(), value.strip()))
    return out


def parse_time(text: str) -> datetime.datetime:
    """An ISO date or date-time; without a zone it is UTC."""
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{text!r} is not an ISO date or time (e.g. 2026-11-24 or 2026-11-24T08:00)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.timezone.utc)


def _same(actual, wanted: str) -> bool:
    if actual is None:
        return wanted.lower() in ("none", "null", "")
    if isinstance(actual, bool):
        return wanted.lower() in (("true", "1", "yes") if actual else ("false", "0", "no"))
    if isinstance(actual, (int, float)):
        try:
            return float(wanted) == float(actual)
        except ValueError:
            return False
    return str(actual) == wanted


def _time_of(entry: Dict) -> Optional[datetime.datetime]:
    try:
        return parse_time(entry["time"])
    except ConfigError:
        return None


def matches(entry: Dict, key: str, value: str) -> bool:
    """Whether ``entry`` satisfies ``key=value`` (see the module's notes)."""
    if key in TIME_FILTERS:
        when = _time_of(entry)
        bound = parse_time(value)
        return when is not None and (when >= bound if key == "since" else when <= bound)
    if key in PREFIX_FIELDS:
        return bool(value) and str(entry.get(key) or "").startswith(value)
    if key in entry and key != "config":
        return _same(entry[key], value)
    config = entry.get("config") or {}
    if key in config:
        return _same(config[key], value)
    return False


def known_keys(entries: Sequence[Dict]) -> List[str]:
    keys = set(TIME_FILTERS)
    for entry in entries:
        keys.update(k for k in entry if k != "config")
        keys.update(entry.get("config") or {})
    return sorted(keys)


def select(entries: Sequence[Dict], terms: Sequence[Tuple[str, str]]) -> List[Dict]:
    """The entries matching every term; a key that no entry knows is a :class:`ConfigError` (a typo)."""
    if entries:
        known = set(known_keys(entries))
        unknown = [k for k, _ in terms if k not in known]
        if unknown:
            raise ConfigError(f"unknown filter key {unknown[0]!r}: use a field of the index or a configuration "
                              f"option ({', '.join(k for k in known_keys(entries) if k != 'index')})")
    for key, value in terms:
        if key in TIME_FILTERS:
            parse_time(value)  # a bad date is an error even when no entry is left to compare
        elif key == "grid":
            from fourd_mpi.core.grid import GridShape

            GridShape.parse(value)  # a malformed grid (1x1x) is an error, not "0 runs"
    return [e for e in entries if all(matches(e, k, v) for k, v in terms)]


def resolve(arg: str, index_path: str, warn=None) -> List[Tuple[Optional[Dict], str]]:
    """The runs one command-line argument names, as ``(index entry or None, trace path)``:

    - an existing file or directory, or a glob: its traces (entries None: made from the trace);
    - ``KEY=VALUE[,KEY=VALUE...]``: the entries of the index ``index_path`` that match;
    - anything else: a run id in that index.

    Raises :class:`ConfigError` when the argument names nothing.
    """
    if os.path.exists(arg) or glob.has_magic(arg):
        files, why = expand_traces(arg)
        if why is not None:
            raise ConfigError(f"{arg}: {why}")
        return [(None, path) for path in files]
    entries = read_index_tree(index_path, warn)  # a sweep's runs too (results/SWEEP/SITE/index.jsonl)
    if "=" in arg:
        found = select(entries, parse_terms([arg]))
        if not found:
            raise ConfigError(f"no run in {index_path} matches {arg!r}"
                              + ("" if entries else " (the index is missing or empty: fourd-mpi results reindex DIR)"))
    else:
        found = [e for e in entries if e["run_id"] == arg]
        if not found:
            raise ConfigError(f"{arg}: no such trace file, directory or glob, and no run {arg!r} in {index_path}")
    return [(entry, trace_of(entry, index_path)) for entry in found]
