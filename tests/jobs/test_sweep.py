"""Sweep specs, site profiles and job scripts: validation, expansion, rendering, quoting, local runs.

The real-Slurm end-to-end test is tests/jobs/test_sweep_slurm.py. Here: every error names the
key and its line and leaves nothing written; scripts of every built-in site pass bash -n
and shellcheck and request consistent resources; hostile values cannot reach a shell.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.schedulers import parse_time
from fourd_mpi.jobs.sites import builtin_sites, load_site, retired_sites
from fourd_mpi.jobs.spec import load_spec
from fourd_mpi.jobs.sweep import build_manifest, write_sweep

IN_CI = os.environ.get("CI", "").lower() == "true"
BASE = """\
name: s1
study: weak
ranks: [1, 2, 4, 8]
grids: {1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2], 8: [1x2x2x2]}
model: {preset: gpt-tiny, batch: 8}
options: {steps: 3}
"""


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def fourd(args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env or mpi_env())


# -- expansion ------------------------------------------------------------------------------

def test_weak_batch_grows_with_ranks(tmp_path):
    runs = load_spec(write(tmp_path, BASE)).expand()
    assert [(r.ranks, str(r.grid), r.model.batch) for r in runs] == [
        (1, "1x1x1x1", 8), (2, "1x1x1x2", 16), (4, "1x1x2x2", 32), (8, "1x2x2x2", 64)]
    assert len({r.run_id for r in runs}) == 4


def test_warmup_is_checked_against_the_steps_of_each_run(tmp_path):
    """One option at a time is checked against the defaults, combinations per run: warmup 12 with
    steps 20 is fine although the default steps (10) is smaller; warmup 3 with steps 3 is refused."""
    runs = load_spec(write(tmp_path, BASE.replace("options: {steps: 3}", "options: {steps: 20, warmup: 12}"))).expand()
    assert len(runs) == 4
    with pytest.raises(ConfigError, match="--warmup 3 leaves no measured step of --steps 3"):
        load_spec(write(tmp_path, BASE.replace("options: {steps: 3}", "options: {steps: 3, warmup: 3}"))).expand()


def test_weak_growth_of_hidden_and_layers(tmp_path):
    hidden = load_spec(write(tmp_path, BASE + "weak: {grow: hidden}\n")).expand()
    # hidden ~ sqrt(ranks) in multiples of the head count (8): 64, 88 (90.5), 128, 184 (181)
    assert [r.model.hidden for r in hidden] == [64, 88, 128, 184]
    assert [r.model.ffn_hidden for r in hidden] == [256, 352, 512, 736]
    assert {r.model.batch for r in hidden} == {8}
    layers = load_spec(write(tmp_path, BASE.replace("[1x2x2x2]", "[8x1x1x1]") + "weak: {grow: layers}\n"))
    assert [r.model.layers for r in layers.expand()] == [2, 4, 8, 16]


def test_strong_keeps_the_problem(tmp_path):
    runs = load_spec(write(tmp_path, BASE.replace("study: weak", "study: strong"))).expand()
    assert {r.model.batch for r in runs} == {8}


def test_all_grids_matrix_zip_and_repeats(tmp_path):
    spec = load_spec(write(tmp_path, """\
        name: m
        study: strong
        ranks: [4]
        grids: all
        model: {preset: gpt-tiny, batch: 8}
        matrix: {overlap: [none, all], progress: [poll, none]}
        zip: {prefetch_depth: [1, 2], chunks: [2, 4]}
        repeats: 2
        """))
    runs = spec.expand()
    from fourd_mpi.core.grid import grid_factorizations
    from fourd_mpi.step.presets import model_problems, resolve_model

    valid = [g for g in grid_factorizations(4) if not model_problems(resolve_model("gpt-tiny", batch=8), g)]
    assert len(runs) == len(valid) * 2 * 2 * 2 * 2
    first = [dict(r.options) for r in runs[:8]]
    assert [(o["overlap"], o["progress"], o["prefetch-depth"], o["chunks"]) for o in first[::2]] == [
        ("none", "poll", 1, 2), ("none", "poll", 2, 4), ("none", "none", 1, 2), ("none", "none", 2, 4)]
    assert [r.repeat for r in runs[:2]] == [0, 1] and runs[0].run_id.endswith("-r0")
    argv = runs[3].run_argv("res")
    assert "--overlap=none" in argv and "--prefetch-depth=2" in argv and argv[-4:] == [
        "--run-id", runs[3].run_id, "--display", "lines"]


def test_several_models_and_auto_grids(tmp_path):
    spec = load_spec(write(tmp_path, """\
        name: two
        study: strong
        ranks: [8]
        grids: auto:3
        model: [{preset: gpt-tiny, batch: 8}, {preset: mlp-tiny}]
        """))
    runs = spec.expand()
    assert [r.model.name for r in runs] == ["gpt-tiny"] * 3 + ["mlp-tiny"] * 3
    from fourd_mpi.perf.tune import top_grids
    from fourd_mpi.step.presets import model_problems

    assert [r.grid for r in runs[:3]] == top_grids(runs[0].model, 8, 3)
    assert all(r.grid.size == 8 and not model_problems(r.model, r.grid) for r in runs)
    assert len({r.run_id for r in runs}) == 6


# -- errors: key and line, before anything is written ---------------------------------------

BAD_SPECS = [
    ("unknown key", BASE + "stepz: 3\n", 7, "unknown key 'stepz'"),
    ("bad study", BASE.replace("study: weak", "study: wide"), 2, "'wide' is not one of weak, strong"),
    ("injection in name", BASE.replace("name: s1", "name: 'x; rm -rf ~'"), 1, "letters, digits"),
    ("bad grid text", BASE.replace("[1x1x1x2]", "[1x1x2]"), 4, "grids.2[0]: '1x1x2': a grid is DxZxYxX"),
    ("grid of the wrong size", BASE.replace("2: [1x1x1x2]", "2: [1x1x2x2]"), 4,
     "none of the grids 1x1x2x2 has 2 ranks"),
    ("grid the model cannot use",
     BASE.replace("8: [1x2x2x2]", "8: [1x1x1x8]").replace("batch: 8", "batch: 8, heads: 4, hidden: 36"), 4,
     "not divisible"),
    ("unknown preset", BASE.replace("preset: gpt-tiny", "preset: gpt-huge"), 5, "'gpt-huge' is not one of"),
    ("unknown run option", BASE.replace("steps: 3", "stepps: 3"), 6, "unknown option 'stepps'"),
    ("bad option value", BASE + "matrix:\n  overlap: [none, al]\n", 8, "matrix.overlap[1]"),
    ("option owned by the sweep", BASE.replace("steps: 3", "gx: 2"), 6, "set by the sweep"),
    ("duplicate key", BASE + "ranks: [2]\n", 7, "ranks given twice (first at line 3)"),
    ("unequal zip", BASE + "zip: {chunks: [2, 4], prefetch_depth: [1]}\n", 7, "same length"),
    ("rank count with no grid entry", BASE.replace("8: [1x2x2x2]}", "16: [1x2x2x4]}"), 4, "16 ranks is not in ranks"),
    ("not a mapping", "- 1\n- 2\n", None, "must be a YAML mapping"),
    ("not YAML", BASE + "matrix: {overlap: [none\n", 8, "flow sequence at line 7"),
    ("weak rule on a strong study", BASE.replace("study: weak", "study: strong") + "weak: {grow: batch}\n", 7,
     "weak-scaling studies only"),
    ("ranks not a multiple for weak", BASE.replace("ranks: [1, 2, 4, 8]", "ranks: [2, 3]").replace(
        "grids: {1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2], 8: [1x2x2x2]}", "grids: all"), 3, "not a multiple"),
]


@pytest.mark.parametrize("why,text,line,message", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_names_key_and_line(tmp_path, why, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert message in str(err.value)
    if line is not None:
        assert str(err.value).startswith(f"{path}:{line}:"), str(err.value)
    # the CLI says the same in one line, exit 2, and writes nothing
    done = fourd(["sweep", "render", path, "--site", "slurm"], tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "results").exists()


def test_unknown_site_and_bad_site_file(tmp_path):
    spec = write(tmp_path, BASE)
    done = fourd(["sweep", "plan", spec, "--site", "hal9000"], tmp_path)
    assert done.returncode == 2 and "unknown site 'hal9000': choose one of" in done.stderr
    site = write(tmp_path, "name: mine\nscheduler: slurm\nlauncher: srun\nranks_per_node: 4\n"
                           "env: {X: '1'}\ndefaults: {time: '1:00:00', account: 'a b'}\n", "mine.yaml")
    done = fourd(["sweep", "plan", spec, "--site", site], tmp_path)
    assert done.returncode == 2 and f"{site}:6: defaults.account" in done.stderr, done.stderr


def test_ranks_must_fill_nodes_and_accounts_required(tmp_path):
    spec = write(tmp_path, BASE.replace("[1, 2, 4, 8]", "[1, 2, 4, 8, 6]").replace(
        "8: [1x2x2x2]}", "8: [1x2x2x2], 6: [6x1x1x1]}").replace("study: weak", "study: strong").replace(
        "batch: 8", "batch: 24"))
    done = fourd(["sweep", "plan", spec, "--site", "perlmutter", "--account", "m1"], tmp_path)
    assert done.returncode == 2 and "6 ranks do not fill nodes of 4 ranks" in done.stderr, done.stderr
    done = fourd(["sweep", "plan", write(tmp_path, BASE), "--site", "frontier"], tmp_path)
    assert done.returncode == 2 and "site frontier needs job.account" in done.stderr


def test_plan_lists_nodes_and_memory(tmp_path):
    done = fourd(["sweep", "plan", write(tmp_path, BASE), "--site", "perlmutter", "--account", "m1"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "4 runs on site perlmutter" in lines[0] and "memory/rank" in lines[1]
    last = lines[-1].split()
    assert last[2:6] == ["8", "2", "4", "1x2x2x2"] and last[-1] == "MiB"
    data = json.loads(fourd(["sweep", "plan", write(tmp_path, BASE), "--format", "json"], tmp_path).stdout)
    assert [r["memory_per_rank"] > 0 for r in data["runs"]] == [True] * 4


# -- rendered scripts -----------------------------------------------------------------------

def _render_site(tmp_path, site_name, spec_text=BASE):
    spec = load_spec(write(tmp_path, spec_text))
    site = load_site(site_name)
    if "account" in site.requires:
        spec.job["account"] = "proj1"
    if site_name == "summit":
        spec.job["ranks_per_node"] = 2
    out = f"jobscripts/{site_name}"
    manifest = build_manifest(spec, site, "spec.yaml", out)
    write_sweep(manifest, spec, site, str(tmp_path / out))
    return manifest


def _directive(text, pattern):
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, (pattern, text)
    return found[0]


@pytest.mark.parametrize("site_name", builtin_sites() + retired_sites())
def test_scripts_are_valid_shell_with_consistent_resources(tmp_path, site_name):
    manifest = _render_site(tmp_path, site_name)
    site = load_site(site_name)
    for run in manifest["runs"]:
        path = tmp_path / run["script"]
        text = path.read_text()
        assert os.access(path, os.X_OK) and text.startswith("#!/bin/bash\n")
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        n, nodes, per_node = run["ranks"], run["nodes"], run["ranks_per_node"]
        assert nodes * per_node == n
        if site.uses_gpus:
            assert per_node <= site.gpus_per_node  # one GPU per rank
        command = text.strip().splitlines()[-1]
        assert f"--run-id {run['run_id']}" in command and f"--gx {run['grid'].split('x')[3]}" in command
        if site.scheduler == "slurm":
            assert int(_directive(text, r"^#SBATCH --nodes=(\d+)$")) == nodes
            assert int(_directive(text, r"^#SBATCH --ntasks=(\d+)$")) == n
            assert int(_directive(text, r"^#SBATCH --ntasks-per-node=(\d+)$")) == per_node
            limit = _directive(text, r"^#SBATCH --time=(\S+)$")
            assert parse_time(limit) == run["time_seconds"]
            if site.launcher == "srun":
                assert f" -N {nodes} -n {n} --ntasks-per-node={per_node}" in command
            else:  # mpiexec inside the allocation: hydra places ranks as the allocation says
                assert f"mpiexec {' '.join(site.launcher_args)} -n {n} ".replace("  ", " ") in command
            if site.uses_gpus and "gpus-per-node" in dict(site.directives):
                assert int(_directive(text, r"^#SBATCH --gpus-per-node=(\d+)$")) * nodes >= n
        elif site.scheduler == "pbs":
            assert int(_directive(text, r"^#PBS -l select=(\d+)")) == nodes
            assert re.fullmatch(r"\d\d:[0-5]\d:[0-5]\d", _directive(text, r"^#PBS -l walltime=(\S+)$"))
            assert f"mpiexec -n {n} --ppn {per_node} " in command
            assert "gpu_affinity.sh" in command and (tmp_path / run["script"]).with_name("gpu_affinity.sh").exists()
        elif site.scheduler == "lsf":
            hours, minutes = map(int, _directive(text, r"^#BSUB -W (\d+):(\d\d)$"))
            assert (hours * 60 + minutes) * 60 >= run["time_seconds"] and minutes < 60
            if site.launcher in ("jsrun", "lrun"):  # CSM: whole nodes
                assert int(_directive(text, r"^#BSUB -nnodes (\d+)$")) == nodes and "#BSUB -n " not in text
            else:  # plain LSF: slots, a fixed number per host
                assert int(_directive(text, r"^#BSUB -n (\d+)$")) == n and "-nnodes" not in text
                assert int(_directive(text, r'^#BSUB -R "span\[ptile=(\d+)\]"$')) == per_node
                assert f"mpiexec -n {n} " in command
            if site.launcher == "jsrun":
                assert f"jsrun -n {n} -a 1 -c 7 -g 1 -b packed:7 -r {per_node} --smpiargs=-gpu " in command
            elif site.launcher == "lrun":
                assert f"lrun -N {nodes} -T {per_node} --smpiargs=-gpu " in command
        elif site.scheduler == "sge":
            assert int(_directive(text, r"^#\$ -pe mpi (\d+)$")) == n
            assert re.fullmatch(r"\d\d:[0-5]\d:[0-5]\d", _directive(text, r"^#\$ -l h_rt=(\S+)$"))
            assert f"mpiexec -n {n} " in command
        else:
            assert "#SBATCH" not in text and f"mpiexec -n {n} " in command


@pytest.mark.parametrize("site_name", builtin_sites() + retired_sites())
def test_scripts_pass_shellcheck(tmp_path, site_name):
    if shutil.which("shellcheck") is None:
        if IN_CI:
            pytest.fail("CI=true but shellcheck is not installed")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    manifest = _render_site(tmp_path, site_name)
    scripts = [str(tmp_path / r["script"]) for r in manifest["runs"]]
    scripts += [str(p) for p in (tmp_path / "jobscripts" / site_name).glob("gpu_affinity.sh")]
    done = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_examples_are_up_to_date():
    done = subprocess.run([sys.executable, "jobscripts/regenerate.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, env=mpi_env())
    assert done.returncode == 0, done.stdout + done.stderr


def test_hostile_values_are_quoted_or_rejected(tmp_path):
    """Values that reach the shell are quoted: running the script must not run the payload."""
    pwned = tmp_path / "pwned"
    site = write(tmp_path, f"""\
        name: evil
        scheduler: local
        launcher: mpiexec
        ranks_per_node: 8
        env: {{PAYLOAD: "$(touch {pwned}1); `touch {pwned}2`", QUOTE: "it's"}}
        modules: []
        """, "evil.yaml")
    spec = write(tmp_path, BASE.replace("name: s1", "name: s1") + textwrap.dedent(f"""\
        job:
          python: "/nonexistent/py thon; touch {pwned}3"
        """))
    done = fourd(["sweep", "render", spec, "--site", site, "--out", "jobscripts/s1"], tmp_path)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "jobscripts" / "s1" / "s1-000-n1-1x1x1x1.sh"
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, env=env)
    # the quoted python is not found: the job's check says so in one line, before any launcher starts
    assert run.returncode == 127 and f"fourd-mpi job: /nonexistent/py thon; touch {pwned}3 not found" in run.stderr
    assert not list(tmp_path.glob("pwned*"))
    assert "export QUOTE='it'\"'\"'s'" in script.read_text()
    for option in (["--account", "x;rm -rf ~"], ["--partition", "$(id)"], ["--time", "10; reboot"]):
        done = fourd(["sweep", "render", spec, "--site", "slurm", "--out", "o2", *option], tmp_path)
        assert done.returncode == 2 and "error" in done.stderr and not (tmp_path / "o2").exists()


def test_render_writes_beside_the_traces_by_default(tmp_path):
    """No --out: results/SWEEP/SITE/jobs, next to the traces (--results-dir moves both), never jobscripts/."""
    spec = write(tmp_path, BASE)
    done = fourd(["sweep", "render", spec, "--site", "slurm"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "to results/s1/slurm/jobs/ (submit with: fourd-mpi sweep submit results/s1/slurm/jobs)" in done.stdout
    manifest = json.loads((tmp_path / "results/s1/slurm/jobs/manifest.json").read_text())
    assert manifest["script_dir"] == "results/s1/slurm/jobs" and manifest["results_dir"] == "results/s1/slurm"
    assert not (tmp_path / "jobscripts").exists()
    assert fourd(["sweep", "render", spec, "--results-dir", "elsewhere"], tmp_path).returncode == 0
    assert (tmp_path / "elsewhere/jobs/manifest.json").exists()


def test_default_outputs_are_git_ignored_in_a_checkout():
    """What runs, sweeps, bench collectives and trace merges write by default under a checkout is ignored by git;
    the committed samples, baselines, benchmarks and example job scripts are not."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = ["results/20261128-010000-run.h5", "results/run.parts/part000000.h5", "results/index.jsonl",
               "results/run.ranks/rank-0.h5", "results/.run.h5.tmp-12-ab", "results/profiles/host.yaml",
               "results/s1/local/s1-000-n1-1x1x1x1.h5", "results/s1/local/index.jsonl",
               "results/s1/local/jobs/s1-000-n1-1x1x1x1.sh", "results/s1/local/jobs/logs/s1-000.out",
               "results/s1/local/run.parts/part000000.h5", "jobscripts/s1/manifest.json",
               "jobscripts/examples/local/logs/x.out", "results/benchmarks/big.parts/part000000.h5"]
    kept = ["results/benchmarks/new-benchmark.txt", "results/samples/new.h5", "results/baselines/new.h5",
            "jobscripts/examples/local/new.sh", "jobscripts/new-spec.yaml", "results/.gitkeep"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *ignored, *kept], cwd=REPO, capture_output=True,
                          text=True)
    assert done.stdout.split() == ignored, done.stdout
    tracked_but_ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=REPO,
                                         capture_output=True, text=True).stdout
    assert tracked_but_ignored == ""


def test_render_refuses_to_overwrite(tmp_path):
    spec = write(tmp_path, BASE)
    assert fourd(["sweep", "render", spec], tmp_path).returncode == 0
    done = fourd(["sweep", "render", spec], tmp_path)
    assert done.returncode == 2 and "--force" in done.stderr
    (tmp_path / "results/s1/local/jobs/jobs.json").write_text("{}")
    assert fourd(["sweep", "render", spec, "--force"], tmp_path).returncode == 0
    assert (tmp_path / "results/s1/local/jobs/jobs.json").exists()


def test_local_site_submit_status_collect(tmp_path):
    """The local site runs the jobs one after another under mpiexec; submit never runs one twice."""
    spec = write(tmp_path, BASE.replace("ranks: [1, 2, 4, 8]", "ranks: [1, 3]").replace(
        "grids: {1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2], 8: [1x2x2x2]}", "grids: {1: [1x1x1x1], 3: [3x1x1x1]}"))
    assert fourd(["sweep", "render", spec, "--site", "local", "--python", sys.executable], tmp_path).returncode == 0
    done = fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path)
    assert done.returncode == 0 and "2 submitted" in done.stdout, done.stdout + done.stderr
    listed = fourd(["results", "list", "--format", "json"], tmp_path)  # the sweep's runs, in results list
    assert listed.returncode == 0, listed.stderr
    assert sorted(e["run_id"] for e in json.loads(listed.stdout)) == ["s1-000-n1-1x1x1x1", "s1-001-n3-3x1x1x1"]
    status = fourd(["sweep", "status", "results/s1/local/jobs"], tmp_path)
    assert "2/2 traces complete, 0 jobs failed" in status.stdout and status.stdout.count("COMPLETED") == 2
    again = fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path)
    assert "0 submitted" in again.stdout
    os.remove(tmp_path / "results/s1/local/s1-001-n3-3x1x1x1.h5")  # each site keeps its own results directory
    again = fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path)  # finished job, trace gone: not resubmitted
    assert "0 submitted" in again.stdout and "job local-1 completed" in again.stdout
    collected = fourd(["sweep", "collect", "results/s1/local/jobs", "--into", "gathered"], tmp_path)
    assert collected.returncode == 1 and "no trace of s1-001-n3-3x1x1x1 (missing)" in collected.stderr
    assert (tmp_path / "gathered/s1-000-n1-1x1x1x1.h5").exists() and "s1-000-n1-1x1x1x1" in collected.stdout


def test_trace_state_reads_the_status_from_the_header(tmp_path):
    import h5py

    from fourd_mpi.jobs.sweep import trace_state

    partial = tmp_path / "p.h5"
    shutil.copy(REPO / "results" / "samples" / "weak-2.h5", partial)
    with h5py.File(partial, "r+") as h5:
        h5.attrs["status"] = "partial"
    assert trace_state(str(REPO / "results" / "samples" / "weak-2.h5")) == "complete"
    assert trace_state(str(partial)) == "partial"
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    assert trace_state(str(tmp_path / "junk.h5")) == "damaged"
    (tmp_path / "r.ranks").mkdir()
    assert trace_state(str(tmp_path / "r.h5")) == "recoverable"  # no live rank holds it
    assert trace_state(str(tmp_path / "none.h5")) == "missing"


def test_a_spec_file_name_cannot_inject_commands(tmp_path):
    """The spec's path goes into a comment line of every job script: a newline in it must not end the comment."""
    pwned = tmp_path / "pwned"
    spec = write(tmp_path, BASE, name="x\ntouch pwned\n#.yaml")  # run from tmp_path: would create pwned
    done = fourd(["sweep", "render", spec, "--site", "local"], tmp_path)
    assert done.returncode == 0, done.stderr
    scripts = sorted((tmp_path / "results/s1/local/jobs").glob("*.sh"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        assert not any(line.startswith("touch") for line in text.splitlines())
        assert "x\\ntouch" in text  # the newline is shown as its escape, inside the comment
    subprocess.run(["bash", "-n", str(scripts[0])], check=True)  # still a valid script
    subprocess.run(["bash", str(scripts[0])], cwd=tmp_path, capture_output=True, timeout=120)
    assert not pwned.exists()


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """Nested aliases multiply (9^9 nodes from about 450 bytes): refused with one line, not expanded."""
    levels = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        prev, name = chr(96 + i), chr(97 + i)
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    spec = write(tmp_path, BASE + "\n".join(["bomb:"] + ["  " + line for line in levels]) + "\n")
    done = fourd(["sweep", "plan", spec], tmp_path, timeout=60)
    assert done.returncode == 2
    assert "alias bomb" in done.stderr and len(done.stderr.strip().splitlines()) == 1


# -- submission is transactional -------------------------------------------

TWO_RUNS = BASE.replace("ranks: [1, 2, 4, 8]", "ranks: [1, 2]").replace(
    "grids: {1: [1x1x1x1], 2: [1x1x1x2], 4: [1x1x2x2], 8: [1x2x2x2]}", "grids: {1: [1x1x1x1], 2: [1x1x1x2]}")


def test_two_concurrent_submits_launch_each_run_once(tmp_path):
    """Two ``sweep submit`` at once on the local site. Before: each ran every job (the second run of a
    run id failed on the existing trace and marked a complete trace FAILED; jobs.json was rewritten by
    both). Now each run is claimed under a lock in jobs.json before it is launched."""
    spec = write(tmp_path, TWO_RUNS)
    assert fourd(["sweep", "render", spec, "--site", "local", "--python", sys.executable], tmp_path).returncode == 0
    cmd = [sys.executable, "-m", "fourd_mpi", "sweep", "submit", "results/s1/local/jobs"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    text = "".join(out for out, _ in outs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert text.count("submitted s1-") == 2, text  # each run launched once, by one of the two
    jobs = json.loads((tmp_path / "results/s1/local/jobs/jobs.json").read_text())
    assert sorted(j["state"] for j in jobs.values()) == ["COMPLETED", "COMPLETED"], jobs
    status = fourd(["sweep", "status", "results/s1/local/jobs"], tmp_path)
    assert status.returncode == 0 and "2/2 traces complete, 0 jobs failed" in status.stdout, status.stdout
    assert not list((tmp_path / "results/s1/local/jobs").glob(".jobs.json.*"))  # no temp file left


def test_a_job_that_fails_at_once_is_reported_failed(tmp_path):
    """A job whose interpreter does not exist (mpiexec: execvp error). Before: "2 submitted", exit 0,
    and status exited 0 while saying "2 jobs failed". Now submit names each failure and exits 1, the
    record says why, and status exits 1."""
    spec = write(tmp_path, TWO_RUNS)
    assert fourd(["sweep", "render", spec, "--site", "local", "--python", "/nonexistent/python3"],
                 tmp_path).returncode == 0
    done = fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 submitted, 2 failed" in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("fourd-mpi: error: sweep s1: ")]
    assert len(errors) == 2 and all("the job exited with status" in line for line in errors), done.stderr
    jobs = json.loads((tmp_path / "results/s1/local/jobs/jobs.json").read_text())
    assert all(j["state"] == "FAILED" and j["returncode"] != 0 and j["error"] for j in jobs.values())
    status = fourd(["sweep", "status", "results/s1/local/jobs"], tmp_path)
    assert status.returncode == 1 and "2 jobs failed" in status.stdout
    again = fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path)  # failed runs wait for --resubmit-failed
    assert again.returncode == 0 and "0 submitted" in again.stdout


def test_a_claim_whose_submitter_died_reads_as_failed(tmp_path):
    """A submit killed between its claim and the outcome (Ctrl-C, a crash) leaves a claim; once its
    process is gone the run reads FAILED (resubmittable), not submitted forever."""
    from fourd_mpi.jobs.sweep import load_manifest, run_states, save_jobs, sweep_lock

    spec = write(tmp_path, TWO_RUNS)
    assert fourd(["sweep", "render", spec, "--site", "local"], tmp_path).returncode == 0
    sweep_dir = str(tmp_path / "results/s1/local/jobs")
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    with sweep_lock(sweep_dir):
        save_jobs(sweep_dir, {"s1-000-n1-1x1x1x1": {"state": "SUBMITTING", "host": socket.gethostname(),
                                                    "pid": dead.pid, "job_id": None},
                              "s1-001-n2-1x1x1x2": {"state": "SUBMITTING", "host": socket.gethostname(),
                                                    "pid": os.getpid(), "job_id": None}})
    from fourd_mpi.jobs.sweep import load_jobs

    rows = run_states(load_manifest(sweep_dir), load_jobs(sweep_dir))
    assert [r["state"] for r in rows] == ["FAILED", "SUBMITTING"]


def test_a_sweep_left_by_an_interrupted_submit_converges(tmp_path):
    """What an interrupted ``sweep submit`` leaves: a run whose trace is complete but whose job is recorded
    FAILED, and a run whose job died with its per-rank files (no trace). Before: status exited 1 forever,
    said "spooling", named no command, and --resubmit-failed skipped the second run. Now status takes each
    state from the trace and says what to run; --resubmit-failed runs exactly the run without a complete
    trace (its earlier files set aside); then status exits 0."""
    spec = write(tmp_path, TWO_RUNS)
    assert fourd(["sweep", "render", spec, "--site", "local", "--python", sys.executable], tmp_path).returncode == 0
    assert fourd(["sweep", "submit", "results/s1/local/jobs"], tmp_path).returncode == 0
    jobs_path = tmp_path / "results/s1/local/jobs/jobs.json"
    jobs = json.loads(jobs_path.read_text())
    first, second = sorted(jobs)
    jobs[first]["state"] = jobs[second]["state"] = "FAILED"
    jobs_path.write_text(json.dumps(jobs))
    manifest = json.loads((tmp_path / "results/s1/local/jobs/manifest.json").read_text())
    trace = tmp_path / next(r["trace"] for r in manifest["runs"] if r["run_id"] == second)
    trace.unlink()
    killed = subprocess.run([sys.executable, "-m", "fourd_mpi", "run", "--steps", "4", "--results-dir",
                             str(trace.parent), "--run-id", second, "--display", "quiet", "--inject-fault", "0:2:kill"],
                            capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=300)
    assert killed.returncode == -9, killed.stderr
    spool = str(trace)[:-3] + ".ranks"
    status = fourd(["sweep", "status", "results/s1/local/jobs"], tmp_path)
    assert status.returncode == 1 and "1/2 traces complete, 1 jobs failed" in status.stdout, status.stdout
    assert "recoverable" in status.stdout and "spooling" not in status.stdout, status.stdout
    assert f"run fourd-mpi trace recover {shlex.quote(os.path.relpath(spool, tmp_path))} " in status.stdout or \
           f"run fourd-mpi trace recover {shlex.quote(str(spool))} " in status.stdout, status.stdout
    row = next(line for line in status.stdout.splitlines() if line.startswith(first))
    assert "COMPLETED" in row and "complete" in row, row
    again = fourd(["sweep", "submit", "--resubmit-failed", "results/s1/local/jobs"], tmp_path)
    assert again.returncode == 0 and "1 submitted" in again.stdout, again.stdout + again.stderr
    assert f"skip {first}: trace complete" in again.stdout and f"submitted {second}" in again.stdout, again.stdout
    assert "superseded" in again.stdout
    status = fourd(["sweep", "status", "results/s1/local/jobs"], tmp_path)
    assert status.returncode == 0 and "2/2 traces complete, 0 jobs failed" in status.stdout, status.stdout
