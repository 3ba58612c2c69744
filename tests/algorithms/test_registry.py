"""The algorithm registry and the named baselines (pure: no MPI).

Each baseline pins axes of the 4D grid (:mod:`fourd_mpi.algorithms.registry`); these tests check the
pinning, the inference of the free axes and the one-line errors on several world sizes.
"""

import pytest

from fourd_mpi.algorithms import registry
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import resolve

NONE = {"data": None, "z": None, "y": None, "x": None}
#: a GPT whose sizes divide by 1..8 and 6 (heads 24, hidden 48, ffn 96, batch 24)
SIZES = {"hidden": 48, "heads": 24, "ffn_hidden": 96, "seq": 8, "batch": 24}
#: the axis each baseline puts every rank on when no size is given
CHARACTERISTIC = {"axonn4d": "data", "megatron1d": "y", "fsdp": "z", "dp": "data"}


def _resolve(world, algorithm, **grid):
    return resolve(world, "gpt-tiny", {**NONE, **grid}, dict(SIZES), algorithm=algorithm)


def test_every_algorithm_is_listed_with_a_title_and_a_usual_name():
    assert registry.DEFAULT_ALGORITHM == "axonn4d"
    assert set(CHARACTERISTIC) <= set(registry.names())
    for name in registry.names():
        a = registry.get(name)
        assert a.name == name and a.title and a.display and a.family
        assert registry.display_name(name) == a.display
    assert registry.display_name("megatron1d") == "Megatron-LM 1D"
    assert registry.display_name("not-registered") == "not-registered"


@pytest.mark.parametrize("world", [1, 2, 6, 8, 12])
@pytest.mark.parametrize("name", sorted(CHARACTERISTIC))
def test_inference_puts_every_rank_on_the_characteristic_axis(name, world):
    grid = _resolve(world, name).grid
    assert getattr(grid, CHARACTERISTIC[name]) == world
    assert grid.size == world
    for axis, size in registry.get(name).fixed.items():
        assert getattr(grid, axis) == size


@pytest.mark.parametrize("world, given, expected", [
    (8, {"data": 2}, {"megatron1d": GridShape(2, 1, 4, 1), "fsdp": GridShape(2, 4, 1, 1)}),
    (6, {"data": 3}, {"megatron1d": GridShape(3, 1, 2, 1), "fsdp": GridShape(3, 2, 1, 1)}),
    (8, {"y": 2}, {"megatron1d": GridShape(4, 1, 2, 1)}),
    (12, {"z": 3}, {"fsdp": GridShape(4, 3, 1, 1)}),
])
def test_one_free_axis_given_the_other_takes_the_rest(world, given, expected):
    for name, grid in expected.items():
        assert _resolve(world, name, **given).grid == grid


@pytest.mark.parametrize("name, axis", [("megatron1d", "x"), ("megatron1d", "z"), ("fsdp", "x"), ("fsdp", "y"),
                                        ("dp", "x"), ("dp", "y"), ("dp", "z")])
@pytest.mark.parametrize("world", [6, 8])
def test_a_fixed_axis_of_another_size_is_one_line_naming_the_algorithm(name, axis, world):
    with pytest.raises(ConfigError) as err:
        _resolve(world, name, **{axis: 2})
    text = str(err.value)
    assert "\n" not in text
    assert f"--algorithm {name}" in text and f"--g{axis} 2" in text and "axonn4d" in text


@pytest.mark.parametrize("name", sorted(CHARACTERISTIC))
def test_a_fixed_axis_given_as_its_own_size_is_accepted(name):
    fixed = {axis: 1 for axis in registry.get(name).fixed}
    assert _resolve(8, name, **fixed).grid.size == 8


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown algorithm 'megatron3d': choose one of axonn4d, megatron1d"):
        registry.get("megatron3d")
    with pytest.raises(ConfigError):
        _resolve(8, "megatron3d")


@pytest.mark.parametrize("world", [6, 8, 12])
def test_grid_problem_keeps_exactly_the_grids_an_algorithm_runs(world):
    base = _resolve(world, "axonn4d")
    for name in CHARACTERISTIC:
        algorithm = registry.get(name)
        kept = [g for g in grid_factorizations(world) if algorithm.grid_problem(base, g) is None]
        expected = [g for g in grid_factorizations(world)
                    if all(getattr(g, a) == s for a, s in algorithm.fixed.items())]
        assert kept == expected
    # megatron1d: every (data, y) split; dp: the one all-data grid
    assert len([g for g in grid_factorizations(world) if registry.get("dp").grid_problem(base, g) is None]) == 1
    assert "fixes G_x = 1" in registry.get("megatron1d").grid_problem(base, GridShape(1, 1, 1, world))


def test_old_metadata_without_the_key_reads_as_axonn4d():
    assert registry.of_metadata({}) == "axonn4d"
    assert registry.of_metadata({"grid": "1x2x2x2", "run_options": {"dtype": "float32"}}) == "axonn4d"
    assert registry.of_metadata({"run_options": {"algorithm": "fsdp"}}) == "fsdp"
    assert registry.of_metadata({"algorithm": "dp", "run_options": {"algorithm": "dp"}}) == "dp"


def test_the_header_line_names_the_algorithm_and_its_pinned_axes():
    options = _resolve(8, "megatron1d")
    line = registry.get("megatron1d").describe(options.grid)
    assert line.startswith("algorithm megatron1d: Megatron-LM 1D tensor parallelism")
    assert "G_x = 1, G_z = 1" in line and "1x1x8x1" in line
