"""NVTX ranges (``run --nvtx``, issue 32 item 5) on the CPU: the calls are made, named step / phase / layer /
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
import atexit, json, os
calls = []
def push_range(message=None, color=None, domain=None, category=None, payload=None):
    calls.append(["push", message, domain])
def pop_range(domain=None):
    calls.append(["pop", None, domain])
@atexit.register
def _dump():
    with open(os.path.join(os.environ["NVTX_LOG_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(calls, f)
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
    return proc, [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]


@pytest.mark.mpi
def test_a_run_marks_steps_phases_layers_and_ops_balanced(tmp_path):
    proc, ranks = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(ranks) == 2
    for calls in ranks:
        assert balanced(calls) and all(domain == "fourd_mpi" for _, _, domain in calls)
        pushed = [m for kind, m, _ in calls if kind == "push"]
        assert [m for m in pushed if m.startswith("step ")] == ["step 0", "step 1", "step 2"]
        assert {"phase forward", "phase backward", "phase optimizer"} <= set(pushed)
        assert any(m.startswith("layer block0.") and m.endswith("(forward)") for m in pushed)
        assert {"op optimizer", "op gelu"} <= set(pushed)


@pytest.mark.mpi
def test_ranges_are_balanced_when_a_rank_raises(tmp_path):
    proc, ranks = _run(tmp_path, "--inject-fault", "1:2:raise")
    assert proc.returncode != 0 and "injected fault" in proc.stderr
    raised = [calls for calls in ranks if calls]
    if not raised:  # the abort took the ranks down before any wrote its record of calls
        pytest.skip("no rank wrote its NVTX record before the job was aborted")
    assert all(balanced(calls) for calls in raised)


@pytest.mark.mpi
def test_a_missing_package_is_one_line(tmp_path):
    proc, _ = _run(tmp_path, fake="raise ImportError('no nvtx here')\n")
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count(MISSING) == 1
