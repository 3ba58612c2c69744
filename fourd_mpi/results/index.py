"""The results index: one JSON line per run in ``<results-dir>/index.jsonl``.

A directory's index is read together with the indexes of the directories below it (:func:`read_index_tree`):
the runs of a sweep write theirs in ``results/SWEEP/SITE/index.jsonl``, and ``results list`` (default
``results``) lists them with the others.

``fourd-mpi run`` appends a line on rank 0 once the trace is written (:func:`append_entry`);
``fourd-mpi results reindex DIR`` rebuilds the file from the traces in ``DIR``
(:func:`fourd_mpi.trace.indexing.reindex`, which reads them: this module reads no trace).
A line (:func:`make_entry`, checked against :data:`ENTRY_SCHEMA`) holds the run id, start time,
git commit, the **configuration key** (:func:`config_key`), algorithm, model, grid, world size,
the step-time median and quartiles (the run summary's, :data:`fourd_mpi.trace.summary.STEP_FORMULA`),
model TFLOP/s per rank, MFU, HFU and % of measured GEMM (:mod:`fourd_mpi.perf.peaks`), the exposed
communication share, the trace status and the trace path (relative to the index's
directory, so that a results directory can be moved), whether the ranks were pinned (``pinned``: the trace's
``binding.pinned``, :mod:`fourd_mpi.core.binding`; null when unknown), and the keyed configuration itself.

**Concurrency.** Jobs of one study may finish at the same moment and share the results
directory. A writer opens the index with ``O_APPEND``, takes an exclusive ``fcntl.flock`` on it and
writes the whole line with one ``os.write``; readers take a shared lock. A line that is not valid
JSON or not an entry (a writer killed mid-write, a file system without ``flock``, a hand edit) is
skipped with a warning naming the line; the other lines are read. :func:`rewrite_index` rewrites the file
in place under the exclusive lock (truncate, then write), so appenders that opened it before keep
appending to the same file. ``flock`` is advisory and local on some network file systems (NFS
before v4 locks per client only): keep the index on a file system that honours it, or rebuild it
with ``fourd-mpi results reindex``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from fourd_mpi.core.binding import pinned_of
from fourd_mpi.perf.peaks import stored_peaks
from fourd_mpi.util.files import NO_LOCK_ERRNOS, write_all
from fourd_mpi.util.yamlspec import schema_message

INDEX_NAME = "index.jsonl"
#: version of a line's layout (``"index": 1``)
INDEX_VERSION = 1
#: options that change where or how a run is written or shown, not what it runs: left out of the key
#: (``peak-tflops`` changes only the % of peak reported, ``trace-group-size`` only how the trace is split)
OUTPUT_ONLY = ("results-dir", "run-id", "label", "display", "force", "trace-group-size", "peak-tflops")
#: options added after traces were written, with the value that older traces ran with: filled in
#: before hashing, so an old trace and a new one of the same configuration share a key
KEY_DEFAULTS = {"algorithm": "axonn4d"}
DEFAULT_ALGORITHM = KEY_DEFAULTS["algorithm"]
CONFIG_KEY_FORMULA = ("config key = first 16 hex digits of SHA-256 of the resolved configuration as sorted-key "
                      "JSON, without the output-only options " + ", ".join(OUTPUT_ONLY))

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
#: what a line must hold to be read (others are skipped with a warning)
ENTRY_SCHEMA = {
    "type": "object",
    "required": ["index", "run_id", "time", "config_key", "algorithm", "grid", "world_size", "median_s", "q1_s",
                 "q3_s", "status", "trace", "config"],
    "properties": {
        "index": {"type": "integer", "minimum": 1}, "run_id": {"type": "string", "minLength": 1},
        "time": {"type": "string"}, "git_commit": _STR, "version": _STR,
        "config_key": {"type": "string", "pattern": "^[0-9a-f]{16}$"}, "algorithm": {"type": "string"},
        "model": _STR, "label": _STR, "grid": {"type": "string"}, "world_size": {"type": "integer", "minimum": 1},
        "num_nodes": {"type": ["integer", "null"]}, "level": _STR, "measured_steps": {"type": ["integer", "null"]},
        "median_s": _NUM, "q1_s": _NUM, "q3_s": _NUM, "min_s": _NUM, "max_s": _NUM,
        "model_tflops_per_rank": _NUM, "mfu_pct": _NUM, "hfu_pct": _NUM, "gemm_pct": _NUM, "wait_share": _NUM,
        "percent_of_peak": _NUM, "status": {"type": "string"},
        "trace": {"type": "string"}, "host": _STR, "pinned": {"type": ["boolean", "null"]},
        "config": {"type": "object"},
    },
}


def keyed_config(config: Dict) -> Dict:
    """The configuration that identifies a run: ``config`` (a trace's ``metadata["config"]``, keyed by
    long option names) without :data:`OUTPUT_ONLY`, with :data:`KEY_DEFAULTS` filled in. ``attention`` is the
    kernels that ran (``unfused`` is left out, as runs before the option have no key for it), so a fused and an
    unfused run are two configurations."""
    out = {k: v for k, v in dict(config or {}).items() if k not in OUTPUT_ONLY}
    for name, default in KEY_DEFAULTS.items():
        if out.get(name) is None:
            out[name] = default
    if out.get("attention") == "unfused":  # what every run did before --attention: the keys of older runs hold
        del out["attention"]
    return out


def config_key(config: Dict) -> str:
    """:data:`CONFIG_KEY_FORMULA`: equal for runs of one configuration, whatever their output options."""
    text = json.dumps(keyed_config(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rekeyed(entry: Dict, ignore) -> Dict:
    """``entry`` with its config key computed without the options ``ignore`` (``compare --ignore``:
    match runs that differ only in them, e.g. ``steps``)."""
    config = {k: v for k, v in entry["config"].items() if k not in set(ignore)}
    return dict(entry, config=config, config_key=config_key(config))


def index_file(where: str) -> str:
    """The index named by ``where``: a ``.jsonl`` file as is, else ``where/index.jsonl`` (a results directory)."""
    return where if where.endswith(".jsonl") else os.path.join(where, INDEX_NAME)


def _finite(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def make_entry(metadata: Dict, status: str, trace_path: str, index_dir: str, stats=None) -> Dict:
    """The index line of a run from its trace metadata (``metadata["summary"]`` for the step times,
    else ``stats``, a :class:`~fourd_mpi.trace.summary.StepStats`), its status and its trace path."""
    config = metadata.get("config") if isinstance(metadata.get("config"), dict) else {}
    summary = metadata.get("summary") if isinstance(metadata.get("summary"), dict) else {}
    times = {k: _finite(summary.get(k)) for k in ("median_s", "q1_s", "q3_s", "min_s", "max_s")}
    steps = summary.get("steps")
    if times["median_s"] is None and stats is not None:
        times = {k: _finite(getattr(stats, k)) for k in times}
        steps = stats.steps
    world = int(metadata.get("world_size") or 1)
    tflops = _finite(summary.get("model_tflops_per_rank"))
    flops = _finite(metadata.get("model_flops_per_step"))
    if tflops is None and flops is not None and times["median_s"]:
        tflops = flops / world / times["median_s"] / 1e12
    peak, gemm = stored_peaks(summary)
    hardware = _finite(summary.get("hardware_tflops_per_rank"))
    hardware = tflops if hardware is None else hardware
    mfu = 100.0 * tflops / peak if tflops is not None and peak else None
    hfu = 100.0 * hardware / peak if hardware is not None and peak else None
    gemm_pct = 100.0 * tflops / gemm if tflops is not None and gemm else None
    algorithm = config.get("algorithm") or metadata.get("algorithm") or DEFAULT_ALGORITHM
    return {
        "index": INDEX_VERSION, "run_id": str(metadata.get("run_id") or os.path.basename(trace_path)[:-3]),
        "time": str(metadata.get("start_time") or ""), "git_commit": metadata.get("git_commit"),
        "version": (metadata.get("packages") or {}).get("fourd_mpi") if isinstance(metadata.get("packages"), dict)
        else None,
        "config_key": config_key(config), "algorithm": str(algorithm), "model": config.get("model"),
        "label": config.get("label"), "grid": str(metadata.get("grid") or ""), "world_size": world,
        "num_nodes": metadata.get("num_nodes"), "level": metadata.get("level"),
        "measured_steps": int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) else None,
        **times, "model_tflops_per_rank": tflops, "mfu_pct": mfu, "hfu_pct": hfu, "gemm_pct": gemm_pct,
        "wait_share": _finite(summary.get("wait_share")), "status": status,
        "trace": os.path.relpath(os.path.abspath(trace_path), os.path.abspath(index_dir)),
        "host": metadata.get("launch_host"), "pinned": pinned_of(metadata), "config": keyed_config(config),
    }


def entry_line(entry: Dict) -> bytes:
    """One line of strict JSON (no NaN), newline-terminated."""
    return (json.dumps(entry, sort_keys=False, separators=(",", ":"), allow_nan=False, default=str) + "\n").encode()


#: on file systems that do not lock (:data:`~fourd_mpi.util.files.NO_LOCK_ERRNOS`) an append goes on unlocked: a
#: single ``O_APPEND`` write is still whole on most of them, and losing the line would be worse


@contextlib.contextmanager
def _locked(path: str, flags: int, lock: int) -> Iterator[int]:
    """``path`` opened with ``flags`` under ``flock(lock)``. Opening never blocks (``O_NONBLOCK``: a
    FIFO is refused, not waited on); what cannot be opened or locked (a read-only file system, a
    directory, a FIFO, no permission) raises :class:`~fourd_mpi.errors.ConfigError` with one line."""
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.util.files import check_regular_file, refuse_nonregular

    verb = "write" if flags & (os.O_WRONLY | os.O_RDWR) else "read"
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        check_regular_file(path, "index file")  # a directory, a FIFO without a reader (ENXIO): say so
        raise ConfigError(f"cannot {verb} the index {path}: {exc.strerror or exc}") from None
    try:
        refuse_nonregular(path, os.fstat(fd).st_mode, "index file")
        os.set_blocking(fd, True)
        try:
            fcntl.flock(fd, lock)
        except OSError as exc:
            if exc.errno not in NO_LOCK_ERRNOS:
                raise ConfigError(f"cannot lock the index {path}: {exc.strerror or exc}") from None
        yield fd  # closing the descriptor releases the lock
    finally:
        os.close(fd)


def append_entry(path: str, entry: Dict) -> None:
    """Append ``entry`` to the index ``path`` (created if missing) as one line, in one ``os.write``
    under an exclusive ``flock``; safe against other processes appending at the same time. Never through a
    link into another directory (:func:`refuse_foreign_link`)."""
    line = entry_line(entry)
    refuse_foreign_link(path, "the run")
    with _locked(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, fcntl.LOCK_EX) as fd:
        write_all(fd, line)


def _validator():
    import jsonschema

    global _VALIDATOR
    if _VALIDATOR is None:
        _VALIDATOR = jsonschema.Draft202012Validator(ENTRY_SCHEMA)
    return _VALIDATOR


_VALIDATOR = None


#: deepest nesting of a line's JSON (an entry needs 3): a deeper line is skipped like any bad line, before
#: the recursive parser, the validator or a printer could exhaust the stack on it
MAX_LINE_DEPTH = 32


def _too_deep(text: str) -> bool:
    """Whether the JSON ``text`` nests more than :data:`MAX_LINE_DEPTH` levels (brackets outside strings)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_LINE_DEPTH:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def parse_line(text: str) -> Tuple[Optional[Dict], Optional[str]]:
    """``(entry, None)`` for a valid line, ``(None, reason)`` otherwise."""
    if _too_deep(text):
        return None, f"not an index entry (nested more than {MAX_LINE_DEPTH} levels)"
    try:
        entry = json.loads(text)
    except ValueError as exc:
        return None, f"not JSON ({str(exc).split(':')[0]}): a torn or partial write?"
    except RecursionError:
        return None, f"not an index entry (nested more than {MAX_LINE_DEPTH} levels)"
    error = next(iter(_validator().iter_errors(entry)), None)
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "line"
        return None, f"not an index entry ({where}: {schema_message(error)[:120]})"
    return entry, None


def read_index(path: str, warn: Optional[Callable[[str], None]] = None) -> List[Dict]:
    """Every valid entry of the index ``path`` in file order (a missing file: none). Invalid or torn
    lines are skipped, each reported through ``warn`` as ``PATH:LINE: reason``."""
    if not os.path.exists(path):
        return []
    with _locked(path, os.O_RDONLY, fcntl.LOCK_SH) as fd:
        try:
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read()
        except OSError as exc:  # EIO of a failing disk
            from fourd_mpi.errors import ConfigError

            raise ConfigError(f"cannot read the index {path}: {exc.strerror or exc}") from None
    entries = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        entry, why = parse_line(raw.decode("utf-8", errors="replace"))
        if entry is None:
            if warn is not None:
                warn(f"{path}:{number}: skipped: {why}")
            continue
        entries.append(entry)
    return entries


#: directories below a results directory that hold no index of their own: trace parts and spools, hidden ones
_NOT_RESULTS = (".parts", ".ranks")
#: how deep below a results directory indexes are looked for (results/SWEEP/SITE is 2)
MAX_INDEX_DEPTH = 4


def nested_indexes(directory: str) -> List[str]:
    """The index files in the directories below ``directory`` (up to :data:`MAX_INDEX_DEPTH` levels, links not
    followed, hidden directories and trace parts and spools skipped), sorted by path."""
    found = []
    top = os.path.abspath(directory)
    for where, dirs, files in os.walk(top):
        depth = 0 if where == top else os.path.relpath(where, top).count(os.sep) + 1
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not d.endswith(_NOT_RESULTS)
                         and not d.startswith("rank-") and depth < MAX_INDEX_DEPTH)
        if where != top and INDEX_NAME in files:
            found.append(os.path.join(where, INDEX_NAME))
    return sorted(found)


def read_index_tree(path: str, warn: Optional[Callable[[str], None]] = None) -> List[Dict]:
    """The entries of the index ``path`` and, when ``path`` is a directory's ``index.jsonl``, those of the indexes
    below that directory (:func:`nested_indexes`: a sweep's ``results/SWEEP/SITE/index.jsonl``), in that order.
    A nested entry's ``trace`` is made relative to ``path``'s directory, so :func:`trace_of` with ``path`` finds
    it. A nested index that cannot be read is skipped through ``warn``."""
    from fourd_mpi.errors import ConfigError

    entries = read_index(path, warn)
    if os.path.basename(path) != INDEX_NAME:
        return entries
    top = os.path.dirname(os.path.abspath(path))
    for sub in nested_indexes(top):
        try:
            rows = read_index(sub, warn)
        except ConfigError as exc:
            if warn is not None:
                warn(f"{sub}: skipped: {exc}")
            continue
        here = os.path.dirname(sub)
        entries += [dict(e, trace=os.path.relpath(os.path.join(here, e["trace"]), top)) for e in rows]
    return entries


def expand_traces(arg: str) -> Tuple[List[str], Optional[str]]:
    """Trace files named by one argument (a file, a directory of ``*.h5``, or a glob), or why none."""
    if os.path.isdir(arg):
        found = sorted(p for p in glob.glob(os.path.join(glob.escape(arg), "*.h5")) if os.path.isfile(p))
        return found, (None if found else "directory holds no *.h5 file")
    if os.path.exists(arg):
        return [arg], None
    if glob.has_magic(arg):
        found = sorted(p for p in glob.glob(arg) if os.path.isfile(p))
        return found, (None if found else "no file matches the pattern")
    from fourd_mpi.util.files import missing_reason

    return [], missing_reason(arg)


def trace_of(entry: Dict, index_path: str) -> str:
    """The trace file of an entry (its ``trace`` is relative to the index's directory)."""
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(index_path)), entry["trace"]))


def rewrite_index(output: str, entries: List[Dict], scanned) -> List[Dict]:
    """Replace the index ``output`` by ``entries`` (what :func:`fourd_mpi.trace.indexing.reindex` read from the
    traces, ``scanned``: their real paths) in place under the exclusive lock that runs append under (see the
    module's notes on concurrency); an entry appended since the scan whose trace exists and was not scanned is
    kept. Returns the entries written, sorted by time and run id."""
    with _locked(output, os.O_RDWR | os.O_CREAT, fcntl.LOCK_EX) as fd:
        # lines appended since the scan (a run that finished meanwhile: its trace was not there yet) are kept
        entries = entries + appended_since(fd, output, scanned)
        entries.sort(key=lambda e: (e["time"], e["run_id"]))
        data = b"".join(entry_line(e) for e in entries)
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            write_all(fd, data)
            os.fsync(fd)
        except OSError as exc:  # a full disk, EIO
            from fourd_mpi.errors import ConfigError

            raise ConfigError(f"cannot write the index {output}: {exc.strerror or exc}") from None
    return entries


def refuse_foreign_link(output: str, writer: str = "reindex") -> None:
    """Refuse to write an index that is a symbolic link to a file in another directory (``writer``: ``reindex``,
    which rewrites it, or ``run`` and ``trace recover``, which append to it): the write goes through the link,
    and that index (shared, or any file at all) holds another directory's entries, which a rebuild from this
    directory's traces would drop, and among which an appended line would name its trace relative to the wrong
    directory. A link within the directory is followed (the file is this directory's, provably its own)."""
    if not os.path.islink(output):
        return
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.util.files import link_target

    target = os.path.realpath(output)
    if os.path.dirname(target) != os.path.realpath(os.path.dirname(os.path.abspath(output))):
        what = ("reindex would rewrite it and drop that directory's entries; remove the link (or give -o a file)"
                if writer == "reindex" else
                f"{writer} would append its line to that directory's index; remove the link (then "
                f"'fourd-mpi results reindex' builds this directory's own)")
        raise ConfigError(f"{output} is a symbolic link to {link_target(output)}, a file of another directory: "
                          f"{what}")


def appended_since(fd: int, index_path: str, scanned) -> List[Dict]:
    """The valid entries of the open index ``fd`` whose trace exists but was not among the ``scanned`` files
    (real paths): lines that runs appended while :func:`fourd_mpi.trace.indexing.reindex` read the traces (under
    the same lock, so none is lost when the index is rewritten)."""
    kept = []
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            fh.seek(0)
            data = fh.read()
    except OSError:
        return kept
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        entry, _ = parse_line(raw.decode("utf-8", errors="replace"))
        if entry is None:
            continue
        trace = os.path.realpath(trace_of(entry, index_path))
        if trace not in scanned and os.path.isfile(trace):
            kept.append(entry)
    return kept


def index_run(metadata: Dict, status: str, trace_path: str, results_dir: str) -> str:
    """What ``fourd-mpi run`` calls on rank 0 after the merge: append the run's line to
    ``results_dir/index.jsonl``; returns the index path."""
    path = index_file(results_dir)
    append_entry(path, make_entry(metadata, status, trace_path, results_dir))
    return path
