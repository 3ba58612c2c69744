"""Site profiles checked against the centres' own pages (issue 31 item 4): each site's rendered job
script carries the idioms its centre documents, and each site file states its sources and choices.

What each centre documents (the pages are in each file's ``documentation:``):

- NERSC Perlmutter: ``-c 32 --cpu-bind=cores``, one GPU visible to each task with ``--gpus-per-task=1
  --gpu-bind=map_gpu:0,1,2,3`` (GPU = node-local rank); mpi4py built with ``cc -target-accel=nvidia80``
  so the GTL library is linked for ``MPICH_GPU_SUPPORT_ENABLED=1``.
- ALCF Polaris: ``mpiexec --ppn --depth --cpu-bind depth`` and ALCF's wrapper that gives local rank r
  GPU ``3 - r % 4`` (Polaris's GPU 3 is nearest cores 0-7).
- OLCF Frontier: ``-c 7 --gpus-per-task=1 --gpu-bind=closest``, rocm/7.0.2, ROCM_HOME at run time.
- CSCS Alps: ``--gpus-per-task=1`` with 4 ranks per node, ``-c 72``, the uenv by ``#SBATCH --uenv/--view``.
- Summit (historic): ``jsrun -a1 -c7 -g1 -b packed:7``; a generic LSF cluster: ``bsub -n`` with
  ``-R "span[ptile=N]"``.

The scripts cannot be submitted here (no Cray, PBS or LSF); the wrapper script runs for real.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap

import pytest

from conftest import REPO
from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.sites import builtin_sites, load_site
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


def test_perlmutter_binds_one_gpu_per_rank_as_nerscs_example(tmp_path):
    text = render(tmp_path, "perlmutter")[8]
    assert "#SBATCH --constraint=gpu" in text and "#SBATCH --cpus-per-task=32" in text
    assert "module load craype-accel-nvidia80" in text and "export MPICH_GPU_SUPPORT_ENABLED=1" in text
    line = launch_line(text)
    assert line.startswith("srun --cpu-bind=cores --gpus-per-task=1 --gpu-bind=map_gpu:0,1,2,3 -N 2 -n 8 "
                           "--ntasks-per-node=4 -c 32 python3 -m fourd_mpi run --backend cupy ")
    order = [int(g) for g in re.search(r"--gpu-bind=map_gpu:([\d,]+)", line).group(1).split(",")]
    assert order == list(range(4))  # NERSC: GPU = node-local rank
    source = open(load_site("perlmutter").source).read()
    assert 'MPICC="cc -target-accel=nvidia80 -shared" pip install' in source  # GTL linked


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
    assert "module load rocm/7.0.2" in text and "module load craype-accel-amd-gfx90a" in text
    assert 'export ROCM_HOME="${ROCM_PATH}"' in text and "export MPICH_GPU_SUPPORT_ENABLED=1" in text
    assert launch_line(text).startswith("srun --gpus-per-task=1 --gpu-bind=closest -N 1 -n 8 --ntasks-per-node=8 "
                                        "-c 7 python3 -m fourd_mpi run --backend cupy ")
    source = open(load_site("frontier").source).read()
    assert 'fourd_mpi[rocm]' in source and "cupy-rocm-7-0" in source
    setup = (REPO / "setup.py").read_text()
    assert '"rocm": ["cupy-rocm-7-0"]' in setup  # the extra the site names (ROCm 7.0, as rocm/7.0.2)


def test_alps_uses_the_uenv_and_one_gpu_per_grace_hopper(tmp_path):
    text = render(tmp_path, "alps")[8]
    for line in ("#SBATCH --uenv=prgenv-gnu/25.6:v2", "#SBATCH --view=default", "#SBATCH --cpus-per-task=72",
                 "#SBATCH --partition=normal", "export MPICH_GPU_SUPPORT_ENABLED=1"):
        assert line in text.splitlines(), line
    assert launch_line(text).startswith("srun --gpus-per-task=1 -N 2 -n 8 --ntasks-per-node=4 -c 72 ")


def test_summit_is_historic_and_binds_packed(tmp_path):
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


@pytest.mark.parametrize("site_name", ("perlmutter", "polaris", "alps", "summit", "lsf"))
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
