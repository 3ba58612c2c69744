"""The trace reader validates everything it trusts: each hostile or damaged file
of the probes is refused with one line (never a traceback, never unbounded memory), damaged files are
skipped by the offline commands unless ``--allow-damaged`` while the good files are analysed, and
``-o`` into a missing directory is a one-line error. One process, no MPI: real sample traces from
``results/samples`` are copied and altered with h5py."""

from __future__ import annotations

import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import REPO, mpi_env

from fourd_mpi.errors import DamagedTraceError, TraceError
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import MAX_ATTR_BYTES, load_trace

SAMPLE = REPO / "results" / "samples" / "grid-1x2x2x2-overlap.h5"  # 8 ranks, level op, 4 steps
GOOD = REPO / "results" / "samples" / "weak-2.h5"


def fourd(*args, timeout=120, memory=None):
    """``fourd-mpi ARGS`` in a fresh process (``memory``: an address-space limit in bytes)."""
    pre = None
    if memory:
        import resource

        def pre():
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO, preexec_fn=pre)


def _rewrite_column(f, name, column, dtype, value=None):
    data = f[name][()]
    new = np.zeros(len(data), np.dtype([(n, dtype if n == column else data.dtype[n]) for n in data.dtype.names]))
    for n in data.dtype.names:
        new[n] = data[n] if n != column or value is None else value
    del f[name]
    f.create_dataset(name, data=new)


def hostile(tmp_path, kind: str) -> str:
    """A copy of the 8-rank sample altered as one of the issue's probes."""
    path = tmp_path / f"{kind}.h5"
    shutil.copy(SAMPLE, path)
    with h5py.File(path, "r+") as f:
        if kind == "world-size":
            f["metadata"].attrs["world_size"] = 10**12
        elif kind == "dtype":
            _rewrite_column(f, "events", "op", "<f8", 3.5)
        elif kind == "op-code":
            ev = f["events"][()]
            ev["op"][5] = 200
            f["events"][...] = ev
        elif kind == "json-keys":
            f["metadata"].attrs["json_keys"] = "[not json"
        elif kind == "summary-deep":
            f["metadata"].attrs["summary"] = "[" * 100_000 + "]" * 100_000
        elif kind == "summary-huge":
            f["metadata"].attrs["summary"] = '"' + "x" * (MAX_ATTR_BYTES + 10) + '"'
        elif kind == "summary-type":
            f["metadata"].attrs["summary"] = '{"median_s": "fast"}'
        elif kind == "offsets":
            ranks = f["ranks"][()]
            ranks["event_offset"][[2, 3]] = ranks["event_offset"][[3, 2]]
            f["ranks"][...] = ranks
        elif kind == "declared-rows":  # a chunked dataset resized far beyond what was written
            f["events"].resize((10**9,))
            f.attrs["events"] = 10**9
        elif kind == "vocab":
            f["vocab"].attrs["ops"] = '["x"]'
        elif kind == "truncated-fixed":  # the last rank's last 500 events cut, every header count fixed
            n = f["events"].shape[0] - 500
            f["events"].resize((n,))
            f.attrs["events"] = n
            ranks = f["ranks"][()]
            ranks["event_count"][-1] -= 500
            f["ranks"][...] = ranks
        elif kind == "nan-times":
            rs = f["rank_steps"][()]
            rs["seconds"][3] = np.nan
            rs["start_ns"][4] = -5
            f["rank_steps"][...] = rs
        elif kind == "negative-duration":
            ev = f["events"][()]
            ev["end_ns"][7] = ev["start_ns"][7] - 1000
            f["events"][...] = ev
    return str(path)


INVALID = {  # probe -> what the one-line error says
    "world-size": "metadata world_size 1000000000000 != the 8 rows of /ranks",
    "dtype": r"column /events.op is stored as float64, expected uint8",
    "op-code": "op code 200 outside its vocabulary",
    "json-keys": "'json_keys' is not valid JSON",
    "summary-deep": "'summary' is not valid JSON|nested more than",
    "summary-huge": "more than 16,777,216",
    "summary-type": r"metadata summary.median_s: 'fast' is not of type",
    "offsets": "lies outside that rank's event_offset/event_count range|not monotonic",
    "declared-rows": "declares 1,000,000,000 rows|GiB in memory",
    "vocab": "vocabulary 'ops' has 1 words",
}
DAMAGED = {
    "truncated-fixed": "events in /events, its record says",
    "nan-times": "negative start_ns",
    "negative-duration": "ending before they start",
}


def test_the_unaltered_samples_are_sound():
    for path in sorted((REPO / "results" / "samples").glob("*.h5")):
        trace = load_trace(str(path))
        assert trace.damage == [] and check_invariants(trace) == [], path


@pytest.mark.parametrize("kind", sorted(INVALID))
def test_invalid_traces_are_refused_with_one_line(tmp_path, kind):
    path = hostile(tmp_path, kind)
    with pytest.raises(TraceError, match=INVALID[kind]) as info:
        load_trace(path, allow_damaged=True)
    assert not isinstance(info.value, DamagedTraceError)
    assert path in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_damaged_traces_are_refused_unless_allowed(tmp_path, kind):
    path = hostile(tmp_path, kind)
    with pytest.raises(DamagedTraceError, match="is damaged: .*--allow-damaged"):
        load_trace(path)
    trace = load_trace(path, allow_damaged=True)
    assert any(__import__("re").search(DAMAGED[kind], why) for why in trace.damage), trace.damage


@pytest.mark.parametrize("kind", ["world-size", "dtype", "op-code", "json-keys", "summary-deep",
                                  "truncated-fixed", "nan-times"])
def test_trace_check_and_show_fail_cleanly_on_every_probe(tmp_path, kind):
    """Before: world-size grew memory without bound, dtype/op-code/truncated/NaN passed ``check``
    ("ok"), json-keys/summary ended in tracebacks. After: exit 1 (damaged, listed) or 2 (invalid, one
    line), under a 2 GiB address-space limit."""
    path = hostile(tmp_path, kind)
    check = fourd("trace", "check", path, memory=2 << 30)
    assert "Traceback" not in check.stderr, check.stderr
    if kind in DAMAGED:
        assert check.returncode == 1 and "damaged: " in check.stdout and "violation(s)" in check.stdout, check.stdout
        show = fourd("trace", "show", path)
        assert show.returncode == 2 and "--allow-damaged" in show.stderr
        assert fourd("trace", "show", "--allow-damaged", path).returncode == 0
    else:
        assert check.returncode == 2 and len(check.stderr.strip().splitlines()) == 1, check.stderr
        assert check.stderr.startswith(f"fourd-mpi: error: {path}")


def test_analyze_skips_bad_files_and_analyses_the_rest(tmp_path):
    """Before: the dtype probe aborted ``analyze`` of the whole directory with a KeyError traceback,
    and the NaN trace was analysed silently."""
    directory = tmp_path / "runs"
    directory.mkdir()
    shutil.copy(GOOD, directory / "a-good.h5")
    for kind in ("dtype", "nan-times", "op-code"):
        shutil.move(hostile(tmp_path, kind), directory / f"b-{kind}.h5")
    proc = fourd("analyze", directory, "--what", "runs", "--format", "csv")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: warning: skipped ")]
    assert len(skipped) == 3 and len(proc.stderr.strip().splitlines()) == 3, proc.stderr
    assert "weak-2" in proc.stdout and proc.stdout.count("\n") == 2  # header + the good run
    allowed = fourd("analyze", directory, "--what", "runs", "--format", "csv", "--allow-damaged")
    assert allowed.returncode == 1 and allowed.stdout.count("\n") == 3  # the NaN trace analysed on request
    export = fourd("export", "perfetto", directory / "b-nan-times.h5", "-o", tmp_path / "x.json")
    assert export.returncode == 2 and "is damaged" in export.stderr and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv", [
    ["analyze", GOOD, "-o", "{missing}/table.txt"],
    ["export", "perfetto", GOOD, "-o", "{missing}/t.json"],
    ["plot", "breakdown", GOOD, "-o", "{missing}/b.png"],
    ["tune", "--model", "gpt-tiny", "--ranks", "4", "--emit-sweep", "{missing}/s.yaml"],
])
def test_output_into_a_missing_directory_is_one_line(tmp_path, argv):
    """Before: FileNotFoundError tracebacks after the work was done."""
    missing = tmp_path / "no" / "such"
    proc = fourd(*[str(a).format(missing=missing) for a in argv])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"fourd-mpi: error: cannot write {missing}/{argv[-1].split('/')[-1]}: the " \
                                  f"directory {missing} does not exist (create it first)"
