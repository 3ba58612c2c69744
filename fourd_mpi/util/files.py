"""Output and input files, one rule for every command: nothing is replaced unless the user asked for it,
no output lands on an input or in a run's spool, every output location is checked writable (and with
space) before the work starts, files are written under a temporary name and renamed, a directory is
emptied only when fourd-mpi made it (its :data:`MARKER` names the files it wrote), nothing is written
through a symbolic link or over one (fourd-mpi makes none where it writes: :func:`refuse_link`; a directory
reached through a link is written only when its marker says fourd-mpi made it), and nothing read blocks."""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import os
import re
import stat
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence

from fourd_mpi.errors import ConfigError

#: a run's per-rank spool directory (``<results>/<run-id>.ranks``) and the file that makes one
#: (:mod:`fourd_mpi.trace.files` reads these names from here)
SPOOL_SUFFIX = ".ranks"
RUN_META = "run.json"
#: the file fourd-mpi writes into every directory it creates and may later empty (``sweep render
#: --out``): a JSON object ``{"made_by": "fourd-mpi", "files": [...]}`` naming what it wrote there
MARKER = ".fourd-mpi-dir.json"
#: free bytes an output location must have before a command starts its work
MIN_FREE_BYTES = 1 << 20


def refuse_overwrite(path: Optional[str], force: bool, flag: str = "--force") -> None:
    """Raise :class:`ConfigError` when ``path`` exists and ``force`` is false (``path`` None: no output).

    Every command that writes a file checks this before it reads or computes anything, so a
    refused run costs nothing.
    """
    if path and os.path.lexists(path) and not force:
        raise ConfigError(f"{path} already exists (use {flag} to replace it)")


def link_target(path: str) -> str:
    """What the symbolic link ``path`` points to, as it is written, with the file that names when that differs
    (``../shared/index.jsonl (/data/shared/index.jsonl)``)."""
    try:
        written = os.readlink(path)
    except OSError:
        return "?"
    resolved = os.path.realpath(path)
    return written if written == resolved else f"{written} ({resolved})"


def refuse_link(path: Optional[str], option: str = "-o", what: str = "") -> None:
    """The rule for every file a command writes: never through a symbolic link, never over one. fourd-mpi makes
    no link where it writes, so a link there is not provably its own: writing would replace whatever it points
    to (a file another directory shares, or anyone's), and replacing it would drop the link someone made.
    One :class:`ConfigError` line naming the link and what it points to (``what``: the command's word for the
    file, else ``option PATH``). A link that leads nowhere says so (:func:`check_output_dir`)."""
    if not path or not os.path.islink(path):
        return
    name = what or (f"{option} {path}" if option else str(path))
    if not os.path.exists(path):
        raise ConfigError(f"cannot write {name}: a symbolic link that leads nowhere (or in a loop): it points to "
                          f"{link_target(path)}")
    raise ConfigError(f"cannot write {name}: it is a symbolic link to {link_target(path)}, which fourd-mpi did not "
                      "make: it neither writes through a link nor replaces one (give the file's own path or another "
                      "name)")


def refuse_output(path: Optional[str], force: bool, flag: str = "--force", inputs: Sequence[str] = (),
                  option: str = "-o", makes_dirs: bool = False, writes_trace: bool = False) -> None:
    """The one rule for an output file, checked before any work: not a symbolic link (:func:`refuse_link`), not
    an existing file without ``force``, not a directory, FIFO or device (``/dev/full``), not one of ``inputs``
    (the same file under any name), not inside a run's spool, and its directory exists (``makes_dirs``: the
    command creates it, so its nearest existing ancestor is checked), is writable and has space
    (:func:`check_writable`); unless the command ``writes_trace``, an existing trace is never replaced
    (:func:`refuse_hdf5`). Each refusal is one :class:`ConfigError` line."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if makes_dirs and not os.path.isdir(directory):
        directory = nearest_directory(directory)
        refuse_link(path, option)
    else:
        check_output_dir(path)  # not a regular file (a directory, FIFO, device, dangling link): said first,
    refuse_overwrite(path, force, flag)  # so that --force is never suggested for what it cannot replace
    check_not_input(path, inputs, option)
    check_not_in_spool(path, option)
    if not writes_trace:
        refuse_hdf5(path, option)
    check_writable(directory, f"{option} {path}")


def nearest_directory(path: str) -> str:
    """``path`` or its nearest existing ancestor that is a directory."""
    here = os.path.abspath(path)
    while not os.path.isdir(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def check_output_dir(path: Optional[str]) -> None:
    """Raise :class:`ConfigError` when the directory ``path`` would be written into does not exist
    or is not a directory (it is not created: a typo should not make a new tree), or when ``path``
    itself is a directory, FIFO, socket or device (a temporary file renamed onto it would replace it)."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist (create it first)"
        raise ConfigError(f"cannot write {path}: the directory {directory} {what}")
    refuse_link(path, "", str(path))  # before "already exists": --force does not make a link writable
    if os.path.isdir(path):
        raise ConfigError(f"cannot write {path}: it is a directory")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise ConfigError(f"cannot write {path}: it is not a regular file ({_kind(mode)}); give a file name")


def same_file(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name one existing file (hard links and symbolic links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_not_input(path: str, inputs: Sequence[str], option: str = "-o") -> None:
    """Refuse an output that is one of ``inputs`` (files, or directories it would land in when an
    input is a spool): an output never replaces what the command reads."""
    for source in inputs:
        if source and same_file(path, source):
            raise ConfigError(f"{option} {path} is also an input of this command ({source}): an output never "
                              "replaces its input; give another file name")


def named_inputs(args: Sequence[str], pattern: str = "*.h5") -> List[str]:
    """The files that input arguments name, as the readers expand them: each argument itself, a
    directory's ``pattern`` files, a glob's matches (for :func:`check_not_input`)."""
    import glob

    out = []
    for arg in args:
        if not arg:
            continue
        out.append(arg)
        if os.path.isdir(arg):
            out += glob.glob(os.path.join(glob.escape(arg), pattern))
        elif glob.has_magic(arg):
            out += glob.glob(arg)
    return out


#: the first bytes of every HDF5 file (a trace)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def refuse_hdf5(path: Optional[str], option: str = "-o") -> None:
    """Refuse a text output (an index, a report) that would replace an existing HDF5 file: a trace."""
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(HDF5_SIGNATURE))
    except OSError:
        return
    if head == HDF5_SIGNATURE:
        raise ConfigError(f"{option} {path} is an HDF5 file (a trace?): this command writes text and never replaces "
                          "one; give another file name")


def spool_of(path: str) -> Optional[str]:
    """The run spool (``*.ranks`` holding ``run.json``) that ``path`` lies in or is, else None."""
    here = os.path.realpath(path)
    while True:
        if here.endswith(SPOOL_SUFFIX) and os.path.isfile(os.path.join(here, RUN_META)):
            return here
        up = os.path.dirname(here)
        if up == here:
            return None
        here = up


def check_not_in_spool(path: str, option: str = "-o") -> None:
    """Refuse an output inside a run's per-rank spool: it would be deleted with the spool, or replace spool data."""
    spool = spool_of(os.path.dirname(os.path.abspath(path))) or (spool_of(path) if os.path.isdir(path) else None)
    if spool is not None:
        raise ConfigError(f"{option} {path} lies inside the run spool {spool}: write outputs outside it (the "
                          "spool is removed once recovered, and its files are the run's data)")


def check_writable(directory: str, what: str, need: int = MIN_FREE_BYTES) -> None:
    """Create and remove a probe file in ``directory``, and ask for ``need`` free bytes: a read-only file
    system, a missing permission or a full disk is one :class:`ConfigError` line before the work starts."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".fourd-mpi-probe-", dir=directory)
    except OSError as exc:
        raise ConfigError(f"cannot write {what}: {directory}: {exc.strerror or exc}") from None
    try:
        os.close(fd)
        free = os.statvfs(directory)
        left = free.f_bavail * free.f_frsize
    except OSError as exc:
        raise ConfigError(f"cannot write {what}: {directory}: {exc.strerror or exc}") from None
    finally:
        remove_quietly(probe)
    if left < need:
        raise ConfigError(f"cannot write {what}: no space left on the file system of {directory} "
                          f"({left:,} bytes free)")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the descriptor ``fd``: a regular file takes it in one ``os.write``; after a short
    write (a full disk) the next write raises."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


#: ``flock``/``fcntl`` errors of file systems that refuse locks (NFS mounted ``nolock``, some FUSE and Lustre
#: mounts): the trace spool, the results index and a sweep's submit lock each go on unlocked there
NO_LOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)


def remove_quietly(path: str) -> None:
    """Remove ``path`` if it is there (a temporary file or a probe); an error is not one."""
    try:
        os.remove(path)
    except OSError:
        pass


def temporary_name(path: str) -> str:
    """A name beside ``path`` for writing it (``.tmp-PID-NAME``: the suffix kept, so writers that pick the
    format by suffix still do), renamed onto ``path`` once complete (:func:`replacing`)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".tmp-{os.getpid()}-{name}")


_TEMPORARY = re.compile(r"\.tmp-\d+-(.+)")


def final_name(path: str) -> str:
    """The base name ``path`` will have once renamed into place: ``NAME`` of a :func:`temporary_name`
    (``.tmp-PID-NAME``), else the base name of ``path``."""
    name = os.path.basename(str(path))
    match = _TEMPORARY.fullmatch(name)
    return match.group(1) if match else name


def open_output(path: str, mode: str = "w", encoding: Optional[str] = None):
    """Open ``path`` for writing, gzip-compressed when it ends with ``.gz``. The gzip header names the
    file's final name (:func:`final_name`, less ``.gz``, as ``gzip NAME`` writes it), never the temporary
    name a writer under :func:`replacing` is given."""
    if not str(path).endswith(".gz"):
        return open(path, mode, encoding=encoding) if "b" not in mode else open(path, mode)
    raw = open(path, "wb")
    try:
        packed = gzip.GzipFile(filename=final_name(path), mode="wb", fileobj=raw)
    except BaseException:
        raw.close()
        raise
    packed.myfileobj = raw  # closed with the gzip stream (as gzip.open does)
    return packed if "b" in mode else io.TextIOWrapper(packed, encoding=encoding)


@contextlib.contextmanager
def replacing(path: str, option: str = "-o") -> Iterator[str]:
    """Write ``path`` by its :func:`temporary_name`, renamed into place when the block ends without an
    error; on an error the temporary file is removed and ``path`` is untouched (an ``OSError`` becomes
    one :class:`ConfigError` line). ``path`` a symbolic link is refused (:func:`refuse_link`), also when it
    appeared after the command's checks."""
    refuse_link(path, option)
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise ConfigError(f"cannot write {option} {path}: {exc.strerror or exc}") from None
    except BaseException:
        remove_quietly(tmp)
        raise


def open_no_follow(path: str, mode: int = 0o644):
    """``open(path, "w")`` that never writes through a symbolic link at ``path`` (``O_NOFOLLOW``: a link there,
    planted under a temporary name, is an ``OSError``, not followed); a text stream."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "w")


def write_text(path: str, text: str, option: str = "-o") -> None:
    """``text`` into ``path``, atomically (:func:`replacing`)."""
    with replacing(path, option) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)


# --- directories: only those the project made are ever emptied ---------------------------------------

def read_marker(directory: str) -> Optional[Dict]:
    """The :data:`MARKER` of ``directory`` (a dict with ``files``), or None when it has none (not ours)."""
    import json

    try:
        raw = read_regular_file(os.path.join(directory, MARKER), 1 << 22, "marker")
        marker = json.loads(raw)
    except (OSError, ValueError, ConfigError):
        return None
    if (not isinstance(marker, dict) or marker.get("made_by") != "fourd-mpi"
            or not isinstance(marker.get("files"), list)):
        return None
    marker["files"] = [f for f in marker["files"] if isinstance(f, str) and _plain_name(f)]
    return marker


def _plain_name(name: str) -> bool:
    """A name of a file directly in the directory (no separator, not . or ..)."""
    return bool(name) and "/" not in name and name not in (".", "..") and "\0" not in name


def claim_directory(directory: str, force: bool, option: str = "--out", owned_files: Sequence[str] = ()) -> List[str]:
    """May ``directory`` receive a command's files? Returns the files the project wrote there before (to
    replace), after refusing with one line: a path that is not a directory; an existing directory that is
    not empty and holds no :data:`MARKER` (nor one of ``owned_files``: an older fourd-mpi's manifest) — it
    was not made by fourd-mpi, and nothing in it is ever removed; one that is ours without ``force``.
    Also checks that it (or its parent, when it is to be made) is writable and has space."""
    path = os.path.abspath(directory)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option} {directory} exists and is not a directory")
    if os.path.islink(path) and read_marker(path) is None:  # a link to a directory fourd-mpi made is its own
        raise ConfigError(f"{option} {directory} is a symbolic link to {link_target(path)}, a directory fourd-mpi "
                          f"did not make (it holds no {MARKER}): nothing is written through it; give a new "
                          "directory or the directory's own path")
    check_not_in_spool(os.path.join(path, "x"), option)
    if not os.path.isdir(path):  # made below its nearest existing ancestor: check that one
        check_writable(nearest_directory(path), f"{option} {directory}")
        return []
    entries = [e for e in os.listdir(path)]
    marker = read_marker(path)
    for name in ([MARKER] + list(marker["files"]) if marker else list(owned_files)):
        refuse_link(os.path.join(path, name), what=f"{option} {directory}: {name}")  # only files are replaced
    if marker is None and entries and not any(name in entries for name in owned_files):
        raise ConfigError(f"{option} {directory} is a directory that fourd-mpi did not create (it is not empty and "
                          f"holds no {MARKER}): nothing in it is removed or replaced; give a new or empty directory")
    if entries and not force:
        raise ConfigError(f"{option} {directory} already holds fourd-mpi's output: give --force to write it again "
                          "(only the files fourd-mpi wrote there are replaced)")
    check_writable(path, f"{option} {directory}")
    return list(marker["files"]) if marker else []


def write_marker(directory: str, files: Sequence[str]) -> None:
    """Mark ``directory`` as made by fourd-mpi, naming ``files`` (its own, the only ones it may remove)."""
    import json

    write_text(os.path.join(directory, MARKER),
               json.dumps({"made_by": "fourd-mpi", "files": sorted(set(files))}, indent=1) + "\n", "marker")


def missing_reason(path: str) -> str:
    """Why ``path`` names nothing, in words: a symbolic link in a loop, one that leads nowhere, or no such
    file or directory (a loop read as "no such file" or "is a file" before)."""
    import errno

    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return "a symbolic link in a loop (too many levels of symbolic links)"
            return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
    return "no such file or directory"


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
