"""A simulated CuPy on NumPy that checks CUDA stream ordering (a test backend; no GPU needed).

Installed as ``sys.modules["cupy"]`` by ``tests/helpers/simcupy_run.py``, it lets the real
:class:`fourd_mpi.core.backend.CupyBackend`, the step, the algorithms and the collectives run
on a machine without a GPU, and records every access to device and pinned memory so that a
missing synchronization shows up as a *violation* instead of silently wrong gradients.

What is modelled (CUDA stream semantics, as a happens-before relation with vector clocks):

* Agents: the host and each stream. Every operation enqueued on a stream (a kernel, an
  ``memcpyAsync``, an event record, a ``wait_event``) is ordered after everything the host did
  before enqueuing it (the stream's clock absorbs the host's); operations on one stream are
  ordered in issue order. Nothing else orders two streams: ``Event.record(S)`` snapshots S's
  clock, ``S2.wait_event(e)`` merges it into S2; ``Stream.synchronize()``,
  ``Event.synchronize()`` and an ``Event.done`` that answers True merge into the host. Events
  answer ``done == False`` a few times before True, so polling loops are exercised.
* Memory: each allocation (a device allocation, or a pinned host buffer) keeps its last write
  (agent, counter) and the reads since. An access by agent A is *ordered* iff A's clock covers
  the last write (and, for a write, the reads since); anything else is a data race on a GPU.
  Device memory comes from a pool like CuPy's: memory freed by the garbage collector goes back
  to the pool and the next ``empty`` of that size gets it with its access history, so memory
  that queued kernels may still use is caught when MPI writes into it.
* MPI (:class:`CheckedComm`, the communicator classes of ``simcupy_run.py``): MPI is a host
  agent. A send buffer is read at issue (must be ordered after its last kernel or copy write)
  and stays MPI's until the host observed the request's completion (its handle became
  ``MPI.REQUEST_NULL`` after ``Test``/``Wait``/``Testsome``/``Waitany``); a receive buffer is
  written at issue (no pending kernel access) and belongs to the request until then: a kernel or
  copy touching it before is a violation; after, the reading stream must be ordered after the
  host's observation (a launch after it is; the staged H2D copy's consumers need its event).

What is not modelled: kernels run eagerly on the host when launched (so results are correct
even where ordering is broken: the checker, not the numbers, reports the race); the legacy
default stream's implicit synchronization with blocking streams (the backend's copy stream is
non-blocking); sub-allocation granularity (an allocation is one unit); host code that reads
device memory through NumPy without ``cupy.asnumpy`` (CuPy would raise); fused
``ElementwiseKernel``/``ReductionKernel`` (absent: the step takes its chained path); device
arrays are ``np.ndarray`` subclasses, so step branches on ``isinstance(x, np.ndarray)`` take
their NumPy paths (the same math through the tracked ufuncs); multiple devices; timing.
"""

from __future__ import annotations

import bisect
import ctypes
import time
import traceback
import types
import weakref

import numpy as np

__version__ = "13.0.0-sim"
HOST = "host"
#: how many times a recorded event answers ``done == False`` before True
NOT_DONE_POLLS = 2


class Violation:
    """One broken stream rule: the operation, the buffer, the rule and where (a short stack)."""

    def __init__(self, rule, op, buffer, detail):
        self.rule, self.op, self.buffer, self.detail = rule, op, buffer, detail
        frames = [f for f in traceback.extract_stack()[:-3] if "tests/helpers/" not in f.filename
                  and "mpi4py" not in f.filename]
        self.stack = " <- ".join(f"{f.filename.split('fourd_mpi/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:][::-1])

    def __str__(self):
        return f"{self.rule}: {self.op} on {self.buffer}: {self.detail} [at {self.stack}]"


class Allocation:
    """One device allocation or pinned host buffer: its address range and access history."""

    count = 0

    def __init__(self, start, nbytes, kind, block):
        Allocation.count += 1
        self.name = f"{kind}#{Allocation.count}({nbytes} B)"
        self.start, self.nbytes, self.kind, self.block = start, nbytes, kind, block
        self.last_write = None  # (agent, counter, what)
        self.reads = {}  # agent -> (counter, what) since the last write
        self.pending = []  # [(request, "r"|"w", what)]: MPI owns the buffer until the host saw completion
        self.owner = None  # weakref to the live root array


class Simulator:
    """The clocks, streams, memory registry, pool and violations of one process."""

    def __init__(self):
        self.host = {HOST: 0}
        self.violations = []
        self.starts = []  # sorted allocation start addresses
        self.allocs = {}  # start -> Allocation
        self.free = {}  # nbytes -> [Allocation] (CuPy's pool: freed memory, history kept)
        self.checked_mpi_calls = 0
        self.kernels = 0
        self.null_stream = Stream(sim=self, null=True)
        self.current = self.null_stream
        self.streams = {0: self.null_stream}

    # clocks -----------------------------------------------------------------------
    @staticmethod
    def merge(into, other):
        for agent, c in other.items():
            if into.get(agent, 0) < c:
                into[agent] = c

    def host_tick(self):
        self.host[HOST] += 1
        return self.host[HOST]

    def violation(self, rule, op, alloc, detail):
        v = Violation(rule, op, alloc.name if alloc is not None else "-", detail)
        self.violations.append(v)

    # memory registry ----------------------------------------------------------------
    def register(self, array, kind, keep=True):
        start = array.__array_interface__["data"][0]
        if array.nbytes == 0 or start in self.allocs:
            return self.allocs.get(start)
        alloc = Allocation(start, array.nbytes, kind, array if keep else None)
        bisect.insort(self.starts, start)
        self.allocs[start] = alloc
        return alloc

    def unregister(self, alloc):
        if self.allocs.get(alloc.start) is alloc:
            del self.allocs[alloc.start]
            self.starts.pop(bisect.bisect_left(self.starts, alloc.start))

    def find(self, address):
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        alloc = self.allocs[self.starts[i]]
        return alloc if address < alloc.start + alloc.nbytes else None

    def alloc_of(self, array):
        if not isinstance(array, np.ndarray) or array.size == 0:
            return None
        return self.find(array.__array_interface__["data"][0])

    def new_device(self, shape, dtype):
        """Device memory from the pool (a freed block of this size, with its history) or fresh."""
        dtype = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype).view(DeviceArray)
        free = self.free.get(nbytes)
        alloc = free.pop() if free else None
        if alloc is None:
            block = np.empty(nbytes, np.uint8)
            alloc = self.register(block, "device")
        arr = alloc.block[:nbytes].view(dtype).reshape(shape).view(DeviceArray)
        self._own(arr, alloc)
        return arr

    def adopt(self, result):
        """A NumPy result becomes a device array (pool memory, like every CuPy result)."""
        arr = self.new_device(result.shape, result.dtype)
        np.copyto(arr.view(np.ndarray), result)
        return arr

    def _own(self, arr, alloc):
        arr._root = None
        alloc.owner = weakref.ref(arr)
        weakref.finalize(arr, self._release, alloc)

    def _release(self, alloc):
        if alloc.block is not None and len(self.free.get(alloc.nbytes, ())) < 64:
            self.free.setdefault(alloc.nbytes, []).append(alloc)
        else:
            self.unregister(alloc)

    # accesses -----------------------------------------------------------------------
    def settle(self, alloc):
        """Drop MPI ownership whose request the host has seen complete (the host's write lands now)."""
        if not alloc.pending:
            return
        from mpi4py import MPI

        keep = []
        for request, mode, what in alloc.pending:
            if request == MPI.REQUEST_NULL:
                counter = self.host_tick()
                if mode == "w":
                    alloc.last_write, alloc.reads = (HOST, counter, what + " (completed)"), {}
                else:
                    alloc.reads[HOST] = (counter, what + " (completed)")
            else:
                keep.append((request, mode, what))
        alloc.pending = keep

    def access(self, agent, clock, alloc, write, what):
        """Check and record one access by ``agent`` whose knowledge is ``clock``."""
        if alloc is None:
            return
        self.settle(alloc)
        for request, mode, owner in alloc.pending:
            if write or mode == "w":
                self.violation("rule 2: buffer used while its MPI request is in flight", what, alloc,
                               f"{'writes' if write else 'reads'} memory that {owner} still owns "
                               "(the host has not observed the request's completion)")
        last = alloc.last_write
        if last is not None and clock.get(last[0], 0) < last[1]:
            rule = ("rule 1: MPI reads a device buffer before the kernels producing it finished"
                    if agent == HOST else "unordered access: reads data not yet written on its stream's timeline")
            self.violation(rule, what, alloc, f"{agent} is not ordered after the write by {last[0]} ({last[2]})")
        if write:
            for reader, (counter, rwhat) in alloc.reads.items():
                if reader != agent and clock.get(reader, 0) < counter:
                    rule = ("reuse (rules 1-3): MPI writes memory that a queued copy or kernel may still read"
                            if agent == HOST else "unordered write over a pending read")
                    self.violation(rule, what, alloc, f"{agent} is not ordered after the read by {reader} ({rwhat})")
            alloc.last_write, alloc.reads = (agent, clock[agent], what), {}
        else:
            alloc.reads[agent] = (clock[agent], what)

    def launch(self, reads, writes, what, stream=None):
        """A kernel (or copy) enqueued on ``stream`` (the current one): reads then writes."""
        stream = stream or self.current
        ra = [self.alloc_of(x) for x in reads]
        wa = [self.alloc_of(x) for x in writes]
        for a in ra + wa:  # the host may see completions now, before the enqueue inherits its clock
            if a is not None:
                self.settle(a)
        clock = stream.enqueue()
        self.kernels += 1
        for a in ra:
            self.access(stream.agent, clock, a, False, f"{what} on {stream.agent}")
        for a in wa:
            self.access(stream.agent, clock, a, True, f"{what} on {stream.agent}")

    def host_read(self, array, what):
        """A synchronous device-to-host copy on the current stream (``asnumpy``, ``float()``)."""
        self.launch([array], [], what)
        self.merge(self.host, self.current.clock)

    # MPI ----------------------------------------------------------------------------
    def mpi_issue(self, op, sends, recvs):
        """MPI (a host agent) reads ``sends`` and will write ``recvs``: checked at issue."""
        self.checked_mpi_calls += 1
        found = []
        for buf, write in [(b, False) for b in sends] + [(b, True) for b in recvs]:
            alloc = self.alloc_of(buf)
            if alloc is not None:
                self.settle(alloc)
                counter = self.host_tick()
                for request, mode, owner in alloc.pending:
                    if write or mode == "w":
                        self.violation("rule 2: buffer reused while an earlier MPI request is in flight", op, alloc,
                                       f"{owner} has not been observed complete")
                self.access(HOST, self.host, alloc, write, f"{op} ({counter})")
            found.append((alloc, write))
        return found

    def mpi_started(self, found, request, op):
        for alloc, write in found:
            if alloc is not None:
                alloc.pending.append((request, "w" if write else "r", op))

    def report(self):
        lines = [str(v) for v in self.violations]
        return lines


class Stream:
    """``cupy.cuda.Stream``: an agent with its own clock."""

    _next = 1

    def __init__(self, null=False, non_blocking=False, ptr=None, sim=None):
        self.sim = sim or SIM
        if null:
            self.ptr, self.agent = 0, "compute stream (current)"
        else:
            self.ptr, self.agent = Stream._next * 4096, f"stream {Stream._next}"
            Stream._next += 1
            self.sim.streams[self.ptr] = self
        self.clock = {self.agent: 0}

    def enqueue(self):
        self.sim.merge(self.clock, self.sim.host)
        self.clock[self.agent] += 1
        return self.clock

    def synchronize(self):
        self.sim.merge(self.sim.host, self.clock)

    def wait_event(self, event):
        self.enqueue()
        self.sim.merge(self.clock, event.snapshot)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __enter__(self):
        self._prev, self.sim.current = self.sim.current, self
        return self

    def __exit__(self, *exc):
        self.sim.current = self._prev

    def use(self):
        self.sim.current = self
        return self


class Event:
    """``cupy.cuda.Event``: a snapshot of a stream's clock; done after a few polls."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.snapshot, self.polls, self.time = {}, 0, time.perf_counter()

    def record(self, stream=None):
        stream = stream or SIM.current
        self.snapshot = dict(stream.enqueue())
        self.polls, self.time = 0, time.perf_counter()

    @property
    def done(self):
        if not self.snapshot:
            return True
        self.polls += 1
        if self.polls <= NOT_DONE_POLLS:
            return False
        SIM.merge(SIM.host, self.snapshot)
        return True

    def query(self):
        return self.done

    def synchronize(self):
        SIM.merge(SIM.host, self.snapshot)


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A device array: NumPy memory whose every access is checked and recorded (see the module doc).

    ``_root``: the array that owns the allocation (kept alive by its views), None on the root.
    """

    def __array_finalize__(self, obj):
        if isinstance(obj, DeviceArray):
            self._root = obj if getattr(obj, "_root", None) is None else obj._root
            if self.flags.owndata and self.nbytes:  # a method made new memory: a kernel reading obj, writing self
                self._root = None
                alloc = SIM.register(self, "device", keep=False)
                if alloc is not None:
                    alloc.owner = weakref.ref(self)
                    weakref.finalize(self, SIM.unregister, alloc)
                    SIM.launch([obj], [self], f"array method ({alloc.name})")
        else:
            self._root = None

    @property
    def data(self):
        return _Pointer(self.__array_interface__["data"][0])

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        outs = out if isinstance(out, tuple) else ((out,) if out is not None else ())
        writes = list(outs) + ([inputs[0]] if method == "at" else [])
        SIM.launch(_arrays(inputs), _arrays(writes), f"{ufunc.__name__}.{method}")
        if outs:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        result = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        return _wrap(result, outs, inputs)

    def __array_function__(self, func, types_, args, kwargs):
        name = func.__name__
        written = list(_arrays([kwargs.get("out")]))
        if name in ("copyto", "put", "place", "putmask", "fill_diagonal") and args:
            written.append(args[0])
        if name == "dot" and len(args) > 2:
            written.append(args[2])
        SIM.launch(_arrays([args, kwargs]), written, name)
        result = func(*_plain(args), **_plain(kwargs))
        return _wrap(result, tuple(written), args)

    def __getitem__(self, key):
        result = np.ndarray.__getitem__(self.view(np.ndarray), _plain(key))
        if isinstance(result, np.ndarray) and not np.shares_memory(result, self.view(np.ndarray)):
            SIM.launch([self] + _arrays([key]), [], "gather")
        return _wrap(result, (), (self,))

    def __setitem__(self, key, value):
        SIM.launch(_arrays([value, key]), [self], "setitem")
        np.ndarray.__setitem__(self.view(np.ndarray), _plain(key), _plain(value))

    def copy(self, order="C"):
        out = SIM.new_device(self.shape, self.dtype)
        SIM.launch([self], [out], "copy")
        np.copyto(out.view(np.ndarray), self.view(np.ndarray))
        return out

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        out = SIM.new_device(self.shape, dtype)
        SIM.launch([self], [out], "astype")
        np.copyto(out.view(np.ndarray), self.view(np.ndarray), casting="unsafe")
        return out

    def fill(self, value):
        SIM.launch([], [self], "fill")
        self.view(np.ndarray).fill(value)

    def get(self, stream=None):
        return asnumpy(self)

    def _scalar(self, kind):
        SIM.host_read(self, f"{kind}() (device-to-host)")
        return getattr(self.view(np.ndarray), "item")()

    def item(self, *args):
        SIM.host_read(self, "item() (device-to-host)")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        SIM.host_read(self, "tolist() (device-to-host)")
        return self.view(np.ndarray).tolist()

    def __float__(self):
        return float(self._scalar("float"))

    def __int__(self):
        return int(self._scalar("int"))

    def __bool__(self):
        return bool(self._scalar("bool"))

    def __index__(self):
        return int(self._scalar("index"))


def _arrays(obj):
    """Every DeviceArray in ``obj`` (nested tuples, lists, dicts)."""
    if isinstance(obj, DeviceArray):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [a for item in obj for a in _arrays(item)]
    if isinstance(obj, dict):
        return [a for item in obj.values() for a in _arrays(item)]
    return []


def _plain(obj):
    if isinstance(obj, DeviceArray):
        return obj.view(np.ndarray)
    if isinstance(obj, tuple):
        return tuple(_plain(o) for o in obj)
    if isinstance(obj, list):
        return [_plain(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _wrap(result, outs, inputs):
    """Results back as device arrays: the caller's ``out``, views of device memory, or new allocations."""
    if isinstance(result, tuple):
        return tuple(_wrap(r, outs, inputs) for r in result)
    if not isinstance(result, np.ndarray):
        if isinstance(result, np.generic) and _arrays(inputs):
            return SIM.adopt(np.asarray(result))  # CuPy's reductions give 0-d device arrays
        return result
    for o in outs:
        if isinstance(o, DeviceArray) and result.__array_interface__ == o.view(np.ndarray).__array_interface__:
            return o
    if result.base is None or result.flags.owndata:
        return SIM.adopt(result)
    alloc = SIM.find(result.__array_interface__["data"][0]) if result.size else None
    root = alloc.owner() if alloc is not None and alloc.owner is not None else None
    if root is None:  # a view of host memory (e.g. of a NumPy input): copy it to the device
        out = SIM.new_device(result.shape, result.dtype)
        np.copyto(out.view(np.ndarray), result)
        return out
    view = result.view(DeviceArray)
    view._root = root
    return view


# the cupy module's functions ------------------------------------------------------------------
ndarray = DeviceArray


def empty(shape, dtype=float, order="C"):
    return SIM.new_device(shape, dtype)


def zeros(shape, dtype=float, order="C"):
    out = SIM.new_device(shape, dtype)
    out.fill(0)
    return out


def ones(shape, dtype=float):
    out = SIM.new_device(shape, dtype)
    out.fill(1)
    return out


def asarray(a, dtype=None, order=None):
    if isinstance(a, DeviceArray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype)


def array(a, dtype=None, copy=True, order="K", ndmin=0):
    src = np.asarray(_plain(a), dtype=dtype)
    out = SIM.new_device(src.shape, src.dtype)
    SIM.launch(_arrays([a]), [out], "array (host-to-device)")
    np.copyto(out.view(np.ndarray), src)
    return out


def ascontiguousarray(a, dtype=None):
    if isinstance(a, DeviceArray) and a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype)


def asnumpy(a, stream=None, order="C", out=None):
    if not isinstance(a, DeviceArray):
        return np.asarray(a)
    SIM.host_read(a, "asnumpy (device-to-host)")
    return np.array(a.view(np.ndarray), copy=True)


def get_array_module(*args):
    import sys

    return sys.modules[__name__] if any(isinstance(a, DeviceArray) for a in args) else np


def _numpy_function(name):
    func = getattr(np, name)
    if not callable(func) or isinstance(func, type):
        return func

    def call(*args, **kwargs):
        written = list(_arrays([kwargs.get("out")]))
        if name == "copyto" and args:
            written.append(args[0])
        SIM.launch(_arrays([args, kwargs]), written, name)
        result = func(*_plain(args), **_plain(kwargs))
        return _wrap(result, tuple(written), args)

    call.__name__ = name
    return call


def __getattr__(name):  # every other NumPy function runs as a tracked "kernel"
    if name in ("ElementwiseKernel", "ReductionKernel", "RawKernel", "fuse"):
        raise AttributeError(f"simulated cupy has no {name}: the step takes its chained path")
    if hasattr(np, name):
        return _numpy_function(name)
    raise AttributeError(name)


# cupy.cuda ---------------------------------------------------------------------------------
def _memcpy_async(dst, src, nbytes, kind, stream_ptr):
    stream = SIM.streams[stream_ptr]
    d, s = SIM.find(dst), SIM.find(src)
    for a in (d, s):
        if a is not None:
            SIM.settle(a)
    clock = stream.enqueue()
    what = f"memcpyAsync({'D2H' if kind == 2 else 'H2D' if kind == 1 else kind})"
    SIM.access(stream.agent, clock, s, False, f"{what} on {stream.agent}")
    SIM.access(stream.agent, clock, d, True, f"{what} on {stream.agent}")
    ctypes.memmove(dst, src, nbytes)


class _Device:
    def __init__(self, device=0):
        self.id = device

    def use(self):
        return self

    def synchronize(self):
        for stream in SIM.streams.values():
            stream.synchronize()


def _alloc_pinned(nbytes):
    buf = np.empty(max(int(nbytes), 1), np.uint8)
    SIM.register(buf, "pinned")
    return buf


def _elapsed(a, b):
    return (b.time - a.time) * 1e3


runtime = types.SimpleNamespace(
    is_hip=False, getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 12040, driverGetVersion=lambda: 12040,
    getDeviceProperties=lambda device: {"name": b"Simulated GPU (simcupy)", "totalGlobalMem": 16 << 30,
                                        "major": 9, "minor": 0, "multiProcessorCount": 132},
    memcpyAsync=_memcpy_async, memcpyDeviceToHost=2, memcpyHostToDevice=1, memcpyDeviceToDevice=3,
    deviceSynchronize=lambda: _Device().synchronize(),
    memGetInfo=lambda: (15 << 30, 16 << 30),
)
cuda = types.SimpleNamespace(
    is_available=lambda: True, runtime=runtime, Device=_Device, Stream=Stream, Event=Event,
    get_current_stream=lambda: SIM.current, get_elapsed_time=_elapsed, alloc_pinned_memory=_alloc_pinned,
    device=types.SimpleNamespace(get_cublas_handle=lambda: 0),
)
SIM = Simulator()
