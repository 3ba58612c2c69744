"""Site profiles checked against the centres' own pages: each site's rendered job
script carries the idioms its centre documents, and each site file states its sources and choices.

What each centre documents (the pages are in each file's ``documentation:``):

- NERSC Perlmutter: ``-c 32 --cpu-bind=cores``; mpi4py built with ``cc -target-accel=nvidia80`` so the GTL
  library is linked for ``MPICH_GPU_SUPPORT_ENABLED=1``. GPUs: not NERSC's ``--gpus-per-task=1
  --gpu-bind=map_gpu:0,1,2,3``, which breaks Cray MPICH's intra-node GPU IPC (E3SM 4834, jdftx 252, WarpX
  3349/6382): ``--gpus-per-node=4`` and the wrapper that gives local rank r GPU ``3 - r`` (WarpX 5683), with
  ``MPICH_OFI_NIC_POLICY=GPU``.
- ALCF Polaris: ``mpiexec --ppn --depth --cpu-bind depth`` and ALCF's wrapper that gives local rank r
  GPU ``3 - r % 4`` (Polaris's GPU 3 is nearest cores 0-7).
- OLCF Frontier: ``-c 7``, rocm/7.0.2, ROCM_HOME at run time; the GCD that ``--gpu-bind=closest`` gives each
  L3 region (the guide's NUMA note: 4, 5, 2, 3, 6, 7, 0, 1) set by the wrapper as ROCR_VISIBLE_DEVICES.
- CSCS Alps: 4 ranks per node, ``-c 72``, the uenv by ``#SBATCH --uenv/--view``; GPU = SLURM_LOCALID (CSCS's
  equivalent of ``--gpus-per-task=1``) set by the wrapper.
- ALCF Polaris' queue by node count (debug 1-2 nodes, debug-scaling up to 10, prod 10-496) and ``module load conda;
  conda activate base``; CSCS Alps' venv on a uenv view (``unset PYTHONPATH``, ``PYTHONUSERBASE`` = the view's
  root); OLCF Frontier's modules pinned as the CuPy guide pins them (``cpe/26.03`` among them).
- Summit (historic, out of the default list): ``jsrun -a1 -c7 -g1 -b packed:7``; a generic LSF cluster: ``bsub -n`` with
  ``-R "span[ptile=N]"``.

The scripts cannot be submitted here (no Cray, PBS or LSF); the wrapper script runs for real, and under the
local Slurm (srun sets SLURM_LOCALID) where Debian's Slurm is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap

import pytest
from conftest import REPO

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.sites import builtin_sites, load_site, retired_sites
from fourd_mpi.jobs.spec import load_spec
from fourd_mpi.jobs.sweep import build_manifest, write_sweep

SPEC = """\
name: s1
study: weak
ranks: [4, 8]
grids: {4: [1x1x2x2], 8: [1x2x2x2]}
model: {preset: gpt-tiny, batch: 8}
options: {steps: 3}
"""
#: sites of real machines, and the generic Slurm and LSF ones: each states these in its file's comments
CHECKED_SITES = ("perlmutter", "frontier", "polaris", "alps", "lassen", "summit", "slurm", "lsf")
GPU_SITES = ("perlmutter", "frontier", "polaris", "alps", "lassen", "summit")


def render(tmp_path, site_name):
    """The scripts of an 8-rank (2 nodes where a node has 4 ranks) and a 4-rank run, by script name."""
    (tmp_path / f"{site_name}.spec.yaml").write_text(SPEC)
    spec = load_spec(str(tmp_path / f"{site_name}.spec.yaml"))
    site = load_site(site_name)
    if "account" in site.requires:
        spec.job["account"] = "proj1"
    if site_name in ("summit", "lsf"):
        spec.job["ranks_per_node"] = 4
    # python3 as the job's PATH has it (a real render names the rendering interpreter: docs/placement.md section 3)
    manifest = build_manifest(spec, site, "spec.yaml", f"jobs/{site_name}", python="python3")
    write_sweep(manifest, spec, site, str(tmp_path / "jobs" / site_name))
    return {r["ranks"]: (tmp_path / r["script"]).read_text() for r in manifest["runs"]}


def launch_line(text):
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("site_name", CHECKED_SITES)
def test_site_file_cites_its_pages_and_states_its_choices(site_name):
    site = load_site(site_name)
    assert site.documentation and all(url.startswith("https://") for url in site.documentation)
    header = "".join(line for line in open(site.source) if line.startswith("#"))
    assert "CPU binding" in header and "mpi4py" in header
    if site_name in GPU_SITES:
        assert site.uses_gpus and "GPU binding" in header and "GPU-aware MPI" in header


#: the GPU of node-local rank r on each site with a GPU affinity wrapper, from the sources in the site files
CLOSEST_GPU = {"perlmutter": [3, 2, 1, 0], "polaris": [3, 2, 1, 0], "alps": [0, 1, 2, 3],
               "frontier": [4, 5, 2, 3, 6, 7, 0, 1]}


def run_wrapper(wrapper, environ):
    """What the wrapper exports: run it with ``environ`` around a command that prints the environment."""
    done = subprocess.run([str(wrapper), "env"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **environ})
    return done.returncode, dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line), done.stderr


def test_perlmutter_keeps_cuda_ipc_and_gives_each_rank_its_closest_gpu(tmp_path):
    text = render(tmp_path, "perlmutter")[8]
    assert "#SBATCH --constraint=gpu" in text and "#SBATCH --cpus-per-task=32" in text
    assert "#SBATCH --gpus-per-node=4" in text.splitlines()
    assert "module load craype-accel-nvidia80" in text and "export MPICH_GPU_SUPPORT_ENABLED=1" in text
    assert "export MPICH_OFI_NIC_POLICY=GPU" in text.splitlines()
    line = launch_line(text)
    assert line.startswith("srun --cpu-bind=cores -N 2 -n 8 --ntasks-per-node=4 -c 32 jobs/perlmutter/gpu_affinity.sh "
                           "python3 -m fourd_mpi run --backend cupy ")
    assert "--gpus-per-task" not in text and "--gpu-bind" not in text and "MPICH_GPU_IPC_ENABLED" not in text
    wrapper = tmp_path / "jobs" / "perlmutter" / "gpu_affinity.sh"
    seen = []
    for local_rank in range(8):
        rc, env, err = run_wrapper(wrapper, {"SLURM_LOCALID": str(local_rank)})
        assert rc == 0, err
        seen.append(int(env["CUDA_VISIBLE_DEVICES"]))
    assert seen == [3, 2, 1, 0] * 2  # WarpX PR 5683: GPU 3 is nearest cores 0-15, where local rank 0 runs
    source = open(load_site("perlmutter").source).read()
    assert 'MPICC="cc -target-accel=nvidia80 -shared" pip install' in source  # GTL linked
    for cited in ("E3SM-Project/E3SM issue 4834", "shankar1729/jdftx issue 252", "BLAST-WarpX/warpx PR 3349",
                  "BLAST-WarpX/warpx issue 6382", "BLAST-WarpX/warpx PR 5683"):
        assert cited in source, cited


@pytest.mark.parametrize("site_name", sorted(CLOSEST_GPU))
def test_gpu_wrapper_maps_each_local_rank_to_its_closest_gpu(tmp_path, site_name):
    site = load_site(site_name)
    render(tmp_path, site_name)
    wrapper = tmp_path / "jobs" / site_name / "gpu_affinity.sh"
    order = CLOSEST_GPU[site_name]
    assert list(site.gpu_order) == order and sorted(order) == list(range(site.gpus_per_node))
    variable = "ROCR_VISIBLE_DEVICES" if site_name == "frontier" else "CUDA_VISIBLE_DEVICES"
    for local_rank in range(2 * len(order)):
        rc, env, err = run_wrapper(wrapper, {site.local_rank_variable: str(local_rank)})
        assert rc == 0, err
        assert env[variable] == str(order[local_rank % len(order)])
    rc, env, err = run_wrapper(wrapper, {})  # not under the launcher: one line naming the variable, no command
    assert rc != 0 and site.local_rank_variable in err and "PATH" not in env
    rc, env, err = run_wrapper(wrapper, {site.local_rank_variable: "1; touch pwned"})
    assert rc == 2 and "not a rank number" in err and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("site_name", builtin_sites())
def test_no_site_binds_gpus_per_task_under_gpu_aware_cray_mpich(tmp_path, site_name):
    """--gpus-per-task / --gpu-bind make a GPU cgroup per task: Cray MPICH's GPU IPC then fails (docs/sites.md)."""
    site = load_site(site_name)
    if dict(site.env).get("MPICH_GPU_SUPPORT_ENABLED") != "1":
        return
    scripts = render(tmp_path, site_name).values()
    for text in scripts:
        assert "--gpus-per-task" not in text and "--gpu-bind" not in text and "--ntasks-per-gpu" not in text
    if site.scheduler == "slurm":
        assert site.gpu_affinity_script and dict(site.directives).get("gpus-per-node") == str(site.gpus_per_node)


@pytest.mark.parametrize("args, env, message", [
    ('["--gpus-per-task=1"]', '{MPICH_GPU_SUPPORT_ENABLED: "1"}', "breaks Cray MPICH's intra-node GPU IPC"),
    ('["--gpu-bind=closest"]', '{MPICH_GPU_SUPPORT_ENABLED: "1"}', "breaks Cray MPICH's intra-node GPU IPC"),
    ('["--ntasks-per-gpu=1"]', '{MPICH_GPU_SUPPORT_ENABLED: "1"}', "breaks Cray MPICH's intra-node GPU IPC"),
])
def test_site_file_refuses_per_task_gpu_binding_with_gpu_aware_cray_mpich(tmp_path, args, env, message):
    path = tmp_path / "mysite.yaml"
    path.write_text(f"name: mysite\nscheduler: slurm\nlauncher: srun\nranks_per_node: 4\ngpus_per_node: 4\n"
                    f"launcher_args: {args}\nenv: {env}\n")
    with pytest.raises(ConfigError) as err:
        load_site(str(path))
    assert message in str(err.value) and "gpu_affinity_script" in str(err.value)
    # allowed: IPC switched off on purpose, --gpu-bind=none, or no GPU-aware MPICH
    for ok_args, ok_env in ((args, '{MPICH_GPU_SUPPORT_ENABLED: "1", MPICH_GPU_IPC_ENABLED: "0"}'),
                            ('["--gpu-bind=none"]', env), (args, "{}")):
        path.write_text(f"name: mysite\nscheduler: slurm\nlauncher: srun\nranks_per_node: 4\ngpus_per_node: 4\n"
                        f"launcher_args: {ok_args}\nenv: {ok_env}\n")
        load_site(str(path))


@pytest.mark.parametrize("extra, message", [
    ("gpu_affinity_script: true\ngpu_map: [0, 1, 2]", "must list each of the node's 4 GPUs"),
    ("gpu_affinity_script: true\ngpu_map: [0, 1, 1, 3]", "must list each of the node's 4 GPUs"),
    ("gpu_map: [0, 1, 2, 3]", "need gpu_affinity_script: true"),
    ("gpu_affinity_script: true\ngpu_visible_env: \"X; rm -rf /\"", "gpu_visible_env"),
])
def test_site_file_refuses_bad_gpu_maps(tmp_path, extra, message):
    path = tmp_path / "mysite.yaml"
    path.write_text(f"name: mysite\nscheduler: slurm\nlauncher: srun\nranks_per_node: 4\ngpus_per_node: 4\n{extra}\n")
    with pytest.raises(ConfigError) as err:
        load_site(str(path))
    assert message in str(err.value)


def test_polaris_wrapper_gives_local_rank_r_gpu_3_minus_r(tmp_path):
    text = render(tmp_path, "polaris")[8]
    assert "#PBS -l select=2:system=polaris" in text and "module load craype-accel-nvidia80" in text
    assert re.search(r"^mpiexec -n 8 --ppn 4 --depth 8 --cpu-bind depth jobs/polaris/gpu_affinity.sh python3 ",
                     launch_line(text), re.M)
    wrapper = tmp_path / "jobs" / "polaris" / "gpu_affinity.sh"
    seen = []
    for local_rank in range(8):
        done = subprocess.run([str(wrapper), "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], capture_output=True,
                              text=True, env={"PMI_LOCAL_RANK": str(local_rank), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        seen.append(int(done.stdout))
    assert seen == [3, 2, 1, 0, 3, 2, 1, 0]  # ALCF: reverse order, one GPU per rank


def test_frontier_binds_the_closest_gcd_and_runs_rocm(tmp_path):
    text = render(tmp_path, "frontier")[8]
    assert "#SBATCH --cpus-per-task=7" in text and "#SBATCH --partition=batch" in text
    assert "#SBATCH --gpus-per-node=8" in text.splitlines()
    assert "module load rocm/7.0.2" in text and "module load craype-accel-amd-gfx90a" in text
    assert 'export ROCM_HOME="${ROCM_PATH}"' in text and "export MPICH_GPU_SUPPORT_ENABLED=1" in text
    assert launch_line(text).startswith("srun -N 1 -n 8 --ntasks-per-node=8 -c 7 jobs/frontier/gpu_affinity.sh "
                                        "python3 -m fourd_mpi run --backend cupy ")
    wrapper = (tmp_path / "jobs" / "frontier" / "gpu_affinity.sh").read_text()
    assert 'export ROCR_VISIBLE_DEVICES="${gpus[local_rank % 8]}"' in wrapper and "gpus=(4 5 2 3 6 7 0 1)" in wrapper
    source = open(load_site("frontier").source).read()
    assert 'fourd_mpi[rocm]' in source and "cupy-rocm-7-0" in source
    setup = (REPO / "setup.py").read_text()
    assert '"rocm": ["cupy-rocm-7-0"]' in setup  # the extra the site names (ROCm 7.0, as rocm/7.0.2)


def test_alps_uses_the_uenv_and_one_gpu_per_grace_hopper(tmp_path):
    text = render(tmp_path, "alps")[8]
    for line in ("#SBATCH --uenv=prgenv-gnu/25.6:v2", "#SBATCH --view=default", "#SBATCH --cpus-per-task=72",
                 "#SBATCH --partition=normal", "export MPICH_GPU_SUPPORT_ENABLED=1"):
        assert line in text.splitlines(), line
    assert "#SBATCH --gpus-per-node=4" in text.splitlines()
    assert launch_line(text).startswith("srun -N 2 -n 8 --ntasks-per-node=4 -c 72 jobs/alps/gpu_affinity.sh python3 ")


def test_summit_is_historic_and_binds_packed(tmp_path):
    assert "summit" not in builtin_sites() and "summit" in retired_sites()  # selectable, not a default site
    site = load_site("summit")
    assert site.retired == "2024-11" and "historic" in site.description
    text = render(tmp_path, "summit")[8]
    assert "# HISTORIC site: summit was retired in 2024-11" in text and "#BSUB -nnodes 2" in text
    assert launch_line(text).startswith("jsrun -n 8 -a 1 -c 7 -g 1 -b packed:7 -r 4 --smpiargs=-gpu python3 ")
    assert "HISTORIC" not in render(tmp_path, "perlmutter")[8]


def test_generic_lsf_asks_for_slots_per_host(tmp_path):
    text = render(tmp_path, "lsf")[8]
    assert "#BSUB -n 8" in text.splitlines() and '#BSUB -R "span[ptile=4]"' in text.splitlines()
    assert "-nnodes" not in text and launch_line(text).startswith("mpiexec -n 8 python3 ")
    lassen = render(tmp_path, "lassen")[8]
    assert "#BSUB -nnodes 2" in lassen and "#BSUB -n 8" not in lassen  # CSM: whole nodes


@pytest.mark.parametrize("site_name", ("perlmutter", "polaris", "alps", "frontier", "summit", "lsf"))
def test_checked_sites_pass_shellcheck(tmp_path, site_name):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    render(tmp_path, site_name)
    scripts = sorted(str(p) for p in (tmp_path / "jobs" / site_name).glob("*.sh"))
    done = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("key, value, message", [
    ("documentation", '["http://docs.example.org/"]', "documentation page is an https:// URL"),
    ("retired", '"November 2024"', "the month the machine was retired, YYYY-MM"),
])
def test_site_file_refuses_bad_documentation_and_retired_values(tmp_path, key, value, message):
    path = tmp_path / "mysite.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: mysite
        scheduler: slurm
        launcher: srun
        ranks_per_node: 4
        {key}: {value}
        """))
    with pytest.raises(ConfigError) as err:
        load_site(str(path))
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1


def test_every_builtin_site_is_listed():
    assert {"alps", "lsf"} <= set(builtin_sites()) and "aurora" not in builtin_sites()  # Aurora: docs/sites.md


POLARIS_SPEC = """\
name: q1
study: weak
ranks: [4, 8, 12, 36, 40, 44]
grids: {4: [1x1x1x4], 8: [2x1x1x4], 12: [3x1x1x4], 36: [9x1x1x4], 40: [10x1x1x4], 44: [11x1x1x4]}
model: {preset: gpt-tiny, batch: 2}
weak: {grow: batch}
options: {steps: 3}
"""


def polaris_manifest(tmp_path, **job):
    path = tmp_path / "q1.yaml"
    path.write_text(POLARIS_SPEC)
    spec = load_spec(str(path))
    spec.job.update(account="proj1", **job)
    return build_manifest(spec, load_site("polaris"), "q1.yaml", "jobs/polaris", python="python3")


def test_polaris_queue_follows_alcf_node_limits(tmp_path):
    """ALCF: debug takes 1-2 nodes, debug-scaling up to 10, prod (routing) 10-496; 4 ranks per node."""
    manifest = polaris_manifest(tmp_path)
    queues = {r["nodes"]: r["_job"].queue for r in manifest["runs"]}
    assert queues == {1: "debug", 2: "debug", 3: "debug-scaling", 9: "debug-scaling", 10: "debug-scaling",
                      11: "prod"}
    write_sweep(manifest, spec_of(tmp_path), load_site("polaris"), str(tmp_path / "jobs" / "polaris"))
    scripts = {r["nodes"]: (tmp_path / r["script"]).read_text().splitlines() for r in manifest["runs"]}
    assert "#PBS -q debug" in scripts[2] and "#PBS -q debug-scaling" in scripts[3] and "#PBS -q prod" in scripts[11]


def spec_of(tmp_path):
    spec = load_spec(str(tmp_path / "q1.yaml"))
    spec.job["account"] = "proj1"
    return spec


def test_polaris_queue_named_wins_and_is_checked(tmp_path):
    manifest = polaris_manifest(tmp_path, queue="preemptable")  # not in the table: taken as given
    assert {r["_job"].queue for r in manifest["runs"]} == {"preemptable"}
    with pytest.raises(ConfigError) as err:
        polaris_manifest(tmp_path, queue="debug")  # 3 nodes and more: refused by ALCF's debug queue
    text = str(err.value)
    assert "queue debug does not take 3 node(s) for 00:30:00" in text and "debug 1-2 nodes up to 01:00:00" in text
    assert len(text.splitlines()) == 1


def test_polaris_long_small_job_gets_one_line_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        polaris_manifest(tmp_path, time="02:00:00")  # debug queues end at 1 h, prod starts at 10 nodes
    text = str(err.value)
    assert text.startswith("site polaris: no queue takes 1 node(s) for 02:00:00 (debug 1-2 nodes up to 01:00:00; "
                           "debug-scaling 1-10 nodes up to 01:00:00; prod 10-496 nodes up to 1-00:00:00)")
    assert "--queue NAME" in text and len(text.splitlines()) == 1


def test_polaris_sequential_pack_is_queued_by_its_allocation(tmp_path):
    """A pack runs in one allocation of its largest run's nodes: its queue follows that allocation."""
    manifest = polaris_manifest(tmp_path, pack=3, time="00:10:00")
    packs = {p["name"]: p["_pack"].job for p in manifest["packs"]}
    assert {n: (j.nodes, j.queue) for n, j in packs.items()} == {"pack-000": (3, "debug-scaling"),
                                                                 "pack-001": (11, "prod")}


def test_polaris_activates_conda_base_after_the_modules(tmp_path):
    lines = render(tmp_path, "polaris")[8].splitlines()
    order = [lines.index(x) for x in ("module use /soft/modulefiles", "module load conda", "conda activate base")]
    assert order == sorted(order) and lines.index("conda activate base") < len(lines) - 1


def test_alps_job_prepares_the_venv_on_the_uenv_view(tmp_path, monkeypatch):
    """CSCS: unset PYTHONPATH, PYTHONUSERBASE = the view's root (parent of which python's directory)."""
    lines = render(tmp_path, "alps")[8].splitlines()
    assert "unset PYTHONPATH" in lines and 'PYTHONUSERBASE="$(dirname "$(dirname "$(which python)")")"' in lines
    assert "export PYTHONUSERBASE" in lines
    # the lines as bash runs them, with a stand-in view: its bin/python a symbolic link, kept as a link
    view = tmp_path / "user-environment" / "env" / "default"
    (view / "bin").mkdir(parents=True)
    (view / "bin" / "python").symlink_to(shutil.which("python3"))
    script = "\n".join(["set -eo pipefail", "unset PYTHONPATH",
                        'PYTHONUSERBASE="$(dirname "$(dirname "$(which python)")")"', "export PYTHONUSERBASE",
                        "python -c 'import os; print(os.environ.get(\"PYTHONPATH\")); "
                        "print(os.environ[\"PYTHONUSERBASE\"])'"])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": f"{view / 'bin'}:/usr/bin:/bin", "PYTHONPATH": "/elsewhere"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", str(view)]


def test_frontier_loads_the_cupy_guides_pinned_modules_in_its_order(tmp_path):
    lines = [line for line in render(tmp_path, "frontier")[8].splitlines() if line.startswith("module load ")]
    assert lines == ["module load PrgEnv-gnu/8.7.0", "module load cpe/26.03", "module load miniforge3/23.11.0-0",
                     "module load rocm/7.0.2", "module load craype-accel-amd-gfx90a"]


def test_retired_site_is_selectable_with_a_one_line_note(tmp_path):
    import os
    import sys

    (tmp_path / "s.yaml").write_text(SPEC)
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "plan", "s.yaml", "--site", "summit",
                           "--ranks-per-node", "4", "--account", "p1"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "fourd-mpi: note: site summit is a retired machine (retired 2024-11): its profile is kept for its scheduler "
        "and launcher idiom, not for submission"]
    with pytest.raises(ConfigError, match=r"unknown site 'sumit': choose one of .*\(retired machines: summit\)"):
        load_site("sumit")
