"""ReFrame regression test of fourd_mpi: ``fourd-mpi run`` through the system's launcher, against references.

Run it (ReFrame >= 4, ``pip install reframe-hpc``), with ``fourd-mpi`` and the launcher on PATH::

    reframe -C packaging/reframe/config_local.py -c packaging/reframe/fourd_mpi_check.py -r

One case per fourd_mpi site and grid (ReFrame parameters ``site`` and ``grid``) of the references template
``references.yaml`` next to this file (``FOURD_REFRAME_REFERENCES=FILE``: another file of its form); a site's
cases run on the ReFrame systems the template lists for it. Select cases as ReFrame does, e.g.
``-n 'FourdMpiRunCheck%site=local%grid=1x2x2x2'``.

The site gives the run its node shape and environment, from its fourd_mpi site profile
(``fourd_mpi/jobs/sites/SITE.yaml`` of this checkout, or a site FILE.yaml): ranks per node, cores per rank,
the backend (numpy or cupy) and the environment variables the site sets (``MPICH_GPU_SUPPORT_ENABLED``, ...);
the launcher, modules and scheduler options are the centre's ReFrame configuration's (its partitions).
Each rank of a node uses GPU ``local rank % visible GPUs``.

The references are tight (a run 10 % slower than its reference fails) and measured by the centre: the
template holds none, and ``fourd_reference.py`` (next to this file) makes the entries from the centre's own
runs (docs/guide/clusters.md, "ReFrame"). A case without a reference is measured and reported, never
failed on performance. The figures of merit and the tolerances are described in ``fourd_reference.py``.
"""

import os
import sys

import reframe as rfm
import reframe.utility.sanity as sn
from reframe.core.builtins import parameter, performance_function, run_after, run_before, sanity_function, variable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fourd_reference import FIELDS, RUN_ID, index_value, load_template, reference_of  # noqa: E402

TEMPLATE = load_template()
#: the fourd_mpi site profiles of this checkout (a site of the template may also be a FILE.yaml)
SITES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "fourd_mpi", "jobs", "sites")


def site_shape(site):
    """``(ranks per node, cores per rank or None, backend, env)`` of a fourd_mpi site profile (a name of this
    checkout's sites, its retired ones, or a FILE.yaml)."""
    import yaml

    path = site
    if not site.endswith((".yaml", ".yml")):
        path = os.path.join(SITES_DIR, site + ".yaml")
        if not os.path.exists(path):
            path = os.path.join(SITES_DIR, "retired", site + ".yaml")
    with open(path) as fh:
        data = yaml.safe_load(fh)
    env = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    return int(data["ranks_per_node"]), data.get("cpus_per_rank"), data.get("backend", "auto"), env


@rfm.simple_test
class FourdMpiRunCheck(rfm.RunOnlyRegressionTest):
    descr = "fourd_mpi: traced 4D hybrid parallel training steps, figures of merit from the run summary"
    valid_prog_environs = ["*"]
    executable = "fourd-mpi"
    tags = {"benchmark", "mpi", "fourd_mpi"}
    maintainers = ["the fourd_mpi developers"]
    #: the run's index line: the reference a centre fills comes from these files (fourd_reference.py)
    keep_files = ["results/index.jsonl"]

    site = parameter(sorted(TEMPLATE["sites"]))
    grid = parameter(sorted({str(g) for entry in TEMPLATE["sites"].values() for g in entry["grids"]}))

    # the run: README command 1's model and steps (gpt-tiny, 10 steps of which 1 warm-up)
    model = variable(str, value="gpt-tiny")
    steps = variable(int, value=10)
    warmup = variable(int, value=1)
    extra_options = variable(list, value=[])

    @run_after("init")
    def choose_systems(self):
        """The site's systems; a grid the template does not list for the site is not run there."""
        entry = TEMPLATE["sites"][self.site]
        self.valid_systems = list(entry["systems"]) if self.grid in {str(g) for g in entry["grids"]} else []
        self.reference = reference_of(TEMPLATE, self.site, self.grid)
        self.gdata, self.gz, self.gy, self.gx = (int(n) for n in self.grid.split("x"))

    @run_before("run")
    def set_job(self):
        per_node, cores, backend, env = site_shape(self.site)
        self.num_tasks = self.gdata * self.gz * self.gy * self.gx
        self.num_tasks_per_node = min(per_node, self.num_tasks)
        if cores:
            self.num_cpus_per_task = int(cores)
        self.executable_opts = ["run", "--model", self.model, "--gdata", str(self.gdata), "--gz", str(self.gz),
                                "--gy", str(self.gy), "--gx", str(self.gx), "--steps", str(self.steps),
                                "--warmup", str(self.warmup), "--results-dir", "results", "--run-id", RUN_ID,
                                *(["--backend", backend] if backend != "auto" else []), *self.extra_options]
        self.env_vars = {"OMP_NUM_THREADS": str(cores or 1), "OPENBLAS_NUM_THREADS": str(cores or 1), **env}

    @sanity_function
    def validate(self):
        measured = sn.extractsingle(r"^step time: median \S+ s over (\d+) step\(s\)", self.stdout, 1, int)
        return sn.all([
            # the run's short header (fourd_mpi/run/report.py): its grid and rank count, then the MPI library
            sn.assert_found(rf"^fourd-mpi \S+: .* on grid {self.gdata}x{self.gz}x{self.gy}x{self.gx} \(DxZxYxX\), "
                            rf"{self.num_tasks} ranks ", self.stdout),
            sn.assert_found(r"^backend .*; MPI: ", self.stdout),
            sn.assert_eq(measured, self.steps - self.warmup),
            sn.assert_found(r"^trace: \S+\.h5$", self.stdout),
            sn.assert_true(os.path.exists(self._index())),
            sn.assert_not_found(r"(?i)^error|Traceback", self.stderr),
        ])

    def _index(self):
        return os.path.join(self.stagedir, "results", "index.jsonl")

    def _fom(self, fom):
        return sn.deferrable(index_value)(self._index(), RUN_ID, fom)

    @run_before("performance")
    def add_mfu(self):
        """MFU only where the run had a data-sheet peak (the index holds null otherwise: a CPU run)."""
        if index_value(self._index(), RUN_ID, "mfu_pct") is not None:
            self.perf_variables["mfu_pct"] = sn.make_performance_function(self._fom("mfu_pct"), FIELDS["mfu_pct"][2])

    @performance_function("s")
    def step_time(self):
        return self._fom("step_time")

    @performance_function("TFLOP/s")
    def tflops_per_rank(self):
        return self._fom("tflops_per_rank")

    @performance_function("%")
    def gemm_pct(self):
        return self._fom("gemm_pct")

    @performance_function("%")
    def exposed_comm_share(self):
        return self._fom("exposed_comm_share")
