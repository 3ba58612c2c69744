"""Rules of the tree itself (docs/contributing.md), checked on the files.

1. The tests mirror the package: the command line's tests are in ``tests/cli/``, never a top-level
   ``tests/test_cli_*.py``; every test file's name is unique across ``tests/`` (there is no ``__init__.py``:
   pytest imports each file by its name).
2. No number of this project's own issues in the package, the documentation or the README: a comment, a
   docstring or a page says what the thing is. Citations of another project's issue stay: ``owner/name issue
   N`` or a project named by a name that is not an ordinary word (``DeepSpeed issue #1069``, ``MPICH issue
   6924``, ``Open MPI's issue 11949``: a capital after the first letter), or one of :data:`OTHER_PROJECTS`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: where a bare issue number would be one of this project's
CHECKED = [ROOT / "fourd_mpi", ROOT / "docs", ROOT / "README.md"]
#: projects cited by a name that looks like an ordinary word (no capital after its first letter)
OTHER_PROJECTS = frozenset({"ufs-weather-model"})
#: this project's own names: "fourd_mpi issue 45" is one of its issues
OWN_NAMES = frozenset({"fourd_mpi", "fourd-mpi", "fourd"})

ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")


def _cited_project(before: str) -> bool:
    """Whether the text right before ``issue N`` names another project (``owner/name``, ``DeepSpeed``,
    ``MPICH``, ``Open MPI's``). Comment markers and line breaks between them are skipped, punctuation is not:
    ``... MPICH. Issue 30`` cites nothing."""
    word = re.search(r"(\S*)$", before.rstrip(" \t\n#*>")).group(1).lstrip("([\"'`")
    if word.endswith("'s"):
        word = word[:-2]
    if word.lower() in OWN_NAMES:
        return False
    if re.fullmatch(r"[\w.-]+/[\w.-]+", word) or word in OTHER_PROJECTS:
        return True
    return bool(re.fullmatch(r"[A-Za-z][\w-]*", word)) and any(c.isupper() for c in word[1:])


def project_issue_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each ``issue N`` / ``issue #N`` in ``text`` that cites no other project."""
    found = []
    for m in ISSUE.finditer(text):
        if not _cited_project(text[:m.start()]):
            line = text.count("\n", 0, m.start()) + 1
            found.append((line, text.splitlines()[line - 1].strip()))
    return found


def _text_files(paths):
    for path in paths:
        for f in sorted([path] if path.is_file() else path.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                try:
                    yield f, f.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    continue  # images, compiled files


def test_command_line_tests_are_under_tests_cli():
    stray = sorted(p.name for p in TESTS.glob("test_cli*.py"))
    assert not stray, f"command-line tests belong in tests/cli/ (named by what they test): {stray}"
    assert sorted((TESTS / "cli").glob("test_*.py")), "tests/cli/ holds the command line's tests"


def test_every_test_file_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)


@pytest.mark.parametrize("text, flagged", [
    ("compare (issue 32: an identical rerun)", [1]),
    ("# Verification (issue 30, second pass)", [1]),
    ('"""Issue 34: one rule"""', [1]),
    ("unchanged since issue 7", [1]),
    ("see fourd_mpi issue 45, item 4", [1]),
    ("Before issue 32 the default was steps", [1]),
    ("the issues 30 and 45", [1]),
    ("built with MPICH.\nIssue 30's targets", [2]),
    ("fixed by issue #43", [1]),
    ("open-mpi/ompi issue 11949: the same", []),
    ("(BLAST-WarpX/warpx issue 6382, 2025)", []),
    ("DeepSpeed issue #1069 (June 2021)", []),
    ("Open MPI's issue 11949 is the same", []),
    ("(ufs-weather-model issue 1732; MPICH issue 6924)", []),
    ("  # torch.cuda.synchronize(); deepspeedai/DeepSpeed\n  # issue #1069 (June 2021)", []),
    ("(pytorch/pytorch issue #41383, 2020)", []),
    ("an issue with the launcher; issues are tracked", []),
])
def test_the_issue_rule_on_known_answers(text, flagged):
    assert [line for line, _ in project_issue_mentions(text)] == flagged


def test_no_project_issue_numbers_in_the_package_and_documentation():
    found = [f"{f.relative_to(ROOT)}:{line}: {text}"
             for f, content in _text_files(CHECKED) for line, text in project_issue_mentions(content)]
    assert not found, ("say what the thing is, not which of this project's issues asked for it (another "
                       "project's issue: cite it as owner/name issue N):\n" + "\n".join(found))
