"""Output files: nothing is replaced unless the user asked for it."""

from __future__ import annotations

import os
from typing import Optional

from fourd_mpi.errors import ConfigError


def refuse_overwrite(path: Optional[str], force: bool, flag: str = "--force") -> None:
    """Raise :class:`ConfigError` when ``path`` exists and ``force`` is false (``path`` None: no output).

    Every command that writes a file checks this before it reads or computes anything, so a
    refused run costs nothing.
    """
    if path and os.path.exists(path) and not force:
        raise ConfigError(f"{path} already exists (use {flag} to replace it)")


def refuse_output(path: Optional[str], force: bool, flag: str = "--force") -> None:
    """:func:`refuse_overwrite` and :func:`check_output_dir`: for outputs whose directory must exist."""
    refuse_overwrite(path, force, flag)
    check_output_dir(path)


def check_output_dir(path: Optional[str]) -> None:
    """Raise :class:`ConfigError` when the directory ``path`` would be written into does not exist
    or is not a directory (it is not created: a typo should not make a new tree)."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist (create it first)"
        raise ConfigError(f"cannot write {path}: the directory {directory} {what}")
    if os.path.isdir(path):
        raise ConfigError(f"cannot write {path}: it is a directory")
