"""MPI progress strategies: who drives nonblocking collectives while a rank computes.

Measured on our machines (docs/design.md section 3): MPICH and Open MPI make no
progress on a nonblocking collective while the host is inside a NumPy matmul,
so the ``Wait`` afterwards costs about the whole collective. Strategies:

``auto`` (the default)
    One of the two below, chosen at the start of a run (:func:`choose_progress`): ``thread`` when
    collectives overlap compute, every axis the rank communicates over stays on its node (shared
    memory), the host computes (NumPy), every node has a spare CPU per rank
    (:data:`THREAD_CPUS_PER_RANK`) and MPI gives ``MPI_THREAD_MULTIPLE``; ``poll`` otherwise.
    Why, measured on our machines (``results/benchmarks/progress-auto-1node.txt``,
    ``progress-auto-link.txt``): a shared-memory transfer moves only while some call polls MPI
    about every 0.1 ms (a thread polling every 1 ms left much of it exposed, every 5 ms nearly
    all), which GEMM chunks cannot do cheaply, so polls hid none of it and a thread 97-98 %, but
    with one CPU per rank the thread took 9-15 % of the compute; across a TCP link the thread also
    competed with the network stack, while polls every 50 ms of compute hid 83-85 % of the
    transfers at comm/compute 0.15-0.33. On a GPU the host polls while the GPU computes, so a
    thread adds nothing. The trace stores the strategy that ran.
``none``
    Nothing between compute; MPI progresses only inside ``Test``/``Wait``. Shows the problem.
``poll``
    GEMMs are split into chunks of about ``chunk_flops`` FLOPs and
    ``MPI_Testsome`` is called on the requests in flight between chunks. On a GPU the
    GEMM is one asynchronous kernel and the host polls until its event completes.
    ``chunk_flops="auto"`` (the default) sizes the chunks from what the run measures
    (:class:`AutoChunk`): chunks of at least :data:`MIN_CHUNK_S` of compute at the
    measured GEMM rate, longer where a poll costs more than :data:`POLL_BUDGET` of them.
    Finer chunks slow the compute they cut (smaller GEMMs, and every poll lets the
    progress engine copy data on the rank's core): on the emulated cluster and on one
    node a fixed 1e7-FLOP chunk (0.5 ms) slowed the compute inside an overlapped step
    1.14-1.52x, a 2 %-poll-budget rule 1.03-1.17x, 1e9 FLOPs (50 ms) 0.90-0.99x in 5 of
    6 cases (1.25x once, rounds 0.88-1.40), and 1e9 hid 72-83 % of the link's transfers
    (1e7: 55-86 %)
    (``results/benchmarks/multinode-overlap.txt``, ``multinode-overlap-1node.txt``).
``thread``
    A dedicated Python thread polls ``MPI_Testsome`` while the main thread computes
    (NumPy releases the GIL inside matmul). Needs ``MPI_THREAD_MULTIPLE``. It
    competes with the ranks for cores: harmful on oversubscribed nodes (8 ranks on
    2 cores), meant for nodes with a spare core per rank. (MPICH's own
    ``MPICH_ASYNC_PROGRESS=1`` is the library-side equivalent; we measured it
    2-150x slower per collective with 8 ranks on 2 cores.)

Every strategy completes a request exactly once and records when it was first
seen complete; only the main thread retires handles (see ``collectives``).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Callable, Deque, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError

PROGRESS_STRATEGIES = ("auto", "none", "poll", "thread")


def _testsome(handles) -> bool:
    """Test the not-yet-complete handles at once; mark the completed ones. False: none was pending."""
    pending = [h for h in handles if not h.done]
    if not pending:
        return False
    from mpi4py import MPI  # here, not at import: the option table reads PROGRESS_STRATEGIES offline

    requests = [h.request for h in pending]
    indices = MPI.Request.Testsome(requests)
    if indices:
        now = time.perf_counter_ns()
        for i in indices:
            pending[i].request = requests[i]
            pending[i].observe_complete(now)
    return True


class NoProgress:
    """MPI progresses only when a handle is tested or waited."""

    name = "none"
    chunk_flops = None
    #: why ``--progress auto`` chose this strategy (None: asked for by name)
    chosen = None
    #: whether :meth:`poll` / :meth:`test` call MPI on the main thread (their time is MPI time in the trace)
    calls_mpi_on_poll = False
    calls_mpi_on_test = True

    def start(self, handle, issue: Callable):
        handle.request = issue()

    def poll(self, handles) -> None:
        pass

    def compute_hook(self, comm):
        return None

    def test(self, handle) -> None:
        if handle.request.Test():
            handle.observe_complete()

    def wait(self, handle) -> None:
        handle.request.Wait()
        handle.observe_complete()

    def wait_any(self, handles) -> int:
        """Block until one of ``handles`` (none complete yet) completes (``MPI_Waitany``); returns its index."""
        from mpi4py import MPI

        requests = [h.request for h in handles]
        index = MPI.Request.Waitany(requests)
        handles[index].request = requests[index]
        handles[index].observe_complete()
        return index

    def close(self) -> None:
        pass

    def describe(self) -> str:
        """The strategy, and why ``--progress auto`` chose it."""
        return self._describe() + (f" ({self.chosen})" if self.chosen else "")

    def _describe(self) -> str:
        return "none (MPI progresses only in Test/Wait)"


#: ``--poll-flops auto``: the largest share of compute time the polls may take
POLL_BUDGET = 0.02
#: ``--poll-flops auto``: the shortest chunk, in seconds of compute at the measured GEMM rate (50 ms: the
#: shortest of the fixed sizes measured that did not slow the compute, 1e9 FLOPs at about 20 GFLOP/s per
#: core; a TCP link of 200 Mbit/s drains a 4 MiB socket buffer in about 170 ms, so polls this often keep it busy)
MIN_CHUNK_S = 0.05
#: ``--poll-flops auto``: bounds of the chunk size in FLOPs, and the size before anything is measured
AUTO_MIN_FLOPS, AUTO_MAX_FLOPS, AUTO_START_FLOPS = 1e6, 1e10, 1e9


class AutoChunk:
    """The chunk size of ``--poll-flops auto``, from two running measurements of this rank.

    ``rate``: GEMM FLOP/s, from the GEMMs computed while collectives are in flight
    (:meth:`observe_compute`: whole GEMMs and the pieces of chunked ones).
    ``cost``: seconds of one ``Testsome`` poll with requests in flight (:meth:`observe_poll`).
    Each is the median of its last :data:`WINDOW` samples: it follows the phase of the run (a
    link busy with TCP, or idle) and one poll stretched by a preemption does not move it.

    The rule: ``n`` polls over ``C`` seconds of compute cost ``n * cost``; with chunks of
    ``chunk_s`` seconds, ``n = C / chunk_s``, so the polls take ``cost / chunk_s`` of the
    compute. The chunk is the longer of :data:`MIN_CHUNK_S` and the finest one whose polls
    stay within the budget ``b`` (:data:`POLL_BUDGET`):

        chunk_s = max(MIN_CHUNK_S, cost / b),    chunk_flops = clamp(rate * chunk_s, AUTO_MIN_FLOPS, AUTO_MAX_FLOPS)

    e.g. a 10 us poll at 20 GFLOP/s gives 1e9 FLOPs (the 50 ms floor); a 2 ms poll gives 2e9 (100 ms).
    Until the GEMM rate is measured the size is :data:`AUTO_START_FLOPS`; until a poll is timed,
    the floor. No communication here: the poll itself is the caller's.
    """

    WINDOW = 31

    def __init__(self, budget: float = POLL_BUDGET):
        self.budget = budget
        self._rates: Deque[float] = deque(maxlen=self.WINDOW)
        self._costs: Deque[float] = deque(maxlen=self.WINDOW)
        self.rate = None
        self.cost = None
        self.flops = AUTO_START_FLOPS

    def observe_compute(self, flops: float, seconds: float) -> None:
        if flops > 0 and seconds > 0:
            self._rates.append(flops / seconds)
            self.rate = statistics.median(self._rates)
            self._update()

    def observe_poll(self, seconds: float) -> None:
        if seconds >= 0:
            self._costs.append(seconds)
            self.cost = statistics.median(self._costs)
            self._update()

    def _update(self) -> None:
        if self.rate is None:
            return
        chunk_s = max(MIN_CHUNK_S, self.cost / self.budget if self.cost is not None else 0.0)
        self.flops = min(AUTO_MAX_FLOPS, max(AUTO_MIN_FLOPS, self.rate * chunk_s))

    def describe(self) -> str:
        if self.rate is None:
            return f"GEMM rate not measured yet ({self.flops:.3g} FLOPs)"
        if self.cost is None:
            return (f"{self.flops:.3g} FLOPs = GEMM rate {self.rate / 1e9:.3g} GFLOP/s x {MIN_CHUNK_S * 1e3:.0f} ms "
                    f"(no poll with requests in flight timed yet)")
        return (f"{self.flops:.3g} FLOPs = GEMM rate {self.rate / 1e9:.3g} GFLOP/s x max({MIN_CHUNK_S * 1e3:.0f} ms, "
                f"poll cost {self.cost * 1e6:.3g} us / {self.budget:.0%})")


class _Hook:
    """Callable given to GEMMs: poll the owner's requests every ``chunk_flops`` (read from the strategy
    at each GEMM, so ``auto`` takes effect from the next one); :meth:`observe` takes the timed pieces."""

    def __init__(self, comm, strategy):
        self.comm = comm
        self.strategy = strategy

    @property
    def chunk_flops(self) -> float:
        return self.strategy.chunk_flops

    def observe(self, flops: float, seconds: float) -> None:
        if self.strategy.auto is not None:
            self.strategy.auto.observe_compute(flops, seconds)

    def __call__(self, record: bool = True) -> None:
        self.comm.poll(record)


class PollProgress(NoProgress):
    """``Testsome`` on the requests in flight between GEMM chunks of ~``chunk_flops`` FLOPs."""

    name = "poll"
    calls_mpi_on_poll = True

    def __init__(self, chunk_flops="auto"):
        self.auto = None
        if chunk_flops == "auto":
            self.auto = AutoChunk()
        elif not isinstance(chunk_flops, (int, float)) or not chunk_flops > 0:
            raise ConfigError(f"poll chunk size must be positive or 'auto', got {chunk_flops}")
        else:
            self._fixed = float(chunk_flops)
        self.polls = 0

    @property
    def chunk_flops(self) -> float:
        return self.auto.flops if self.auto is not None else self._fixed

    def poll(self, handles) -> None:
        self.polls += 1
        if self.auto is None:
            _testsome(handles)
            return
        t0 = time.perf_counter()
        if _testsome(handles):
            self.auto.observe_poll(time.perf_counter() - t0)

    def compute_hook(self, comm):
        return _Hook(comm, self) if comm.in_flight else None

    def _describe(self) -> str:
        if self.auto is not None:
            return (f"poll (Testsome between GEMM chunks of at least {MIN_CHUNK_S * 1e3:.0f} ms of compute, "
                    f"polls under {self.auto.budget:.0%} of it: --poll-flops auto, now {self.auto.describe()})")
        return f"poll (Testsome between GEMM chunks of {self.chunk_flops:.3g} FLOPs)"


class ThreadProgress(NoProgress):
    """A background thread that calls ``Testsome`` every ``interval`` seconds.

    The main thread never touches a request of this strategy: it waits on an
    event the thread sets, so no request is tested by two threads at once.
    """

    name = "thread"
    calls_mpi_on_test = False  # the progress thread tests; the main thread only reads a flag

    def __init__(self, interval: float = 20e-6):
        from mpi4py import MPI

        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise ConfigError(
                f"--progress thread needs MPI_THREAD_MULTIPLE, but MPI provides level {provided}: "
                "initialize mpi4py with threads (mpi4py.rc.thread_level = 'multiple') or use --progress poll"
            )
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: List = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fourd-mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._pending)
            if not pending:
                self._wake.wait(0.01)
                self._wake.clear()
                continue
            _testsome(pending)
            finished = [h for h in pending if h.done]
            if finished:
                with self._lock:
                    for h in finished:
                        self._pending.remove(h)
                for h in finished:
                    h.event.set()
            time.sleep(self.interval)  # releases the GIL for the main thread

    def start(self, handle, issue: Callable):
        handle.event = threading.Event()
        handle.request = issue()
        with self._lock:
            self._pending.append(handle)
        self._wake.set()

    def test(self, handle) -> None:
        pass  # the thread marks completion; handle.done reflects it

    def wait(self, handle) -> None:
        handle.event.wait()

    def wait_any(self, handles) -> int:
        """The index of the first of ``handles`` the progress thread marks complete (checked every ``interval``)."""
        while True:
            for index, handle in enumerate(handles):
                if handle.done:
                    return index
            time.sleep(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _describe(self) -> str:
        return f"thread (a progress thread polls Testsome every {self.interval * 1e6:.0f} us)"


#: ``--progress auto``: the fewest CPUs per rank on every node for a progress thread: one for the rank's compute,
#: one for its thread. With one CPU per rank (2 ranks on 2 cores) the thread hid 97-98 % of the shared-memory
#: transfers but took 9-15 % of the compute and made the step 8-16 % slower than polling, which hid none
#: (``results/benchmarks/progress-auto-1node.txt``)
THREAD_CPUS_PER_RANK = 2


def choose_progress(backend: str, inter_node_axes: Sequence[str], thread_multiple: bool, overlap: bool = True,
                    cpus_per_rank: Optional[float] = None) -> Tuple[str, str]:
    """What ``--progress auto`` runs: ``(strategy, reason)``; the same on every rank of a run.

    ``backend``: ``numpy`` (the host computes) or ``cupy``; ``inter_node_axes``: the communicating axes
    whose communicators span more than one node (:attr:`~fourd_mpi.core.placement.NodePlacement.inter_node_axes`);
    ``thread_multiple``: whether MPI provides ``MPI_THREAD_MULTIPLE``; ``overlap``: whether any collective is
    left in flight during compute (``--overlap`` other than ``none``); ``cpus_per_rank``: the fewest CPUs per
    rank on a node (the distinct CPUs of its ranks' CPU sets / its ranks; None: unknown). No communication.

        thread  if overlap and backend == numpy and no axis crosses nodes
                and cpus_per_rank >= THREAD_CPUS_PER_RANK and thread_multiple
        poll    otherwise
    """
    if not overlap:
        return "poll", "--overlap none leaves nothing in flight during compute"
    if backend != "numpy":
        return "poll", "the GPU computes while the host polls MPI between kernels: a thread would add nothing"
    if inter_node_axes:
        return "poll", (f"{', '.join(inter_node_axes)} cross{'es' if len(inter_node_axes) == 1 else ''} nodes: "
                        "a progress thread would compete with the network stack for the ranks' cores")
    if cpus_per_rank is None:
        return "poll", "the ranks' CPU sets are unknown: a thread per rank could take compute time from them"
    if cpus_per_rank < THREAD_CPUS_PER_RANK:
        return "poll", (f"{cpus_per_rank:.2g} CPU(s) per rank on a node: a progress thread would take compute time "
                        f"from its rank (it needs {THREAD_CPUS_PER_RANK} per rank)")
    if not thread_multiple:
        return "poll", "MPI does not provide MPI_THREAD_MULTIPLE, which a progress thread needs"
    return "thread", ("every communicating axis stays on its node: shared-memory transfers move only while MPI is "
                      "polled about every 0.1 ms, which a thread does and GEMM chunks cannot do cheaply")


def make_progress(name: str, chunk_flops="auto", *, backend: str = "numpy", inter_node_axes: Sequence[str] = (),
                  thread_multiple: bool = False, overlap: bool = True, cpus_per_rank: Optional[float] = None):
    """The strategy ``name`` (``auto``: :func:`choose_progress` of the other arguments; the strategy's
    ``chosen`` then says why). Starts the progress thread of ``thread``."""
    if name == "auto":
        name, reason = choose_progress(backend, inter_node_axes, thread_multiple, overlap, cpus_per_rank)
        strategy = make_progress(name, chunk_flops)
        strategy.chosen = f"--progress auto: {reason}"
        return strategy
    if name == "none":
        return NoProgress()
    if name == "poll":
        return PollProgress(chunk_flops)
    if name == "thread":
        return ThreadProgress()
    raise ConfigError(f"unknown progress strategy {name!r}: choose one of {', '.join(PROGRESS_STRATEGIES)}")
