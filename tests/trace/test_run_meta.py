"""``trace recover`` trusts nothing in a spool's run.json that it has not checked.

Before: ``world_size: 10**12`` pinned a CPU per worker and grew memory without bound (the world was
used as given); a run.json holding a JSON list ended in ``TypeError: list indices must be integers``.
A real spool (a real run, one rank killed at step 2), real processes, ``timeout`` on each.
"""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env, mpirun


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    results = tmp_path_factory.mktemp("crashed")
    mpirun(2, ["run", "--steps", "3", "--results-dir", results, "--run-id", "k", "--display", "quiet",
               "--inject-fault", "1:2"], timeout=120)
    path = results / "k.ranks"
    assert (path / "run.json").is_file() and (path / "rank000001.steps").is_file()
    return path


def recover(path, timeout=60):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(path)], capture_output=True,
                          text=True, timeout=timeout, env=mpi_env(), cwd=REPO)


def damaged(spool, tmp_path, change):
    copy = tmp_path / "s.ranks"
    shutil.copytree(spool, copy)
    meta = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps(change(meta)))
    return copy


def set_world(value):
    def change(meta):
        meta["world_size"] = value
        return meta
    return change


def one_line(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: "), proc.stderr
    return lines[0]


def test_a_huge_world_size_is_bounded_by_the_rank_files(spool, tmp_path):
    copy = damaged(spool, tmp_path, set_world(10 ** 12))
    line = one_line(recover(copy))
    assert "says world_size 1,000,000,000,000 but the highest rank with files there is 1" in line, line


@pytest.mark.parametrize("value, message", [
    (-3, "world_size: -3 is less than the minimum of 1"),
    (0, "world_size: 0 is less than the minimum of 1"),
    ("8", "world_size: '8' is not of type 'integer' (a quoted number is text: write it without quotes)"),
    (2.5, "world_size: 2.5 is not of type 'integer'"),
    (True, "world_size: True is not of type 'integer'"),
])
def test_a_bad_world_size_is_one_line(spool, tmp_path, value, message):
    copy = damaged(spool, tmp_path, set_world(value))
    assert one_line(recover(copy)) == f"fourd-mpi: error: {copy / 'run.json'}: {message}"


@pytest.mark.parametrize("data, kind", [([1, 2, 3], "list"), ("x", "str"), (None, "NoneType")])
def test_run_json_that_is_not_an_object_is_one_line(spool, tmp_path, data, kind):
    copy = damaged(spool, tmp_path, lambda meta: data)
    assert one_line(recover(copy)) == f"fourd-mpi: error: {copy / 'run.json'} is not a JSON object (it holds a {kind})"


def test_a_run_json_with_a_text_flop_count_is_one_line(spool, tmp_path):
    copy = damaged(spool, tmp_path, lambda meta: dict(meta, model_flops_per_step="many"))
    assert "model_flops_per_step: 'many' is not of type 'number'" in one_line(recover(copy))


def test_a_missing_tail_within_the_bound_still_recovers(spool, tmp_path):
    """A world a little larger than the files (ranks whose files were deleted) is still recovered:
    the missing ranks are reported, not refused as a damaged run.json."""
    copy = damaged(spool, tmp_path, set_world(4))
    proc = recover(copy)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "rank(s) 2, 3 had no metadata file" in proc.stdout, proc.stdout


def test_the_intact_spool_still_recovers(spool, tmp_path):
    copy = tmp_path / "s.ranks"
    shutil.copytree(spool, copy)
    proc = recover(copy)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "s.h5").is_file()
