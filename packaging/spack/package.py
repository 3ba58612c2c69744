# Copyright the fourd_mpi developers. SPDX-License-Identifier: BSD-3-Clause
#
# Spack recipe for fourd_mpi. Put this directory into a Spack repository as
# packages/py-fourd-mpi/package.py (see docs/guide/clusters.md, "Installing at a centre"):
#
#   spack repo create ~/spack-fourd && mkdir -p ~/spack-fourd/packages/py-fourd-mpi
#   cp packaging/spack/package.py ~/spack-fourd/packages/py-fourd-mpi/
#   spack repo add ~/spack-fourd
#   spack develop --path "$PWD" py-fourd-mpi@=0.1.0 && spack add py-fourd-mpi+analysis && spack install
#
# The site's MPI (cray-mpich, openmpi, mvapich, ...) comes from Spack's `mpi` virtual, usually an
# external in packages.yaml; py-mpi4py is then built against it.

from spack.package import *


class PyFourdMpi(PythonPackage):
    """MPI-native benchmark suite of 4D hybrid parallel training (data parallelism x 3D tensor
    parallelism, as in AxoNN, SC'24): real training steps of a GPT-style stack on an MPI
    Cartesian communicator, NumPy on CPUs and CuPy on GPUs, HDF5 traces, job scripts for
    Slurm/PBS/LSF/Grid Engine and an analytical performance model."""

    homepage = "https://arxiv.org/abs/2305.13525"
    # The sdist that `python -m build` makes (.ci/run builds and checks it). fourd_mpi is not on
    # PyPI yet: use `spack develop` on a checkout, or put the sdist into a Spack mirror.
    pypi = "fourd_mpi/fourd_mpi-0.1.0.tar.gz"

    license("BSD-3-Clause")

    version("0.1.0")

    variant("cuda", default=False, description="CuPy backend for NVIDIA GPUs (fourd_mpi[gpu])")
    variant("analysis", default=False,
            description="compare's statistics and model calibrate with scipy (fourd_mpi[analysis])")

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
    depends_on("py-pandas@1.5:", type=("build", "run"))  # analyze, model validate
    depends_on("py-matplotlib@3.5:", type=("build", "run"))  # plot

    with when("+cuda"):
        depends_on("cuda")
        depends_on("py-cupy", type=("build", "run"))

    with when("+analysis"):
        depends_on("py-scipy@1.7:", type=("build", "run"))

    def setup_run_environment(self, env):
        # one BLAS thread per rank: ranks are the parallelism
        env.set("OMP_NUM_THREADS", "1")

    def test_version(self):
        """fourd-mpi --version prints the package version"""
        out = which(self.prefix.bin.join("fourd-mpi"))("--version", output=str.split, error=str.split)
        assert str(self.spec.version) in out
