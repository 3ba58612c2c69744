"""The launcher registry (fourd_mpi.jobs.launchers): one class per launcher a site may name, each giving its part
of the job's command line. Known answers written by hand from each launcher's manual: a 2-node job of 8 ranks,
4 per node, 8 cores per rank, on GPU nodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs import sites
from fourd_mpi.jobs.launchers import LAUNCHER_CLASSES, get_launcher
from fourd_mpi.jobs.schedulers import CSM_LAUNCHERS, JobRequest

JOB = JobRequest(name="r", ranks=8, nodes=2, ranks_per_node=4, time_seconds=60, log="r.log")


def site(**over):
    """The fields of a site a launcher reads (a duck-typed :class:`fourd_mpi.jobs.sites.Site`)."""
    return SimpleNamespace(**{"launcher_args": (), "cpus_per_rank": 8, "gpu_affinity_script": False,
                              "uses_gpus": True, **over})


@pytest.mark.parametrize("name, over, expected", [
    ("srun", {}, "srun -N 2 -n 8 --ntasks-per-node=4 -c 8"),
    ("srun", {"launcher_args": ("--cpus-per-task=4",)}, "srun --cpus-per-task=4 -N 2 -n 8 --ntasks-per-node=4"),
    ("srun", {"gpu_affinity_script": True}, "srun -N 2 -n 8 --ntasks-per-node=4 -c 8 jobs/gpu_affinity.sh"),
    ("jsrun", {}, "jsrun -n 8 -a 1 -c 8 -g 1 -b packed:8 -r 4 --smpiargs=-gpu"),
    ("jsrun", {"uses_gpus": False, "cpus_per_rank": None}, "jsrun -n 8 -a 1 -c 1 -b packed:1 -r 4"),
    ("lrun", {}, "lrun -N 2 -T 4 --smpiargs=-gpu"),
    ("polaris-mpiexec", {}, "mpiexec -n 8 --ppn 4 --depth 8 --cpu-bind depth"),
    ("testbed", {"launcher_args": ("--x",)}, "py -m fourd_mpi testbed mpiexec --x -n 8 --ppn 4 --"),
])
def test_each_launcher_gives_its_manuals_line(name, over, expected):
    assert " ".join(get_launcher(name).argv(site(**over), JOB, "jobs", "py")) == expected


def test_plain_mpiexec_names_the_ranks_only():
    """``mpiexec -n 8``: not on this PATH under that name, so no family's spelling is applied."""
    line = get_launcher("mpiexec").argv(site(launcher_args=("-bind-to", "core")), JOB, "jobs", "python3")
    assert line[-2:] == ["-n", "8"] and line[0].endswith("mpiexec")


def test_the_registry_is_the_site_schemas_list_and_lsfs_whole_node_launchers():
    assert tuple(LAUNCHER_CLASSES) == sites.LAUNCHERS == ("mpiexec", "srun", "jsrun", "lrun", "polaris-mpiexec",
                                                          "testbed")
    assert sites.SITE_SCHEMA["properties"]["launcher"]["enum"] == list(sites.LAUNCHERS)
    assert CSM_LAUNCHERS == ("jsrun", "lrun")
    wrapping = [name for name, cls in LAUNCHER_CLASSES.items() if cls.local_rank_variable]
    assert wrapping == ["srun", "polaris-mpiexec"]


def test_an_unknown_launcher_is_one_line():
    with pytest.raises(ConfigError, match=r"^unknown launcher 'aprun': choose one of mpiexec, srun, "):
        get_launcher("aprun")
