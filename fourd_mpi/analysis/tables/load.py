"""Loading traces for the tables: files, directories and globs; unreadable files named, not fatal."""

from __future__ import annotations

import glob
import logging
import os
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.trace.read import Trace, load_trace

log = logging.getLogger(__name__)

def _expand(path: str) -> Tuple[List[str], Optional[str]]:
    """Files named by one argument (file, directory of *.h5, or glob), or a reason it names none."""
    if os.path.isdir(path):
        found = sorted(p for p in glob.glob(os.path.join(glob.escape(path), "*.h5")) if os.path.isfile(p))
        return found, (None if found else "directory holds no *.h5 file")
    if os.path.exists(path):
        return [path], None
    if glob.has_magic(path):
        found = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        return found, (None if found else "no file matches the pattern")
    from fourd_mpi.util.files import missing_reason

    return [], missing_reason(path)


def collect(paths: Union[str, Iterable[str]],
            allow_damaged: bool = False) -> Tuple[List[Trace], List[Tuple[str, str]]]:
    """Load every trace named by ``paths``: files, directories (their ``*.h5``, sorted) or globs.

    Returns ``(traces, problems)``; ``problems`` holds ``(path, reason)`` for every argument that
    names no file and every file :func:`~fourd_mpi.trace.read.load_trace` refused (the reason is the
    :class:`~fourd_mpi.errors.TraceError` message), damaged ones included unless ``allow_damaged``.
    Never raises for a bad file. A file named twice is loaded once.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    traces: List[Trace] = []
    problems: List[Tuple[str, str]] = []
    seen = set()
    for arg in paths:
        arg = os.fspath(arg)
        files, reason = _expand(arg)
        if reason is not None:
            problems.append((arg, reason))
        for path in files:
            key = os.path.realpath(path)
            if key in seen:
                continue
            seen.add(key)
            try:
                traces.append(load_trace(path, allow_damaged=allow_damaged))
            except TraceError as exc:
                problems.append((path, str(exc)))
            except Exception as exc:  # never raise for a bad file
                problems.append((path, f"{path} could not be read: {type(exc).__name__}: {exc}"))
    return traces, problems


def report_skipped(problems: Sequence[Tuple[str, str]]) -> None:
    """One warning per file :func:`collect` skipped: ``fourd-mpi: warning: skipped PATH: REASON`` (on stderr)."""
    for path, reason in problems:
        log.warning("skipped %s: %s", path, reason)


def collect_or_fail(paths: Sequence[str],
                    allow_damaged: bool = False) -> Tuple[List[Trace], List[Tuple[str, str]]]:
    """:func:`collect`, each skipped file reported (:func:`report_skipped`); a :class:`ConfigError`
    when no argument names a readable trace."""
    traces, problems = collect(paths, allow_damaged)
    report_skipped(problems)
    if not traces:
        raise ConfigError(f"no readable trace among {len(paths)} argument(s)")
    return traces, problems
