"""Pure grid arithmetic: inference of missing sizes, factorizations, parsing."""

import pytest

from fourd_mpi.core.grid import GridShape, grid_factorizations, infer_grid_shape
from fourd_mpi.errors import ConfigError


@pytest.mark.parametrize(
    "world, given, expected",
    [
        (8, dict(x=2, y=2, z=2), (1, 2, 2, 2)),
        (8, {}, (8, 1, 1, 1)),
        (8, dict(x=2), (4, 1, 1, 2)),
        (8, dict(data=2, x=2, y=2), (2, 1, 2, 2)),
        (8, dict(data=2, z=2, y=2), (2, 2, 2, 1)),
        (6, dict(data=3, z=2), (3, 2, 1, 1)),
        (6, dict(y=2, x=3), (1, 1, 2, 3)),
        (12, dict(data=2, y=3, z=2), (2, 2, 3, 1)),
        (12, dict(data=12), (12, 1, 1, 1)),
        (1, {}, (1, 1, 1, 1)),
    ],
)
def test_infer(world, given, expected):
    shape = infer_grid_shape(world, **given)
    assert shape.size == world
    assert shape.dims == expected


@pytest.mark.parametrize(
    "world, given, words",
    [
        (8, dict(x=2, y=2, z=2, data=2), ["product 16", "world size is 8"]),
        (8, dict(x=3), ["does not divide", "8"]),
        (12, dict(data=2, x=1), ["omitted axes", "6 ranks"]),
        (8, dict(x=0), ["--gx must be a positive integer, got 0"]),
        (8, dict(y=-2), ["--gy must be a positive integer, got -2"]),
    ],
)
def test_infer_errors_say_what_to_change(world, given, words):
    with pytest.raises(ConfigError) as err:
        infer_grid_shape(world, **given)
    for w in words:
        assert w in str(err.value)


def test_factorizations_of_8_and_12():
    f8 = list(grid_factorizations(8))
    assert len(f8) == 20  # ordered 4-factorizations of 2^3: C(3+3, 3)
    assert len(set(f8)) == 20 and all(g.size == 8 for g in f8)
    f12 = list(grid_factorizations(12))
    assert all(g.size == 12 for g in f12) and len(set(f12)) == len(f12) == 40  # C(2+3,3) * C(1+3,3)
    assert list(grid_factorizations(1)) == [GridShape(1, 1, 1, 1)]


def test_parse_and_print():
    g = GridShape.parse("2x1x2x2")
    assert g == GridShape(2, 1, 2, 2) and str(g) == "2x1x2x2" and g["y"] == 2
    for bad in ("2x2x2", "axbxcxd", "0x1x1x8"):
        with pytest.raises(ConfigError):
            GridShape.parse(bad)
