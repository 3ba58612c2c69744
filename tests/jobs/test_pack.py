"""Job packing: several runs in one allocation, each run still logged and tracked.

Rendering and allocation arithmetic here, without a scheduler; local-site packs run for real
under mpiexec (a failed run in the middle of a sequential pack, hostile paths). The packs on
a real Slurm (sequential, concurrent srun steps, job array) are in test_sweep_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import mpi_env

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.pack import _first_fit_nodes
from fourd_mpi.jobs.schedulers import parse_time
from fourd_mpi.jobs.sites import load_site
from fourd_mpi.jobs.spec import load_spec
from fourd_mpi.jobs.sweep import build_manifest, record_state, write_sweep

IN_CI = os.environ.get("CI", "").lower() == "true"
#: four runs: 1, 1, 2 and 4 ranks, 5 minutes each
SPEC = """\
name: pk
study: strong
ranks: [1, 2, 4]
grids: {1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2]}
model: {preset: gpt-tiny, batch: 4}
options: {steps: 1, warmup: 0, trace_level: step}
job: {time: "00:05:00"}
"""


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def fourd(args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=mpi_env())


def render(tmp_path, site="slurm", spec_text=SPEC, **job):
    spec = load_spec(write(tmp_path, spec_text))
    spec.job.update(job)
    site = load_site(site) if isinstance(site, str) else site
    manifest = build_manifest(spec, site, "spec.yaml", "jobscripts/pk")
    write_sweep(manifest, spec, site, str(tmp_path / "jobscripts/pk"))
    return manifest


def directive(text, name):
    found = re.findall(rf"^#SBATCH --{name}=(\S+)$", text, re.M)
    assert len(found) == 1, (name, text)
    return found[0]


def test_sequential_pack_is_sized_for_the_largest_run_and_the_sum_of_the_times(tmp_path):
    manifest = render(tmp_path, pack=3)
    assert [p["runs"] for p in manifest["packs"]] == [["pk-000-n1-1x1x1x1", "pk-001-n2-1x1x1x2",
                                                       "pk-002-n4-1x1x2x2"]]
    text = (tmp_path / "jobscripts/pk/pack-000.sh").read_text()
    assert directive(text, "nodes") == "1" and directive(text, "ntasks") == "4"  # the 4-rank run's node
    assert parse_time(directive(text, "time")) == 3 * 300
    assert directive(text, "output") == "jobscripts/pk/logs/pack-000.out"
    for run in manifest["runs"]:  # each run: its own script, log and exit-status file, named in the pack
        assert run["pack"] == "pack-000" and run["status"] == run["log"][:-4] + ".status"
        assert (tmp_path / run["script"]).exists() and f" {run['script']}" in text and f" {run['status']}" in text
    subprocess.run(["bash", "-n", str(tmp_path / "jobscripts/pk/pack-000.sh")], check=True)
    assert "SLURM_EXACT" not in text and "wait" not in text.split("run_one()")[1].split("}")[1]
    on_disk = json.loads((tmp_path / "jobscripts/pk/manifest.json").read_text())
    assert on_disk["packs"][0]["time_seconds"] == 900 and "_pack" not in on_disk["packs"][0]


def test_packs_of_n_runs_in_sweep_order(tmp_path):
    manifest = render(tmp_path, pack=2)
    assert [p["runs"] for p in manifest["packs"]] == [["pk-000-n1-1x1x1x1", "pk-001-n2-1x1x1x2"],
                                                      ["pk-002-n4-1x1x2x2"]]
    assert sorted(p.name for p in (tmp_path / "jobscripts/pk").glob("pack-*.sh")) == ["pack-000.sh", "pack-001.sh"]


def test_concurrent_pack_shares_nodes_and_takes_the_longest_time(tmp_path):
    manifest = render(tmp_path, pack=3, pack_mode="concurrent", ranks_per_node=4)
    text = (tmp_path / "jobscripts/pk/pack-000.sh").read_text()
    # 1 + 2 + 4 ranks in nodes of 4 slots: [4] [2, 1] -> 2 nodes of 4 tasks
    assert (directive(text, "nodes"), directive(text, "ntasks"), directive(text, "ntasks-per-node")) == ("2", "8", "4")
    assert parse_time(directive(text, "time")) == 300
    assert "export SLURM_EXACT=1" in text and 'run_one "$i" &' in text and 'wait "$pid"' in text
    assert manifest["packs"][0]["nodes"] == 2


def test_first_fit_decreasing_node_count():
    assert _first_fit_nodes([1, 2, 4], 4) == 2
    assert _first_fit_nodes([3, 3, 2, 2, 2], 4) == 4  # [3] [3] [2, 2] [2]
    assert _first_fit_nodes([], 8) == 0
    assert _first_fit_nodes([1] * 8, 8) == 1


def test_array_pack_selects_the_run_by_task_id_and_refuses_mixed_shapes(tmp_path):
    same = SPEC.replace("ranks: [1, 2, 4]", "ranks: [2]").replace("{1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2]}",
                                                                  "[1x1x1x2]").replace(
        "options:", "matrix: {seed: [1, 2, 3]}\noptions:")
    manifest = render(tmp_path, spec_text=same, pack=3, pack_mode="array")
    text = (tmp_path / "jobscripts/pk/pack-000.sh").read_text()
    assert directive(text, "array") == "0-2" and directive(text, "ntasks") == "2"
    assert parse_time(directive(text, "time")) == 300  # per array task
    assert directive(text, "output") == "jobscripts/pk/logs/pack-000-%a.out"
    assert 'selected=("${SLURM_ARRAY_TASK_ID:-0}")' in text
    assert len(manifest["packs"]) == 1
    shutil.rmtree(tmp_path / "jobscripts")
    with pytest.raises(ConfigError, match=r"--pack-mode array: pack-000 mixes run shapes .*pk-001-n2-1x1x1x2"):
        render(tmp_path, pack=3, pack_mode="array")


@pytest.mark.parametrize("site_name", ["polaris", "summit", "sge"])
def test_other_schedulers_pack_sequentially_and_refuse_the_slurm_modes(tmp_path, site_name):
    jobs = {"account": "proj1"} if site_name in ("polaris", "summit") else {}
    manifest = render(tmp_path, site=site_name, pack=2, **jobs)
    text = (tmp_path / manifest["packs"][0]["script"]).read_text()
    subprocess.run(["bash", "-n", str(tmp_path / manifest["packs"][0]["script"])], check=True)
    if site_name == "polaris":
        assert "#PBS -l walltime=00:10:00" in text and 'cd "${PBS_O_WORKDIR}"' in text
        assert 'job_id="${PBS_JOBID:-local}"' in text
    shutil.rmtree(tmp_path / "jobscripts")
    for mode in ("concurrent", "array"):
        with pytest.raises(ConfigError, match=rf"--pack-mode {mode} needs Slurm .* supports --pack-mode sequential"):
            render(tmp_path, site=site_name, pack=2, pack_mode=mode, **jobs)


def test_a_pack_longer_than_the_site_max_time_is_refused(tmp_path):
    profile = write(tmp_path, """\
        name: short
        scheduler: slurm
        launcher: srun
        ranks_per_node: 8
        max_time: "12"
        """, "short.yaml")
    site = load_site(profile)
    with pytest.raises(ConfigError, match=r"pack-000 \(sequential, 3 runs\) needs a time limit of 00:15:00, more "
                                          r"than site short's max_time 00:12:00"):
        render(tmp_path, site=site, pack=3)
    render(tmp_path, site=site, pack=3, pack_mode="concurrent")  # 5 minutes: fits
    shutil.rmtree(tmp_path / "jobscripts")
    render(tmp_path, site=site, pack=2)  # 10 minutes: fits
    shutil.rmtree(tmp_path / "jobscripts")
    with pytest.raises(ConfigError, match="time limit 00:15:00 is more than site short's max_time"):
        render(tmp_path, site=site, time="15")  # one run alone is checked too


def test_cli_flags_and_spec_and_site_settings(tmp_path):
    spec = write(tmp_path, SPEC.replace('job: {time: "00:05:00"}', 'job: {time: "00:05:00", pack: 2}'))
    done = fourd(["sweep", "render", spec, "--site", "slurm", "--out", "jobscripts/pk"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(json.loads((tmp_path / "jobscripts/pk/manifest.json").read_text())["packs"]) == 2
    done = fourd(["sweep", "render", spec, "--site", "slurm", "--pack", "3", "--pack-mode", "concurrent", "--force",
                  "--out", "jobscripts/pk"], tmp_path)
    packs = json.loads((tmp_path / "jobscripts/pk/manifest.json").read_text())["packs"]
    assert done.returncode == 0 and [(p["mode"], len(p["runs"])) for p in packs] == [("concurrent", 3)]
    done = fourd(["sweep", "render", spec, "--site", "slurm", "--pack", "1", "--force", "--out", "jobscripts/pk"],
                 tmp_path)
    assert done.returncode == 0 and "packs" not in json.loads((tmp_path / "jobscripts/pk/manifest.json").read_text())
    assert not list((tmp_path / "jobscripts/pk").glob("pack-*.sh"))
    site = write(tmp_path, """\
        name: arrays
        scheduler: slurm
        launcher: srun
        ranks_per_node: 8
        defaults: {pack: 4, pack_mode: array}
        """, "arrays.yaml")
    done = fourd(["sweep", "render", spec, "--site", site, "--pack-mode", "sequential", "--force", "--out",
                  "jobscripts/pk"], tmp_path)
    assert done.returncode == 0, done.stderr  # the spec's pack: 2 over the site's 4
    assert len(json.loads((tmp_path / "jobscripts/pk/manifest.json").read_text())["packs"]) == 2
    done = fourd(["sweep", "render", spec, "--site", "local", "--pack-mode", "array", "--out", "o2"], tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "needs Slurm" in done.stderr
    assert not (tmp_path / "o2").exists()
    done = fourd(["sweep", "render", spec, "--pack", "0"], tmp_path)
    assert done.returncode == 2 and "--pack" in done.stderr


def test_a_run_in_a_pack_is_tracked_by_its_exit_status_file(tmp_path):
    status = tmp_path / "r.status"
    record = {"job_id": "7", "state": "PENDING", "status_file": str(status)}
    assert record_state(record, {"7": "RUNNING"}) == "RUNNING"
    assert record_state(record, {"7": "PENDING"}) == "PENDING"
    assert record_state(record, {"7": "TIMEOUT"}) == "TIMEOUT"  # the pack ran out of time before this run ended
    assert record_state(record, {"7": "COMPLETED"}) == "FAILED"  # the pack ended, this run left no status
    status.write_text("0 7\n")
    assert record_state(record, {"7": "RUNNING"}) == "COMPLETED"  # done while the rest of its pack runs
    status.write_text("2 7\n")
    assert record_state(record, {"7": "COMPLETED"}) == "FAILED"
    status.write_text("")  # torn (never written so: it is renamed into place)
    assert record_state(record, {}) == "PENDING"


def test_pack_script_refuses_unknown_positions(tmp_path):
    render(tmp_path, site="local", pack=2)
    done = subprocess.run(["bash", "jobscripts/pk/pack-000.sh", "5"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "no run at position 5 (0 to 1)" in done.stderr
    assert not list((tmp_path / "jobscripts/pk/logs").glob("*.status"))


@pytest.mark.parametrize("site_name", ["slurm", "sge"])
def test_pack_scripts_pass_shellcheck(tmp_path, site_name):
    if shutil.which("shellcheck") is None:
        if IN_CI:
            pytest.fail("CI=true but shellcheck is not installed")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    modes = ["sequential", "concurrent"] if site_name == "slurm" else ["sequential"]
    scripts = []
    for mode in modes:
        (tmp_path / mode).mkdir()
        manifest = render(tmp_path / mode, site=site_name, pack=2, pack_mode=mode)
        scripts += [str(tmp_path / mode / p["script"]) for p in manifest["packs"]]
    done = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_local_sequential_pack_records_a_failed_run_and_goes_on(tmp_path):
    """Three runs in one local pack, the middle one failing at start (a memory limit below the model's
    estimate): the third still runs; each run has its own log and status; submit, status and collect
    report the failed one as failed and the others as done. Then ``submit --resubmit-failed --pack``
    packs just the failed run anew. Paths with shell syntax in them (``--out``, the spec's file name)
    must reach the script quoted: the canaries must not appear."""
    canary = "pwned"  # relative: everything runs in tmp_path
    out = f"o $(touch {canary}1) `touch {canary}2` it's\n;touch {canary}3"
    spec_text = SPEC.replace("ranks: [1, 2, 4]", "ranks: [1]").replace(
        "{1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2]}", "[1x1x1x1]").replace(
        "options:", "zip: {memory_limit: [0, 1KiB, 0], seed: [1, 2, 3]}\noptions:")
    spec = write(tmp_path, spec_text, name=f"s $(touch {canary}4)\ntouch {canary}5\n.yaml")
    done = fourd(["sweep", "render", spec, "--site", "local", "--python", sys.executable, "--pack", "3",
                  "--out", out, "--results-dir", "res"], tmp_path)
    assert done.returncode == 0, done.stderr
    done = fourd(["sweep", "submit", out], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 submitted, 1 failed" in done.stdout
    assert re.search(r"failed pk-001-n1-1x1x1x1 \(pack-000\): the run exited with status 2: .*memory", done.stdout)
    assert not list(tmp_path.glob("pwned*")), done.stdout
    logs = tmp_path / out / "logs"
    assert [(logs / f"pk-00{i}-n1-1x1x1x1.status").read_text().split()[0] for i in range(3)] == ["0", "2", "0"]
    assert "trace: res/pk-002-n1-1x1x1x1.h5" in (logs / "pk-002-n1-1x1x1x1.out").read_text()
    pack_log = (logs / "pack-000.out").read_text()
    assert pack_log.index("pk-001-n1-1x1x1x1 ended with exit status 2") < pack_log.index("pk-002-n1-1x1x1x1 started")
    assert "1 of 3 runs failed" in pack_log
    status = fourd(["sweep", "status", out], tmp_path)
    rows = {}
    for line in status.stdout.splitlines():  # the table's row of each run (the lines after it say what to run)
        if line.startswith("pk-") and not line.split()[0].endswith(":"):
            rows[line.split()[0]] = line.split()
    assert [rows[r][-2:] for r in sorted(rows)] == [["COMPLETED", "complete"], ["FAILED", "missing"],
                                                     ["COMPLETED", "complete"]]
    assert status.returncode == 1 and "2/3 traces complete, 1 jobs failed" in status.stdout
    hint = next(line for line in status.stdout.split("\npk-") if line.startswith("001") and "resubmit" in line)
    assert "run 'fourd-mpi' 'sweep' 'submit' '--resubmit-failed'" not in hint  # shlex.join: plain words unquoted
    assert "fourd-mpi sweep submit --resubmit-failed 'o $(touch pwned1)" in hint  # the path quoted for a shell
    collected = fourd(["sweep", "collect", out], tmp_path)
    assert collected.returncode == 1 and "no trace of pk-001-n1-1x1x1x1 (missing)" in collected.stderr
    assert "pk-000-n1-1x1x1x1" in collected.stdout and "pk-002-n1-1x1x1x1" in collected.stdout
    again = fourd(["sweep", "submit", out, "--resubmit-failed", "--pack", "2"], tmp_path)
    assert again.returncode == 1 and "0 submitted, 1 failed" in again.stdout, again.stdout
    assert again.stdout.count("skip ") == 2 and re.search(r"failed pk-001-n1-1x1x1x1 \(pack-\d{8}T\d{6}-000\)",
                                                          again.stdout)
    assert len(list((tmp_path / out).glob("pack-*-000.sh"))) == 1
    assert not list(tmp_path.glob("pwned*"))


def test_directives_refuse_a_script_directory_with_shell_syntax(tmp_path):
    """#SBATCH lines are not shell-quoted: a newline in --out would start a command in the script."""
    spec = write(tmp_path, SPEC)
    done = fourd(["sweep", "render", spec, "--site", "slurm", "--pack", "2", "--out", "o\ntouch pwned"], tmp_path)
    assert done.returncode == 2 and "--out" in done.stderr and done.stderr.count("\n") == 1
    assert not list(tmp_path.glob("o*"))


def test_a_partly_done_pack_is_resubmitted_with_only_its_remaining_runs(tmp_path):
    """Slurm and Grid Engine pass the positions to the pack script, a Slurm array takes ``--array=K,...``;
    PBS and LSF pass no arguments to a job script, so the remaining runs go as their own jobs."""
    from fourd_mpi.jobs.schedulers import get_scheduler
    from fourd_mpi.jobs.sweep import plan_launches

    manifest = render(tmp_path, pack=3)
    pack, runs = manifest["packs"][0], manifest["runs"]
    left = [runs[0], runs[2]]
    whole = plan_launches(get_scheduler("slurm"), pack, runs, runs)
    assert [(x.script, x.args, x.options, x.packed) for x in whole] == [(pack["script"], [], [], True)]
    (part,) = plan_launches(get_scheduler("slurm"), pack, runs, left)
    assert part.args == ["0", "2"] and part.runs == left
    (part,) = plan_launches(get_scheduler("slurm"), {**pack, "mode": "array"}, runs, left)
    assert part.options == ["--array=0,2"] and part.args == []
    for name in ("pbs", "lsf"):
        alone = plan_launches(get_scheduler(name), pack, runs, left)
        assert [(x.script, x.packed) for x in alone] == [(r["script"], False) for r in left]
