"""The host array pool reuses an array only when nothing refers to it."""

import numpy as np

from fourd_mpi.core.bufferpool import HostArrayPool


def test_dead_arrays_are_reused_live_ones_are_not():
    pool = HostArrayPool()
    a = pool.empty((4, 3), np.float32)
    first = id(a)
    b = pool.empty((4, 3), np.float32)
    assert b is not a  # a is alive
    del a
    c = pool.empty((4, 3), np.float32)
    assert id(c) == first  # a was dead: handed out again
    assert pool.stats()["allocations"] == 2 and pool.stats()["hits"] == 1
    del b, c


def test_a_view_keeps_its_base_alive():
    pool = HostArrayPool()
    a = pool.empty((5, 2), np.float64)
    view = a.T[1:]
    base = id(a)
    del a
    assert id(pool.empty((5, 2), np.float64)) != base
    del view
    assert id(pool.empty((5, 2), np.float64)) == base


def test_a_holder_like_an_in_flight_request_keeps_it():
    """A handle keeps its send and receive buffers (``CommHandle._buffers``) until the request completed."""
    pool = HostArrayPool()
    recv = pool.empty(8, np.float64)
    holder = (None, recv)
    rid = id(recv)
    del recv
    assert id(pool.empty(8, np.float64)) != rid
    del holder
    assert id(pool.empty(8, np.float64)) == rid


def test_shapes_and_dtypes_are_separate_keys():
    pool = HostArrayPool()
    a = pool.empty((2, 3), np.float32)
    del a
    b = pool.empty((3, 2), np.float32)
    c = pool.empty((2, 3), np.float64)
    assert b.shape == (3, 2) and c.dtype == np.float64
    assert pool.stats()["keys"] == 3 and pool.stats()["allocations"] == 3
    z = pool.zeros((2, 3), np.float32)
    assert not z.any()
    assert pool.stats()["bytes"] == 24 + 24 + 48
