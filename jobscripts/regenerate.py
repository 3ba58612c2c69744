#!/usr/bin/env python3
"""Render the example study jobscripts/weak-gpt-tiny.yaml for every built-in site (retired ones too).

    python3 jobscripts/regenerate.py           # rewrite jobscripts/examples/<site>/
    python3 jobscripts/regenerate.py --check   # exit 1 if a checked-in example is out of date

Run from anywhere; paths inside the scripts are relative to the repository root, where
the jobs are meant to be submitted from.
"""

import argparse
import filecmp
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fourd_mpi.jobs.sites import builtin_sites, load_site, retired_sites  # noqa: E402
from fourd_mpi.jobs.sweep import build_manifest, write_sweep  # noqa: E402
from fourd_mpi.jobs.spec import load_spec  # noqa: E402

SPEC = "jobscripts/weak-gpt-tiny.yaml"
EXAMPLES = "jobscripts/examples"
#: per-site job settings where the site's default node shape does not divide 1, 2, 4, 8 ranks
RANKS_PER_NODE = {"summit": 4}
#: a placeholder project for the sites that refuse jobs without one
ACCOUNT = "PROJECT123"
#: the interpreter the examples name (a real render names the one it runs with, e.g. /home/me/.venv/bin/python,
#: so that the jobs run in that environment; the examples must not depend on where they were regenerated)
PYTHON = "python3"


def render_all(root: str) -> list:
    """Render every site's example under ``root`` (paths inside are those of ``EXAMPLES``)."""
    written = []
    for name in builtin_sites() + retired_sites():
        spec = load_spec(SPEC)
        if name in RANKS_PER_NODE:
            spec.job["ranks_per_node"] = RANKS_PER_NODE[name]
        site = load_site(name)
        if "account" in site.requires:
            spec.job["account"] = ACCOUNT
        script_dir = f"{EXAMPLES}/{name}"
        manifest = build_manifest(spec, site, SPEC, script_dir, python=PYTHON)
        written += write_sweep(manifest, spec, site, os.path.join(root, script_dir), force=True)
    return written


def stale(reference: str, fresh: str) -> list:
    """Files that differ, are missing or are extra, between two example trees."""
    problems = []
    for directory, _, files in os.walk(fresh):
        for name in files:
            rel = os.path.relpath(os.path.join(directory, name), fresh)
            if not os.path.exists(os.path.join(reference, rel)):
                problems.append(f"missing {rel}")
            elif not filecmp.cmp(os.path.join(reference, rel), os.path.join(fresh, rel), shallow=False):
                problems.append(f"differs {rel}")
    for directory, _, files in os.walk(reference):
        for name in files:
            rel = os.path.relpath(os.path.join(directory, name), reference)
            if not os.path.exists(os.path.join(fresh, rel)) and "/logs/" not in f"/{rel}":
                problems.append(f"extra {rel}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    os.chdir(REPO)
    if not args.check:
        written = render_all(REPO)
        print(f"wrote {len(written)} scripts under {EXAMPLES}/")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        render_all(tmp)
        problems = stale(os.path.join(REPO, EXAMPLES), os.path.join(tmp, EXAMPLES))
    for line in problems:
        print(f"{EXAMPLES}: {line}")
    if problems:
        print("out of date: run python3 jobscripts/regenerate.py")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
