"""comm_table's grouping helpers against the NumPy definitions they replace: ``_groups`` is
``np.unique(key, return_inverse=True)`` and ``_group_medians`` the median of each group's sorted values
(``lexsort``), bit for bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fourd_mpi.analysis.tables.comm import _group_medians, _groups


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(keys=st.lists(st.integers(0, 70_000), max_size=300), span_extra=st.sampled_from([0, 1, 5, 1 << 17]),
       values=st.data())
def test_groups_and_medians_equal_unique_and_sorted_medians(keys, span_extra, values):
    key = np.array(keys, dtype=np.int64)
    span = (int(key.max()) + 1 if len(key) else 1) + span_extra
    uniq, inverse = _groups(key, span)
    expect_uniq, expect_inverse = np.unique(key, return_inverse=True)
    np.testing.assert_array_equal(uniq, expect_uniq)
    np.testing.assert_array_equal(inverse, expect_inverse)
    if not len(key):
        return
    flight = np.array(values.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, 1e9, 7.0, 1e-3]) | st.floats(0, 1e12),
                                           min_size=len(key), max_size=len(key))))
    count = np.bincount(inverse, minlength=len(uniq))
    order = np.lexsort((flight, inverse))
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    expected = 0.5 * (flight[order][starts + (count - 1) // 2] + flight[order][starts + count // 2])
    got = _group_medians(flight, inverse, count)
    assert got.tobytes() == expected.tobytes()
