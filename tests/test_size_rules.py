"""The size rules of the package: no module over :data:`MAX_FILE_LINES` lines and no function over
:data:`MAX_FUNCTION_LINES` lines, unless its docstring (the module's, or the function's) has a line
that starts with ``Long:`` and gives the reason on that line.

Lengths are counted from the source: a file by its lines (as ``wc -l``), a function by its ``def``
node in the AST (``end_lineno - lineno + 1``, decorators not counted, nested functions counted on
their own as well as inside the one that holds them).
"""

from __future__ import annotations

import ast
from pathlib import Path

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
REASON_PREFIX = "Long:"

PACKAGE = Path(__file__).resolve().parents[1] / "fourd_mpi"


def has_reason(docstring: str | None) -> bool:
    """True when some line of ``docstring`` starts (after indentation) with ``Long:`` and says more."""
    for line in (docstring or "").splitlines():
        line = line.strip()
        if line.startswith(REASON_PREFIX) and line[len(REASON_PREFIX):].strip():
            return True
    return False


def offenders(package: Path = PACKAGE) -> list[str]:
    """One line per module or function of ``package`` over its limit with no ``Long:`` reason."""
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(package.parent)
        tree = ast.parse(source, str(path))
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES and not has_reason(ast.get_docstring(tree)):
            found.append(f"{where}: {lines} lines (over {MAX_FILE_LINES}) and no 'Long:' line in its docstring")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not has_reason(ast.get_docstring(node)):
                    found.append(f"{where}:{node.lineno} {node.name}: {length} lines "
                                 f"(over {MAX_FUNCTION_LINES}) and no 'Long:' line in its docstring")
    return found


def test_no_long_module_or_function_without_a_reason():
    found = offenders()
    assert not found, "\n" + "\n".join(found)


def test_reason_line_is_recognized(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "bare.py").write_text(f'def f():\n    """Doc."""\n{body}\n')
    (tmp_path / "kept.py").write_text(f'def f():\n    """Doc.\n\n    Long: one flat list.\n    """\n{body}\n')
    (tmp_path / "empty.py").write_text(f'def f():\n    """Doc.\n\n    Long:\n    """\n{body}\n')
    found = offenders(tmp_path)
    assert [line.split(":")[0] for line in found] == [f"{tmp_path.name}/bare.py", f"{tmp_path.name}/empty.py"]
