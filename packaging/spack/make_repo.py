#!/usr/bin/env python3
"""Make a Spack package repository for fourd_mpi from local sdists (fourd_mpi is not published).

    python packaging/spack/make_repo.py OUT --sdist dist/fourd_mpi-0.1.0.tar.gz [--sdist ...]
    spack repo add OUT/spack_repo/fourd_mpi

Copies packaging/spack/spack_repo/fourd_mpi to OUT/spack_repo/fourd_mpi, copies each sdist to
OUT/sources/, and writes into the recipe one ``version(V, sha256=..., url="file://...")`` per sdist:
the checksum is the sdist's own, taken now, so Spack verifies the archive it fetches later against
the one given here. OUT is created; an existing OUT/spack_repo/fourd_mpi is replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "spack_repo", "fourd_mpi")
RECIPE = os.path.join("packages", "py_fourd_mpi", "package.py")
BEGIN = "    # local sdists (packaging/spack/make_repo.py writes them between these two lines)\n"
END = "    # end of local sdists\n"
SDIST_NAME = re.compile(r"^fourd_mpi-(?P<version>[0-9][0-9A-Za-z.+-]*)\.tar\.gz$")


class BadInput(Exception):
    pass


def sdist_version(path: str) -> str:
    """The version of an sdist named fourd_mpi-V.tar.gz that holds fourd_mpi-V/setup.py."""
    match = SDIST_NAME.match(os.path.basename(path))
    if not match:
        raise BadInput(f"{path}: not an sdist of fourd_mpi (expected fourd_mpi-VERSION.tar.gz)")
    version = match.group("version")
    try:
        with tarfile.open(path, "r:gz") as tar:
            names = set(tar.getnames())
    except (OSError, tarfile.TarError) as exc:
        raise BadInput(f"{path}: not a readable .tar.gz ({exc})") from None
    if f"fourd_mpi-{version}/setup.py" not in names:
        raise BadInput(f"{path}: has no fourd_mpi-{version}/setup.py (is it fourd_mpi's sdist?)")
    return version


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_repo(out: str, sdists) -> str:
    """Write the repository under ``out``; the path to give ``spack repo add``."""
    versions = {}
    for path in sdists:
        version = sdist_version(path)
        if version in versions:
            raise BadInput(f"{path}: version {version} given twice")
        versions[version] = path
    out = os.path.abspath(out)
    repo = os.path.join(out, "spack_repo", "fourd_mpi")
    sources = os.path.join(out, "sources")
    os.makedirs(sources, exist_ok=True)
    if os.path.exists(repo):
        shutil.rmtree(repo)
    shutil.copytree(SOURCE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    lines = []
    for version, path in sorted(versions.items(), reverse=True):
        target = os.path.join(sources, os.path.basename(path))
        if os.path.abspath(path) != target:
            shutil.copyfile(path, target)
        lines.append(f'    version("{version}", sha256="{sha256(target)}", url="file://{target}")\n')
    recipe = os.path.join(repo, RECIPE)
    with open(recipe) as fh:
        text = fh.read()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise BadInput(f"{recipe}: the markers of the local sdists are missing")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    with open(recipe, "w") as fh:
        fh.write(head + BEGIN + "".join(lines) + END + tail)
    return repo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory of the repository (OUT/spack_repo/fourd_mpi) and the sdists")
    parser.add_argument("--sdist", action="append", required=True, metavar="FILE",
                        help="fourd_mpi-VERSION.tar.gz (python -m build --sdist); give it once per version")
    args = parser.parse_args(argv)
    try:
        repo = make_repo(args.out, args.sdist)
    except BadInput as exc:
        print(f"make_repo.py: {exc}", file=sys.stderr)
        return 2
    print(f"spack repo add {repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
