"""The multi-node test bed (:mod:`fourd_mpi.testbed`, docs/multinode.md), for real: network namespaces,
veth links shaped with tbf, ranks started on the nodes by the mpich wheel's mpiexec through the bed's
shim, a real Slurm with one slurmd per node, and the rendered sweeps of the ``emulated`` and
``emulated-slurm`` sites.

Needs root, iproute2 and util-linux (and Debian's Slurm for the Slurm tests); elsewhere those tests
skip with the reason, except under ``CI=true`` (``.ci/run``), where a missing piece is a failure.
Input checks run everywhere. Every bed here has a name of its own (``t`` + this process's id), so
concurrent sessions never collide, and is taken down at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, mpi_env
from fourd_mpi.errors import ConfigError
from fourd_mpi.testbed import bed as tb
from fourd_mpi.testbed import slurm as tbslurm

IN_CI = os.environ.get("CI", "").lower() == "true"
NAME = f"t{os.getpid() % 10 ** 7}"


def fourd(args, cwd=REPO, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], cwd=cwd, env=env or mpi_env(),
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(done, *fragments):
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("fourd-mpi: error: ")
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def need_machine(slurm: bool = False):
    why = tb.why_unavailable()
    if not why and slurm and tbslurm.missing_programs():
        why = f"Slurm is not installed ({', '.join(tbslurm.missing_programs())} missing): apt-get install " \
              f"slurmctld slurmd slurm-client"
    if why:
        if IN_CI:
            pytest.fail(f"CI=true but no test bed: {why}")
        pytest.skip(why)


# -- input: one line, exit 2, anywhere -----------------------------------------------------------

@pytest.mark.parametrize("argv, fragments", [
    (["--rate", "12furlongs"], ["link rate '12furlongs' does not parse", "200mbit"]),
    (["--rate", "1mbit,2mbit,3mbit"], ["one value or one per node (2)"]),
    (["--burst", "lots"], ["burst 'lots' does not parse"]),
    (["--nodes", "99"], ["99 nodes asked, a bed makes at most 32"]),
    (["--node-names", "a1,b1,a1"], ["node name 'a1' is given twice"]),
    (["--node-names", "Bad_Name"], ["node name 'Bad_Name'"]),
    (["--nodes", "3", "--node-names", "a1,b1"], ["--nodes 3 but 2 node names"]),
    (["--name", "Way-Too-Long-Name"], ["bed name 'Way-Too-Long-Name'"]),
])
def test_bad_input_is_one_line(argv, fragments):
    one_line_error(fourd(["testbed", "up", "--name", NAME, *argv] if "--name" not in argv
                         else ["testbed", "up", *argv]), *fragments)


def test_rates_and_sizes_parse_as_tc_reads_them():
    assert tb.parse_rate("200mbit") == 200_000_000
    assert tb.parse_rate("1gbit") == 10 ** 9
    assert tb.parse_rate("25mbps") == 200_000_000  # bytes per second
    assert tb.parse_rate("1mibit") == 2 ** 20
    assert tb.parse_rate("none") is None
    for bad in ("200", "fast", "-5mbit", "200 furlongs", "1bit"):
        with pytest.raises(ConfigError):
            tb.parse_rate(bad)
    assert tb.parse_size("64kb") == tb.parse_size("64k") == tb.parse_size("64kib") == 65536
    assert tb.default_burst(200_000_000) == 250_000 and tb.default_burst(8_000_000) == 65536


def test_subnets_of_two_names_differ_and_avoid_taken_ones():
    import ipaddress

    a, b = tb.choose_subnet("alpha", []), tb.choose_subnet("beta", [])
    assert a != b and a.subnet_of(ipaddress.ip_network("10.64.0.0/10"))
    assert tb.choose_subnet("alpha", [a]) != a
    with pytest.raises(ConfigError, match="no free /24"):
        tb.choose_subnet("alpha", [ipaddress.ip_network("10.0.0.0/8")])


def test_refused_where_namespaces_are_unavailable(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "run it as root (not root here)" in tb.why_unavailable()
    with pytest.raises(ConfigError, match="not root here"):
        tb.up(tb.make_spec(NAME, 2))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert tb.why_unavailable().startswith("the test bed needs ip, tc, nsenter, unshare on PATH")


def test_not_root_is_one_line_from_the_command():
    """As a user: the same line from the command (a non-root user where this runs as root)."""
    if os.geteuid() == 0:
        code = ("import os, sys; os.geteuid = lambda: 1000; from fourd_mpi.cli.main import main; "
                f"sys.exit(main(['testbed', 'up', '--name', {NAME!r}]))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpi_env(), cwd=REPO)
    else:
        done = fourd(["testbed", "up", "--name", NAME])
    one_line_error(done, "run it as root (not root here)")


# -- a bed with Slurm ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bed():
    need_machine()
    slurm = not tbslurm.missing_programs()
    if IN_CI and not slurm:
        pytest.fail("CI=true but Slurm is not installed")
    done = fourd(["testbed", "up", "--name", NAME, "--nodes", "2", "--rate", "200mbit",
                  *(["--slurm"] if slurm else []), "--format", "json"])
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    yield state
    fourd(["testbed", "down", "--name", NAME])


def test_up_is_idempotent_and_status_shows_the_nodes(bed):
    again = fourd(["testbed", "up", "--name", NAME, "--nodes", "2", "--rate", "200mbit",
                   *(["--slurm"] if bed.get("slurm") else [])])
    assert again.returncode == 0 and "already up" in again.stderr, again.stderr
    other = fourd(["testbed", "up", "--name", NAME, "--nodes", "3"])
    one_line_error(other, f"test bed {NAME} is up with other settings")
    st = fourd(["testbed", "status", "--name", NAME])
    assert st.returncode == 0, st.stdout
    for node in bed["nodes"]:
        assert node["name"] in st.stdout and node["addr"] in st.stdout
        assert os.path.exists(f"/var/run/netns/{node['name']}")
    assert "200mbit" in st.stdout
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", bed["nodes"][0]["veth"]], capture_output=True, text=True)
    assert "tbf" in qdisc.stdout and "rate 200Mbit" in qdisc.stdout, qdisc.stdout


def test_node_name_clashes_are_refused(bed):
    one_line_error(fourd(["testbed", "up", "--name", NAME + "x", "--node-names", bed["nodes"][0]["name"] + ",zz1"]),
                   f"clashes with a node of test bed {NAME}")
    subprocess.run(["ip", "netns", "add", NAME + "-own"], check=True)
    try:
        one_line_error(fourd(["testbed", "up", "--name", NAME + "y", "--node-names", NAME + "-own"]),
                       "clashes with an existing network namespace")
    finally:
        subprocess.run(["ip", "netns", "del", NAME + "-own"], check=True)


def test_the_launcher_passes_environment_and_exit_status_and_host_names(bed):
    env = {**mpi_env(), "FOURD_PROBE": "it's passed"}
    # the exit status on its own launch: Open MPI ends the job when the first rank exits non-zero, and the
    # others' output may be lost then (Hydra lets every rank finish)
    failed = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--", "sh", "-c", "exit 3"], timeout=120)
    assert failed.returncode == 3, failed.stderr
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--", "sh", "-c",
                  'echo "$(hostname) $FOURD_PROBE $UCX_TLS"'], env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    # hydra forwards each rank's output as it comes: match the records, not the lines
    names = [n["name"] for n in bed["nodes"]]
    seen = sorted(re.findall(rf"({re.escape(NAME)}-n\d) it's passed tcp,self", done.stdout))
    assert seen == sorted(n for n in names for _ in range(2)), done.stdout
    cyclic = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--order", "cyclic", "--", "sh", "-c",
                    'echo "${PMI_RANK:-$OMPI_COMM_WORLD_RANK} $(hostname)"'], timeout=120)  # Hydra's, Open MPI's
    assert cyclic.returncode == 0, cyclic.stderr
    seen = sorted(re.findall(rf"(\d) ({re.escape(NAME)}-n\d)", cyclic.stdout))
    assert seen == [(str(r), names[r % 2]) for r in range(4)], cyclic.stdout
    one_line_error(fourd(["testbed", "mpiexec", "--name", NAME, "-n", "6", "--ppn", "2", "--", "true"]),
                   "6 ranks at 2 per node need 3 nodes", "has 2")


def test_cross_node_verify_and_run_send_bytes_over_the_links(bed, tmp_path):
    before = tb.link_counters(tb.load_state(NAME))
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--ppn", "2", "--", sys.executable, "-m",
                  "fourd_mpi", "verify", "--grid", "1x2x1x2", "--grid", "2x1x1x2", "--steps", "2"], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed, 0 failed" in done.stdout, done.stdout
    runs = {}
    for order in ("block", "cyclic"):  # X inside nodes, then X across nodes
        runs[order] = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--ppn", "2", "--order", order, "--",
                             sys.executable, "-m", "fourd_mpi", "run", "--gz", "2", "--gx", "2", "--steps", "3",
                             "--results-dir", tmp_path / order], timeout=600)
        assert runs[order].returncode == 0, runs[order].stdout[-3000:] + runs[order].stderr[-3000:]
        assert "on 4 ranks, 2 node(s), 2 rank(s) per node" in runs[order].stdout, runs[order].stdout
        if order == "block":
            after = tb.link_counters(tb.load_state(NAME))
    inside, across = runs["block"].stdout, runs["cyclic"].stdout
    assert re.search(r"^\s+z\s+2\s+\S+\s+inter-node", inside, re.M) and \
        re.search(r"^\s+x\s+2\s+\S+\s+intra-node", inside, re.M), inside
    assert re.search(r"^\s+x\s+2\s+\S+\s+inter-node", across, re.M) and \
        re.search(r"^\s+z\s+2\s+\S+\s+intra-node", across, re.M), across
    for node in before:  # the weight all-gathers over Z crossed each node's link, both ways
        assert after[node]["sent"] - before[node]["sent"] > 200_000, (before, after)
        assert after[node]["received"] - before[node]["received"] > 200_000, (before, after)
    # the regression check between the placements: one configuration compared (slower or not: no wall
    # time is asserted), exit 0 or 1, never a usage error
    done = fourd(["compare", tmp_path / "cyclic", "--baseline", tmp_path / "block", "--threshold", "5%",
                  "--format", "json"], timeout=300)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert len(json.loads(done.stdout)["comparisons"]) == 1, done.stdout


@pytest.mark.parametrize("ranks, ppn", [(4, 2), (2, 1)])
def test_bench_collectives_on_the_bed_writes_intra_and_inter_levels(bed, tmp_path, ranks, ppn):
    """A calibration on the bed: the levels follow the launcher's node assignment (also for a prime world
    size, which has no grid of its own: 2 ranks on 2 nodes is an inter-node world), and the profile keeps
    the measured points the model interpolates."""
    import yaml

    out = tmp_path / "bed.yaml"
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", str(ranks), "--ppn", str(ppn), "--", sys.executable,
                  "-m", "fourd_mpi", "bench", "collectives", "--ops", "iallreduce,iallgather", "--min-size", "1K",
                  "--max-size", "8K", "--iters", "3", "--min-time", "0", "--warmup", "1", "--overlap-sizes", "0",
                  "--accept-poor-fit", "-o", out,  # the bed's tbf bursts: fits miss by 59-74 % rms
                  "--fallback", "laptop"], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prof = yaml.safe_load(out.read_text())
    assert prof["calibration"]["num_nodes"] == 2 and prof["node"]["ranks_per_node"] == ppn
    assert "inter" in prof["levels"] and ("intra" in prof["levels"]) == (ppn > 1), prof["levels"].keys()
    inter = prof["levels"]["inter"]
    assert inter["shared_by"] == ppn
    # inter-node points are kept per placement, "p@g": p ranks with g of them on each node
    points = inter["measured"]["allreduce"][f"{ranks}@{ppn}"]
    assert [b for b, _ in points] == [1024, 8192] and all(t > 0 for _, t in points)
    if ranks == 4:  # grid 2x1x1x2: X of 2 inside a node, data of 2 one rank on each node
        assert set(inter["measured"]["allreduce"]) == {"4@2", "2@1"}, inter["measured"]["allreduce"].keys()
    # back-to-back runs of all-reduces (the step's data all-reduces), inter-node groups only, same keys and sizes
    runs = inter["measured_runs"]["allreduce"]
    assert set(runs) == set(inter["measured"]["allreduce"]), runs.keys()
    assert [b for b, _ in runs[f"{ranks}@{ppn}"]] == [1024, 8192] and all(t > 0 for _, t in runs[f"{ranks}@{ppn}"])
    assert "measured_runs" not in prof["levels"].get("intra", {})


SPEC = """\
name: emu
study: weak
ranks: [4]
grids: {4: [1x2x1x2]}
model: {preset: gpt-tiny, batch: 4}
weak: {grow: batch}
options: {steps: 2, warmup: 1}
job: {time: "00:05:00", ranks_per_node: 2}
"""


@pytest.mark.parametrize("site", ["emulated", "emulated-slurm"])
def test_a_rendered_two_node_sweep_runs_on_the_bed(bed, tmp_path, site):
    if site == "emulated-slurm" and not bed.get("slurm"):
        need_machine(slurm=True)
    env = {**mpi_env(), "FOURD_TESTBED": NAME}
    if bed.get("slurm"):
        env["SLURM_CONF"] = bed["slurm"]["conf"]
    (tmp_path / "spec.yaml").write_text(SPEC)
    done = fourd(["sweep", "render", "spec.yaml", "--site", site, "--python", sys.executable], tmp_path, env)
    assert done.returncode == 0, done.stderr
    script = next((tmp_path / "jobscripts" / "emu").glob("emu-000-*.sh")).read_text()
    assert "4 ranks = 2 node(s) x 2 ranks per node" in script
    if site == "emulated-slurm":
        assert "#SBATCH --nodes=2" in script
    done = fourd(["sweep", "submit", "jobscripts/emu"], tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 400
    while True:
        st = fourd(["sweep", "status", "jobscripts/emu"], tmp_path, env)
        if "1/1 traces complete" in st.stdout or "1 jobs failed" in st.stdout or time.monotonic() > deadline:
            break
        time.sleep(2)
    log = "".join(p.read_text() for p in (tmp_path / "jobscripts" / "emu" / "logs").glob("*"))
    assert "1/1 traces complete" in st.stdout, st.stdout + log[-3000:]
    assert "on 4 ranks, 2 node(s), 2 rank(s) per node" in log, log[-3000:]
    if site == "emulated-slurm":
        assert f"on {NAME}-n1 at " in log  # the batch script ran on the bed's first node


def test_slurm_places_tasks_on_every_node(bed):
    if not bed.get("slurm"):
        need_machine(slurm=True)
    env = {**mpi_env(), "SLURM_CONF": bed["slurm"]["conf"]}
    done = subprocess.run(["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "hostname"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = sorted(re.findall(rf"{re.escape(NAME)}-n\d", done.stdout))
    assert seen == sorted([f"{NAME}-n1"] * 2 + [f"{NAME}-n2"] * 2), done.stdout


# -- nothing left behind ----------------------------------------------------------------------------

def leftovers(name: str, state: dict) -> list:
    out = [f"namespace {n['name']}" for n in state["nodes"] if os.path.exists(f"/var/run/netns/{n['name']}")]
    out += [f"link {link}" for link in [state["bridge"]] + [n["veth"] for n in state["nodes"]]
            if os.path.exists(f"/sys/class/net/{link}")]
    out += [f"process {p}" for p in state.get("pids", []) if tb.pid_alive(p)]
    out += [f"state {tb.bed_dir(name)}"] if os.path.exists(tb.bed_dir(name)) else []
    return out


def test_down_removes_everything_even_under_a_running_job(tmp_path):
    """A bed with Slurm and a job running on both nodes (its MPICH segments in the nodes' /dev/shm), taken
    down as a killed test's cleanup would: processes, daemons, namespaces, links, files and segments go."""
    need_machine()
    name = NAME + "d"
    slurm = [] if tbslurm.missing_programs() and not IN_CI else ["--slurm"]
    done = fourd(["testbed", "up", "--name", name, "--nodes", "2", "--rate", "1gbit", *slurm, "--format", "json"])
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    marker = f"fourd-testbed-probe-{name}"
    job = subprocess.Popen([sys.executable, "-m", "fourd_mpi", "testbed", "mpiexec", "--name", name, "-n", "4", "--",
                            sys.executable, "-c", "from mpi4py import MPI; import time, os; "
                            f"open('/dev/shm/{marker}', 'w').close(); MPI.COMM_WORLD.Barrier(); "
                            "MPI.COMM_WORLD.rank or print('ready', flush=True); time.sleep(600)"],
                           env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "ready", job.stderr.read() if job.poll() is not None else ""
        busy = sum(len(tb._netns_pids(n["name"])) for n in state["nodes"])
        assert busy >= 4  # ranks (and slurmd) live in the nodes
        assert not os.path.exists(f"/dev/shm/{marker}")  # each node's /dev/shm is its own
        down = fourd(["testbed", "down", "--name", name])
        assert down.returncode == 0 and "process(es)" in down.stdout and "namespace" in down.stdout, down.stdout
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
        fourd(["testbed", "down", "--name", name])
    assert leftovers(name, state) == []
    again = fourd(["testbed", "down", "--name", name])
    assert again.returncode == 0 and "was not up" in again.stdout
    st = fourd(["testbed", "status", "--name", name])
    assert st.returncode == 1 and "is not up" in st.stdout


def test_down_removes_a_half_made_bed():
    """What a killed ``up`` leaves (the state lists a namespace and a bridge, ``complete`` false, a process
    in the namespace) is removed by ``down`` (``down --all``, the CI-start check, does this for every bed;
    not run here: it would take down a concurrent session's beds)."""
    need_machine()
    name = NAME + "h"
    node, bridge = f"{name}-n1", f"{name}-br"
    os.makedirs(tb.bed_dir(name), exist_ok=True)
    tb.save_state({"name": name, "created": [["link", bridge], ["netns", node]], "complete": False})
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    subprocess.run(["ip", "netns", "add", node], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", node, "sleep", "600"])
    try:
        st = fourd(["testbed", "status", "--name", name])
        assert st.returncode == 1 and "damaged" in st.stdout, st.stdout
        done = fourd(["testbed", "down", "--name", name])
        assert done.returncode == 0, done.stderr
        assert sleeper.wait(timeout=30) != 0
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
    assert not os.path.exists(f"/var/run/netns/{node}") and not os.path.exists(f"/sys/class/net/{bridge}")
    assert not os.path.exists(tb.bed_dir(name))
