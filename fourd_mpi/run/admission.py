"""Memory admission: before a run allocates, every rank checks that the run fits in what it may use.

The need is the memory model's estimate per rank (:func:`fourd_mpi.perf.memory.estimate_memory`:
weights, gradients, optimizer state, activations, communication buffers) plus the synthetic data
batches the run prepares before its first step (``2 * batches * m * h/G_x`` elements, of which
the model already counts one batch as the step's input and target).

What a rank may use (its *budget*), the smallest of:

- ``--memory-limit SIZE`` when given (it replaces everything below; ``0`` turns the check off);
- host memory: ``MemAvailable`` of ``/proc/meminfo`` divided by the ranks on this node (a
  ``COMM_TYPE_SHARED`` split of the communicator);
- the memory cgroup this rank runs in (Slurm's ``task/cgroup``, a container): its limit minus
  its usage, divided by the ranks of this node in the same cgroup (cgroup v2 ``memory.max`` /
  ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``);
- the address-space limit (``ulimit -v``, ``RLIMIT_AS``) minus what this process maps already;
- on the CuPy backend, the device's free memory (``cudaMemGetInfo``) divided by the ranks of
  this node on the same device.

Every rank measures its own budget; the smallest over the ranks decides, so every rank raises
the same :class:`~fourd_mpi.errors.ConfigError`, naming the estimate, the budget and where it
comes from, and a change that fits: another grid of the same ranks, a smaller batch, fewer
layers, a smaller hidden size (:func:`suggestions`).

The model counts what the step keeps, not NumPy's temporaries: a run that passes can still
run out of memory in a transient. :func:`guard_allocation` turns a ``MemoryError`` while the
model and data are allocated into the same one-line error on every rank.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, replace
from math import gcd
from typing import Callable, List, Optional, Tuple, TypeVar

from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.presets import ModelConfig, model_problems
from fourd_mpi.util.text import human_bytes

T = TypeVar("T")
#: a suggested change must fit with this factor on the estimate: the step's temporaries (dW blocks,
#: Adam's elementwise work, the array pool) are not in the model, and the peak RSS of one rank
#: measured 1.39x (gpt-tiny, hidden 1024: 623 MB over a 60 MB interpreter for a 404 MiB estimate)
#: and 1.35x (hidden 2048: 2194 MB for 1576 MiB) of the estimate with /usr/bin/time
SUGGESTION_HEADROOM = 1.5
#: limits at or above this many bytes mean "no limit" (cgroup v1 writes 2^63 rounded to a page)
UNLIMITED = 1 << 60


# -- the need ---------------------------------------------------------------------------------------

#: bytes of temporaries per element of a tensor while it is generated (int64 indices, the uint64 hash,
#: float64 values, the cast copy), measured with ``tracemalloc``: 28 per element of the largest weight
#: shard around :class:`~fourd_mpi.step.model.Model`, 32 per element of one ``[m, h/G_x]`` data tensor
#: around :class:`~fourd_mpi.step.model.SyntheticData`; the larger is used for both
#: (tests/run/test_admission.py measures them again)
INIT_TRANSIENT_BYTES = 32


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes per rank: the memory model's total during the steps plus the synthetic data batches
    beyond the first, or the peak while the weights are initialised, whichever is larger."""

    model_bytes: int
    data_bytes: int
    #: the peak before the steps: weights plus the temporaries of the largest weight shard, or weights,
    #: every data batch and the temporaries of one data tensor
    init_bytes: int
    #: the model's categories in words: ``weights 1.2 GiB, gradients 1.2 GiB, ...``
    describe_model: str

    @property
    def total(self) -> int:
        return max(self.model_bytes + self.data_bytes, self.init_bytes)


def _model_total(estimate) -> int:
    total = estimate.total
    return int(total() if callable(total) else total)


def largest_shard(cfg: ModelConfig, grid: GridShape) -> int:
    """Elements of the largest weight shard a rank stores, ``n*k/(G_x*G_y*G_z)``."""
    from fourd_mpi.perf.memory import block_elements, fc_weights

    return max(block_elements(n, k, t, grid) // grid.z for _, n, k, t in fc_weights(cfg, grid))


def memory_need(options, attention: str = "unfused") -> MemoryNeed:
    """The estimate per rank of :class:`~fourd_mpi.algorithms.runoptions.RunOptions` ``options`` (pure); ``attention``:
    the kernels that will run (``unfused`` keeps the score matrix; a fused mode only a row statistic)."""
    cfg, grid = options.model, options.grid
    # the family's own estimate (pipeline: the fullest stage) and tokens per rank m (optimus3d: B*s/(G_data q^2))
    estimate, m = get_algorithm(options.algorithm).spec.required("admission")(options, attention)
    batches = min(options.data_batches, options.steps)
    tensor = m * (cfg.hidden // grid.x)  # one input or target [m, h/G_x] ([m, h/q] on a cube)
    data = 2 * max(0, batches - 1) * tensor * dtype_bytes(options.dtype)
    init = estimate.weights + max(INIT_TRANSIENT_BYTES * largest_shard(cfg, grid),  # making the weights
                                  2 * batches * tensor * dtype_bytes(options.dtype)  # making the data
                                  + INIT_TRANSIENT_BYTES * tensor)
    parts = {k: v for k, v in estimate.as_dict().items() if k != "total" and v}
    shown = ", ".join(f"{k.replace('_buffers', '')} {human_bytes(v)}" for k, v in parts.items())
    return MemoryNeed(_model_total(estimate), data, init, shown)


# -- the budget -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """What one rank may allocate: ``bytes`` and where the number comes from (``source``)."""

    bytes: int
    source: str


def mem_available(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` in bytes (None where the kernel does not say)."""
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup",
                  root: str = "/sys/fs/cgroup") -> Optional[Tuple[int, int, str]]:
    """``(limit, usage, cgroup path)`` of this process's memory cgroup, or None without a limit.

    cgroup v2 (a ``0::/path`` line): ``root/path/memory.max`` and ``memory.current``; v1 (a
    ``N:memory:/path`` line): ``root/memory/path/memory.limit_in_bytes`` and ``memory.usage_in_bytes``.
    A container sees its own cgroup at the mount's root, so the root files are the fallback.
    """
    try:
        with open(proc_cgroup) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            dirs, files = [os.path.join(root, path.lstrip("/")), root], ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
            dirs, files = [os.path.join(base, path.lstrip("/")), base], ("memory.limit_in_bytes",
                                                                           "memory.usage_in_bytes")
        else:
            continue
        for d in dirs:
            if os.path.exists(os.path.join(d, files[0])):
                limit, usage = _read_int(os.path.join(d, files[0])), _read_int(os.path.join(d, files[1]))
                if limit is None or limit >= UNLIMITED:
                    break
                return limit, usage or 0, path
    return None


def address_space(status: str = "/proc/self/status") -> Optional[Tuple[int, int]]:
    """``(RLIMIT_AS, VmSize)`` in bytes: the address-space limit (``ulimit -v``) and what this process
    maps already; None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= UNLIMITED:
        return None
    mapped = 0
    try:
        with open(status) as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return soft, mapped


def host_budgets(ranks_on_node: int, ranks_in_cgroup: int, hostname: str) -> List[Budget]:
    """This rank's share of the host memory by every measure that applies (see the module doc)."""
    out = []
    available = mem_available()
    if available is not None:
        out.append(Budget(available // ranks_on_node, f"MemAvailable {human_bytes(available)} / "
                                                      f"{ranks_on_node} ranks on node {hostname}"))
    cgroup = cgroup_memory()
    if cgroup is not None:
        limit, usage, path = cgroup
        out.append(Budget(max(0, limit - usage) // ranks_in_cgroup,
                          f"memory cgroup {path}: limit {human_bytes(limit)} - {human_bytes(usage)} used, / "
                          f"{ranks_in_cgroup} ranks in it on node {hostname}"))
    space = address_space()
    if space is not None:
        limit, mapped = space
        out.append(Budget(max(0, limit - mapped), f"ulimit -v {human_bytes(limit)} - {human_bytes(mapped)} "
                                                  f"this process maps already, on node {hostname}"))
    return out


def device_budget(backend, ranks_on_device: int, hostname: str) -> Optional[Budget]:
    """The CuPy device's free memory divided by the ranks of this node that use it (None on NumPy)."""
    if getattr(backend, "name", "numpy") != "cupy":
        return None
    free, _ = backend.xp.cuda.runtime.memGetInfo()
    return Budget(free // ranks_on_device, f"free memory of GPU {backend.xp.cuda.Device().id} "
                                           f"{human_bytes(free)} / {ranks_on_device} ranks on it, node {hostname}")


def _device_key(backend) -> str:
    if getattr(backend, "name", "numpy") != "cupy":
        return ""
    try:
        return backend.xp.cuda.Device().pci_bus_id
    except Exception:  # noqa: BLE001 - any identifier of the device will do
        return str(backend.xp.cuda.Device().id)


def _cgroup_key() -> str:
    found = cgroup_memory()
    return found[2] if found is not None else ""


def rank_budget(comm, backend, memory_limit: Optional[int]) -> Optional[Budget]:
    """This rank's budget (its smallest measure), or None when the check is off (``--memory-limit 0``).

    With ``--memory-limit`` nothing is measured. Otherwise collective over ``comm``: a
    ``COMM_TYPE_SHARED`` split and an allgather on it count the ranks of this node, of its
    memory cgroup and of its device.
    """
    if memory_limit is not None:
        return None if memory_limit == 0 else Budget(memory_limit, "--memory-limit")
    import socket

    from mpi4py import MPI

    hostname = socket.gethostname()
    mine = (_cgroup_key(), _device_key(backend))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        keys = node.allgather(mine)
    finally:
        node.Free()
    budgets = host_budgets(len(keys), sum(k[0] == mine[0] for k in keys), hostname)
    device = device_budget(backend, sum(k[1] == mine[1] for k in keys), hostname)
    if device is not None:
        budgets.append(device)
    return min(budgets, key=lambda b: b.bytes) if budgets else None


# -- what would fit ---------------------------------------------------------------------------------

def grid_flags(grid: GridShape) -> str:
    return f"--gdata {grid.data} --gz {grid.z} --gy {grid.y} --gx {grid.x}"


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> Optional[int]:
    """The largest ``k`` in ``[low, high]`` with ``fits(k)``, for a ``fits`` true below some bound."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // gcd(out, v)
    return out


def suggestions(options, world_size: int, budget: int,
                need: Callable[[object], int] = lambda o: memory_need(o).total) -> List[str]:
    """Changes that fit ``budget`` bytes per rank with :data:`SUGGESTION_HEADROOM`, as command-line
    flags (pure).

    In order: the grid of ``world_size`` ranks with the smallest estimate; the largest smaller
    batch (a multiple of ``G_data * G_z``); and, when neither fits, the most layers, then the
    largest hidden size (a multiple of what the grid and heads need; a GPT's FFN stays 4 h,
    another FFN width keeps its ratio). Empty when nothing fits.
    """
    cfg, grid = options.model, options.grid
    budget = int(budget / SUGGESTION_HEADROOM)

    def fits_model(model: ModelConfig, g: GridShape = grid) -> bool:
        if model_problems(model, g):
            return False
        try:
            return need(replace(options, model=model, grid=g)) <= budget
        except ConfigError:
            return False

    out: List[str] = []
    best = None
    for g in grid_factorizations(world_size):
        if g == grid or model_problems(cfg, g):
            continue
        total = need(replace(options, grid=g))
        if total <= budget and (best is None or total < best[0]):
            best = (total, g)
    if best is not None:
        out.append(grid_flags(best[1]))
    unit = grid.data * grid.z
    k = _largest(1, cfg.batch // unit - 1, lambda k: fits_model(replace(cfg, batch=k * unit)))
    if k is not None:
        out.append(f"--batch {k * unit}")
    if out:
        return out
    layers = _largest(1, cfg.layers - 1, lambda n: fits_model(replace(cfg, layers=n)))
    if layers is not None:
        return [f"--layers {layers}"]
    ratio = cfg.ffn_hidden / cfg.hidden
    gpt_default = cfg.kind == "gpt" and cfg.ffn_hidden == 4 * cfg.hidden

    def resized(h: int) -> ModelConfig:
        return replace(cfg, hidden=h, ffn_hidden=max(1, round(h * ratio)))

    step = _lcm(grid.x, grid.y, *((cfg.heads,) if cfg.kind == "gpt" else ()))
    k = _largest(1, (cfg.hidden - 1) // step, lambda k: need(replace(options, model=resized(k * step))) <= budget)
    for k in range(k or 0, max(0, (k or 0) - 1000), -1):  # the largest that also divides evenly
        if fits_model(resized(k * step)):
            h = resized(k * step)
            return [f"--hidden {h.hidden}" + ("" if gpt_default else f" --ffn-hidden {h.ffn_hidden}")]
    return []


def refusal(need: MemoryNeed, budget: Budget, options, world_size: int) -> str:
    """The one line of a refused run."""
    data = f", data batches {human_bytes(need.data_bytes)}" if need.data_bytes else ""
    if need.init_bytes > need.model_bytes + need.data_bytes:
        what = ("while the weights are initialised; during the steps "
                f"{human_bytes(need.model_bytes + need.data_bytes)}: ")
    else:
        what = ""
    text = (f"the run needs {human_bytes(need.total)} per rank ({what}{need.describe_model}{data}), "
            f"{human_bytes(budget.bytes)} available ({budget.source})")
    fixes = suggestions(options, world_size, budget.bytes)
    if fixes:
        return text + "; fits with " + " or ".join(fixes)
    return text + (f"; no grid of {world_size} ranks, smaller batch, layer count or hidden size fits: "
                   "use more ranks or a machine with more memory")


# -- the check --------------------------------------------------------------------------------------

def admit(comm, options, backend) -> Tuple[MemoryNeed, Optional[Budget]]:
    """Refuse a run that does not fit, with the same :class:`ConfigError` on every rank of ``comm``.

    Collective over ``comm``; call it before the model and data are allocated. Returns the need
    and the smallest budget over the ranks (None: ``--memory-limit 0`` or nothing measurable).
    """
    need = memory_need(options, backend.attention)
    mine = rank_budget(comm, backend, options.memory_limit)
    everyone = comm.allgather(None if mine is None else (mine.bytes, mine.source))
    known = [b for b in everyone if b is not None]
    if not known:
        return need, None
    tight = Budget(*min(known))
    if need.total > tight.bytes:
        raise ConfigError(refusal(need, tight, options, options.grid.size))  # ranks of one 4D grid
    return need, tight


def allocate(comm, what: str, fn: Callable[[], T], need: Optional[MemoryNeed] = None) -> T:
    """Run ``fn`` (which allocates, and makes no collective) on every rank of ``comm``; a
    ``MemoryError`` (or a user error) on any rank becomes the same :class:`ConfigError` on all.

    Collective over ``comm`` (one allgather), so a rank that ran out of memory never leaves
    the others waiting in the run's first collective.
    """
    from fourd_mpi.errors import BackendError

    result, error = None, None
    try:
        result = fn()
    except MemoryError as exc:
        estimate = f"; the memory model estimated {human_bytes(need.total)} per rank" if need is not None else ""
        error = ("ConfigError", f"out of memory while allocating {what} on rank {comm.Get_rank()} "
                                f"({' '.join(str(exc).split()) or type(exc).__name__}){estimate}: give a smaller "
                                "model or batch, more ranks, or check --memory-limit")
    except (ConfigError, BackendError) as exc:
        error = (type(exc).__name__, str(exc))
    errors = comm.allgather(error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        result = None
        raise (BackendError if first[0] == "BackendError" else ConfigError)(first[1])
    return result
