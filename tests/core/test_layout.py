"""Block arithmetic of the 3D matmul and the synthetic tensors (no MPI)."""

import numpy as np
import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.core.layout import activation_layout, block_range, local_sequences, weight_layout, weight_shard_indices
from fourd_mpi.step.synthetic import stream_id, uniform_at, uniform_block


@pytest.mark.parametrize("n, k, go, gi, gz", [(12, 8, 3, 2, 4), (6, 6, 1, 1, 1), (16, 4, 2, 4, 2), (9, 6, 3, 3, 2)])
def test_weight_shards_tile_the_matrix_exactly_once(n, k, go, gi, gz):
    hits = np.zeros(n * k, dtype=int)
    for o in range(go):
        for i in range(gi):
            for z in range(gz):
                rows, cols = weight_shard_indices(n, k, go, o, gi, i, gz, z)
                assert len(rows) == n * k // (go * gi * gz)
                # rows stay inside the out-block, cols inside the in-block
                assert set(rows) <= set(range(*block_range(n, go, o)))
                assert set(cols) <= set(range(*block_range(k, gi, i)))
                hits[rows * k + cols] += 1
    assert (hits == 1).all()


def test_shard_is_contiguous_piece_of_flattened_block():
    # block (1, 0) of a 4x6 matrix split 2x2 is rows 2-3, cols 0-2; flattened in 3 shards of 2
    rows, cols = weight_shard_indices(4, 6, 2, 1, 2, 0, 3, 1)
    assert list(zip(rows, cols)) == [(2, 2), (3, 0)]


def test_block_range_and_sequences():
    assert block_range(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError):
        block_range(10, 3, 0)
    g = GridShape(2, 2, 1, 2)
    seen = [local_sequences(8, g, d, z) for d in range(2) for z in range(2)]
    assert seen == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_layout_strings():
    assert str(activation_layout("x")) == "[tokens/data*z, hidden/x] rep(y)"
    assert str(weight_layout("y", "x")) == "[out/y, in/x] flat/z rep(data)"


def test_synthetic_values_do_not_depend_on_the_split():
    full = uniform_block(7, stream_id("w", 1), (6, 10), slice(0, 6), slice(0, 10))
    part = uniform_block(7, stream_id("w", 1), (6, 10), slice(2, 5), slice(4, 9))
    assert np.array_equal(full[2:5, 4:9], part)
    assert full.min() >= -1 and full.max() < 1 and abs(full.mean()) < 0.3
    # different seeds and streams differ
    assert not np.array_equal(uniform_at(7, 1, np.arange(5)), uniform_at(8, 1, np.arange(5)))
    assert not np.array_equal(uniform_at(7, 1, np.arange(5)), uniform_at(7, 2, np.arange(5)))
