"""Deterministic synthetic weights and data, identical on every grid shape.

Every element of every global tensor is a pure function of ``(seed, stream,
global index)`` (a SplitMix64 hash, counter-based like Philox), so a rank
generates exactly its own shard without materialising the global tensor, and
every grid shape sees the same global tensors. Values are uniform in ``[-1, 1)``.
"""

from __future__ import annotations

import zlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def stream_id(*names) -> int:
    """A stable 32-bit id for a named stream (e.g. ``("weight", "block3.fc1")``)."""
    return zlib.crc32("/".join(str(n) for n in names).encode())


def _splitmix64(x):
    """SplitMix64 finalizer on uint64 arrays (NumPy or CuPy: same bits on either)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniform_at(seed: int, stream: int, index, xp=np):
    """float64 values in ``[-1, 1)`` for the given global flat indices of one stream.

    ``xp``: the array module that computes them (CuPy generates a GPU rank's data on the
    device, bit-identical to NumPy's: integer hashing and exact float64 scaling).
    """
    key = _splitmix64(np.uint64((seed & 0xFFFFFFFF) << 32 | (stream & 0xFFFFFFFF)) + np.zeros(1, np.uint64))[0]
    with np.errstate(over="ignore"):
        bits = _splitmix64(xp.asarray(index, dtype=xp.uint64) ^ key)
    # top 53 bits -> [0, 1) -> [-1, 1)
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0 / 9007199254740992.0) - 1.0


def uniform_block(seed: int, stream: int, shape_global, rows: slice, cols: slice, xp=np):
    """The block ``[rows, cols]`` of a 2-D global tensor of shape ``shape_global`` (computed with ``xp``)."""
    ncols = shape_global[1]
    r = xp.arange(rows.start, rows.stop, dtype=xp.int64)[:, None]
    c = xp.arange(cols.start, cols.stop, dtype=xp.int64)[None, :]
    return uniform_at(seed, stream, (r * ncols + c).ravel(), xp).reshape(len(r), c.shape[1])
