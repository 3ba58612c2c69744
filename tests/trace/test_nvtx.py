"""NVTX ranges (``run --nvtx``) on the CPU: the calls are made, named step / phase / layer /
op, and balanced on every path, errors included. A stand-in ``nvtx`` module records the calls (the real
package needs no GPU either, but cannot be read back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, find_mpiexec, mpi_env

from fourd_mpi.trace.events import Tracer
from fourd_mpi.trace.nvtx import MISSING, Ranges, make_ranges

RECORDER = '''
import json, os
# one JSON line per call, written at once: the record survives an MPI_Abort (no atexit runs then)
_log = open(os.path.join(os.environ["NVTX_LOG_DIR"], f"rank{os.environ.get('PMI_RANK', os.getpid())}.jsonl"), "a",
            buffering=1)
def push_range(message=None, color=None, domain=None, category=None, payload=None):
    _log.write(json.dumps(["push", message, domain]) + "\\n")
def pop_range(domain=None):
    _log.write(json.dumps(["pop", None, domain]) + "\\n")
'''


class Recorder:
    def __init__(self):
        self.calls = []

    def push_range(self, message=None, color=None, domain=None):
        self.calls.append(("push", message))

    def pop_range(self, domain=None):
        self.calls.append(("pop", None))


def balanced(calls) -> bool:
    depth = 0
    for kind, *_ in calls:
        depth += 1 if kind == "push" else -1
        if depth < 0:
            return False
    return depth == 0


def test_scopes_nest_and_stay_balanced_when_a_layer_raises():
    rec = Recorder()
    tracer = Tracer(layers=["block0.fc1"], level="op")
    tracer.ranges = Ranges(rec)
    tracer.begin_step(0)
    tracer.enter_phase("forward")
    with tracer.layer("block0.fc1", "forward"), tracer.op("gelu"):
        pass
    tracer.enter_phase("backward")
    with pytest.raises(RuntimeError):
        with tracer.layer("block0.fc1", "backward"), tracer.op("attention"):
            raise RuntimeError("boom")
    assert tracer.ranges.stack == ["step 0", "phase backward"]  # the scopes that raised are closed
    tracer.ranges.unwind()  # what the engine does when a step raises
    assert balanced(rec.calls) and tracer.ranges.stack == []
    pushed = [m for kind, m in rec.calls if kind == "push"]
    assert pushed == ["step 0", "phase forward", "layer block0.fc1 (forward)", "op gelu", "phase backward",
                      "layer block0.fc1 (backward)", "op attention"]
    # the next step starts clean even if nobody unwound the last one
    tracer.begin_step(1)
    tracer.enter_phase("optimizer")
    tracer.end_step(0, 1, [], {})
    assert balanced(rec.calls)


def test_without_the_package_one_line_and_no_ranges(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx raises ImportError
    said = []
    assert make_ranges(True, said.append) is None and said == [MISSING]
    assert make_ranges(False, said.append) is None and said == [MISSING]


def _run(tmp_path, *extra, fake=RECORDER):
    fake_dir = tmp_path / "fake"
    (fake_dir / "nvtx").mkdir(parents=True)
    (fake_dir / "nvtx" / "__init__.py").write_text(fake)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = mpi_env()
    env["PYTHONPATH"] = str(fake_dir) + os.pathsep + env["PYTHONPATH"]
    env["NVTX_LOG_DIR"] = str(logs)
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--steps", "3",
           "--nvtx", "--display", "lines", "--peak-tflops", "1", "--results-dir", str(tmp_path / "results"),
           "--trace-level", "layer", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    return proc, {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in logs.glob("*.jsonl")}


@pytest.mark.mpi
def test_a_run_marks_steps_phases_layers_and_ops_balanced(tmp_path):
    proc, ranks = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(ranks) == ["rank0", "rank1"]
    for calls in ranks.values():
        assert balanced(calls) and all(domain == "fourd_mpi" for _, _, domain in calls)
        pushed = [m for kind, m, _ in calls if kind == "push"]
        assert [m for m in pushed if m.startswith("step ")] == ["step 0", "step 1", "step 2"]
        assert {"phase forward", "phase backward", "phase optimizer"} <= set(pushed)
        assert any(m.startswith("layer block0.") and m.endswith("(forward)") for m in pushed)
        assert {"op optimizer", "op gelu"} <= set(pushed)


@pytest.mark.mpi
def test_ranges_are_balanced_when_a_rank_raises(tmp_path):
    """Rank 1 raises at the start of step 2; the job is then aborted (MPI_Abort: no exit handler runs), so
    the stand-in writes each call as it is made. The raising rank unwinds its ranges before the abort:
    its record holds steps 0 and 1 and is balanced, on a quiet or a loaded machine alike (rank 0, killed
    wherever the abort finds it, may be inside a range)."""
    proc, ranks = _run(tmp_path, "--inject-fault", "1:2:raise")
    assert proc.returncode != 0 and "injected fault" in proc.stderr
    calls = ranks["rank1"]
    assert balanced(calls), calls
    assert [m for kind, m, _ in calls if kind == "push" and m.startswith("step ")] == ["step 0", "step 1"]


@pytest.mark.mpi
def test_a_missing_package_is_one_line(tmp_path):
    proc, _ = _run(tmp_path, fake="raise ImportError('no nvtx here')\n")
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count(MISSING) == 1
