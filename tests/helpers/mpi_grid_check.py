"""Run under mpiexec: the 4D grid's rank order, axis communicators and node facts; the pipeline's grid
(the same class with the axis ``inter``: ``data, inter, z, y, x``) against the communicators the pipeline
used to split by hand (``MPI_Comm_split`` by stage, and by stage rank), for every stage count and 4D grid."""

import sys

from mpi4py import MPI

from fourd_mpi.algorithms.pipeline_plan import place
from fourd_mpi.core.grid import AXES, ProcessGrid, grid_factorizations


def main():
    world = MPI.COMM_WORLD
    failures = []
    for shape in grid_factorizations(world.Get_size()):
        grid = ProcessGrid(world, shape)
        c = grid.coords
        expected_rank = ((c["data"] * shape.z + c["z"]) * shape.y + c["y"]) * shape.x + c["x"]
        if expected_rank != world.Get_rank():
            failures.append(f"{shape}: rank {world.Get_rank()} has coords {c}")
        for axis in AXES:
            comm = grid.axis_comm(axis)
            if comm.Get_size() != shape[axis] or comm.Get_rank() != c[axis]:
                failures.append(f"{shape}: {axis} comm size/rank {comm.Get_size()}/{comm.Get_rank()}")
            # members of an axis communicator differ only in that axis' coordinate
            others = comm.allgather({a: c[a] for a in AXES if a != axis})
            if any(o != others[0] for o in others):
                failures.append(f"{shape}: {axis} comm mixes coordinates {others}")
        if grid.local_size != world.Get_size() or grid.num_nodes != 1:  # one host in tests
            failures.append(f"{shape}: node facts {grid.local_size} {grid.num_nodes}")
        if not all(grid.intra_node.values()):
            failures.append(f"{shape}: axes not intra-node {grid.intra_node}")
        text = grid.describe()
        if str(shape) not in text or world.allgather(text) != [text] * world.Get_size():
            failures.append(f"{shape}: describe() differs between ranks")
        grid.free()
    failures += check_pipeline_grids(world)
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if world.Get_rank() == 0:
        print("\n".join(failures) or f"grid ok for {world.Get_size()} ranks")
    return 1 if failures else 0


def congruent(a, b) -> bool:
    """Same ranks in the same order (``MPI_Comm_compare``: ``MPI_IDENT`` or ``MPI_CONGRUENT``)."""
    return MPI.Comm.Compare(a, b) in (MPI.IDENT, MPI.CONGRUENT)


def check_pipeline_grids(world):
    """Every ``G_inter`` dividing the world and every 4D grid of a stage: the 5-axis grid's stage grid and
    ``inter`` communicator equal the hand-made splits of the pipeline (world rank ``r`` is in stage
    ``(r // T) mod P`` at stage rank ``place(r)``, hand-computed in :func:`place`); a two-axis subset's
    communicator holds the ranks equal on the other axes, row-major over the subset, in any spelling."""
    failures = []
    size, rank = world.Get_size(), world.Get_rank()
    for stages in (p for p in range(1, size + 1) if size % p == 0):
        for shape in grid_factorizations(size // stages):
            dims = {"data": shape.data, "inter": stages, "z": shape.z, "y": shape.y, "x": shape.x}
            grid = ProcessGrid(world, dims)
            c = grid.coords
            tensor = shape.z * shape.y * shape.x
            expected_rank = ((((c["data"] * stages + c["inter"]) * shape.z + c["z"]) * shape.y + c["y"]) * shape.x
                             + c["x"])
            stage, stage_rank = place(rank, stages, tensor)
            if expected_rank != rank or c["inter"] != stage:
                failures.append(f"{stages}/{shape}: rank {rank} has coords {c}")
            by_stage = world.Split(color=stage, key=stage_rank)
            by_tensor_rank = world.Split(color=stage_rank, key=stage)
            sub = grid.sub(AXES)
            if not congruent(sub.cart, by_stage) or sub.rank != stage_rank or sub.shape != shape:
                failures.append(f"{stages}/{shape}: stage grid rank {sub.rank}, expected {stage_rank}")
            if sub.world is not world or sub.root is not grid or sub.coords != {a: c[a] for a in AXES}:
                failures.append(f"{stages}/{shape}: stage grid facts {sub.coords}")
            inter = grid.axis_comm("inter")
            if not congruent(inter, by_tensor_rank) or inter.Get_rank() != stage:
                failures.append(f"{stages}/{shape}: inter communicator differs from the split by stage rank")
            for axis in AXES:
                if sub.axis_comm(axis) is not grid.axis_comm(axis) or sub.axis_comm(axis).Get_size() != shape[axis]:
                    failures.append(f"{stages}/{shape}: stage's {axis} communicator is not the grid's")
            pair = grid.axes_comm(("x", "z"))
            if pair is not grid.axes_comm(("z", "x")) or pair.Get_rank() != c["z"] * shape.x + c["x"]:
                failures.append(f"{stages}/{shape}: (z, x) communicator rank {pair.Get_rank()}")
            others = pair.allgather({a: c[a] for a in dims if a not in ("z", "x")})
            if any(o != others[0] for o in others) or pair.Get_size() != shape.z * shape.x:
                failures.append(f"{stages}/{shape}: (z, x) communicator mixes coordinates {others}")
            by_stage.Free()
            by_tensor_rank.Free()
            sub.free()
            grid.free()
    return failures


if __name__ == "__main__":
    sys.exit(main())
