"""Can this MPI library take GPU buffers, and in which of the operations the step uses?

Detection never hands MPI a device pointer (a library that cannot read one may crash
the process): it reads the library's identity (``MPI_Get_library_version``), calls the
library's own query functions where it has them (found with ``ctypes`` in the loaded
``libmpi``), and reads the environment variables that switch GPU support on:

==============  ===========================================================================
library         evidence
==============  ===========================================================================
Cray MPICH      ``MPICH_GPU_SUPPORT_ENABLED=1`` (and the GTL library linked, which we cannot
                see); without it device buffers crash or corrupt
MPICH           ``MPIX_Query_cuda_support()`` (``MPIX_GPU_query_support``; 0 when built
                without CUDA or with ``MPIR_CVAR_ENABLE_GPU=0``)
Open MPI        ``MPIX_Query_cuda_support()``; its FAQ/docs list ``MPI_Iallgather`` and
                ``MPI_Iallreduce`` as not CUDA-aware (with UCX: the nonblocking reductions only),
                so those classes stage while p2p and blocking collectives go direct
MVAPICH2-GDR    ``MV2_USE_CUDA=1``
Intel MPI       ``I_MPI_OFFLOAD=1`` (2021.14 and later: CUDA buffers)
others          unknown: staged
==============  ===========================================================================

Which operations go direct is decided per operation class (:data:`OP_CLASSES`: point-to-point,
blocking collectives, nonblocking all-gather, nonblocking reductions) by one table,
:data:`ROUTE_RULES`: per library family, version range and variant (Open MPI's PML, read at run
time by :func:`open_mpi_pml`), what switches CUDA support on and, per class, direct or staged with
the documentation that says so. A class no document covers is staged ("undocumented: staged").
:func:`route_rules` applies it (pure); :attr:`GpuAwareness.routes` holds the result, which
``--device-buffers auto`` follows class by class; :attr:`GpuAwareness.direct_ok` is the verdict
for the nonblocking collectives (both classes direct). The whole report goes into the trace
metadata (``gpu_aware_mpi``).

The evidence is then confirmed by a smoke test (:func:`smoke_test`): a small
``Iallreduce`` of a device array whose result is compared with the expected sum.
It runs only where the evidence already allows device buffers (or where the user
forces ``--device-buffers direct`` on a library whose documentation names no class as
staged: ``run.build.check_forced_direct`` refuses the others, since Open MPI 4.1.4 with
CUDA segfaulted in this very test on an H200): a library that cannot read a device
pointer may crash the process, and no Python guard catches a segfault. A raised error, a
wrong result or no completion within a timeout counts as failure (staging).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

#: query functions, ``int f(void)``, of MPICH and Open MPI (absent ones are skipped)
QUERY_FUNCTIONS = ("MPIX_Query_cuda_support", "MPIX_Query_hip_support", "MPIX_Query_rocm_support",
                   "MPIX_Query_ze_support")
#: environment variables that switch GPU support in some library
GPU_ENV = ("MPICH_GPU_SUPPORT_ENABLED", "MPIR_CVAR_ENABLE_GPU", "MV2_USE_CUDA", "OMPI_MCA_opal_cuda_support",
           "OMPI_MCA_pml", "I_MPI_OFFLOAD", "UCX_TLS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
           "ROCR_VISIBLE_DEVICES")


@dataclass
class GpuAwareness:
    """What we know about device buffers and this MPI (one rank's view)."""

    library: str
    version: str
    libmpi: Optional[str]
    queries: Dict[str, bool] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    #: True: CUDA device buffers are accepted; False: they are not; None: unknown
    cuda_aware: Optional[bool] = None
    #: nonblocking collectives (Iallgather, Ireduce_scatter_block, Iallreduce) on device buffers are safe
    direct_ok: bool = False
    reason: str = ""
    #: the device-buffer smoke test (:func:`smoke_test`): None when it did not run
    smoke_test: Optional[Dict] = None
    #: the version parsed from the library's text ("4.1.4"; "" if none), and the variant the rules read
    #: (Open MPI: the PML in use, ``ucx``/``ob1``/``cm``, None if unknown; MVAPICH: ``plus``)
    version_number: str = ""
    variant: Optional[str] = None
    #: the row of :data:`ROUTE_RULES` that applied ("" when none did)
    rule: str = ""
    #: per operation class (:data:`OP_CLASSES`): ``route`` (direct/staged), ``calls``, ``source`` (URL or None),
    #: ``says`` (what the source says, or why staged)
    routes: Dict[str, Dict] = field(default_factory=dict)

    def as_dict(self) -> Dict:
        return asdict(self)


def library_family(version_text: str) -> str:
    """``MPI_Get_library_version`` text -> "Cray MPICH", "MPICH", "Open MPI", "MVAPICH", "Intel MPI" or "unknown"."""
    text = version_text.lower()
    if "cray" in text and "mpich" in text:
        return "Cray MPICH"
    if "mvapich" in text:
        return "MVAPICH"
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "Intel MPI"
    if "open mpi" in text:
        return "Open MPI"
    if "mpich" in text:
        return "MPICH"
    return "unknown"


def loaded_libmpi() -> Optional[str]:
    """Path of the ``libmpi`` this process has loaded (``/proc/self/maps``), else the linker's guess."""
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh
                            if "/libmpi" in line and ".so" in line and "libmpi_" not in line})
    except OSError:
        paths = []
    if paths:
        return paths[0]
    return ctypes.util.find_library("mpi")


def run_queries(libmpi: Optional[str]) -> Dict[str, bool]:
    """Call every :data:`QUERY_FUNCTIONS` the library exports (MPI must be initialized)."""
    if not libmpi:
        return {}
    try:
        lib = ctypes.CDLL(libmpi)
    except OSError:
        return {}
    results = {}
    for name in QUERY_FUNCTIONS:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes, fn.restype = [], ctypes.c_int
        results[name] = bool(fn())
    return results


# ---------------------------------------------------------------------------------------------
# What goes direct, per operation class: the rules table (data; :func:`route_rules` reads it)
# ---------------------------------------------------------------------------------------------
#: the operation classes of the step, and the MPI calls each one carries
OP_CLASSES = ("p2p", "blocking", "nb_gather", "nb_reduce")
OP_CLASS_CALLS = {
    "p2p": "MPI_Isend/MPI_Irecv (pipeline stages)",
    "blocking": "MPI_Allreduce (loss scalars, host buffers in this step)",
    "nb_gather": "MPI_Iallgather",
    "nb_reduce": "MPI_Ireduce_scatter_block, MPI_Iallreduce",
}

OMPI_FAQ = "https://www.open-mpi.org/faq/?category=runcuda"
OMPI5_DOCS = "https://docs.open-mpi.org/en/v5.0.1/tuning-apps/networking/cuda.html"
MPICH_CHANGES = "https://github.com/pmodels/mpich/blob/main/CHANGES"
MPICH_MATRIX = "https://github.com/pmodels/mpich/wiki/GPU-Support-Matrix-(3.4.x)"
NERSC_CRAY = "https://docs.nersc.gov/development/programming-models/mpi/cray-mpich/"
CSCS_CRAY = "https://eth-cscs.github.io/cscs-docs/software/communication/cray-mpich"
MV2_GDR = "http://mvapich.cse.ohio-state.edu/userguide/gdr/2.3"
IMPI_BUFFERS = "https://www.intel.com/content/www/us/en/docs/mpi-library/developer-reference-linux/2021-15/gpu-buffers-support.html"
IMPI_SUPPORT = "https://www.intel.com/content/www/us/en/docs/mpi-library/developer-reference-linux/2021-14/gpu-support.html"
IMPI_SUPPORT_OLD = "https://www.intel.com/content/www/us/en/docs/mpi-library/developer-reference-linux/2021-9/gpu-support.html"

UNDOCUMENTED = "undocumented: staged"


@dataclass(frozen=True)
class Source:
    """One documented fact: where it is and what it says (short)."""

    url: str
    says: str

    def short(self) -> str:
        return f"{self.says} ({self.url})"


def _src(url: str, says: str) -> Source:
    return Source(url, says)


@dataclass(frozen=True)
class RouteRule:
    """One row: a library family (and version range, and variant: Open MPI's PML, MVAPICH-Plus), what
    switches CUDA support on, and per operation class ``(route, source)`` once it is on.

    ``enabled_by``: ``("query", NAME)`` (the library's ``int NAME(void)`` returns 1), ``("env", VAR, VALUE)``,
    or None (never CUDA-aware). ``absent``: :attr:`GpuAwareness.cuda_aware` when the switch is missing
    (False: documented to fail; None: unknown).
    """

    name: str
    family: str
    min_version: Optional[Tuple[int, ...]]
    below_version: Optional[Tuple[int, ...]]
    variant: Optional[str]
    enabled_by: Optional[Tuple[str, ...]]
    absent: Optional[bool]
    routes: Dict[str, Tuple[str, Optional[Source]]]


_OMPI_NO_NBC = _src(OMPI_FAQ + "#mpi-apis-no-cuda", "Open MPI FAQ 'Which MPI APIs do NOT work with CUDA-aware?' lists "
                    "MPI_Iallgather and MPI_Iallreduce; 'Neither the nonblocking collective APIs ... are supported'")
_OMPI_UCX_NO_NBR = _src(OMPI_FAQ + "#mpi-apis-no-cuda-ucx", "Open MPI FAQ 'Which MPI APIs do NOT work with "
                        "CUDA-aware UCX?': non-blocking reduction collectives like MPI_Ireduce, MPI_Iallreduce")
_OMPI5_NO_NBC = _src(OMPI5_DOCS, "Open MPI 5 docs 'Which MPI APIs do NOT work with CUDA-aware?' lists "
                     "MPI_Iallgather, MPI_Iallreduce")
_OMPI5_UCX_NO_NBR = _src(OMPI5_DOCS, "Open MPI 5 docs 'Which MPI APIs do NOT work with CUDA-aware UCX?': all "
                         "non-blocking reduction collectives like MPI_Ireduce, MPI_Iallreduce")

ROUTE_RULES: Tuple[RouteRule, ...] = (
    RouteRule("Open MPI 2.0-4.x, UCX PML", "Open MPI", (2, 0), (5, 0), "ucx", ("query", "MPIX_Query_cuda_support"),
              None, {
                  "p2p": ("direct", _src(OMPI_FAQ + "#mpi-apis-cuda-ucx", "Open MPI FAQ 'Which MPI APIs work with "
                                         "CUDA-aware UCX?' lists MPI_Isend, MPI_Irecv (UCX v1.4)")),
                  "blocking": ("direct", _src(OMPI_FAQ + "#mpi-apis-cuda-ucx", "same list: MPI_Allreduce, "
                                              "MPI_Reduce_scatter_block, MPI_Allgather")),
                  "nb_gather": ("direct", _src(OMPI_FAQ + "#mpi-apis-cuda-ucx", "same list: MPI_Iallgather")),
                  "nb_reduce": ("staged", _OMPI_UCX_NO_NBR)}),
    RouteRule("Open MPI 2.0-4.x, ob1 (smcuda/tcp BTLs) or cm", "Open MPI", (2, 0), (5, 0), None,
              ("query", "MPIX_Query_cuda_support"), None, {
                  "p2p": ("direct", _src(OMPI_FAQ + "#mpi-apis-cuda", "Open MPI FAQ 'Which MPI APIs work with "
                                         "CUDA-aware?': MPI_Isend, MPI_Irecv since v1.7.0")),
                  "blocking": ("direct", _src(OMPI_FAQ + "#mpi-apis-cuda", "same table: MPI_Allgather since "
                                              "v1.7.0; MPI_Allreduce, MPI_Reduce_scatter_block since v1.8.5")),
                  "nb_gather": ("staged", _OMPI_NO_NBC),
                  "nb_reduce": ("staged", _OMPI_NO_NBC)}),
    RouteRule("Open MPI 5.x, UCX PML", "Open MPI", (5, 0), None, "ucx", ("query", "MPIX_Query_cuda_support"),
              None, {
                  "p2p": ("direct", _src(OMPI5_DOCS, "Open MPI 5 docs 'Which MPI APIs work with CUDA-aware UCX?' "
                                         "lists MPI_Isend, MPI_Irecv")),
                  "blocking": ("direct", _src(OMPI5_DOCS, "same list: MPI_Allreduce, MPI_Reduce_scatter_block")),
                  "nb_gather": ("direct", _src(OMPI5_DOCS, "same list: MPI_Iallgather")),
                  "nb_reduce": ("staged", _OMPI5_UCX_NO_NBR)}),
    RouteRule("Open MPI 5.x, ob1 (smcuda/tcp BTLs) or cm", "Open MPI", (5, 0), None, None,
              ("query", "MPIX_Query_cuda_support"), None, {
                  "p2p": ("direct", _src(OMPI5_DOCS, "Open MPI 5 docs 'Which MPI APIs work with CUDA-aware?' lists "
                                         "MPI_Isend, MPI_Irecv")),
                  "blocking": ("direct", _src(OMPI5_DOCS, "same list: MPI_Allreduce, MPI_Reduce_scatter_block, "
                                              "MPI_Allgather")),
                  "nb_gather": ("staged", _OMPI5_NO_NBC),
                  "nb_reduce": ("staged", _OMPI5_NO_NBC)}),
    RouteRule("MPICH >= 3.4 with CUDA (yaksa)", "MPICH", (3, 4), None, None, ("query", "MPIX_Query_cuda_support"),
              None, {cls: ("direct", _src(MPICH_CHANGES, "MPICH CHANGES, 'Changes in 3.4': 'Add support for GPU "
                                          "buffers (CUDA, Level Zero) in pt2pt, collectives, and one-sided "
                                          "communication'; " + MPICH_MATRIX + ": NVIDIA pt2pt and collectives "
                                          "supported (ch4:ofi: may incur extra copies)"))
                     for cls in OP_CLASSES}),
    RouteRule("Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1 (GTL linked)", "Cray MPICH", None, None, None,
              ("env", "MPICH_GPU_SUPPORT_ENABLED", "1"), False,
              {cls: ("direct", _src(NERSC_CRAY, "NERSC: 'HPE Cray MPI is a CUDA-aware MPI implementation ... pointers "
                                    "to GPU device memory in MPI buffers' (no per-operation exception listed); at run "
                                    "time MPICH_GPU_SUPPORT_ENABLED=1 must be set; " + CSCS_CRAY + ": GTL linked "
                                    "and the variable set, else GPU buffers fail"))
               for cls in OP_CLASSES}),
    RouteRule("MVAPICH-Plus", "MVAPICH", None, None, "plus", None, None,
              {cls: ("staged", None) for cls in OP_CLASSES}),
    RouteRule("MVAPICH2-GDR >= 2.3 with MV2_USE_CUDA=1", "MVAPICH", None, None, None, ("env", "MV2_USE_CUDA", "1"),
              None, {cls: ("direct", _src(MV2_GDR, "MVAPICH2-GDR 2.3 user guide: GPU-buffer based intranode and "
                                          "internode MPI communication, and 'efficient support for Non-Blocking "
                                          "Collectives (NBC) from GPU buffers'"))
                     for cls in OP_CLASSES}),
    RouteRule("Intel MPI >= 2021.14 with I_MPI_OFFLOAD=1", "Intel MPI", (2021, 14), None, None,
              ("env", "I_MPI_OFFLOAD", "1"), None, {
                  "p2p": ("direct", _src(IMPI_BUFFERS, "Intel MPI Developer Reference 'GPU Buffers Support': device "
                                         "buffers in MPI functions such as MPI_Send, MPI_Recv, MPI_Bcast, "
                                         "MPI_Allreduce (Level Zero or CUDA; NVIDIA GPUs since 2021.14: "
                                         + IMPI_SUPPORT + ")")),
                  "blocking": ("direct", _src(IMPI_BUFFERS, "same page: MPI_Bcast, MPI_Allreduce")),
                  "nb_gather": ("staged", None),
                  "nb_reduce": ("staged", None)}),
    RouteRule("Intel MPI < 2021.14", "Intel MPI", None, (2021, 14), None, None, False,
              {cls: ("staged", _src(IMPI_SUPPORT_OLD, "Intel MPI 2021.9 'GPU Support': 'Current support is limited "
                                    "to Intel GPUs only' (no CUDA buffers)")) for cls in OP_CLASSES}),
)


def parse_version(text: str) -> Optional[Tuple[int, ...]]:
    """The first ``X.Y[.Z]`` of a ``MPI_Get_library_version`` text (``Open MPI v4.1.4`` -> ``(4, 1, 4)``)."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def open_mpi_pml(env: Dict[str, str], maps_text: Optional[str] = None) -> Optional[str]:
    """The PML Open MPI uses (``ucx``, ``ob1``, ``cm``), or None when it cannot be told.

    A plain ``OMPI_MCA_pml`` (the user's choice) wins; else the one ``mca_pml_*.so`` component still loaded
    after ``MPI_Init`` (Open MPI closes the components it did not select; a static build shows none). None
    falls to the rows that do not name a PML, whose routes are a subset of the UCX rows'."""
    chosen = env.get("OMPI_MCA_pml", "").strip()
    if re.fullmatch(r"[a-z0-9]+", chosen):
        return chosen
    if maps_text is None:
        try:
            with open("/proc/self/maps") as fh:
                maps_text = fh.read()
        except OSError:
            return None
    loaded = set(re.findall(r"mca_pml_([a-z0-9]+)\.so", maps_text))
    return loaded.pop() if len(loaded) == 1 else None


def library_variant(library: str, version_text: str, env: Dict[str, str]) -> Optional[str]:
    """What :data:`ROUTE_RULES` distinguishes within a family: Open MPI's PML, MVAPICH-Plus."""
    if library == "Open MPI":
        return open_mpi_pml(env)
    if library == "MVAPICH" and "plus" in version_text.lower():
        return "plus"
    return None


def find_rule(library: str, version: Optional[Tuple[int, ...]], variant: Optional[str]) -> Optional[RouteRule]:
    """The first row of :data:`ROUTE_RULES` for ``library`` whose variant (None: any) and version range
    (an unknown version matches any) fit."""
    for rule in ROUTE_RULES:
        if rule.family != library or (rule.variant is not None and rule.variant != variant):
            continue
        if version is not None and ((rule.min_version and version < rule.min_version)
                                    or (rule.below_version and version >= rule.below_version)):
            continue
        return rule
    return None


def _all_staged(why: str) -> Dict[str, Dict]:
    return {cls: {"route": "staged", "calls": OP_CLASS_CALLS[cls], "source": None, "says": why} for cls in OP_CLASSES}


def route_rules(library: str, queries: Dict[str, bool], env: Dict[str, str],
                version: Optional[Tuple[int, ...]] = None, variant: Optional[str] = None):
    """``(cuda_aware, routes, rule name, reason)`` from the evidence and :data:`ROUTE_RULES` (pure).

    ``routes``: per class of :data:`OP_CLASSES` a dict ``route`` (direct/staged), ``calls``, ``source``, ``says``.
    Not CUDA-aware (or unknown, or no row): every class staged."""
    rule = find_rule(library, version, variant)
    if rule is None:
        shown = ".".join(map(str, version)) if version else "of unknown version"
        known = any(r.family == library for r in ROUTE_RULES)
        why = (f"no documented rule for {library} {shown}: {UNDOCUMENTED}" if known else
               f"no way to ask {library} about device buffers: staging through host memory ({UNDOCUMENTED})")
        cuda = queries.get("MPIX_Query_cuda_support")
        return (bool(cuda) if cuda is not None else None), _all_staged(why), "", why
    kind = rule.enabled_by[0] if rule.enabled_by else None
    if kind is None:
        why = f"{rule.name}: no device-buffer support documented for CUDA: staging through host memory"
        return rule.absent, _all_staged(why), rule.name, why
    if kind == "query":
        name = rule.enabled_by[1]
        answer = queries.get(name)
        if answer is None:
            why = (f"no way to ask {library} about device buffers (no {name}: built without the CUDA extension?): "
                   "staging through host memory")
            return None, _all_staged(why), rule.name, why
        if not answer:
            disabled = env.get("MPIR_CVAR_ENABLE_GPU") == "0" and library == "MPICH"
            why = (f"{library} GPU support disabled by MPIR_CVAR_ENABLE_GPU=0 ({name}() = 0)" if disabled else
                   f"{library} reports no CUDA support ({name}() = 0: built without CUDA)")
            return False, _all_staged(why), rule.name, why
        evidence = f"{library} reports CUDA support ({name}() = 1)"
    else:
        var, value = rule.enabled_by[1], rule.enabled_by[2]
        if env.get(var) != value:
            why = f"{library} without {var}={value} (set it to pass device buffers): staging through host memory"
            if library == "Cray MPICH":
                why = (f"Cray MPICH without {var}={value} (set it, and load the GTL library): "
                       "staging through host memory")
            return rule.absent, _all_staged(why), rule.name, why
        evidence = f"{var}={value}"
    routes = {}
    for cls in OP_CLASSES:
        route, source = rule.routes[cls]
        routes[cls] = {"route": route, "calls": OP_CLASS_CALLS[cls], "source": source.url if source else None,
                       "says": source.says if source else UNDOCUMENTED}
    staged = [f"{cls} ({OP_CLASS_CALLS[cls]})" for cls in OP_CLASSES if routes[cls]["route"] == "staged"]
    why = f"{rule.name}: {evidence}" + (f"; staged: {', '.join(staged)}" if staged else "; every class direct")
    return True, routes, rule.name, why


def decide(library: str, queries: Dict[str, bool], env: Dict[str, str],
           version: Optional[Tuple[int, ...]] = None, variant: Optional[str] = None):
    """``(cuda_aware, direct_ok, reason)`` from the evidence (pure: the tests feed it cases); ``direct_ok``:
    both nonblocking-collective classes go direct (:func:`route_rules` has the per-class answer)."""
    cuda, routes, _, reason = route_rules(library, queries, env, version, variant)
    direct = all(routes[cls]["route"] == "direct" for cls in ("nb_gather", "nb_reduce"))
    return cuda, direct, reason


def detect() -> GpuAwareness:
    """This rank's view (local, no communication, no device pointer). MPI must be initialized."""
    from mpi4py import MPI

    version = MPI.Get_library_version().strip()
    library = library_family(version)
    libmpi = loaded_libmpi()
    queries = run_queries(libmpi)
    env = {k: os.environ[k] for k in GPU_ENV if k in os.environ}
    number = parse_version(version)
    variant = library_variant(library, version, env)
    cuda, routes, rule, reason = route_rules(library, queries, env, number, variant)
    direct = all(routes[cls]["route"] == "direct" for cls in ("nb_gather", "nb_reduce"))
    return GpuAwareness(library=library, version=version.splitlines()[0].strip() if version else "",
                        libmpi=libmpi, queries=queries, env=env, cuda_aware=cuda, direct_ok=direct, reason=reason,
                        version_number=".".join(map(str, number)) if number else "", variant=variant, rule=rule,
                        routes=routes)


def describe_routes(awareness: "GpuAwareness", chosen: Optional[Dict[str, str]] = None) -> list:
    """Report lines: library, version, CUDA-aware yes/no/unknown, then one line per operation class with
    what the rules say and its source (``chosen``: the routes the run uses, when they differ)."""
    aware = {True: "yes", False: "no", None: "unknown"}[awareness.cuda_aware]
    variant = f", {awareness.variant}" if awareness.variant else ""
    lines = [f"GPU-aware MPI: {awareness.library} {awareness.version_number or '?'}{variant}: CUDA-aware {aware}; "
             f"{awareness.reason}"]
    if awareness.cuda_aware is not True and not chosen:
        lines.append(f"  every operation class staged for device buffers ({', '.join(OP_CLASSES)})")
        return lines
    for cls in OP_CLASSES:
        info = awareness.routes.get(cls, {})
        rule_route = info.get("route", "staged")
        used = (chosen or {}).get(cls, rule_route)
        shown = used if used == rule_route else f"{used} (rules: {rule_route})"
        source = info.get("source")
        says = info.get("says", UNDOCUMENTED)
        lines.append(f"  {cls:<9} {shown:<7} {info.get('calls', OP_CLASS_CALLS[cls])}: "
                     + (f"{says} [{source}]" if source else says))
    return lines


#: elements of the smoke-test all-reduce, and how long it may take before it counts as failed
SMOKE_ELEMENTS = 1024
SMOKE_TIMEOUT_S = 20.0


def smoke_expected(size: int, n: int = SMOKE_ELEMENTS) -> np.ndarray:
    """What the smoke test's sum must be on ``size`` ranks: rank ``r`` contributes ``arange(n) % 251 + r``
    (small integers: exact in float32, order-independent)."""
    base = (np.arange(n) % 251).astype(np.float64)
    return size * base + size * (size - 1) / 2


def smoke_test(comm, backend, timeout_s: float = SMOKE_TIMEOUT_S) -> Dict:
    """``Iallreduce`` of a small backend (device) array over ``comm``, checked against :func:`smoke_expected`.

    Collective over ``comm``; every rank returns the same verdict
    ``{"ran": True, "ok": bool (all ranks), "elements", "seconds", "detail"}``.
    The test runs on a duplicate of ``comm``: if a rank gives up after ``timeout_s`` the
    pending request and its communicator are abandoned (never freed), so they cannot
    match a later collective. The verdict is agreed on ``comm`` with host buffers.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    n = SMOKE_ELEMENTS
    ok, detail, abandoned = False, "", False
    t0 = time.perf_counter()
    try:
        host = (np.arange(n) % 251 + rank).astype(np.float32)
        xp = backend.xp
        send = xp.asarray(host)
        recv = xp.zeros(n, dtype=np.float32)
        backend.synchronize()  # MPI reads the device buffer outside any stream (stream rule 1)
        request = dup.Iallreduce(send, recv, op=MPI.SUM)
        deadline = time.perf_counter() + timeout_s
        while not request.Test():
            if time.perf_counter() > deadline:
                abandoned = True
                raise TimeoutError(f"no completion within {timeout_s:g} s")
            time.sleep(1e-4)
        got = np.asarray(backend.to_host(recv), dtype=np.float64)
        expected = smoke_expected(size, n)
        wrong = int(np.count_nonzero(got != expected))
        ok = wrong == 0
        detail = "result correct" if ok else (f"{wrong} of {n} elements wrong "
                                              f"(first got {got[0]!r}, expected {expected[0]!r})")
    except Exception as exc:  # an MPI error on a device pointer, a timeout, ...
        detail = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    seconds = time.perf_counter() - t0
    if not abandoned:
        dup.Free()
    verdicts = comm.allgather((ok, detail))
    all_ok = all(v[0] for v in verdicts)
    if not all_ok:
        bad = next(r for r, v in enumerate(verdicts) if not v[0])
        detail = f"rank {bad}: {verdicts[bad][1]}"
    return {"ran": True, "ok": all_ok, "elements": n, "seconds": round(seconds, 6), "detail": detail}
