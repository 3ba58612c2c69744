"""``--format json`` of the commands that print a result (``fourd_mpi/cli/jsonout.py``): standard output is one
JSON document and nothing else (``json.loads`` of all of it), with the keys its help lists.

Each command runs as typed, in a process of its own (the MPI ones under a real ``mpiexec``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, find_mpiexec, mpi_env

from fourd_mpi.cli.args import walk_parsers
from fourd_mpi.cli.jsonout import DOCUMENTS, JsonDoc, plain
from fourd_mpi.cli.main import build_parser

TRACE = REPO / "results" / "baselines" / "baseline-gpt-tiny-np2.h5"
SAMPLES = REPO / "results" / "samples"


def fourd(*args, cwd=REPO, nranks=0):
    """``fourd-mpi ARGS`` (under ``mpiexec -n NRANKS`` when given): the completed process."""
    launcher = [find_mpiexec(), "-n", str(nranks)] if nranks else []
    return subprocess.run([*launcher, sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True,
                          text=True, env=mpi_env(), cwd=cwd, timeout=300)


def document(command: str, proc) -> dict:
    """The one JSON document on standard output, with exactly the keys ``command``'s schema declares."""
    doc = json.loads(proc.stdout)
    schema = DOCUMENTS[command]
    assert set(schema.keys) - schema.optional <= set(doc) <= set(schema.keys), (command, sorted(doc))
    return doc


def test_every_document_is_listed_in_its_help():
    """Each declared document belongs to a command whose --format offers json and whose help names every key."""
    parsers = {" ".join(path): p for path, p in walk_parsers(build_parser())}
    for command, schema in DOCUMENTS.items():
        fmt = next(a for a in parsers[command]._actions if "--format" in a.option_strings)
        assert "json" in fmt.choices, command
        for key in schema.keys:
            assert f"{key} (" in fmt.help, (command, key)


def test_the_document_is_plain_json():
    import numpy as np

    assert plain({"a": float("nan"), 1: np.int64(3), "b": (np.float32(0.5), float("inf")), "c": {2}}) == {
        "a": None, "1": 3, "b": [0.5, None], "c": [2]}
    schema = JsonDoc("test only", {"a": "x", "b": "y"}, optional=("b",))
    schema.check({"a": 1})
    with pytest.raises(ValueError, match="differ from the declared schema"):
        schema.check({"a": 1, "c": 2})
    del DOCUMENTS["test only"]


def test_tune_json():
    doc = document("tune", fourd("tune", "--ranks", "8", "--model", "gpt-tiny", "--top", "3", "--format", "json"))
    assert doc["ranks"] == 8 and doc["algorithms"] == ["axonn4d"] and len(doc["top"]) == 3
    assert [t["rank"] for t in doc["top"]] == [1, 2, 3] and doc["top"][0]["step_ms"] <= doc["top"][1]["step_ms"]
    assert doc["why"].startswith(doc["top"][0]["grid"]) and doc["options"]["dtype_source"]
    across = document("tune", fourd("tune", "--ranks", "8", "--model", "gpt-small", "--algorithm", "all", "--top", "2",
                                    "--format", "json"))
    assert len(across["algorithms"]) > 1 and across["why"] is None and across["best"][0]["vs_best"] == 1.0


def test_model_commands_json(tmp_path):
    doc = document("model compare-axonn", fourd("model", "compare-axonn", "--ranks", "64", "--batch", "64",
                                                "--min-tp", "4", "--top", "2", "--format", "json"))
    assert doc["cases"][0]["batch"] == 64 and len(doc["cases"][0]["ours"]) == 2 and doc["cases"][0]["explained"]
    doc = document("model paper", fourd("model", "paper", "--series", "none", "--format", "json"))
    assert doc["best"]["grid"] and doc["settings"]["gpus"] == 1024 and doc["series"] == []
    doc = document("model predict", fourd("model", "predict", "--batch", "1536", "--grid", "16x1x8x1", "--format",
                                          "json"))
    assert doc["step_s"] > 0
    doc = document("model published", fourd("model", "published", "--dataset", "axonn_sc24", "--no-claims",
                                            "--format", "json"))
    assert doc["points"] and "claims" not in doc
    proc = fourd("model", "calibrate", SAMPLES, "--profile", "laptop", "-o", tmp_path / "c.yaml", "--format", "json")
    doc = document("model calibrate", proc)
    assert doc["output"] == str(tmp_path / "c.yaml") and doc["runs"] and doc["weights"]
    assert f"wrote {tmp_path / 'c.yaml'}" in proc.stderr  # not on standard output


def test_trace_and_results_json(tmp_path):
    doc = document("trace show", fourd("trace", "show", TRACE, "--format", "json"))
    assert doc["status"] == "complete" and len(doc["steps"]) == 22 and doc["metadata"]["run_id"] == TRACE.stem
    assert doc["steps"][0]["warmup"] is True and doc["summary"]["median_s"] > 0
    doc = document("trace check", fourd("trace", "check", TRACE, "--format", "json"))
    assert doc == {"file": str(TRACE), "events": 44, "world_size": 2, "steps": 22, "violations": [], "ok": True}
    shutil.copy(TRACE, tmp_path / TRACE.name)
    doc = document("results reindex", fourd("results", "reindex", tmp_path, "--format", "json"))
    assert doc == {"index": str(tmp_path / "index.jsonl"), "runs": 1, "skipped": []}


def test_sweep_json(tmp_path):
    spec = REPO / "jobscripts" / "weak-gpt-tiny.yaml"
    out = tmp_path / "jobs"
    doc = document("sweep render", fourd("sweep", "render", spec, "--site", "local", "--out", out, "--format", "json"))
    assert doc["directory"] == str(out) and doc["runs"] == len([f for f in doc["files"] if f.endswith(".sh")])
    doc = document("sweep submit", fourd("sweep", "submit", out, "--dry-run", "--format", "json"))
    assert doc["dry_run"] is True and doc["failed"] == [] and doc["sweep"] == "weak-gpt-tiny"


def test_testbed_down_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "testbed", "down", "--name", "jsonnone", "--format",
                           "json"], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**mpi_env(), "FOURD_TESTBED_STATE": str(tmp_path)})
    if proc.returncode == 2 and not proc.stdout:  # no root or no ip/tc here: one line, as every testbed command
        pytest.skip(proc.stderr.strip())
    doc = document("testbed down", proc)
    assert doc == {"beds": [{"name": "jsonnone", "removed": [], "left": []}], "problems": []}


@pytest.mark.mpi
def test_mpi_commands_json(tmp_path):
    """verify, run and info on 2 ranks: rank 0's one document (run: nothing of its configuration or steps on
    standard output); verify --json FILE holds the same; trace recover of a run stopped by SIGTERM at step 2."""
    proc = fourd("verify", "--steps", "2", "--format", "json", "--json", tmp_path / "v.json", nranks=2)
    doc = document("verify", proc)
    assert proc.returncode == 0 and doc["passed"] == len(doc["results"]) >= 1 and doc["failed"] == 0
    assert json.loads((tmp_path / "v.json").read_text()) == doc
    proc = fourd("run", "--steps", "3", "--results-dir", tmp_path, "--run-id", "j", "--format", "json", nranks=2)
    doc = document("run", proc)
    assert doc["trace"] == str(tmp_path / "j.h5") and doc["run_id"] == "j" and doc["summary"]["steps"] == 2
    assert doc["config"]["steps"] == 3 and (tmp_path / "j.h5").exists()
    doc = document("info", fourd("info", "--gx", "2", "--format", "json", nranks=2))
    assert doc["world_size"] == 2 and doc["grid"] == "1x1x1x2" and doc["placement"]["axes"]["x"]["size"] == 2
    assert doc["parameters"] and doc["model"]["name"] == "gpt-tiny"
    proc = fourd("run", "--gdata", "2", "--steps", "4", "--display", "quiet", "--results-dir", tmp_path, "--run-id",
                 "t", "--inject-fault", "1:2:sigterm", nranks=2)
    assert proc.returncode != 0 and (tmp_path / "t.ranks").is_dir(), proc.stderr
    proc = fourd("trace", "recover", tmp_path / "t.ranks", "--format", "json")
    doc = document("trace recover", proc)
    assert proc.returncode == 0 and doc["path"] == str(tmp_path / "t.h5") and doc["steps"] == [0, 1]
    assert doc["status"] == "interrupted" and doc["removable"] is None
