"""Output and input files: nothing is replaced unless the user asked for it, nothing read blocks."""

from __future__ import annotations

import os
import stat
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


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def check_regular_file(path: str, what: str = "file", error=ConfigError) -> None:
    """Raise ``error`` (one line) when ``path`` exists but is not a regular file: a directory, or a
    FIFO, socket or device, whose ``open`` or ``read`` can block forever (a FIFO with no writer).
    A missing path passes (the caller's ``open`` reports it in its own words). Uses ``stat``, which
    never blocks; :func:`read_regular_file` also closes the race with ``O_NONBLOCK`` + ``fstat``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    refuse_nonregular(path, mode, what, error)


def refuse_nonregular(path: str, mode: int, what: str, error=ConfigError) -> None:
    """Raise ``error`` (one line) unless ``mode`` (of ``stat``/``fstat`` of ``path``) is a regular file's."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise error(f"{path} is a directory, not {'an' if what[:1] in 'aeiou' else 'a'} {what}")
    raise error(f"{path} is not a regular file ({_kind(mode)}); give the {what} itself")


def read_regular_file(path: str, limit: int, what: str = "file", error=ConfigError) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``, opened without blocking (``O_NONBLOCK``,
    then ``fstat``): a FIFO, socket, device or directory is refused with one line, never waited on.
    ``OSError`` of the open or read propagates (the caller names the file in its words)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        refuse_nonregular(path, os.fstat(fd).st_mode, what, error)
        os.set_blocking(fd, True)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
