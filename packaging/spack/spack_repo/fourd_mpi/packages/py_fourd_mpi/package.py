# Copyright the fourd_mpi developers. SPDX-License-Identifier: BSD-3-Clause
#
# Spack (>= 1.0) recipe for fourd_mpi, in a package repository of Spack 1.0's layout
# (spack_repo/fourd_mpi/packages/py_fourd_mpi/package.py; builtin's build systems come from the
# spack-packages repository). fourd_mpi is not published, so the recipe names no download: its
# versions are local sdists, written in by packaging/spack/make_repo.py with the sdist's sha256
# (see docs/sites.md, "Spack"):
#
#   python -m build --sdist --outdir dist .
#   python packaging/spack/make_repo.py ~/spack-fourd --sdist dist/fourd_mpi-0.1.0.tar.gz
#   spack repo add ~/spack-fourd/spack_repo/fourd_mpi
#   spack install py-fourd-mpi+analysis ^mpi=cray-mpich      # the site's MPI: an external
#
# or, from a checkout without an sdist: spack develop --path "$PWD" py-fourd-mpi@=0.1.0.
# The site's MPI (cray-mpich, openmpi, mvapich, ...) comes from Spack's `mpi` virtual, usually an
# external in packages.yaml; py-mpi4py is then built against it.

from spack.package import *
from spack_repo.builtin.build_systems.python import PythonPackage


class PyFourdMpi(PythonPackage):
    """MPI-native benchmark suite of 4D hybrid parallel training (data parallelism x 3D tensor
    parallelism, as in AxoNN, SC'24): real training steps of a GPT-style stack on an MPI
    Cartesian communicator, NumPy on CPUs and CuPy on GPUs, HDF5 traces, job scripts for
    Slurm/PBS/LSF/Grid Engine and an analytical performance model."""

    homepage = "https://arxiv.org/abs/2305.13525"

    license("BSD-3-Clause")

    # local sdists (packaging/spack/make_repo.py writes them between these two lines)
    # end of local sdists

    variant("cuda", default=False, description="CuPy backend on NVIDIA GPUs (fourd_mpi[gpu])")
    variant("rocm", default=False, description="CuPy backend on AMD GPUs (fourd_mpi[rocm])")
    variant("analysis", default=False,
            description="compare's statistics and model calibrate with scipy (fourd_mpi[analysis])")
    conflicts("+cuda", when="+rocm", msg="CuPy is built for CUDA or for ROCm, not both")

    depends_on("python@3.9:", type=("build", "run"))
    depends_on("py-setuptools@77:", type="build")
    depends_on("py-wheel", type="build")

    depends_on("mpi")
    depends_on("py-mpi4py@4:", type=("build", "run"))
    depends_on("py-numpy@1.22:", type=("build", "run"))
    depends_on("py-h5py@3:", type=("build", "run"))
    depends_on("py-pyyaml@5.1:", type=("build", "run"))
    depends_on("py-tomli@1.1:", when="^python@:3.10", type=("build", "run"))
    depends_on("py-tqdm@4.60:", type=("build", "run"))
    depends_on("py-jinja2@3:", type=("build", "run"))
    depends_on("py-jsonschema@4:", type=("build", "run"))
    depends_on("py-xxhash@3:", type=("build", "run"))
    depends_on("py-tabulate@0.9:", type=("build", "run"))
    depends_on("py-pandas@1.5:", type=("build", "run"))  # analyze, model validate
    depends_on("py-matplotlib@3.5:", type=("build", "run"))  # plot

    depends_on("py-cupy+cuda", when="+cuda", type=("build", "run"))
    depends_on("py-cupy+rocm", when="+rocm", type=("build", "run"))

    with when("+analysis"):
        depends_on("py-scipy@1.7:", type=("build", "run"))

    # No setup_run_environment: the module sets nothing for everyone who loads it (thread counts
    # such as OMP_NUM_THREADS belong to the job script: the site profiles set them per rank).

    def test_version(self):
        """fourd-mpi --version prints the package version"""
        out = which(self.prefix.bin.join("fourd-mpi"))("--version", output=str.split, error=str.split)
        assert str(self.spec.version) in out
