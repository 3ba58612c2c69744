"""Run under mpiexec: the 4D grid's rank order, axis communicators and node facts."""

import sys

from mpi4py import MPI

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
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if world.Get_rank() == 0:
        print("\n".join(failures) or f"grid ok for {world.Get_size()} ranks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
