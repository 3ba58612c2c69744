"""The results index: config keys, atomic appends under concurrency, torn lines, the run's own line,
reindex, and ``fourd-mpi results list | show | reindex`` (real runs, real files, no mocks)."""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import shutil

import pytest
from conftest import REPO, mpirun

from fourd_mpi.cli.main import main
from fourd_mpi.results.index import (
    INDEX_NAME,
    KEY_DEFAULTS,
    OUTPUT_ONLY,
    append_entry,
    config_key,
    entry_line,
    read_index,
)
from fourd_mpi.trace.indexing import entry_of_trace, reindex
from fourd_mpi.trace.read import load_trace

BASELINES = REPO / "results" / "baselines"
BASE, SLOW = BASELINES / "baseline-gpt-tiny-np2.h5", BASELINES / "slower-gpt-tiny-np2.h5"


def a_config(**changes):
    config = {"model": "gpt-tiny", "gx": 2, "dtype": "float32", "steps": 10, "results-dir": "results",
              "label": None, "display": "auto", "trace-group-size": 0, "peak-tflops": None}
    config.update(changes)
    return config


def an_entry(run_id: str, pad: int = 0, **changes):
    entry = entry_of_trace(load_trace(str(BASE)), str(BASELINES))
    entry.update(run_id=run_id, **changes)
    if pad:
        entry["config"] = dict(entry["config"], padding="x" * pad)
    return entry


def test_config_key_leaves_out_output_options_and_fills_the_algorithm():
    key = config_key(a_config())
    for name in OUTPUT_ONLY:
        assert config_key(a_config(**{name: "elsewhere"})) == key, name
    assert config_key(a_config(dtype="float64")) != key
    assert config_key(a_config(steps=11)) != key
    assert config_key(a_config(algorithm="axonn4d")) == key  # traces from before --algorithm existed
    assert config_key(a_config(algorithm="megatron1d")) != key
    assert len(key) == 16 and int(key, 16) >= 0


def test_the_default_algorithm_is_the_registry_default():
    from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM

    assert KEY_DEFAULTS["algorithm"] == DEFAULT_ALGORITHM


def _writer(path: str, writer: int, lines: int, pad: int) -> None:
    base = an_entry("x", pad=pad)
    for i in range(lines):
        append_entry(path, dict(base, run_id=f"w{writer:02d}-{i:03d}"))


def test_concurrent_appends_from_many_processes_give_whole_lines(tmp_path):
    """20 processes x 50 lines of about 20 kB (bigger than a pipe buffer and than Python's file
    buffer, so a write split into pieces would interleave) -> 1000 valid lines, each once."""
    path = str(tmp_path / INDEX_NAME)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 50, 20000)) for w in range(20)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    warnings = []
    entries = read_index(path, warnings.append)
    assert warnings == []
    ids = [e["run_id"] for e in entries]
    assert len(ids) == 1000 and sorted(ids) == sorted(f"w{w:02d}-{i:03d}" for w in range(20) for i in range(50))
    with open(path, "rb") as fh:
        raw = fh.read()
    assert raw.count(b"\n") == 1000 and all(len(line) > 20000 for line in raw.split(b"\n")[:-1])


def test_torn_and_foreign_lines_are_skipped_with_a_warning(tmp_path):
    path = tmp_path / INDEX_NAME
    good = entry_line(an_entry("first"))
    torn = entry_line(an_entry("torn"))[:200]  # a writer killed mid-line
    foreign = json.dumps({"run_id": "not an entry"}).encode() + b"\n"
    path.write_bytes(good + torn + b"\n" + foreign + entry_line(an_entry("last")) + b"\n\n")
    warnings = []
    entries = read_index(str(path), warnings.append)
    assert [e["run_id"] for e in entries] == ["first", "last"]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"{path}:2: skipped: not JSON") and f"{path}:3: skipped: not an index" in warnings[1]


def test_a_missing_index_reads_as_empty(tmp_path):
    assert read_index(str(tmp_path / INDEX_NAME)) == []


@pytest.mark.mpi
def test_every_run_appends_its_line_and_reindex_rebuilds_the_same(tmp_path):
    results = tmp_path / "res"
    for ranks, run_id in ((2, "one"), (2, "two"), (3, "odd")):
        grid = ["--gx", "2"] if ranks == 2 else []  # 3 ranks: data parallel, 3x1x1x1
        proc = mpirun(ranks, ["run", *grid, "--model", "gpt-tiny", "--batch", "6", "--steps", "3",
                              "--trace-level", "step", "--results-dir", results, "--run-id", run_id, "--display",
                              "quiet", "--peak-tflops", "1", "--label", run_id], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = read_index(str(results / INDEX_NAME))
    assert [e["run_id"] for e in entries] == ["one", "two", "odd"]
    assert entries[2]["world_size"] == 3 and entries[2]["grid"] == "3x1x1x1"
    assert entries[2]["config_key"] != entries[0]["config_key"]  # another grid: another configuration
    one = entries[0]
    trace = load_trace(str(results / "one.h5"))
    summary = trace.metadata["summary"]
    assert one["config_key"] == entries[1]["config_key"]  # labels differ: output-only
    assert one["config_key"] == config_key(trace.metadata["config"])
    assert (one["median_s"], one["q1_s"], one["q3_s"]) == (summary["median_s"], summary["q1_s"], summary["q3_s"])
    assert one["model_tflops_per_rank"] == summary["model_tflops_per_rank"]
    assert one["mfu_pct"] == pytest.approx(100 * summary["model_tflops_per_rank"] / 1.0)
    assert one["gemm_pct"] == pytest.approx(100 * summary["model_tflops_per_rank"] / summary["gemm_tflops"])
    assert (one["grid"], one["world_size"], one["status"], one["algorithm"]) == ("1x1x1x2", 2, "complete", "axonn4d")
    assert one["trace"] == "one.h5" and one["time"] == trace.metadata["start_time"]
    assert one["git_commit"] == trace.metadata["git_commit"]
    before = (results / INDEX_NAME).read_text()
    rebuilt, problems = reindex(str(results))
    assert problems == [] and rebuilt == entries
    assert (results / INDEX_NAME).read_text() == before


def test_reindex_names_and_leaves_out_a_bad_trace(tmp_path, capfd):
    shutil.copy(BASE, tmp_path)
    shutil.copy(SLOW, tmp_path)
    (tmp_path / "broken.h5").write_bytes(b"not hdf5")
    (tmp_path / INDEX_NAME).write_text("stale line\n")
    assert main(["results", "reindex", str(tmp_path)]) == 1  # as analyze: 1 when a file was skipped
    out, err = capfd.readouterr()
    assert f"{tmp_path / INDEX_NAME}: 2 run(s) indexed, 1 trace(s) skipped" in out
    assert f"skipped {tmp_path / 'broken.h5'}" in err
    assert [e["run_id"] for e in read_index(str(tmp_path / INDEX_NAME))] == ["baseline-gpt-tiny-np2",
                                                                              "slower-gpt-tiny-np2"]
    elsewhere = tmp_path / "other.jsonl"
    elsewhere.write_text("keep me\n")
    assert main(["results", "reindex", str(tmp_path), "-o", str(elsewhere)]) == 2  # -o FILE: not without --force
    assert elsewhere.read_text() == "keep me\n" and "already exists" in capfd.readouterr().err
    assert main(["results", "reindex", str(tmp_path), "-o", str(elsewhere), "--force"]) == 1
    assert len(read_index(str(elsewhere))) == 2


def test_the_committed_index_matches_its_traces(tmp_path):
    shutil.copy(BASE, tmp_path)
    shutil.copy(SLOW, tmp_path)
    rebuilt, _ = reindex(str(tmp_path))
    assert rebuilt == read_index(str(BASELINES / INDEX_NAME))


def _list(capfd, *args):
    code = main(["results", "list", "--index", str(BASELINES), *args])
    out, err = capfd.readouterr()
    return code, out, err


def test_results_list_filters_and_formats(capfd):
    code, out, _ = _list(capfd, "--format", "json")
    assert code == 0 and [e["run_id"] for e in json.loads(out)] == ["baseline-gpt-tiny-np2", "slower-gpt-tiny-np2"]
    _, out, _ = _list(capfd, "--format", "json", "--model", "gpt-tiny", "--grid", "1x1x1x2", "--status", "complete",
                      "--algorithm", "axonn4d", "steps=22", "dtype=float32", "config_key=bc70")
    assert len(json.loads(out)) == 2
    _, out, _ = _list(capfd, "--format", "json", "--since", "2026-11-24T00:44:02")
    assert [e["run_id"] for e in json.loads(out)] == ["slower-gpt-tiny-np2"]
    _, out, _ = _list(capfd, "--format", "json", "--until", "2026-11-24T00:44:02Z")
    assert [e["run_id"] for e in json.loads(out)] == ["baseline-gpt-tiny-np2"]
    for empty in (["--algorithm", "megatron1d"], ["steps=21"], ["--grid", "2x1x1x1"], ["--since", "2027-01-01"]):
        _, out, _ = _list(capfd, "--format", "json", *empty)
        assert json.loads(out) == [], empty
    _, out, _ = _list(capfd, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["run_id"] for r in rows] == ["baseline-gpt-tiny-np2", "slower-gpt-tiny-np2"]
    assert float(rows[0]["median_s"]) < float(rows[1]["median_s"])
    _, out, _ = _list(capfd)
    assert out.splitlines()[0].split()[:4] == ["run_id", "time", "model", "grid"] and "2 run(s)" in out


def test_results_list_usage_errors(capfd, tmp_path):
    code, _, err = _list(capfd, "modle=gpt-tiny")
    assert code == 2 and err.startswith("fourd-mpi: error: unknown filter key 'modle'")
    code, _, err = _list(capfd, "--since", "yesterday")
    assert code == 2 and "not an ISO date" in err
    code, _, err = _list(capfd, "gpt-tiny")
    assert code == 2 and "expected KEY=VALUE" in err
    assert main(["results", "list", "--index", str(tmp_path)]) == 2
    assert "no index at" in capfd.readouterr().err


def test_results_list_output_file(capfd, tmp_path):
    out_file = tmp_path / "runs.csv"
    code, out, err = _list(capfd, "--format", "csv", "-o", str(out_file))
    assert code == 0 and out == "" and out_file.read_text().startswith("run_id,")
    assert err.strip() == f"wrote {out_file} (csv: 2 run(s))"
    code, _, err = _list(capfd, "--format", "csv", "-o", str(out_file))
    assert code == 2 and "already exists" in err


def test_results_show(capfd):
    assert main(["results", "show", "slower-gpt-tiny-np2", "--index", str(BASELINES), "--format", "json"]) == 0
    entry = json.loads(capfd.readouterr().out)
    assert entry["run_id"] == "slower-gpt-tiny-np2" and entry["config"]["model"] == "gpt-tiny"
    assert main(["results", "show", "slower-gpt-tiny-np2", "--index", str(BASELINES)]) == 0
    out = capfd.readouterr().out
    assert "config_key: bc70a74fa83d923c" in out and '  dtype = "float32"' in out
    assert main(["results", "show", "nope", "--index", str(BASELINES)]) == 2


def test_results_list_finds_the_runs_of_sweeps_below_the_results_directory(capfd, tmp_path):
    """A sweep's runs write results/SWEEP/SITE/index.jsonl: list, show and compare's run ids find them from results."""
    from fourd_mpi.results.index import nested_indexes, read_index_tree, trace_of

    top = tmp_path / "results"
    sweep = top / "weak" / "local"
    (sweep / "run.parts").mkdir(parents=True)
    (top / ".hidden").mkdir()
    shutil.copy(BASE, sweep / "weak-000.h5")
    append_entry(str(sweep / INDEX_NAME), entry_of_trace(load_trace(str(sweep / "weak-000.h5")), str(sweep)) | {
        "run_id": "weak-000"})
    (sweep / "run.parts" / INDEX_NAME).write_text("not an index of runs\n")  # trace parts: never read
    (top / ".hidden" / INDEX_NAME).write_text("not an index of runs\n")
    assert nested_indexes(str(top)) == [str(sweep / INDEX_NAME)]
    # no index of its own at the top: the sweep's runs still list
    assert main(["results", "list", "--index", str(top), "--format", "json"]) == 0
    out, err = capfd.readouterr()
    listed = json.loads(out)
    assert [e["run_id"] for e in listed] == ["weak-000"] and listed[0]["trace"] == "weak/local/weak-000.h5"
    assert err == ""
    shutil.copy(SLOW, top / "slower.h5")
    append_entry(str(top / INDEX_NAME), an_entry("top-run") | {"trace": "slower.h5"})
    entries = read_index_tree(str(top / INDEX_NAME))
    assert [e["run_id"] for e in entries] == ["top-run", "weak-000"]
    assert trace_of(entries[1], str(top / INDEX_NAME)) == str(sweep / "weak-000.h5")
    assert main(["results", "show", "weak-000", "--index", str(top), "--format", "json"]) == 0
    assert json.loads(capfd.readouterr().out)["trace"] == "weak/local/weak-000.h5"
    # a .jsonl file named explicitly is read alone
    assert [e["run_id"] for e in read_index_tree(str(sweep / INDEX_NAME))] == ["weak-000"]
    from fourd_mpi.results.query import resolve

    assert resolve("weak-000", str(top / INDEX_NAME)) == [(entries[1], str(sweep / "weak-000.h5"))]
