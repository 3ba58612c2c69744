"""The grid of named axes (:class:`fourd_mpi.core.grid.ProcessGrid`) on one process: axis order, the
communicator of a subset in any spelling, a sub-grid, and one-line errors. The rank order and the
communicators on many ranks: ``tests/helpers/mpi_grid_check.py`` (``tests/step/test_parallel.py``)."""

import pytest

from fourd_mpi.core.grid import AXES, GridShape, ProcessGrid, grid_dims
from fourd_mpi.errors import ConfigError


def test_a_shape_names_the_four_axes_and_a_mapping_keeps_its_order():
    assert list(grid_dims(GridShape(2, 1, 3, 1)).items()) == [("data", 2), ("z", 1), ("y", 3), ("x", 1)]
    dims = {"data": 2, "inter": 3, "z": 1, "y": 1, "x": 2}
    assert list(grid_dims(dims)) == ["data", "inter", "z", "y", "x"]
    with pytest.raises(ConfigError, match="positive sizes"):
        grid_dims({"data": 0, "x": 2})


def test_the_pipeline_grid_is_the_same_class_with_one_more_axis():
    from mpi4py import MPI

    grid = ProcessGrid(MPI.COMM_SELF, {"data": 1, "inter": 1, "z": 1, "y": 1, "x": 1})
    try:
        assert grid.axes == ("data", "inter", "z", "y", "x") and grid.root is grid and grid.world is MPI.COMM_SELF
        assert grid.axes_comm(("x", "z")) is grid.axes_comm(("z", "x"))  # one communicator per subset, cached
        stage = grid.sub(("x", "y", "z", "data"))  # grid order, whatever the spelling
        assert stage.axes == AXES and stage.root is grid and stage.world is MPI.COMM_SELF
        assert stage.shape == GridShape(1, 1, 1, 1) and stage.axis_comm("x") is grid.axis_comm("x")
        assert grid.sub(grid.axes) is grid
        assert repr(grid) == "ProcessGrid(1x1x1x1x1, rank=0, coords=(data=0, inter=0, z=0, y=0, x=0))"
        assert "grid G_data x G_inter x G_z x G_y x G_x = 1x1x1x1x1 on 1 ranks" in grid.describe()
        assert "4D grid G_data x G_z x G_y x G_x = 1x1x1x1 on 1 ranks" in stage.describe()
        with pytest.raises(KeyError, match="pipe"):
            grid.axes_comm(("pipe",))
        stage.free()
    finally:
        grid.free()


def test_a_grid_of_the_wrong_size_is_one_line():
    from mpi4py import MPI

    with pytest.raises(ConfigError, match=r"grid 2x1x1x1 \(data x z x y x x\) has 2 ranks but the world size is 1"):
        ProcessGrid(MPI.COMM_SELF, GridShape(2, 1, 1, 1))
