"""The linter: ``ruff check`` with the project's configuration (pyproject.toml ``[tool.ruff]``: syntax errors,
pyflakes' error class of comparisons and statements, unused imports and variables, sorted imports, line length)
passes on the whole tree."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes_on_the_tree():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
