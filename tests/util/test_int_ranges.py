"""``util.text.int_ranges``: the one formatter of rank and CPU lists (messages, the node line, traces' CPU sets)."""

import pytest

from fourd_mpi.util.text import int_ranges


@pytest.mark.parametrize("values, text", [
    ([], ""),
    ([3], "3"),
    ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
    ([8, 7, 0, 2, 1, 5, 5], "0-2,5,7-8"),  # any order, each value once
    ([0, 2, 4], "0,2,4"),
    ((i for i in range(64)), "0-63"),
])
def test_int_ranges_known_answers(values, text):
    assert int_ranges(values) == text
