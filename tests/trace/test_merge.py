"""Hierarchical trace merge (fourd_mpi.trace.merge): groups of ranks write part files, a top-level
file binds them with a virtual /events; readers see the same trace as the single-file merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import HELPERS, REPO, mpi_env, mpirun

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, LANE_HOST, LANE_STEP, OPS, RANK_STEP_DTYPE, SCHEMA_VERSION
from fourd_mpi.trace.files import parts_dir_of
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.parts import MAX_PARTS, PART_SCHEMA, auto_group_size, plan_groups, resolve_group_size
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.recover import recover
from fourd_mpi.trace.spool import RankSpool
from fourd_mpi.util.files import RUN_META

OP = {name: i for i, name in enumerate(OPS)}


# ---------------------------------------------------------------------------
# group arithmetic (pure)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("world, size, groups", [
    (8, 3, [(0, 3), (3, 6), (6, 8)]),
    (5, 2, [(0, 2), (2, 4), (4, 5)]),
    (4, 4, [(0, 4)]),
    (4, 9, [(0, 4)]),
    (1, 1, [(0, 1)]),
])
def test_plan_groups_cover_the_world_in_rank_order(world, size, groups):
    assert plan_groups(world, size) == groups


def test_default_group_size_is_a_node_and_caps_the_part_count():
    assert auto_group_size(8, 8) == 8                      # one node: one group, one file
    assert auto_group_size(4096, 128) == 128               # 32 nodes: 32 parts
    assert auto_group_size(32768, 4) == 32768 // MAX_PARTS  # 4 ranks per node would be 8192 parts: 256
    assert resolve_group_size(5, 0, 8) == 5 and resolve_group_size(5, 3, 8) == 3 and resolve_group_size(5, 9, 1) == 5
    with pytest.raises(ValueError):
        plan_groups(4, 0)


# ---------------------------------------------------------------------------
# the collective merge on real mpiexec runs
# ---------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("nranks, group_size", [(8, 3), (5, 2)])
def test_hierarchical_merge_equals_the_single_file_merge(tmp_path, nranks, group_size):
    """Real traced steps spooled twice; merged as one file and in uneven groups: every dataset equal
    byte for byte, the parts copied elsewhere still read (helpers/mpi_merge_check.py)."""
    proc = mpirun(nranks, [str(tmp_path), group_size], script=str(HELPERS / "mpi_merge_check.py"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"merge check ok parts={-(-nranks // group_size)}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_run_with_trace_group_size_writes_parts_that_show_and_analyze_read(tmp_path):
    results = tmp_path / "results"
    proc = mpirun(5, ["run", "--model", "gpt-tiny", "--layers", "1", "--batch", "5", "--steps", "2",
                      "--results-dir", results, "--run-id", "grouped", "--trace-group-size", "2", "--display", "quiet",
                      "--peak-tflops", "1"],
                  timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = results / "grouped.h5"
    assert sorted(os.listdir(results)) == ["grouped.h5", "grouped.parts", "index.jsonl"]
    assert sorted(os.listdir(results / "grouped.parts")) == [f"part{i:06d}.h5" for i in range(3)]
    trace = load_trace(str(path))
    assert trace.schema_version == SCHEMA_VERSION and trace.attrs["parts"] == 3 and trace.world_size == 5
    assert trace.metadata["config"]["trace-group-size"] == 2
    assert check_invariants(trace) == []
    for row in trace.ranks:  # each rank's slice holds that rank's events only
        ev = trace.events[row["event_offset"]: row["event_offset"] + row["event_count"]]
        assert row["event_count"] > 0 and (ev["rank"] == row["rank"]).all()
    cli = [sys.executable, "-m", "fourd_mpi"]
    show = subprocess.run(cli + ["trace", "show", str(path)], capture_output=True, text=True, env=mpi_env(), cwd=REPO)
    assert show.returncode == 0 and "events in 3 part files" in show.stdout, show.stdout + show.stderr
    analyze = subprocess.run(cli + ["analyze", str(results)], capture_output=True, text=True, env=mpi_env(), cwd=REPO)
    assert analyze.returncode == 0 and "grouped" in analyze.stdout and "skipped" not in analyze.stderr, \
        analyze.stdout + analyze.stderr


# ---------------------------------------------------------------------------
# recovery by groups (one process, worker processes), files only
# ---------------------------------------------------------------------------

def spool_of(tmp_path, world: int, steps, name="run-g", ranks_per_node=None) -> str:
    """A crashed run's spool: rank r finished ``steps[r]`` steps (uneven event counts, events appended
    out of time order so the merge must sort)."""
    spool_dir = tmp_path / f"{name}.ranks"
    spool_dir.mkdir()
    meta = {"run_id": name, "world_size": world, "layers": ["", "l1"], "level": "op"}
    if ranks_per_node:
        meta["ranks_per_node"] = ranks_per_node
    (spool_dir / RUN_META).write_text(json.dumps(meta))
    for rank in range(world):
        spool = RankSpool(str(spool_dir), rank, {"rank": rank, "hostname": f"n{rank // 2}", "node": rank // 2})
        for step in range(steps[rank]):
            t0 = 10**9 + step * 10**6 + rank
            n = 3 + (rank * 5 + step) % 4  # uneven per rank and step
            ev = np.zeros(n + 1, dtype=EVENT_DTYPE)
            ev["rank"], ev["step"] = rank, step
            ev["op"][:n], ev["lane"][:n] = OP["gemm"], LANE_HOST
            ev["start_ns"][:n] = t0 + 10 + 100 * np.arange(n)[::-1]  # reversed: unsorted in the spool
            ev["end_ns"][:n] = ev["start_ns"][:n] + 50
            ev["flops"][:n] = 1e6
            ev[n] = ev[0]
            ev["op"][n], ev["lane"][n], ev["start_ns"][n], ev["end_ns"][n] = OP["step"], LANE_STEP, t0, t0 + 10**5
            rec = np.zeros(1, dtype=RANK_STEP_DTYPE)
            rec[0] = (rank, step, step == 0, t0, t0 + 10**5, 1.0, 1e-4, 50 * n, 0, n + 1, 0)
            spool.append(ev, rec)
        spool.close()
    return str(spool_dir)


def same_trace(a, b) -> None:
    for name in ("events", "ranks", "rank_steps", "steps"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


@pytest.mark.parametrize("jobs", [1, 2])
def test_recover_by_groups_equals_the_single_file_recovery(tmp_path, jobs):
    spool = spool_of(tmp_path, 7, [3, 3, 2, 3, 3, 3, 3])  # rank 2 died in step 2: steps 0-1 kept
    single = recover(spool, output=str(tmp_path / "single.h5"), group_size=7)
    grouped = recover(spool, output=str(tmp_path / "grouped.h5"), group_size=3, jobs=jobs)
    assert single["parts"] == 0 and grouped["parts"] == 3
    assert grouped["events_dropped"] == single["events_dropped"] > 0 and grouped["steps"] == [0, 1]
    a, b = load_trace(single["path"]), load_trace(grouped["path"])
    assert b.status == "partial" and b.attrs["parts"] == 3 and a.attrs["parts"] == 0
    same_trace(a, b)
    assert check_invariants(b) == []
    assert (np.diff(b.events["rank"].astype(np.int64)) >= 0).all()
    with h5py.File(parts_dir_of(grouped["path"]) + "/part000001.h5", "r") as part:
        assert part.attrs["schema"] == PART_SCHEMA and part.attrs["first_rank"] == 3 and part.attrs["rank_count"] == 3


def test_recover_default_groups_follow_the_runs_ranks_per_node(tmp_path):
    spool = spool_of(tmp_path, 6, [2] * 6, ranks_per_node=[2, 2, 2])
    result = recover(spool, jobs=1)
    assert result["parts"] == 3 and result["path"] == str(tmp_path / "run-g.h5")
    assert os.path.isdir(tmp_path / "run-g.parts")
    small = spool_of(tmp_path, 3, [2] * 3, name="small")  # no ranks_per_node: one file, as before
    assert recover(small)["parts"] == 0 and not os.path.exists(tmp_path / "small.parts")


def test_a_moved_multi_part_trace_reads_and_a_missing_or_foreign_part_is_refused(tmp_path):
    spool = spool_of(tmp_path, 5, [2] * 5)
    path = recover(spool, group_size=2)["path"]
    before = load_trace(path)
    moved = tmp_path / "elsewhere" / "deeper"
    moved.mkdir(parents=True)
    shutil.move(path, moved / "run-g.h5")
    shutil.move(parts_dir_of(path), moved / "run-g.parts")
    after = load_trace(str(moved / "run-g.h5"))
    same_trace(before, after)
    with h5py.File(moved / "run-g.h5", "r") as f:  # plain h5py: the virtual dataset, relative sources
        assert f["events"].is_virtual and f["events"][()].tobytes() == before.events.tobytes()
    # a part from another run in its place
    other = spool_of(tmp_path, 5, [2] * 5, name="other")
    other_path = recover(other, group_size=2)["path"]
    shutil.copy(parts_dir_of(other_path) + "/part000001.h5", moved / "run-g.parts" / "part000001.h5")
    with pytest.raises(TraceError, match="is not a part of the trace"):
        load_trace(str(moved / "run-g.h5"))
    os.remove(moved / "run-g.parts" / "part000001.h5")
    with pytest.raises(TraceError, match="part000001.h5 is missing .*copy or move both"):
        load_trace(str(moved / "run-g.h5"))
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "check", str(moved / "run-g.h5")],
                          capture_output=True, text=True, env=mpi_env(), cwd=REPO)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1 and "is missing" in proc.stderr


def test_parts_directory_is_never_overwritten_without_force_and_force_leaves_no_orphans(tmp_path):
    spool = spool_of(tmp_path, 4, [2] * 4)
    out = str(tmp_path / "t.h5")
    recover(spool, output=out, group_size=2)
    with pytest.raises(TraceError, match="already exists"):
        recover(spool, output=out, group_size=2)
    os.remove(out)  # a stale parts directory alone also blocks a new trace of that name
    with pytest.raises(TraceError, match=r"t\.parts already exists"):
        recover(spool, output=out, group_size=2)
    assert recover(spool, output=out, group_size=3, force=True)["parts"] == 2
    assert sorted(os.listdir(tmp_path / "t.parts")) == ["part000000.h5", "part000001.h5"]
    assert recover(spool, output=out, group_size=4, force=True)["parts"] == 0  # replaced by one file
    assert not os.path.exists(tmp_path / "t.parts")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp files or directories left
    assert load_trace(out).attrs["parts"] == 0


def test_trace_recover_cli_by_groups(tmp_path):
    spool = spool_of(tmp_path, 6, [2] * 6)
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", spool, "--group-size", "4",
                           "--jobs", "2", "--compression", "lzf"], capture_output=True, text=True, env=mpi_env(),
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "events in 2 part files" in proc.stdout
    trace = load_trace(str(tmp_path / "run-g.h5"))
    expected = sum(3 + (r * 5 + s) % 4 + 1 for r in range(6) for s in range(2))  # n + 1 per rank and step
    assert trace.attrs["parts"] == 2 and len(trace.events) == expected and check_invariants(trace) == []
    with h5py.File(str(tmp_path / "run-g.parts" / "part000000.h5"), "r") as part:
        assert part["events"].compression == "lzf"


# ---------------------------------------------------------------------------
# recover's removability check of a multi-part trace (readback) and its worker pool
# ---------------------------------------------------------------------------

def test_readback_check_calls_a_sound_multi_part_trace_removable_like_the_full_check(tmp_path):
    spool = spool_of(tmp_path, 6, [2] * 6)
    fast = recover(spool, output=str(tmp_path / "fast.h5"), group_size=2, jobs=2)
    full = recover(spool, output=str(tmp_path / "full.h5"), group_size=2, check="full")
    assert fast["verified"] == "readback" and full["verified"] == "full"
    assert fast["removable"] is None and full["removable"] is None
    same_trace(load_trace(fast["path"]), load_trace(full["path"]))
    single = recover(spool, output=str(tmp_path / "one.h5"), group_size=6)  # one file: always the full check
    assert single["verified"] == "full" and single["removable"] is None
    with pytest.raises(TraceError, match="unknown recover check"):
        recover(spool, output=str(tmp_path / "x.h5"), check="quick")


def test_readback_sees_a_part_that_differs_from_what_was_written(tmp_path):
    from fourd_mpi.trace.rebuild import verify_part

    spool = spool_of(tmp_path, 4, [2] * 4)
    path = recover(spool, group_size=2)["path"]
    part = parts_dir_of(path) + "/part000001.h5"
    with h5py.File(part, "r") as f:
        events, run_id = f["events"][()], str(f.attrs["run_id"])
    import xxhash

    crc = xxhash.xxh3_64(events.view(np.uint8)).hexdigest()  # an independent one-shot digest of the bytes
    assert verify_part((part, 1, len(events), crc, run_id)) is None
    other = xxhash.xxh3_64(events[:-1].view(np.uint8)).hexdigest()
    assert "differ from those written" in verify_part((part, 1, len(events), other, run_id))
    assert "attributes written" in verify_part((part, 0, len(events), crc, run_id))
    with h5py.File(part, "r+") as f:  # one time changed on disk after the write
        f["events"][0, "start_ns"] = events["start_ns"][0] + 1
    assert "differ from those written" in verify_part((part, 1, len(events), crc, run_id))
    os.remove(part)
    assert "does not read back" in verify_part((part, 1, len(events), crc, run_id))


def test_recover_refuses_a_rank_step_that_lacks_events_its_record_counts(tmp_path):
    spool = spool_of(tmp_path, 4, [2] * 4)
    events_file = os.path.join(spool, "rank000002.events")  # rank 2 lost its last event of step 1
    size = os.path.getsize(events_file)
    os.truncate(events_file, size - EVENT_DTYPE.itemsize)
    # validated before publication, in both checks: nothing written, the damage named
    for check, out in (("readback", "t.h5"), ("full", "full.h5")):
        with pytest.raises(TraceError, match=r"damaged: rank 2 step 1: 6 events in the \.events file, "
                                             r"its record says 7 \(1 such rank-steps\).*nothing was written"):
            recover(spool, output=str(tmp_path / out), group_size=2, jobs=2, check=check)
        assert not os.path.exists(tmp_path / out) and not os.path.exists(tmp_path / out.replace(".h5", ".parts"))


def test_group_pool_forks_only_without_open_hdf5_objects(tmp_path):
    from fourd_mpi.trace.rebuild import GroupPool

    with GroupPool(2, 3) as pool:
        assert pool.start_method == "fork" and pool.map(abs, [-1, 2, -3]) == [1, 2, 3]
    path = tmp_path / "open.h5"
    with h5py.File(path, "w"):  # an open file: a forked child would inherit its HDF5 state
        with GroupPool(2, 3) as pool:
            assert pool.start_method == "spawn" and pool.map(abs, [-1, 2, -3]) == [1, 2, 3]
    with GroupPool(1, 3) as pool:
        assert pool.pool is None and pool.map(abs, [-4]) == [4]


def test_recover_reads_rank_files_in_batches_and_sorts_each_rank(tmp_path, monkeypatch):
    """Batches smaller than a group (one rank each, or two) give the same trace as one batch."""
    from fourd_mpi.trace import rebuild

    spool = spool_of(tmp_path, 5, [3, 3, 3, 2, 3])
    whole = load_trace(recover(spool, output=str(tmp_path / "whole.h5"), group_size=5)["path"])
    original = rebuild.rank_batches
    for rows in (1, 9):
        monkeypatch.setattr(rebuild, "rank_batches",
                            lambda *a, rows=rows, original=original: original(*a, max_events=rows))
        for size in (5, 2):
            out = str(tmp_path / f"b{rows}-{size}.h5")
            same_trace(whole, load_trace(recover(spool, output=out, group_size=size)["path"]))
    assert (np.diff(whole.events["rank"].astype(np.int64)) >= 0).all()
    for rank in range(5):
        assert (np.diff(whole.events["start_ns"][whole.events["rank"] == rank]) >= 0).all()


def test_a_part_that_does_not_read_back_keeps_the_spool_and_is_named_where_it_lies(tmp_path, monkeypatch):
    from fourd_mpi.trace import rebuild

    spool = spool_of(tmp_path, 4, [2] * 4)
    monkeypatch.setattr(rebuild, "verify_part", lambda task: f"{task[0]} does not read back: injected"
                        if task[1] == 1 else None)
    result = recover(spool, group_size=2, jobs=1)
    assert result["removable"] == f"{parts_dir_of(result['path'])}/part000001.h5 does not read back: injected"
    assert load_trace(result["path"]).attrs["parts"] == 2  # the trace itself is published


# --- recovery that never lies ------------------------------------------------------------------------

def test_recover_refuses_events_whose_rank_bytes_were_flipped(tmp_path):
    """Before: exit 0 and a published trace that 'trace check' rejected ("rank 4278190081 outside the world")."""
    spool = spool_of(tmp_path, 2, [2, 2])
    events_file = os.path.join(spool, "rank000001.events")
    with open(events_file, "r+b") as fh:  # the high byte of the rank field of record 3
        fh.seek(3 * EVENT_DTYPE.itemsize + EVENT_DTYPE.fields["rank"][1] + 3)
        fh.write(b"\xff")
    with pytest.raises(TraceError, match=r"rank000001\.events is damaged: record 3 says rank 4278190081, not 1 .*"
                                         r"nothing was written"):
        recover(spool, output=str(tmp_path / "t.h5"))
    assert not os.path.exists(tmp_path / "t.h5")
    done = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", spool, "-o", str(tmp_path / "t.h5")],
                          capture_output=True, text=True, env=mpi_env())
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is damaged" in done.stderr, done.stderr


@pytest.mark.parametrize("target", ["t.h5", "rank000000.events"])
def test_recover_never_writes_into_the_spool(tmp_path, target):
    """Before: -o S.ranks/t.h5 was written and then 'S.ranks can now be removed'; with --force,
    -o S.ranks/rank000000.events replaced spool data."""
    spool = spool_of(tmp_path, 2, [2, 2])
    before = open(os.path.join(spool, "rank000000.events"), "rb").read()
    done = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", spool, "-o",
                           os.path.join(spool, target), "--force"], capture_output=True, text=True, env=mpi_env())
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "lies inside the run spool" in done.stderr
    assert open(os.path.join(spool, "rank000000.events"), "rb").read() == before
    assert not os.path.exists(os.path.join(spool, "t.h5"))


def test_recover_pool_workers_die_with_their_parent(tmp_path):
    """Before: 'trace recover --jobs 2' killed with SIGKILL left its workers blocked forever (parent pid 1)."""
    import signal
    import time

    code = ("import os, sys, time\n"
            "from fourd_mpi.trace.rebuild import GroupPool\n"
            "pool = GroupPool(2, 3)\n"
            "print(' '.join(str(p) for p in pool.pool._processes), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=mpi_env())
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 120  # they notice within a poll; minutes of slack for a loaded machine
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in workers if _running(p)]
    for pid in alive:  # leave no stray process behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"pool workers {alive} outlived their killed parent"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
