"""``--attention``: what runs where, and the refusals (the kernels themselves: tests/core/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fourd_mpi.core.backend import make_backend
from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.step import fusedattention


def test_auto_on_numpy_is_unfused_with_the_reason():
    backend = make_backend("numpy", np.float32)
    impl, why = fusedattention.choose("auto", backend, 64)
    assert impl == "unfused" and why.startswith("auto: the numpy backend has no fused attention kernel")
    assert fusedattention.choose("unfused", backend, 64) == ("unfused", "--attention unfused")


@pytest.mark.parametrize("mode", ["fused", "cudnn", "flash"])
def test_an_explicit_fused_mode_on_numpy_is_one_error(mode):
    backend = make_backend("numpy", np.float32)
    with pytest.raises(BackendError, match=rf"^--attention {mode}: the numpy backend has no fused attention kernel"):
        fusedattention.choose(mode, backend, 64)
    with pytest.raises(BackendError, match="unknown attention mode 'fast'"):
        fusedattention.choose("fast", backend, 64)


def test_resolve_refuses_fused_attention_with_the_numpy_backend():
    from fourd_mpi.run.options import resolve

    sizes = dict(data=None, z=None, y=None, x=None)
    with pytest.raises(ConfigError, match=r"^--attention flash runs on a GPU only"):
        resolve(1, "gpt-tiny", sizes, {}, backend="numpy", attention="flash")
    with pytest.raises(ConfigError, match=r"^--attention: invalid choice: 'x'"):
        resolve(1, "gpt-tiny", sizes, {}, attention="x")
    assert resolve(1, "gpt-tiny", sizes, {}, attention="fused").attention == "fused"  # backend auto: at start-up


@pytest.mark.mpi
def test_run_and_verify_say_which_attention_ran(run_mpi, tmp_path):
    proc = run_mpi(2, ["run", "--gx", "2", "--steps", "2", "--results-dir", tmp_path, "--backend", "numpy",
                       "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention: unfused (auto: the numpy backend has no fused attention kernel" in proc.stdout
    proc = run_mpi(3, ["verify", "--gx", "3", "--hidden", "48", "--heads", "3", "--steps", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention: unfused in the checked runs; the reference's is unfused" in proc.stdout


@pytest.mark.mpi
def test_fused_attention_without_a_gpu_is_one_line_on_every_rank(run_mpi, tmp_path):
    proc = run_mpi(2, ["run", "--gx", "2", "--steps", "2", "--results-dir", tmp_path, "--backend", "numpy",
                       "--attention", "cudnn"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "--attention cudnn" in ln]
    assert len(lines) >= 1 and all("runs on a GPU only" in ln for ln in lines)


def test_the_config_key_tells_fused_from_unfused_and_keeps_older_keys():
    from fourd_mpi.results.index import config_key

    old = {"model": "gpt-tiny", "gx": 2, "steps": 10}  # a trace from before --attention
    assert config_key(dict(old, attention="unfused")) == config_key(old)
    assert config_key(dict(old, attention="fused")) != config_key(old)
    assert config_key(dict(old, attention="fused")) != config_key(dict(old, attention="flash"))


@pytest.mark.mpi
def test_the_trace_records_the_attention_that_ran(run_mpi, tmp_path):
    """``auto`` resolves on the machine: the trace's configuration holds what ran, so its key matches runs made
    before the option (all unfused) and tells a fused GPU run from an unfused one."""
    from fourd_mpi.trace.read import load_trace

    proc = run_mpi(2, ["run", "--gx", "2", "--steps", "2", "--results-dir", tmp_path, "--run-id", "a",
                       "--display", "quiet", "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'attention = "unfused"' in proc.stdout  # the resolved configuration printed, reusable as it is
    meta = load_trace(str(tmp_path / "a.h5"), events=False).metadata
    assert meta["config"]["attention"] == "unfused"
    assert meta["attention"]["implementation"] == "unfused"
    assert meta["attention"]["reason"].startswith("auto: the numpy backend has no fused attention kernel")
