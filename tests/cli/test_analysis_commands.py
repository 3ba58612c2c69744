"""``fourd-mpi analyze`` and ``fourd-mpi export`` end to end on the committed sample traces (no mpiexec)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.cli.main import main

SAMPLES = REPO / "results" / "samples"


def fourd(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


def test_samples_are_small_and_complete():
    files = sorted(SAMPLES.glob("*.h5"))
    assert len(files) >= 8
    assert sum(f.stat().st_size for f in files) < 1_000_000  # kilobytes, not megabytes
    proc = fourd("trace", "check", files[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_analyze_the_sample_sweep():
    proc = fourd("analyze", SAMPLES)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for section in ("== runs ==", "== breakdown ==", "== comm ==", "== compare ==", "== weak scaling =="):
        assert section in out, section
    assert "weak-8" in out and "grid-8x1x1x1" in out and "busbw" in out and "overlap_pct = 100" in out


def test_analyze_formats(tmp_path):
    proc = fourd("analyze", SAMPLES, "--format", "json")
    data = json.loads(proc.stdout)
    assert set(data) >= {"runs", "breakdown", "comm"}
    runs = {r["run_id"]: r for r in data["runs"]}
    assert runs["weak-8"]["world_size"] == 8 and runs["weak-8"]["grid"] == "1x2x2x2"
    # the analysis repeats the summary the run stored
    from fourd_mpi.trace.read import load_trace

    summary = load_trace(str(SAMPLES / "weak-8.h5")).metadata["summary"]
    assert runs["weak-8"]["step_median_s"] == pytest.approx(summary["median_s"])
    assert runs["weak-8"]["tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    csv = tmp_path / "runs.csv"
    proc = fourd("analyze", SAMPLES, "--what", "runs", "--format", "csv", "-o", csv)
    assert proc.returncode == 0 and csv.read_text().startswith("run_id,path,status")
    again = fourd("analyze", SAMPLES, "--what", "runs", "--format", "csv", "-o", csv)
    assert again.returncode == 2 and "already exists" in again.stderr
    md = fourd("analyze", SAMPLES, "--what", "runs,compare", "--format", "markdown")
    assert "## runs" in md.stdout and "\n| run_id " in md.stdout
    bad = fourd("analyze", SAMPLES, "--format", "csv")
    assert bad.returncode == 2 and "one table" in bad.stderr


def test_a_directory_of_good_and_bad_files(tmp_path):
    import h5py

    for name in ("weak-1.h5", "weak-2.h5"):
        shutil.copy(SAMPLES / name, tmp_path / name)
    data = (SAMPLES / "weak-4.h5").read_bytes()
    (tmp_path / "truncated.h5").write_bytes(data[: len(data) // 3])
    (tmp_path / "zeroed.h5").write_bytes(bytes(1024) + data[1024:])
    shutil.copy(SAMPLES / "weak-8.h5", tmp_path / "future.h5")
    with h5py.File(tmp_path / "future.h5", "a") as f:
        f.attrs["schema_version"] = 99
    proc = fourd("analyze", tmp_path, "--what", "runs")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # something was skipped
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: warning: skipped ")]
    assert len(skipped) == 3, proc.stderr
    assert any("truncated.h5" in s for s in skipped) and any("zeroed.h5" in s for s in skipped)
    assert any("future.h5" in s and "schema v99" in s for s in skipped)
    assert "weak-1" in proc.stdout and "weak-2" in proc.stdout
    nothing = fourd("analyze", tmp_path / "truncated.h5")
    assert nothing.returncode == 2 and "no readable trace" in nothing.stderr


def test_export_from_the_command_line(tmp_path):
    out = tmp_path / "w8.json.gz"
    proc = fourd("export", "perfetto", SAMPLES / "weak-8.h5", "-o", out, "--select-steps", "1",
                 "--select-ranks", "0-3")
    assert proc.returncode == 0, proc.stderr
    import gzip

    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert {e["pid"] for e in events} == {1, 2, 3, 4}  # pid = rank + 1
    cali = tmp_path / "w8.cali.json"
    assert fourd("export", "thicket", SAMPLES / "weak-8.h5", "-o", cali).returncode == 0
    doc = json.loads(cali.read_text())
    assert {"data", "columns", "column_metadata", "nodes"} <= set(doc) and doc["run_id"] == "weak-8"
    proc = fourd("export", "thicket", SAMPLES / "weak-8.h5", "-o", cali)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    proc = fourd("export", "perfetto", SAMPLES / "weak-8.h5", "-o", tmp_path / "x.json", "--select-steps", "42")
    assert proc.returncode == 2 and "42" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kind, args", [
    ("scaling", [SAMPLES / "weak-1.h5", SAMPLES / "weak-2.h5", SAMPLES / "weak-4.h5", SAMPLES / "weak-8.h5"]),
    ("breakdown", [SAMPLES]),
    ("overlap", [SAMPLES]),
    ("timeline", [SAMPLES / "grid-1x2x2x2-overlap.h5", "--select-steps", "2", "--select-ranks", "0-3"]),
])
def test_plot_from_the_command_line(tmp_path, kind, args):
    out = tmp_path / f"{kind}.svg"
    proc = fourd("plot", kind, *args, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_plot_errors(tmp_path):
    proc = fourd("plot", "timeline", SAMPLES, "-o", tmp_path / "t.png")
    assert proc.returncode == 2 and "one trace" in proc.stderr
    proc = fourd("plot", "timeline", SAMPLES / "weak-8.h5", "-o", tmp_path / "t.png", "--select-steps", "99")
    assert proc.returncode == 2 and "99" in proc.stderr and "Traceback" not in proc.stderr
    proc = fourd("plot", "scaling", SAMPLES / "weak-8.h5", "-o", tmp_path / "s.png")
    assert proc.returncode == 2 and "no weak-scaling line" in proc.stderr
    proc = fourd("plot", "breakdown", SAMPLES, "-o", tmp_path / "b.jpg")
    assert proc.returncode == 2 and ".png, .svg or .pdf" in proc.stderr


@pytest.mark.parametrize("what, traces, needed", [
    ("compare", ["grid-8x1x1x1.h5"], "got 1 trace(s)"),
    ("compare", ["weak-1.h5", "grid-8x1x1x1.h5"], "got 2 trace(s), no two of them alike"),
    ("scaling", ["grid-8x1x1x1.h5", "grid-2x2x1x2.h5"], "got 2 trace(s) at 1 rank count(s)"),
    ("runs,scaling", ["weak-2.h5"], "got 1 trace(s) at 1 rank count(s)"),
])
def test_compare_and_scaling_asked_for_with_too_few_traces_is_one_line(what, traces, needed):
    """Before, ``--what compare|scaling`` on one trace printed nothing and exited 0."""
    proc = fourd("analyze", *[SAMPLES / t for t in traces], "--what", what)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and needed in proc.stderr, proc.stderr
    assert f"--what {what.split(',')[-1]} needs" in proc.stderr


def test_compare_and_scaling_with_enough_traces_answer():
    compare = fourd("analyze", *sorted(SAMPLES.glob("grid-*.h5")), "--what", "compare")
    scaling = fourd("analyze", *sorted(SAMPLES.glob("weak-*.h5")), "--what", "scaling", "--scaling", "weak")
    assert compare.returncode == 0 and "== compare ==" in compare.stdout, compare.stderr
    assert scaling.returncode == 0 and "== weak scaling ==" in scaling.stdout, scaling.stderr


def test_a_gzip_export_names_the_final_file_in_its_header(tmp_path, monkeypatch):
    """Before: the FNAME field named the temporary file (.tmp-PID-a.json)."""
    monkeypatch.chdir(tmp_path)
    assert main(["export", "perfetto", str(REPO / "results" / "samples" / "weak-1.h5"), "-o", "a.json.gz"]) == 0
    head = (tmp_path / "a.json.gz").read_bytes()
    assert head[:2] == b"\x1f\x8b" and head[3] & 0x08  # FNAME present
    fname = head[10:head.index(b"\0", 10)]
    assert fname == b"a.json"  # as gzip a.json writes it
    assert [p.name for p in tmp_path.iterdir()] == ["a.json.gz"]
