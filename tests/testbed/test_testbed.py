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
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, mpi_env

import fourd_mpi
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
    (["--name", "Way-Too-Long-Name"], ["bed name 'Way-Too-Long-Name' (from --name)"]),
    (["--name", ""], ["argument --name: expected a value, got ''"]),
    (["--name", "../x"], ["bed name '../x' (from --name)"]),
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
    # the README's install, not activated: fourd-mpi and python are the environment's, not looked up on PATH
    bare = {**mpi_env(), "PATH": os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                                                 if d and os.path.abspath(d) != os.path.dirname(sys.executable))}
    bare.pop("VIRTUAL_ENV", None)
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "2", "--", "fourd-mpi", "--version"], env=bare,
                 timeout=120)
    assert done.returncode == 0 and f"fourd-mpi {fourd_mpi.__version__}" in done.stdout, done.stdout + done.stderr
    # one write per rank (print writes its words apart when unbuffered): two ranks cannot interleave inside it
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "2", "--", "python", "-c",
                  "import sys, fourd_mpi; sys.stdout.write(f'prefix {sys.prefix}\\n')"], env=bare, timeout=120)
    assert done.returncode == 0 and done.stdout.count(f"prefix {sys.prefix}") == 2, done.stdout + done.stderr


def test_cross_node_verify_and_run_send_bytes_over_the_links(bed, tmp_path):
    before = tb.link_counters(tb.load_state(NAME))
    done = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--ppn", "2", "--", sys.executable, "-m",
                  "fourd_mpi", "verify", "--grid", "1x2x1x2", "--grid", "2x1x1x2", "--steps", "2"], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed, 0 failed" in done.stdout, done.stdout
    runs = {}
    for order in ("block", "cyclic"):  # X inside nodes, then X across nodes
        runs[order] = fourd(["testbed", "mpiexec", "--name", NAME, "-n", "4", "--ppn", "2", "--order", order, "--",
                             sys.executable, "-m", "fourd_mpi", "run", "--show-config",  # the axes' placement
                             "--gz", "2", "--gx", "2", "--steps", "3",
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
    done = fourd(["sweep", "render", "spec.yaml", "--site", site, "--python", sys.executable, "--out",
                  "jobscripts/emu"], tmp_path, env)
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
    assert "4 ranks on 2 node(s), 2 per node" in log, log[-3000:]  # the run's short header
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


def test_slurm_refuses_a_bed_directory_too_long_for_its_sockets(tmp_path):
    """slurmstepd makes a Unix socket per job step in the node's spool directory; over 107 characters it cannot,
    and Slurm requeues and holds the job for ever ("launch failed requeued held"). ``up --slurm`` refuses first,
    with one line, and leaves nothing behind."""
    need_machine(slurm=True)
    root = str(tmp_path / ("long" * 12))
    name = f"{NAME}s"
    done = fourd(["testbed", "up", "--name", name, "--nodes", "2", "--slurm"], env=root_env(root))
    one_line_error(done, "too long for Slurm", "at most 107", "FOURD_TESTBED_STATE")
    assert not os.path.exists(os.path.join(root, name, "state.json"))
    assert not os.path.exists(f"/var/run/netns/{name}-n1")


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


def test_down_removes_a_half_made_bed_and_only_what_it_marked(monkeypatch):
    """What a killed ``up`` leaves (``complete`` false; a namespace with a process in it and a bridge, both
    recorded and marked; a veth recorded but killed before its marker) is removed by ``down``, all but the
    unmarked veth, which is named for a person to check."""
    need_machine()
    root = private_root("half")
    try:
        monkeypatch.setattr(tb, "STATE_ROOT", root)
        name = NAME + "h"
        spec = tb.make_spec(name, 1, rate="none")
        state = {"format": tb.STATE_FORMAT, "name": name, "id": "0123456789abcdef", "spec": {}, "bridge": spec.bridge,
                 "created": [], "netns": {}, "daemons": [], "complete": False}
        real_sh, calls = tb._sh, []

        def killed_after_veth_add(argv, check=True):  # up killed right after it made the veth, before its alias
            calls.append(argv)
            done = real_sh(argv, check)
            if argv[:3] == ["ip", "link", "add"] and "veth" in argv:
                raise KeyboardInterrupt
            return done

        monkeypatch.setattr(tb, "_sh", killed_after_veth_add)
        subnet = tb.choose_subnet(name, tb._networks_in_use())
        node = tb.Node(spec.nodes[0], str(next(subnet.hosts())), f"{name}-v1", None, None)
        state.update(nodes=[tb.asdict(node)], bridge_addr=str(list(subnet.hosts())[253]))
        with pytest.raises(KeyboardInterrupt):
            tb._make(state, [node], subnet)
        monkeypatch.setattr(tb, "_sh", real_sh)
        sleeper = subprocess.Popen(["ip", "netns", "exec", node.name, "sleep", "600"])
        try:
            env = root_env(root)
            st = fourd(["testbed", "status", "--name", name], env=env)
            assert st.returncode == 1 and "damaged" in st.stdout, st.stdout
            done = fourd(["testbed", "down", "--name", name], env=env)
            one_line_error(done, f"check by hand: link {name}-v1 (alias '', not 'fourd-testbed:0123456789abcdef')")
            assert "removed 1 process(es), link " + spec.bridge + ", namespace " + node.name in done.stdout, done.stdout
            assert sleeper.wait(timeout=30) != 0
        finally:
            if sleeper.poll() is None:
                sleeper.kill()
        assert not os.path.exists(f"/var/run/netns/{node.name}") and not os.path.exists(f"/sys/class/net/{spec.bridge}")
        assert not os.path.exists(os.path.join(root, name))
    finally:
        subprocess.run(["ip", "link", "del", f"{NAME}h-v1"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


# -- the bed touches only what it made: foreign objects beside every probe -------------------------------

def private_root(tag: str) -> str:
    """A state root of this test alone, with a space in its path."""
    return tempfile.mkdtemp(prefix=f"fourd tb {tag} ")


def root_env(root: str, **extra) -> dict:
    return {**mpi_env(), "FOURD_TESTBED_STATE": root, **extra}


class Foreign:
    """Objects this test bed did not make, named as the bed's own would be (``NAME-br``, ``NAME-v1`` and its peer,
    namespace ``NAME-n1`` with a ``sleep`` in it) or carrying the bed's directory in their command line."""

    def __init__(self, name: str, bed_dir: str):
        self.name, self.bed_dir = name, bed_dir
        self.bridge, self.veth, self.peer, self.ns = f"{name}-br", f"{name}-v1", f"{name}-p1", f"{name}-n1"
        self.procs = []
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
        # a marker of this tool's form but no bed's id: a marker alone is not enough
        subprocess.run(["ip", "link", "set", self.bridge, "alias", "fourd-testbed:ffffffffffffffff"], check=True)
        subprocess.run(["ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.peer], check=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        self.inode = os.stat(f"/var/run/netns/{self.ns}").st_ino
        self.procs.append(subprocess.Popen(["ip", "netns", "exec", self.ns, "sleep", "600"]))
        self.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", bed_dir,
                                            os.path.join(bed_dir, "state.json")]))

    def survived(self) -> list:
        """What of it is gone (empty: all survived)."""
        gone = [f"link {x}" for x in (self.bridge, self.veth, self.peer) if not os.path.exists(f"/sys/class/net/{x}")]
        if not os.path.exists(f"/var/run/netns/{self.ns}") or os.stat(f"/var/run/netns/{self.ns}").st_ino != self.inode:
            gone.append(f"namespace {self.ns}")
        gone += [f"process {p.args}" for p in self.procs if p.poll() is not None]
        return gone

    def remove(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
        for link in (self.bridge, self.veth):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


@pytest.fixture
def foreign():
    """``foreign(name, bed_dir)`` makes a :class:`Foreign`; all of them are removed at the end."""
    need_machine()
    made = []

    def make(name, bed_dir):
        made.append(Foreign(name, bed_dir))
        return made[-1]

    try:
        yield make
    finally:
        for f in made:
            f.remove()


def one_line_refusal(done):
    """Exit non-zero, one line on stderr, no traceback."""
    assert done.returncode != 0, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("how", ["--name ../x", "--name /abs", "--name ''", "FOURD_TESTBED=../x", "FOURD_TESTBED=",
                                 "FOURD_TESTBED=/abs"])
@pytest.mark.parametrize("command", ["down", "status", "env", "mpiexec", "up"])
def test_bad_names_touch_nothing(foreign, how, command):
    """A bed name outside the rule (a path, empty) from ``--name`` or ``FOURD_TESTBED`` is refused by every
    subcommand, one line, exit 2: the directory it points at, the state root, the other beds' objects and
    processes all survive."""
    parent = private_root("names")
    root = os.path.join(parent, "state root")
    outside = os.path.join(parent, "x")  # what ../x names from the state root
    absolute = os.path.join(parent, "abs")
    try:
        for d in (root, outside, absolute):
            os.makedirs(d)
        for d in (root, outside, absolute):
            open(os.path.join(d, "keep"), "w").close()
        value = {"../x": "../x", "/abs": absolute, "''": ""}[how.split(" ", 1)[1] if how.startswith("--") else
                                                              how.split("=", 1)[1] or "''"]
        f = foreign(NAME + "b", os.path.join(root, value))
        argv = ["testbed", command]
        env = root_env(root)
        if how.startswith("--name"):
            argv += ["--name", value]
        else:
            env["FOURD_TESTBED"] = value
        argv += {"mpiexec": ["-n", "1", "--", "true"], "up": ["--nodes", "1"]}.get(command, [])
        done = fourd(argv, env=env)
        source = "--name" if how.startswith("--name") else "FOURD_TESTBED"
        if how == "--name ''":  # every free-text option refuses an empty value before the command runs
            one_line_error(done, "argument --name: expected a value, got ''")
        else:
            one_line_error(done, f"bed name {value!r} (from {source}): use a lowercase letter")
        assert done.stdout == ""
        for d in (root, outside, absolute):
            assert os.path.exists(os.path.join(d, "keep")), d
        assert f.survived() == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_down_all_with_a_bad_environment_name_is_refused_too():
    one_line_error(fourd(["testbed", "down", "--all"], env=root_env("/nonexistent-fourd", FOURD_TESTBED="../..")),
                   "bed name '../..' (from FOURD_TESTBED)")


def forged_state(name: str, f: Foreign) -> dict:
    """A state of this tool's format whose bed id is not on any object: it lists the foreign objects and
    records the foreign processes with their real start times."""
    return {"format": tb.STATE_FORMAT, "name": name, "id": "0123456789abcdef", "spec": {}, "bridge": f.bridge,
            "subnet": "10.255.254.0/24", "bridge_addr": "10.255.254.254",
            "nodes": [{"name": f.ns, "addr": "10.255.254.1", "veth": f.veth, "rate_bits": None, "burst_bytes": None}],
            "created": [["link", f.bridge], ["netns", f.ns], ["link", f.veth], ["link", f.peer]],
            "netns": {f.ns: [os.stat(f"/var/run/netns/{f.ns}").st_dev, f.inode]},
            "daemons": [tb.daemon_record(p.pid) for p in f.procs], "complete": False}


STATES = {
    "corrupt": lambda name, f: '{"name": "%s", "created": [["link", "%s"' % (name, f.bridge),
    "bare": lambda name, f: "{}",
    "empty": lambda name, f: "",
    # what the earlier version wrote: no format tag, no id, its processes by PID
    "earlier": lambda name, f: json.dumps({"name": name, "created": [["link", f.bridge], ["netns", f.ns]],
                                           "pids": [p.pid for p in f.procs], "complete": True}),
    "other bed's": lambda name, f: json.dumps({**forged_state(name, f), "name": "someother"}),
    "hostile paths": lambda name, f: json.dumps({**forged_state(name, f), "created": [["netns", "../../etc"]]}),
    "forged": lambda name, f: json.dumps(forged_state(name, f)),
    "missing": None,
}


@pytest.mark.parametrize("kind", list(STATES))
def test_a_bad_state_removes_nothing(foreign, kind, monkeypatch):
    """A bed directory whose state is missing, corrupt, bare, of another version or bed, or forged (this format,
    listing foreign objects and processes under an id none of them carries): ``down``, ``up``, ``status``,
    ``down --all`` and the CI-start ``clean_leftovers`` remove nothing and say so in one line, exit non-zero."""
    root = private_root("state")
    name = NAME + "s"
    try:
        bed_dir = os.path.join(root, name)
        os.makedirs(bed_dir)
        f = foreign(name, bed_dir)
        open(os.path.join(bed_dir, "keep"), "w").close()
        if STATES[kind] is not None:
            with open(os.path.join(bed_dir, "state.json"), "w") as fh:
                fh.write(STATES[kind](name, f))
        env = root_env(root)
        for argv in (["down", "--name", name], ["up", "--name", name, "--nodes", "1", "--rate", "none"],
                     ["status", "--name", name], ["down", "--all"]):
            done = fourd(["testbed", *argv], env=env)
            if kind == "forged" and argv[0] == "down":  # a valid state: nothing of it carries its marker
                one_line_error(done, "not removed, not made by this test bed", f"link {f.bridge} (alias "
                               "'fourd-testbed:ffffffffffffffff', not 'fourd-testbed:0123456789abcdef')",
                               f"namespace {f.ns} (not the one")
                assert "removed" not in done.stdout and "process" not in done.stdout, done.stdout
                assert f.survived() == [], (argv, f.survived())
                os.makedirs(bed_dir, exist_ok=True)  # down dropped the (valid) state and its directory: again
                open(os.path.join(bed_dir, "keep"), "w").close()
                with open(os.path.join(bed_dir, "state.json"), "w") as fh:
                    fh.write(STATES[kind](name, f))
                continue
            if kind == "forged" and argv[0] == "up":
                one_line_error(done, f"clashes with an existing network namespace")
            elif kind == "forged" and argv[0] == "status":
                assert done.returncode == 1 and "damaged" in done.stdout, done.stdout
            elif kind == "missing" and argv == ["down", "--all"]:  # no state file: not a bed's directory
                assert done.returncode == 0 and done.stdout == "no test bed was up\n", done.stdout + done.stderr
            else:
                one_line_error(done, f"test bed {name}: ", "removed nothing; check by hand: ",
                               f"directory {bed_dir}, link {f.bridge}, link {f.peer}, link {f.veth}, "
                               f"namespace {f.ns} (and processes in it)")
            assert os.path.exists(os.path.join(bed_dir, "keep")), argv
            assert f.survived() == [], (argv, f.survived())
        # the CI-start check, in this process (its stale-segment sweep of /dev/shm left out: not this test's)
        monkeypatch.setattr(tb, "STATE_ROOT", root)
        monkeypatch.setattr(tb, "stale_shm_segments", lambda: [])
        lines = tb.clean_leftovers()
        if kind == "missing":
            assert lines == []
        elif kind == "forged":
            assert lines == [f"test bed {name}: removed its state; not removed, not the bed's (check them): link "
                             f"{f.peer} (alias '', not 'fourd-testbed:0123456789abcdef'), link {f.veth} (alias '', "
                             f"not 'fourd-testbed:0123456789abcdef'), link {f.bridge} (alias "
                             f"'fourd-testbed:ffffffffffffffff', not 'fourd-testbed:0123456789abcdef'), namespace "
                             f"{f.ns} (not the one test bed {name} made)"], lines
        else:
            assert len(lines) == 1 and "removed nothing; check by hand" in lines[0], lines
            assert os.path.exists(os.path.join(bed_dir, "keep"))
        assert f.survived() == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_down_all_acts_only_on_valid_states(foreign):
    """``down --all`` beside foreign subdirectories of the state root (a bed-like name without a state, another
    name, a corrupt state): it takes down the one real bed and nothing else."""
    root = private_root("all")
    try:
        env = root_env(root)
        real = NAME + "r"
        done = fourd(["testbed", "up", "--name", real, "--nodes", "1", "--rate", "none", "--format", "json"], env=env)
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        keep = []
        for sub in ("plain", "Upper", "abc-def", "a b", NAME + "q"):
            os.makedirs(os.path.join(root, sub))
            keep.append(os.path.join(root, sub, "keep"))
            open(keep[-1], "w").close()
        with open(os.path.join(root, NAME + "q", "state.json"), "w") as fh:
            fh.write("{}")
        f = foreign(NAME + "q", os.path.join(root, NAME + "q"))
        g = foreign(NAME + "g", os.path.join(root, "plain"))
        done = fourd(["testbed", "down", "--all"], env=env)
        one_line_error(done, f"test bed {NAME}q: state file", "removed nothing; check by hand")
        assert done.stdout.startswith(f"test bed {real}: removed "), done.stdout
        assert leftovers(real, state) == []
        assert all(os.path.exists(k) for k in keep), [k for k in keep if not os.path.exists(k)]
        assert f.survived() == [] and g.survived() == []
    finally:
        subprocess.run([sys.executable, "-m", "fourd_mpi", "testbed", "down", "--name", NAME + "r"],
                       env=root_env(root), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_two_state_roots_never_touch_each_others_beds(foreign):
    """A bed up under one state root; under a second root, ``up``/``down`` of the same name (no state there, then
    a corrupt one) refuse in one line before removing anything, and the first bed stays up and healthy."""
    first, second = private_root("one"), private_root("two")
    name = NAME + "t"
    try:
        done = fourd(["testbed", "up", "--name", name, "--nodes", "1", "--rate", "none"], env=root_env(first))
        assert done.returncode == 0, done.stderr
        f = foreign(NAME + "u", os.path.join(first, name))
        for state in (None, "not json"):
            if state is not None:
                os.makedirs(os.path.join(second, name), exist_ok=True)
                with open(os.path.join(second, name, "state.json"), "w") as fh:
                    fh.write(state)
            up = fourd(["testbed", "up", "--name", name, "--nodes", "1", "--rate", "none"], env=root_env(second))
            one_line_refusal(up)
            assert (f"node name '{name}-n1' clashes with an existing network namespace" in up.stderr
                    if state is None else
                    "removed nothing; check by hand" in up.stderr), up.stderr
            down = fourd(["testbed", "down", "--name", name], env=root_env(second))
            one_line_error(down, "removed nothing", f"link {name}-br", f"namespace {name}-n1")
            st = fourd(["testbed", "status", "--name", name], env=root_env(first))
            assert st.returncode == 0 and "damaged" not in st.stdout, st.stdout
        assert f.survived() == []
        done = fourd(["testbed", "down", "--name", name], env=root_env(first))
        assert done.returncode == 0 and "namespace" in done.stdout, done.stdout + done.stderr
    finally:
        fourd(["testbed", "down", "--name", name], env=root_env(first))
        shutil.rmtree(first, ignore_errors=True)
        shutil.rmtree(second, ignore_errors=True)


def test_a_state_root_with_a_space_works(monkeypatch):
    """``up``, ``mpiexec`` (hydra passes the launcher's path on unquoted: the bed has a plain-path link to its
    directory) and ``down`` under a state root whose path holds spaces."""
    need_machine()
    root = private_root("space")
    name = NAME + "p"
    try:
        env = root_env(root)
        done = fourd(["testbed", "up", "--name", name, "--nodes", "2", "--rate", "none"], env=env)
        assert done.returncode == 0, done.stderr
        run = fourd(["testbed", "mpiexec", "--name", name, "-n", "2", "--", "sh", "-c", "echo on $(hostname)"],
                    env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        assert sorted(re.findall(rf"on ({name}-n\d)", run.stdout)) == [f"{name}-n1", f"{name}-n2"], run.stdout
        monkeypatch.setattr(tb, "STATE_ROOT", root)
        alias = tb.alias_path(name)
        assert alias and " " not in alias and os.readlink(alias) == os.path.join(root, name)
        down = fourd(["testbed", "down", "--name", name], env=env)
        assert down.returncode == 0 and "namespace" in down.stdout, down.stdout + down.stderr
        assert not os.path.exists(os.path.join(root, name)) and (alias is None or not os.path.lexists(alias))
    finally:
        fourd(["testbed", "down", "--name", name], env=root_env(root))
        shutil.rmtree(root, ignore_errors=True)
