"""A caching allocator for host arrays: the step's buffers are allocated once and reused.

Every step of a run asks for the same arrays in the same order (receive buffers of
the collectives, GEMM outputs, elementwise results). Allocating them fresh each
time costs page faults: NumPy hands arrays above glibc's mmap threshold (128 KiB
to 32 MiB) to ``mmap``, and every first touch of a page faults. The pool keeps
every array it handed out and gives it out again, for the same ``(shape, dtype)``,
once nothing refers to it any more.

Liveness is the array's reference count, the rule CPython uses to free it: the
pool holds one reference; an array that a caller, a saved activation, a view of
it (NumPy views keep their base alive) or an in-flight MPI request (the handle
keeps its send and receive buffers) still refers to has more, and is never handed
out. So a buffer is reused only when it is dead: never while a request on it is in
flight, never while a view of it is alive.

Memory: per ``(shape, dtype)`` the pool holds as many arrays as were alive at once
(the step's peak for that key); free arrays of one key are not used for another.
:meth:`stats` says what it holds. Host (NumPy) only: CuPy has its own stream-ordered
memory pool for device arrays.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Tuple

import numpy as np

#: references to a pooled array when only the pool holds it: the pool's list, and
#: the temporary reference ``sys.getrefcount`` takes of its argument
_POOL_ONLY = 2


class HostArrayPool:
    """Reusable NumPy arrays keyed by ``(shape, dtype)``.

    ``empty(shape, dtype)``: a pooled array whose previous contents are arbitrary (like
    ``np.empty``). ``hits``: requests served from the pool; ``allocations``: arrays created.
    """

    def __init__(self):
        self._arrays: Dict[Tuple[tuple, np.dtype], List[np.ndarray]] = {}
        self._next: Dict[Tuple[tuple, np.dtype], int] = {}
        self.allocations = 0
        self.hits = 0
        self.bytes_held = 0

    def empty(self, shape, dtype) -> np.ndarray:
        if type(shape) is not tuple:  # noqa: E721 - the common case (a tuple) skips the normalization
            shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        key = (shape, dtype if type(dtype) is np.dtype else np.dtype(dtype))  # noqa: E721
        arrays = self._arrays.get(key)
        if arrays is None:
            arrays = self._arrays[key] = []
        # round robin from where the last search stopped: in a step's steady state the next free
        # array of a key is usually the one after the last handed out
        n = len(arrays)
        start = self._next.get(key, 0)
        for i in range(n):
            j = start + i
            if j >= n:
                j -= n
            if sys.getrefcount(arrays[j]) <= _POOL_ONLY:
                self._next[key] = j + 1 if j + 1 < n else 0
                self.hits += 1
                return arrays[j]
        array = np.empty(shape, dtype=key[1])
        arrays.append(array)
        self.allocations += 1
        self.bytes_held += array.nbytes
        return array

    def zeros(self, shape, dtype) -> np.ndarray:
        out = self.empty(shape, dtype)
        out.fill(0)
        return out

    def clear(self) -> None:
        """Forget every array (those still in use stay valid: their owners keep them)."""
        self._arrays.clear()
        self._next.clear()
        self.bytes_held = 0

    def stats(self) -> Dict[str, int]:
        """``arrays``, ``bytes`` held; ``allocations`` and ``hits`` so far; ``keys`` (distinct shapes)."""
        return {"arrays": sum(len(v) for v in self._arrays.values()), "bytes": self.bytes_held,
                "allocations": self.allocations, "hits": self.hits, "keys": len(self._arrays)}
