"""Check the built sdist and wheel against the source tree (run by packaging/ci_check.sh).

    python packaging/check_dist.py dist/fourd_mpi-X-py3-none-any.whl dist/fourd_mpi-X.tar.gz

The wheel must hold every module of fourd_mpi and every package-data file (site profiles
jobs/sites/*.yaml, job-script templates jobs/templates/*.j2, machine profiles perf/profiles/*.yaml),
the license, the console script and the metadata; the sdist must hold what a rebuild needs
(setup.py, pyproject.toml, MANIFEST.in, README, LICENSE, CITATION.cff, CHANGELOG.md), the same
sources, and the documentation site (mkdocs.yml and every page and script of docs/), and no test files
(setuptools adds tests/test*.py by default: a partial test tree that cannot run). Prints the package data
found and exits 1 with every missing or stray file named.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_GLOBS = ("fourd_mpi/jobs/sites/*.yaml", "fourd_mpi/jobs/sites/retired/*.yaml", "fourd_mpi/jobs/templates/*.j2",
              "fourd_mpi/perf/profiles/*.yaml")


def docs_files():
    """mkdocs.yml and the pages and scripts of docs/ (what MANIFEST.in puts in the sdist)."""
    docs = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*")
            if p.is_file() and p.suffix in (".md", ".py") and "__pycache__" not in p.parts}
    return docs | {"mkdocs.yml"}


def source_files():
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "fourd_mpi").rglob("*.py")
               if "__pycache__" not in p.parts}
    data = {p.relative_to(REPO).as_posix() for g in DATA_GLOBS for p in REPO.glob(g)}
    return modules, data


def main(wheel: str, sdist: str) -> int:
    import re

    version = re.search(r'^__version__ = "([^"]+)"', (REPO / "fourd_mpi" / "__init__.py").read_text(), re.M).group(1)
    modules, data = source_files()
    problems = []
    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"fourd_mpi-{version}.dist-info"
    problems += [f"wheel lacks {n}" for n in sorted(modules | data) if n not in names]
    for n in (f"{info}/METADATA", f"{info}/entry_points.txt", f"{info}/licenses/LICENSE"):
        if n not in names:
            problems.append(f"wheel lacks {n}")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"{info}/METADATA").decode() if f"{info}/METADATA" in names else ""
        entry = zf.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    for line in (f"Version: {version}", "License-Expression: BSD-3-Clause", "Requires-Python: >=3.9",
                 "Provides-Extra: mpich", "Provides-Extra: analysis"):
        if line not in meta.splitlines():
            problems.append(f"wheel METADATA lacks {line!r}")
    if "fourd-mpi = fourd_mpi.cli.main:main" not in entry:
        problems.append("wheel has no fourd-mpi console script")
    stray = sorted(n for n in names if not (n.startswith("fourd_mpi/") or n.startswith(info + "/")))
    problems += [f"wheel holds a stray file {n}" for n in stray]

    top = f"fourd_mpi-{version}/"
    with tarfile.open(sdist) as tf:
        snames = {m.name[len(top):] for m in tf.getmembers() if m.name.startswith(top)}
    needed = {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CITATION.cff", "CHANGELOG.md"}
    problems += [f"sdist lacks {n}" for n in sorted(needed | modules | data | docs_files()) if n not in snames]
    problems += [f"sdist holds a stray test file {n}" for n in sorted(snames) if n.startswith("tests/")]

    print(f"wheel {Path(wheel).name}: {len(names)} files, {len(modules)} modules, package data:")
    for n in sorted(data):
        print(f"  {n}{'' if n in names else '   MISSING'}")
    print(f"sdist {Path(sdist).name}: {len(snames)} entries")
    for p in problems:
        print(f"error: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python packaging/check_dist.py WHEEL SDIST")
    sys.exit(main(sys.argv[1], sys.argv[2]))
